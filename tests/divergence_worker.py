"""The runs of tests/test_divergence.py (one process) and tests/test_divergence_launch.py (two): train with the loss of
one process made NaN at chosen optimizer steps, per scenario, record where every process stopped (or what it skipped)
in `<scenario>.rank<N>.json`, and `check` the records. Launched as `python divergence_worker.py MODEL_DIR OUT_DIR`.
"""

import json
import math
import re
import sys
import warnings
from pathlib import Path

import torch
from launching import controller_state
from safetensors.torch import load_file
from shared import cpu_config

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer, load_math_dataset
from cegppo_trl.divergence import DEEPSPEED, FLAGGED, NON_FINITE, NonFiniteStepError, non_finite_tensors
from cegppo_trl.trainer import SKIPPED_DEEPSPEED


NAN_RANK = 1  # under the launch; process 0 on one process
RUN = dict(learning_rate=0.05, save_strategy="steps", save_steps=1)  # on shared.cpu_config
SCENARIOS = {
    # The first non-finite step (step 3, on one process only): every process stops there, before applying it.
    "stop": dict(nan_steps=[3], config=dict(cegppo_entropy_target=1.0)),
    "stop-lora": dict(nan_steps=[3], config=dict(cegppo_entropy_target=1.0), peft=True),
    # Skip one (step 2) and count it, then stop at the next (step 4); dynamic sampling and the controller on.
    "skip": dict(
        nan_steps=[2, 4],
        config=dict(
            cegppo_max_skipped_steps=1,
            cegppo_entropy_target=1.0,
            cegppo_exclude_zero_advantage_groups=True,
            cegppo_oversampling=2.0,
        ),
    ),
}


# Under DeepSpeed only: the engine passes over a step itself (its overflow check), counted in the same budget.
ENGINE_SCENARIOS = {
    # The engine skips step 2 (counted, logged), then step 4: beyond the budget of 1, every process stops there.
    "engine-skip": dict(
        nan_steps=[], overflow_steps=[2, 4], config=dict(cegppo_max_skipped_steps=1, cegppo_entropy_target=1.0)
    ),
}


def overflow_at_next_step(optimizer) -> None:
    """The stand-in for a bf16 overflow, which the CPU cannot produce: the ZeRO optimizer's next overflow check
    (DeepSpeed 0.19's `check_overflow`) reports one, so DeepSpeed's own path runs: no update, the gradients dropped,
    `DeepSpeedEngine.skipped_steps` + 1."""
    if getattr(optimizer, "_overflow_pending", False):
        return
    check, enabled = optimizer.check_overflow, optimizer.check_grad_overflow

    def overflowed(*args, **kwargs):
        optimizer.overflow = True
        optimizer.check_overflow, optimizer.check_grad_overflow, optimizer._overflow_pending = check, enabled, False

    optimizer.check_overflow, optimizer.check_grad_overflow, optimizer._overflow_pending = overflowed, True, True


class Injecting(CEGPPOTrainer):
    """Makes the loss of process `nan_rank` NaN at the optimizer steps in `nan_steps` (1-based); under DeepSpeed, the
    engine overflows at the steps in `overflow_steps`."""

    nan_steps: tuple = ()
    nan_rank: int = 0
    overflow_steps: tuple = ()

    def training_step(self, *args, **kwargs):
        if self.is_deepspeed_enabled and self.state.global_step + 1 in self.overflow_steps:
            overflow_at_next_step(self.model_wrapped.optimizer)
        return super().training_step(*args, **kwargs)

    def _cegppo_loss_delta(self, *args, **kwargs):
        delta = super()._cegppo_loss_delta(*args, **kwargs)
        step = self.state.global_step + 1
        if self.model.training and step in self.nan_steps and self.accelerator.process_index == self.nan_rank:
            delta = delta * math.nan
        return delta


def varied_reward(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]  # every group informative: a gradient at every step


def overflowing_reward(completions, trainer_state, **kwargs):
    """`varied_reward` on a scale off by 38 orders of magnitude from step 5 (the second generation batch) on."""
    scale = 1e38 if trainer_state.global_step >= 4 else 1.0
    return [scale * reward for reward in varied_reward(completions)]


def run(model_dir, out_dir: Path, name: str, scenario: dict, nan_rank=NAN_RANK, reward=varied_reward, resume=None):
    """Train `scenario` into out_dir / name (`resume`: `train`'s `resume_from_checkpoint`); (the trainer, this
    process's record)."""
    args = cpu_config(CEGPPOConfig, out_dir / name, **{**RUN, **scenario["config"]})
    extra = {}
    if scenario.get("peft"):
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    data = load_math_dataset("builtin:arithmetic").select(range(64))
    extra.update(scenario.get("trainer_kwargs", {}))
    trainer = Injecting(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=data, **extra)
    for callback in scenario.get("callbacks", lambda trainer: [])(trainer):
        trainer.add_callback(callback)
    trainer.nan_steps, trainer.nan_rank = scenario["nan_steps"], nan_rank
    trainer.overflow_steps = scenario.get("overflow_steps", ())
    record = {"error": None}
    try:
        trainer.train(resume_from_checkpoint=resume)
    except NonFiniteStepError as error:
        record.update(error=str(error), error_step=error.step)
    # ZeRO-3 holds each parameter's shard in `ds_tensor` (the parameter itself is empty); the others the whole one
    trainable = [getattr(p, "ds_tensor", p).detach().float() for p in trainer.model.parameters() if p.requires_grad]
    weight_sum = torch.tensor(
        [sum(float(getattr(p, "ds_tensor", p).double().sum()) for p in trainer.model.parameters())]
    )
    if any(hasattr(p, "ds_tensor") for p in trainer.model.parameters()):  # ZeRO: every process's shards, summed
        weight_sum = trainer.accelerator.reduce(weight_sum.to(trainer.accelerator.device), reduction="sum")
    record.update(
        global_step=trainer.state.global_step,
        skipped=trainer.step_guard.skipped,
        logged_deepspeed=[
            [e["step"], e[SKIPPED_DEEPSPEED]] for e in trainer.state.log_history if SKIPPED_DEEPSPEED in e
        ],
        engine_skipped=getattr(trainer.model_wrapped, "skipped_steps", None),
        checkpoints=sorted(p.name for p in (out_dir / name).glob("checkpoint-*")),
        controller=None if trainer._controller is None else vars(trainer._controller),
        weight_sum=float(weight_sum),
        finite=bool(all(torch.isfinite(p).all() for p in trainable)),
    )
    rank = trainer.accelerator.process_index
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()
    return trainer, record


def check(records: list[dict], out_dir: Path, name: str) -> None:
    """Every process stopped at the same step before applying it, naming the process whose loss was NaN (or the
    engine), with one model, every checkpoint before it finite, and the controller's state saved; `skip` and
    `engine-skip` counted their skipped step once, `engine-skip` logged it and left the weights of step 1."""
    expected_step, last_finite = (3, 2) if name.startswith("stop") else (4, 3)
    skipped = r" after skipping 1 step\(s\) \(cegppo_max_skipped_steps\)" if "skip" in name else ""
    where = f"process {NAN_RANK}: " if len(records) > 1 else ""
    what = r"the DeepSpeed engine passed over it" if name == "engine-skip" else f"a non-finite value .*{where}loss nan"
    message = rf"before applying optimizer step {expected_step}{skipped}: {what}.*last finite step {last_finite}"
    for record in records:
        assert record["error_step"] == expected_step, (name, record)
        assert re.search(message, record["error"]), (message, record["error"])
        assert record["global_step"] == last_finite and record["finite"]
    assert len({r["weight_sum"] for r in records}) == 1  # one model on every process
    checkpoints = records[0]["checkpoints"]
    assert checkpoints == [f"checkpoint-{n}" for n in range(1, last_finite + 1)], (name, checkpoints)
    for checkpoint in checkpoints:
        counts = non_finite_tensors(str(out_dir / name / checkpoint))
        assert counts is not None and counts[0] == 0, (name, checkpoint, counts)
    controller = records[0]["controller"]
    assert controller["num_updates"] == 2  # stop: steps 1 and 2; skip: 1 and 3, not the skipped step 2
    assert all(math.isfinite(v) for v in controller.values())
    assert controller_state(out_dir / name / checkpoints[-1]) == controller
    if name == "skip":
        assert all(r["skipped"] == {NON_FINITE: 1, FLAGGED: 0, DEEPSPEED: 0} for r in records)
    if name == "engine-skip":  # DeepSpeed's own counter: steps 2 and 4; the guard's: step 2, then the stop
        assert all(r["skipped"] == {NON_FINITE: 0, FLAGGED: 0, DEEPSPEED: 1} for r in records), records
        assert all(r["engine_skipped"] == 2 for r in records), records
        assert records[0]["logged_deepspeed"] == [[1, 0], [2, 1], [3, 1]], records[0]["logged_deepspeed"]
        one, two = (load_file(str(out_dir / name / f"checkpoint-{n}" / "model.safetensors")) for n in (1, 2))
        assert all(torch.equal(one[k], two[k]) for k in one), "the engine's skipped step 2 changed the weights"


def main() -> None:
    warnings.filterwarnings("ignore")
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    engine = sys.argv[3:] == ["--deepspeed"]
    for name, scenario in {**SCENARIOS, **(ENGINE_SCENARIOS if engine else {})}.items():
        run(model_dir, out_dir, name, scenario)


if __name__ == "__main__":
    main()
