"""A run that diverges stops at its first non-finite step, before applying it, and never saves or resumes from broken
weights (`cegppo_trl/divergence.py`, docs/launch.md "When a run diverges"): CEGPPOTrainer, and the mixin on TRL's
SFTTrainer and GRPOTrainer and on transformers' Trainer. On one process; the 2-process launches are
tests/test_divergence_launch.py (slow).
"""

import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import divergence_worker
import pytest
import torch
from divergence_worker import SCENARIOS, check, overflowing_reward, run
from safetensors.torch import load_file, save_file
from shared import ROOT, TINY_RECIPE, train_error
from test_host_sync import counting_host_transfers

from cegppo_trl.divergence import (
    DEEPSPEED,
    DIVERGED_EXIT_STATUS,
    EXTRA_STATE_FILE,
    FLAGGED,
    LEGACY_GUARD_STATE_FILE,
    NON_FINITE,
    NoFiniteCheckpointError,
    NonFiniteStepError,
    StepGuard,
    check_weights_finite,
    finite_checkpoint_to_resume,
    newest_finite_checkpoint,
    non_finite_tensors,
)
from cegppo_trl.trainer import (
    CONTROLLER_STATE_KEY,
    LEGACY_CONTROLLER_STATE_FILE,
    SKIPPED_NON_FINITE,
    SKIPPED_UNSCORED,
)


def _one_process(tensor, reduction="sum"):
    """The gather and the reduce of one process."""
    return tensor


# --- The step check


def test_a_finite_step_passes_with_one_host_transfer_and_a_non_finite_one_stops_naming_the_values():
    guard = StepGuard(_one_process)
    guard.add_loss(torch.tensor(0.5))
    guard.add_loss(torch.tensor(0.25))
    with counting_host_transfers() as counts:
        outcome = guard.end_step(1, torch.tensor(2.0), "cpu", extra=torch.tensor([3.0, 6.0]))
    assert counts["calls"] == 1 and not outcome.skip and outcome.extra == [3.0, 6.0]
    assert guard.last_finite == (1, 0.75, 2.0)
    guard.add_loss(torch.tensor(math.nan))
    with pytest.raises(NonFiniteStepError) as error:
        guard.end_step(2, torch.tensor(math.inf), "cpu")
    assert error.value.step == 2
    assert str(error.value) == (
        "stopped before applying optimizer step 2: a non-finite value (loss nan, grad norm inf); last finite step 1: "
        "loss 0.75, grad norm 2."
    )


def test_every_process_decides_from_every_process_values_and_a_non_finite_controller_entropy_stops_too():
    """Process 0's own values are finite; process 1's loss is not: the gather gives both the same rows."""
    other = torch.tensor([[math.nan, 1.0, 0.0, 0.0]])
    guard = StepGuard(lambda local: torch.cat([local, other]))
    guard.add_loss(torch.tensor(0.1))
    with pytest.raises(NonFiniteStepError, match=r"process 1: loss nan, grad norm 1\b"):
        guard.end_step(4, torch.tensor(1.0), "cpu")
    guard = StepGuard(_one_process)
    guard.add_loss(torch.tensor(0.1))
    with pytest.raises(NonFiniteStepError, match="non-finite mean token entropy"):
        guard.end_step(1, torch.tensor(1.0), "cpu", extra=torch.tensor([math.nan, 5.0]))


def test_the_engines_skipped_steps_are_counted_once_in_the_budget_and_stop_beyond_it():
    """Under DeepSpeed the engine passed over a step itself (its overflow check reports grad norm inf): with a
    finite loss that is the engine's skip; with a non-finite loss the guard's own (one count per step)."""
    guard = StepGuard(_one_process, max_skipped_steps=2, budget_name="cegppo_max_skipped_steps")
    guard.add_loss(torch.tensor(0.5))
    assert guard.end_step(1, 1.5, "cpu").skip is False
    guard.add_loss(torch.tensor(0.5))
    assert guard.end_step(2, math.inf, "cpu", engine_skipped=1).skip is True
    guard.add_loss(torch.tensor(math.nan))
    assert guard.end_step(3, math.inf, "cpu", engine_skipped=1).skip is True
    assert guard.skipped == {NON_FINITE: 1, FLAGGED: 0, DEEPSPEED: 1}
    guard.add_loss(torch.tensor(0.5))
    with pytest.raises(NonFiniteStepError) as error:
        guard.end_step(4, math.inf, "cpu", engine_skipped=1)
    assert str(error.value).startswith(
        "stopped before applying optimizer step 4 after skipping 2 step(s) (cegppo_max_skipped_steps): the DeepSpeed "
        "engine passed over it (grad norm inf): its gradient overflow check"
    )
    assert str(error.value).endswith("; last finite step 1: loss 0.5, grad norm 1.5.")


def test_the_weights_check_names_the_step_and_passes_frozen_weights():
    layer, frozen = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    check_weights_finite(layer.parameters(), _one_process, 3, "out/checkpoint-3")
    with torch.no_grad():
        frozen.weight[0, 0] = math.nan
    frozen.requires_grad_(False)
    check_weights_finite([*layer.parameters(), *frozen.parameters()], _one_process, 3, "x")
    with torch.no_grad():
        layer.bias[1] = math.inf
    with pytest.raises(NonFiniteStepError, match="weights after step 3 are not finite.*out/checkpoint-3 was not"):
        check_weights_finite(layer.parameters(), _one_process, 3, "out/checkpoint-3")


def _checkpoint(path: Path, finite: bool = True) -> Path:
    path.mkdir(parents=True)
    weights = {"a": torch.ones(2), "b": torch.zeros(3), "step": torch.tensor([1])}
    if not finite:
        weights["b"][1] = math.nan
    save_file(weights, str(path / "model.safetensors"))
    (path / "trainer_state.json").write_text("{}")
    return path


def test_auto_resume_passes_over_non_finite_checkpoints_and_refuses_when_all_are(tmp_path):
    first = _checkpoint(tmp_path / "checkpoint-2")
    _checkpoint(tmp_path / "checkpoint-4", finite=False)
    shards = tmp_path / "checkpoint-6"  # DeepSpeed shards only, from a run without the guard
    (shards / "global_step6").mkdir(parents=True), (shards / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-8").mkdir()  # incomplete: no trainer_state.json
    assert non_finite_tensors(str(first)) == (0, 3)
    said = []
    assert finite_checkpoint_to_resume(str(tmp_path), said.append) == str(first)
    assert said[0].startswith(
        f"Skipping {shards}: it holds only DeepSpeed shards, written without the divergence guard"
    )
    assert said[1] == f"Skipping {tmp_path / 'checkpoint-4'}: 1 of its 3 weight tensors are not finite."
    (shards / EXTRA_STATE_FILE).write_text("{}")  # the guard checked the weights before it wrote them
    assert finite_checkpoint_to_resume(str(tmp_path), said.append) == str(shards)
    shutil.rmtree(first), shutil.rmtree(shards)
    with pytest.raises(NoFiniteCheckpointError, match=r"every checkpoint in .* has non-finite weights \(the newest: "):
        finite_checkpoint_to_resume(str(tmp_path), said.append)
    assert finite_checkpoint_to_resume(str(tmp_path / "none"), said.append) is None
    assert newest_finite_checkpoint([]) == (None, [])


# --- The trainer


def _weights(folder: Path) -> dict:
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(str(folder / name))


def _trainable(trainer) -> dict:
    from peft import PeftModel, get_peft_model_state_dict

    model = trainer.model
    state = get_peft_model_state_dict(model) if isinstance(model, PeftModel) else model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_trainer_stops_before_applying_a_non_finite_step_or_skips_and_counts_it(
    name, tiny_checkpoint, tmp_path, one_torch_thread
):
    """divergence_worker's scenarios (full, LoRA, skip then stop) and checks on one process, and the weights: the
    trainer's are the last checkpoint's (the stopped step was not applied), which training moved; a skipped step
    moves nothing."""
    trainer, record = run(tiny_checkpoint, tmp_path, name, SCENARIOS[name], nan_rank=0)
    check([record], tmp_path, name)
    out, last = tmp_path / name, record["global_step"]
    saved, now = _weights(out / f"checkpoint-{last}"), _trainable(trainer)
    before = _weights(out / f"checkpoint-{last - 1}")
    assert any(not torch.equal(before[k], saved[k]) for k in saved)  # training moved the weights
    assert {k: v for k, v in now.items() if k in saved}.keys() == saved.keys()
    assert all(torch.equal(now[k], saved[k]) for k in saved), f"step {last + 1} was applied"
    if name == "skip":
        one, two = _weights(out / "checkpoint-1"), _weights(out / "checkpoint-2")
        assert all(torch.equal(one[k], two[k]) for k in one), "the skipped step 2 changed the weights"
        logged = [(e["step"], e[SKIPPED_NON_FINITE]) for e in trainer.state.log_history if SKIPPED_NON_FINITE in e]
        assert logged == [(1, 0), (2, 1), (3, 1)]


def test_the_skip_budget_counts_over_a_sigterm_and_a_resume(tiny_checkpoint, tmp_path, one_torch_thread):
    """`cegppo_max_skipped_steps 2`: step 2 is skipped, SIGTERM stops the run after step 3 (cegppo-train's stop),
    the resumed run skips step 5 and stops at step 6, its third skip over both parts."""
    from transformers import TrainerCallback

    from cegppo_trl.scripts.stopping import StopRequest, stop_on_signal_callback

    class Sigterm(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM) if state.global_step == 3 else None

    stop = StopRequest()
    scenario = dict(nan_steps=[2, 5, 6], config=dict(cegppo_max_skipped_steps=2, max_steps=8),
                    callbacks=lambda trainer: [Sigterm(), stop_on_signal_callback(stop, trainer.accelerator)])  # fmt: skip
    try:
        _, record = run(tiny_checkpoint, tmp_path, "budget", scenario, 0)
    finally:
        stop.restore()
    assert record["error"] is None and record["global_step"] == 3 and stop.signum == signal.SIGTERM
    assert record["skipped"] == {NON_FINITE: 1, FLAGGED: 0, DEEPSPEED: 0}
    _, record = run(tiny_checkpoint, tmp_path, "budget", dict(scenario, callbacks=lambda _: []), 0, resume=True)
    assert record["error_step"] == 6 and "after skipping 2 step(s)" in record["error"], record
    assert record["skipped"] == {NON_FINITE: 2, FLAGGED: 0, DEEPSPEED: 0}


def _no_reward(completions, **kwargs):
    return [None] * len(completions)


@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic-sampling"])
def test_batches_without_rewards_are_skipped_and_counted(dynamic, tiny_checkpoint, tmp_path, one_torch_thread):
    config = dict(cegppo_max_skipped_steps=4, save_strategy="no", loss_type="dapo", cegppo_entropy_target=1.0)
    if dynamic:
        config.update(cegppo_exclude_zero_advantage_groups=True, cegppo_oversampling=2.0)
    trainer, record = run(tiny_checkpoint, tmp_path, "all", dict(nan_steps=(), config=config), 0, _no_reward)
    assert record["error"] is None and trainer.state.global_step == 4  # one generation batch: all 4 steps skipped
    assert trainer.step_guard.skipped == {NON_FINITE: 0, FLAGGED: 4, DEEPSPEED: 0}
    assert trainer.state.log_history[3][SKIPPED_UNSCORED] == 4
    start = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert all(torch.equal(start[k], v) for k, v in _trainable(trainer).items() if k in start)
    bounded = dict(nan_steps=(), config=dict(config, cegppo_max_skipped_steps=2))
    _, record = run(tiny_checkpoint, tmp_path, "bounded", bounded, 0, _no_reward)
    assert re.search("step 3 after skipping 2 .*got no reward", record["error"]), record["error"]


@pytest.mark.parametrize("kind", ["non_finite", "unscored"])
def test_the_keyword_and_the_config_field_set_the_same_one_skip_budget(
    kind, tiny_checkpoint, tmp_path, one_torch_thread
):
    """`CEGPPOTrainer(max_skipped_steps=N)` and `cegppo_max_skipped_steps: N` skip the same steps with the same
    counts and weights; the guard alone decides (a batch without rewards too: no `RewardCoverageError` with N > 0)."""
    config, nan_steps, reward = dict(max_steps=3, save_strategy="no"), [2], divergence_worker.varied_reward
    if kind == "unscored":
        nan_steps, reward = [], _no_reward
    records = {}
    for way, budget in (("config", dict(config=dict(config, cegppo_max_skipped_steps=3))),
                        ("keyword", dict(config=config, trainer_kwargs=dict(max_skipped_steps=3)))):  # fmt: skip
        trainer, records[way] = run(tiny_checkpoint, tmp_path, way, dict(nan_steps=nan_steps, **budget), 0, reward)
        assert trainer.step_guard.max_skipped_steps == 3 and records[way]["error"] is None, records[way]
    expected = (
        {NON_FINITE: 1, FLAGGED: 0, DEEPSPEED: 0}
        if kind == "non_finite"
        else {NON_FINITE: 0, FLAGGED: 3, DEEPSPEED: 0}
    )
    assert records["config"]["skipped"] == records["keyword"]["skipped"] == expected
    assert records["config"]["weight_sum"] == records["keyword"]["weight_sum"]


def test_two_different_skip_budgets_are_refused_naming_both(tiny_trainer):
    with pytest.raises(ValueError, match=r"max_skipped_steps=3 and the config's cegppo_max_skipped_steps=2 disagree"):
        tiny_trainer(cegppo_max_skipped_steps=2, trainer_kwargs=dict(max_skipped_steps=3))
    with pytest.raises(ValueError, match=r"max_skipped_steps=-1: it must be a whole number"):
        tiny_trainer(trainer_kwargs=dict(max_skipped_steps=-1))
    assert (
        tiny_trainer(cegppo_max_skipped_steps=2, trainer_kwargs=dict(max_skipped_steps=2)).step_guard.max_skipped_steps
        == 2
    )


def test_a_checkpoint_from_before_the_extra_state_file_resumes_with_its_counts_and_controller(
    tiny_checkpoint, tmp_path, one_torch_thread
):
    """Checkpoints written before EXTRA_STATE_FILE keep the guard's counts (under CE-GPPO's log names) and the
    controller's state in files of their own: a resume restores both (one skip counted, so the next NaN stops)."""
    scenario = SCENARIOS["skip"]
    _, first = run(tiny_checkpoint, tmp_path, "skip", scenario, 0)
    checkpoint = tmp_path / "skip" / "checkpoint-3"
    state = json.loads((checkpoint / EXTRA_STATE_FILE).read_text())
    guard = state["divergence_guard"]
    legacy = {"skipped": {SKIPPED_NON_FINITE: guard["skipped"][NON_FINITE], SKIPPED_UNSCORED: 0},
              "last_finite": guard["last_finite"]}  # fmt: skip
    (checkpoint / LEGACY_GUARD_STATE_FILE).write_text(json.dumps(legacy))
    (checkpoint / LEGACY_CONTROLLER_STATE_FILE).write_text(json.dumps(state[CONTROLLER_STATE_KEY]))
    (checkpoint / EXTRA_STATE_FILE).unlink()
    _, resumed = run(tiny_checkpoint, tmp_path, "skip", scenario, 0, resume=str(checkpoint))
    assert resumed["error_step"] == 4 and "after skipping 1 step(s) (cegppo_max_skipped_steps)" in resumed["error"]
    assert resumed["skipped"] == {NON_FINITE: 1, FLAGGED: 0, DEEPSPEED: 0}
    assert resumed["controller"] == first["controller"] == state[CONTROLLER_STATE_KEY]


def test_no_save_with_non_finite_weights_and_rotation_keeps_the_finite_checkpoint(tiny_trainer, tmp_path):
    trainer = tiny_trainer(save_strategy="steps", save_steps=1, save_total_limit=1, save_only_model=True)
    trainer.state.global_step = 1
    trainer._save_checkpoint(trainer.model, None)  # checkpoint-1, finite
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = math.inf
    trainer.state.global_step = 2
    with pytest.raises(NonFiniteStepError, match=r"weights after step 2 are not finite.*checkpoint-2 was not written"):
        trainer._save_checkpoint(trainer.model, None)  # would have rotated checkpoint-1 out (save_total_limit 1)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]
    assert non_finite_tensors(str(tmp_path / "checkpoint-1"))[0] == 0
    with pytest.raises(NonFiniteStepError, match="not finite"):
        trainer.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final").exists()


def _guarded_trl_trainer(kind: str, model_dir, out: Path, **guard):
    """TRL 1.16's SFTTrainer or GRPOTrainer with the guard at learning rate 10, no clipping. On the tiny model that
    alone stays finite under AdamW (SFT's loss levels at 2,000-4,000; GRPO's policy saturates, grad norm 0), so SFT
    takes plain SGD (grad norm 2e11 at step 5, NaN at 6) and GRPO a reward scale that overflows from step 5."""
    from datasets import Dataset
    from shared import cpu_config
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    from cegppo_trl import DivergenceGuardMixin, load_math_dataset

    diverging = dict(learning_rate=10.0, max_grad_norm=0.0, max_steps=16, save_strategy="steps", save_steps=1)
    if kind == "sft":
        data = Dataset.from_list([{"prompt": f"What is {i}+{i}?", "completion": f" {2 * i}"} for i in range(64)])
        args = SFTConfig(str(out), use_cpu=True, bf16=False, per_device_train_batch_size=8, report_to="none",
                         optim="sgd", **diverging)  # fmt: skip
        return type("GuardedSFT", (DivergenceGuardMixin, SFTTrainer), {})(
            str(model_dir), args=args, train_dataset=data, **guard
        )
    data = load_math_dataset("builtin:arithmetic").select(range(64))
    cls = type("GuardedGRPO", (DivergenceGuardMixin, GRPOTrainer), {})
    args = cpu_config(GRPOConfig, out, scale_rewards="none", **diverging)
    return cls(str(model_dir), overflowing_reward, args=args, train_dataset=data, **guard)


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_the_mixin_stops_a_diverging_trl_trainer_and_resumes_from_the_newest_finite_checkpoint(
    kind, tiny_checkpoint, tmp_path, capsys, one_torch_thread
):
    trainer = _guarded_trl_trainer(kind, tiny_checkpoint, tmp_path)
    with pytest.raises(NonFiniteStepError, match="stopped before applying optimizer step") as error:
        trainer.train()
    step = error.value.step
    assert set(tmp_path.glob("checkpoint-*")) == {tmp_path / f"checkpoint-{n}" for n in range(1, step)}
    assert all(non_finite_tensors(str(tmp_path / f"checkpoint-{n}"))[0] == 0 for n in range(1, step))
    saved, now = _weights(tmp_path / f"checkpoint-{step - 1}"), _trainable(trainer)
    assert all(torch.equal(now[k], saved[k]) for k in saved), f"step {step} was applied"
    broken = tmp_path / f"checkpoint-{step}"  # as a run without the guard would have saved it
    shutil.copytree(tmp_path / f"checkpoint-{step - 1}", broken)
    save_file({k: v * math.nan for k, v in saved.items()}, str(broken / "model.safetensors"), {"format": "pt"})
    capsys.readouterr()
    with pytest.raises(NonFiniteStepError) as again:
        _guarded_trl_trainer(kind, tiny_checkpoint, tmp_path).train(resume_from_checkpoint=True)
    out = capsys.readouterr().out
    assert f"Skipping {broken}: " in out and f"Resuming from {tmp_path / f'checkpoint-{step - 1}'}," in out
    assert again.value.step >= step  # diverging again, from the newest finite checkpoint


def test_the_mixin_on_sft_logs_and_saves_under_its_own_names(tiny_checkpoint, tmp_path, one_torch_thread):
    """On TRL's SFTTrainer the guard speaks its own names: `skipped_steps/*` in the logs, `trainer_extra_state.json`
    in each checkpoint, no CE-GPPO name anywhere; the budget is the keyword's (SFTConfig has no CE-GPPO field)."""
    trainer = _guarded_trl_trainer("sft", tiny_checkpoint, tmp_path, max_skipped_steps=1)
    trainer.args.logging_steps = 1
    with pytest.raises(NonFiniteStepError, match=r"after skipping 1 step\(s\) \(max_skipped_steps\): a non-finite"):
        trainer.train()
    skipped_at = trainer.state.global_step  # the skipped step counts as a step; the next one stopped
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["skipped_steps/non_finite"] for e in logged][-2:] == [0, 1]
    assert all(e["skipped_steps/flagged"] == e["skipped_steps/deepspeed"] == 0 for e in logged)
    assert not [key for e in trainer.state.log_history for key in e if "cegppo" in key]
    saved = json.loads((tmp_path / f"checkpoint-{skipped_at}" / EXTRA_STATE_FILE).read_text())
    assert saved["divergence_guard"]["skipped"] == {NON_FINITE: 1, FLAGGED: 0, DEEPSPEED: 0}
    assert not [p for p in tmp_path.rglob("*") if "cegppo" in p.name]


# --- cegppo-train on one process


def test_cegppo_train_stops_with_status_3_keeps_the_finite_checkpoints_and_resumes_from_the_newest(
    tmp_path, tiny_checkpoint, capsys, one_torch_thread
):
    from cegppo_trl.scripts.train import main

    out = tmp_path / "out"
    argv = ["--config", str(ROOT / TINY_RECIPE), "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(out),
            "--scale_rewards", "none", "--max_grad_norm", "0", "--save_strategy", "steps", "--save_steps", "1",
            "--save_total_limit", "2", "--max_steps", "8"]  # fmt: skip
    assert main([*argv, "--reward_funcs", "divergence_worker.overflowing_reward"]) == DIVERGED_EXIT_STATUS
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("cegppo-train: ")) :]  # ours: the last
    assert len(lines) == 3 and "(loss -inf, grad norm inf); last finite step 4: loss " in lines[0], lines
    assert lines[0].startswith("cegppo-train: stopped before applying optimizer step 5: a non-finite value (")
    assert lines[1].startswith(f"Newest finite checkpoint: {out / 'checkpoint-4'}. Run the same command again")
    assert "learning_rate" in lines[2] and "max_grad_norm" in lines[2] and "reward" in lines[2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert not (out / "model.safetensors").exists()  # not saved as a success
    for name in ("checkpoint-3", "checkpoint-4"):
        assert non_finite_tensors(str(out / name))[0] == 0

    # Only non-finite checkpoints (passing over one: the mixin's test above): one line, status 3, nothing deleted.
    weights = {k: v * math.nan for k, v in load_file(str(out / "checkpoint-4" / "model.safetensors")).items()}
    for folder in out.glob("checkpoint-*"):
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert main([*argv, "--reward_funcs", "divergence_worker.varied_reward"]) == DIVERGED_EXIT_STATUS
    assert "has non-finite weights (the newest: " in train_error(capsys.readouterr().err)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


class _Line(torch.nn.Module):
    """A one-weight model; its loss is NaN at optimizer step 2 (2 micro-batches per step); `events` records backward."""

    def __init__(self, events):
        super().__init__()
        self.w, self.calls = torch.nn.Parameter(torch.ones(1)), 0
        self.w.register_hook(lambda grad: events.append("backward"))

    def forward(self, x, labels=None):
        self.calls += 1
        return {"loss": ((self.w * x).sum() - labels.sum()) ** 2 * (math.nan if self.calls in (3, 4) else 1.0)}


def test_transformers_takes_the_norm_between_the_last_backward_and_the_optimizer_step_and_a_skip_holds_the_lr(
    tmp_path,
):
    """Pins by behaviour the call order the guard relies on (transformers 5.x, private `Trainer._get_grad_norm`):
    once per optimizer step, after its last backward, before `optimizer.step()`; and accelerate's private
    `AcceleratedOptimizer._is_overflow`: a skipped step moves neither the weights nor the learning-rate schedule."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from cegppo_trl import DivergenceGuardMixin

    events = []

    class Recording(DivergenceGuardMixin, Trainer):
        def _get_grad_norm(self, model, grad_norm=None):
            return events.append("norm") or super()._get_grad_norm(model, grad_norm=grad_norm)

        def create_optimizer(self, *args, **kwargs):
            optimizer = super().create_optimizer(*args, **kwargs)
            optimizer.register_step_post_hook(lambda *_: events.append(f"step w={self.model.w.item():.4f}"))
            return optimizer

    data = Dataset.from_list([{"x": [1.0], "labels": [2.0]}] * 8)
    args = TrainingArguments(str(tmp_path), use_cpu=True, learning_rate=0.1, max_steps=3, report_to="none",
                             per_device_train_batch_size=1, gradient_accumulation_steps=2, max_grad_norm=0)  # fmt: skip
    trainer = Recording(model=_Line(events), args=args, train_dataset=data, max_skipped_steps=1)
    trainer.train()
    steps = [e for e in events if e.startswith("step")]
    assert events == [e for step in steps for e in ("backward", "backward", "norm", step)]
    assert len(steps) == 3 and steps[0] == steps[1] != steps[2]  # step 2 skipped: w unchanged
    assert trainer.lr_scheduler.last_epoch == 2  # stepped after steps 1 and 3 only
    assert trainer.step_guard.skipped == {NON_FINITE: 1, FLAGGED: 0, DEEPSPEED: 0}
