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
from shared import cpu_config

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer, load_math_dataset
from cegppo_trl.divergence import SKIPPED_NON_FINITE, SKIPPED_UNSCORED, NonFiniteStepError, non_finite_tensors
from cegppo_trl.trainer import CONTROLLER_STATE_FILE


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


class Injecting(CEGPPOTrainer):
    """Makes the loss of process `nan_rank` NaN at the optimizer steps in `nan_steps` (1-based)."""

    nan_steps: tuple = ()
    nan_rank: int = 0

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
    trainer = Injecting(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=data, **extra)
    for callback in scenario.get("callbacks", lambda trainer: [])(trainer):
        trainer.add_callback(callback)
    trainer.nan_steps, trainer.nan_rank = scenario["nan_steps"], nan_rank
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
    """Every process stopped at the same step before applying it, naming the process whose loss was NaN, with one
    model, every checkpoint before it finite, and the controller's state saved; `skip` counted its skipped step."""
    expected_step, last_finite = (3, 2) if name.startswith("stop") else (4, 3)
    skipped = r" after skipping 1 step\(s\) \(cegppo_max_skipped_steps\)" if name == "skip" else ""
    where = f"process {NAN_RANK}: " if len(records) > 1 else ""
    message = rf"before applying optimizer step {expected_step}{skipped}: .*{where}loss nan.*last finite step "
    message += str(last_finite)
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
    assert json.loads((out_dir / name / checkpoints[-1] / CONTROLLER_STATE_FILE).read_text()) == controller
    if name == "skip":
        assert all(r["skipped"] == {SKIPPED_NON_FINITE: 1, SKIPPED_UNSCORED: 0} for r in records)


def main() -> None:
    warnings.filterwarnings("ignore")
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    for name, scenario in SCENARIOS.items():
        run(model_dir, out_dir, name, scenario)


if __name__ == "__main__":
    main()
