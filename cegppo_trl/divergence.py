"""A divergence guard for any `transformers.Trainer` subclass: a run stops at its first non-finite optimizer step,
before the step is applied, never saves non-finite weights and never resumes from them.

`DivergenceGuardMixin` (put it first: `class GuardedSFT(DivergenceGuardMixin, SFTTrainer)`) owns the overrides; its
`StepGuard` the per-step check. At the end of each optimizer step's backward passes, before the optimizer applies the
step, `StepGuard.end_step` moves the step's loss and gradient norm of every process to the host in one transfer, after
one `gather`: every process makes the same decision at the same step, so none is left waiting in a collective. A
non-finite value on any process raises `NonFiniteStepError` on all of them, or, while fewer than `max_skipped_steps`
steps were skipped, drops the step's gradients instead (the learning-rate schedule does not advance either) and counts
it. Under DeepSpeed the engine's own skipped steps (its overflow check: fp16 loss scaling, bf16 from 0.19 on) are
counted in the same budget. The counts and the last finite step are saved in every checkpoint and restored on resume:
the budget is the whole run's. What each stack guarantees and what to do: docs/launch.md, "When a run diverges".
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch


DIVERGED_EXIT_STATUS = 3  # cegppo-train's exit status for a run stopped by a non-finite step or an unscored batch
# Why a step was skipped: the keys of `StepGuard.skipped`.
NON_FINITE = "non_finite"  # a non-finite loss, gradient norm or checked value (`check_with_step`) on a process
FLAGGED = "flagged"  # flagged by the trainer (`skip_step`; CE-GPPO: a generation batch with no reward)
DEEPSPEED = "deepspeed"  # passed over by the DeepSpeed engine itself (`DeepSpeedEngine.skipped_steps` grew)
UNSCORED_KEY = "cegppo_unscored"  # per-row marker of a generation batch whose rewards were all None (skip mode)
# In every checkpoint: `DivergenceGuardMixin.checkpoint_state()`, by owner (the guard's counts; a subclass's own state).
EXTRA_STATE_FILE = "trainer_extra_state.json"
GUARD_STATE_KEY = "divergence_guard"
# Checkpoints written before EXTRA_STATE_FILE keep the guard's counts here, under CE-GPPO's log names.
LEGACY_GUARD_STATE_FILE = "cegppo_guard_state.json"
LEGACY_SKIPPED_NAMES = {"cegppo/skipped_steps/non_finite": NON_FINITE, "cegppo/skipped_steps/unscored": FLAGGED}
FIXES = (
    "Usual fixes: a lower learning_rate; gradient clipping (max_grad_norm: 1.0, TRL's default); rewards on the scale "
    "of the paper's +1 / -1 (scale_rewards, reward_weights); fewer off-policy steps per generation batch "
    "(steps_per_generation, num_iterations)."
)


class NonFiniteStepError(RuntimeError):
    """A non-finite loss, gradient norm or controller entropy at an optimizer step (or non-finite weights before a
    save); raised on every process at the same step, before the step is applied. `cegppo-train` exits with
    `DIVERGED_EXIT_STATUS`."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def read_extra_state(checkpoint: str) -> dict:
    """A checkpoint's `EXTRA_STATE_FILE` ({} when it has none); a checkpoint from before it gives the guard's counts
    from `LEGACY_GUARD_STATE_FILE`."""
    path = os.path.join(checkpoint, EXTRA_STATE_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    legacy = os.path.join(checkpoint, LEGACY_GUARD_STATE_FILE)
    if not os.path.isfile(legacy):
        return {}
    with open(legacy) as f:
        state = json.load(f)
    skipped = {LEGACY_SKIPPED_NAMES.get(name, name): count for name, count in state.get("skipped", {}).items()}
    return {GUARD_STATE_KEY: {"skipped": skipped, "last_finite": state.get("last_finite")}}


class NoFiniteCheckpointError(ValueError):
    """Auto-resume found checkpoints in `output_dir`, and every one has non-finite weights."""


@dataclass
class StepOutcome:
    """What `StepGuard.end_step` decided: `skip` the step (drop its gradients), and the `extra` values it moved to
    the host with the check (the entropy controller's sums), None when none were given."""

    skip: bool
    extra: list[float] | None = None


@dataclass
class StepGuard:
    """Per-optimizer-step accumulators on the device (`add_loss`, `add_flag`; no host transfer) and the check at
    the step's end (`end_step`: one gather, one host transfer). `gather` is `accelerator.gather`; `budget_name` is
    how the user sets `max_skipped_steps` (named in the stop message)."""

    gather: object
    max_skipped_steps: int = 0
    budget_name: str = "max_skipped_steps"
    skipped: dict = field(default_factory=lambda: {NON_FINITE: 0, FLAGGED: 0, DEEPSPEED: 0})
    last_finite: tuple[int, float, float] | None = None  # (step, loss, grad norm) of the last finite step
    _loss: torch.Tensor | None = None
    _flag: torch.Tensor | None = None

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (the value TRL's loop sums into the logged loss)."""
        loss = loss.detach().float().reshape(())
        self._loss = loss if self._loss is None else self._loss + loss

    def add_flag(self, rows: torch.Tensor) -> None:
        """Skip this step if any of `rows` is positive (CE-GPPO: a micro-batch's `UNSCORED_KEY` rows)."""
        flag = rows.detach().float().amax() if rows.numel() else rows.new_zeros((), dtype=torch.float32)
        self._flag = flag if self._flag is None else torch.maximum(self._flag, flag)

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def state(self) -> dict:
        """What a checkpoint keeps (under `GUARD_STATE_KEY` in `EXTRA_STATE_FILE`), so that a resumed run counts on from it."""
        return {"skipped": self.skipped, "last_finite": self.last_finite}

    def restore(self, state: dict) -> None:
        self.skipped = {**self.skipped, **state["skipped"]}
        self.last_finite = None if state["last_finite"] is None else tuple(state["last_finite"])

    def end_step(
        self, step: int, grad_norm, device, extra: torch.Tensor | None = None, engine_skipped: int = 0
    ) -> StepOutcome:
        """Check optimizer step `step` (1-based) on every process. Raises `NonFiniteStepError` to stop; returns
        whether to skip it. `grad_norm`: a tensor, a float (DeepSpeed) or None (not computed). `extra`: values to
        move to the host with the check (`StepOutcome.extra`), checked as the loss is. `engine_skipped`: how many
        steps the DeepSpeed engine passed over since the last check (it stepped already: counted, not undone)."""
        loss = self._loss if self._loss is not None else torch.zeros((), device=device)
        flag = self._flag if self._flag is not None else torch.zeros((), device=device)
        self._loss = self._flag = None
        if grad_norm is None:
            norm = torch.zeros((), device=loss.device)
        elif torch.is_tensor(grad_norm):
            norm = grad_norm.detach().float().reshape(()).to(loss.device)
        else:
            norm = torch.tensor(float(grad_norm), device=loss.device)
        engine = torch.tensor(float(engine_skipped), device=loss.device)
        local = torch.stack([loss, norm, flag.to(loss.device), engine]).unsqueeze(0)
        values = self.gather(local)  # (processes, 4): the same on every process
        flat = [values.flatten()] + ([extra.detach().float().flatten().to(loss.device)] if extra is not None else [])
        host = torch.cat(flat).tolist()  # the step's one device-to-host transfer
        per_process = [host[i : i + 4] for i in range(0, 4 * values.size(0), 4)]
        extra_host = host[4 * values.size(0) :] if extra is not None else None
        bad = [i for i, (lo, gn, *_) in enumerate(per_process) if not (math.isfinite(lo) and math.isfinite(gn))]
        bad_loss = any(not math.isfinite(lo) for lo, *_ in per_process)
        bad_entropy = extra_host is not None and not all(math.isfinite(v) for v in extra_host)
        flagged = any(f > 0 for _, _, f, _ in per_process)
        engine_skips = int(max(e for *_, e in per_process))  # the engines agree; the most, to be safe
        losses = [lo for lo, *_ in per_process]
        grad = per_process[0][1] if grad_norm is not None else math.nan
        if not bad and not bad_entropy and not flagged and not engine_skips:
            self.last_finite = (step, sum(losses) / len(losses), grad)
            return StepOutcome(False, extra_host)
        # One count per step, by the first reason: a non-finite loss, the trainer's flag, the engine's skip (which
        # reports an infinite gradient norm: its overflow check), a non-finite gradient norm.
        if bad_loss or bad_entropy:
            reason = NON_FINITE
        else:
            reason = FLAGGED if flagged else DEEPSPEED if engine_skips else NON_FINITE
        if self.total_skipped < self.max_skipped_steps:
            self.skipped[reason] += 1
            return StepOutcome(True, None)
        described = self._describe(step, per_process, bad, bad_entropy, grad_norm is not None, reason)
        raise NonFiniteStepError(described, step)

    def _describe(self, step, per_process, bad, bad_entropy, norm_known, reason) -> str:
        """The first line of the stop message (the checkpoint line is added by `stop_message`)."""
        if reason == FLAGGED:
            what = "its generation batch got no reward (every reward function returned None for every completion)"
        elif reason == DEEPSPEED:
            norm = f" (grad norm {per_process[0][1]:.6g})" if norm_known else ""
            what = (
                f"the DeepSpeed engine passed over it{norm}: its gradient overflow check (bf16, or fp16 loss scaling, "
                "which skips a few steps while it calibrates: a skip budget allows those)"
            )
        else:
            parts = []
            for i in bad or range(len(per_process)):
                loss, norm, *_ = per_process[i]
                where = f"process {i}: " if len(per_process) > 1 else ""
                parts.append(f"{where}loss {loss:.6g}" + (f", grad norm {norm:.6g}" if norm_known else ""))
            what = "a non-finite value (" + "; ".join(parts) + ")"
            if bad_entropy:
                what += " (and a non-finite mean token entropy)"
        skipped = f" after skipping {self.total_skipped} step(s) ({self.budget_name})" if self.total_skipped else ""
        last = "no finite step in this run"
        if self.last_finite is not None:
            s, loss, norm = self.last_finite
            last = f"last finite step {s}: loss {loss:.6g}" + (f", grad norm {norm:.6g}" if norm_known else "")
        return f"stopped before applying optimizer step {step}{skipped}: {what}; {last}."


def check_weights_finite(parameters, reduce, step: int, where: str) -> None:
    """Raise `NonFiniteStepError` on every process when a trainable weight is not finite on any (before a save).
    `reduce` is `accelerator.reduce`; a ZeRO-3 parameter is checked through its local partition (`ds_tensor`)."""
    flags = []
    for p in parameters:
        if not p.requires_grad:
            continue  # frozen (a LoRA base): training never changes it
        data = getattr(p, "ds_tensor", None)
        data = p.data if data is None else data
        if data.numel():
            flags.append(torch.isfinite(data).all())
    if not flags:
        return
    broken = (~torch.stack(flags)).any().float()
    if reduce(broken.reshape(1), reduction="sum").item() > 0:  # one transfer per save
        raise NonFiniteStepError(
            f"the weights after step {step} are not finite (a finite update overflowed them): {where} was not "
            "written, and no checkpoint was rotated out.",
            step,
        )


def non_finite_tensors(checkpoint: str) -> tuple[int, int] | None:
    """(non-finite, total) weight tensors in a checkpoint's ``*.safetensors`` files (the model or adapter), or None
    when it holds none (DeepSpeed shards only)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    if not files:
        return None
    broken = total = 0
    for name in files:
        with safe_open(os.path.join(checkpoint, name), framework="pt") as weights:
            for key in weights.keys():
                tensor = weights.get_tensor(key)
                total += 1
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    broken += 1
    return broken, total


def why_not_resumable(checkpoint: str) -> str | None:
    """Why `checkpoint`'s weights must not be resumed from (one sentence), or None. DeepSpeed shards alone are not
    read (the optimizer's would be, whole, on one host); the guard's state file says the guard checked the weights
    before writing them."""
    if not os.path.isfile(os.path.join(checkpoint, "trainer_state.json")):  # the Trainer's last file
        return "not a complete checkpoint (no trainer_state.json)"
    counts = non_finite_tensors(checkpoint)
    if counts is not None:
        return f"{counts[0]} of its {counts[1]} weight tensors are not finite" if counts[0] else None
    if any(os.path.isfile(os.path.join(checkpoint, name)) for name in (EXTRA_STATE_FILE, LEGACY_GUARD_STATE_FILE)):
        return None
    return (
        "it holds only DeepSpeed shards, written without the divergence guard, so its weights cannot be checked "
        "(save the model with each checkpoint, ZeRO-3: zero3_save_16bit_model: true)"
    )


def newest_finite_checkpoint(checkpoints: list[str]) -> tuple[str | None, list[str]]:
    """The newest of `checkpoints` (oldest first) whose saved weights are all finite, and one line for each newer
    one passed over."""
    skipped = []
    for path in reversed(checkpoints):
        why = why_not_resumable(path)
        if why is None:
            return path, skipped
        skipped.append(f"Skipping {path}: {why}.")
    return None, skipped


def complete_checkpoints(output_dir: str, complete: bool = True) -> list[str]:
    """The ``checkpoint-N`` folders of `output_dir`, oldest first, less (`complete`) those without
    ``trainer_state.json`` (the Trainer's last file: one without it was being written when a run stopped)."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import sort_checkpoints

    found = sort_checkpoints(output_dir) if os.path.isdir(output_dir) else []
    return [path for path in found if not complete or os.path.isfile(os.path.join(path, TRAINER_STATE_NAME))]


def finite_checkpoint_to_resume(output_dir: str, say) -> str | None:
    """Auto-resume's checkpoint: the newest complete one whose saved weights are finite, saying (`say`) which newer
    ones it passed over; None when there is none; `NoFiniteCheckpointError` when no one can be resumed from."""
    found = complete_checkpoints(output_dir)
    checkpoint, skipped = newest_finite_checkpoint(found)
    for line in skipped:
        say(line)
    if found and checkpoint is None:
        raise NoFiniteCheckpointError(
            f"every checkpoint in {output_dir} has non-finite weights (the newest: {found[-1]}), so there is none to "
            "resume from: start over in a new --output_dir (or move them away), after one of the fixes in "
            "docs/launch.md, 'When a run diverges'."
        )
    return checkpoint


def stop_message(error: Exception, prog: str, output_dir: str | None) -> str:
    """A script's message (`cegppo-train`'s) for a run stopped by `NonFiniteStepError`, `RewardCoverageError` or
    `NoFiniteCheckpointError`, naming the newest finite checkpoint in `output_dir`."""
    lines = [f"{prog}: {error}"]
    if isinstance(error, NoFiniteCheckpointError):
        return lines[0]
    checkpoint = newest_finite_checkpoint(complete_checkpoints(output_dir))[0] if output_dir else None
    if not isinstance(error, NonFiniteStepError):  # a batch without rewards: one line
        where = f"the newest finite checkpoint is {checkpoint}" if checkpoint else "no finite checkpoint was saved"
        return f"{lines[0]} Stopped; {where} (run the same command again to resume from it, after the fix)."
    if checkpoint is not None:
        lines.append(
            f"Newest finite checkpoint: {checkpoint}. Run the same command again to resume from it "
            "(auto-resume), after one of the fixes below."
        )
    elif output_dir is not None:
        lines.append(f"No finite checkpoint in {output_dir} (save with --save_steps N to resume next time).")
    lines.append(FIXES + " Or skip such steps: --cegppo_max_skipped_steps N.")
    return "\n".join(lines)


class DivergenceGuardMixin:
    """The divergence guard on any `transformers.Trainer` subclass; put it first in the bases:
    ``class GuardedSFT(DivergenceGuardMixin, SFTTrainer)``. `max_skipped_steps` (default 0: stop at the first) steps
    in the whole run, resumes included, are skipped instead of stopping; the counts are logged, by reason, under
    `skipped_steps_log_names` (`skipped_steps/non_finite`, `skipped_steps/flagged`, `skipped_steps/deepspeed`).

    - `training_step` adds each micro-batch's loss to the step's check, which runs in `_get_grad_norm` (transformers 5:
      once per optimizer step, after the last backward, before `optimizer.step()`; under DeepSpeed after the engine
      stepped: the engine's own skipped steps, `DeepSpeedEngine.skipped_steps`, are counted in the same budget).
    - `save_model` refuses non-finite weights (nothing written, no checkpoint rotated out) and writes
      `checkpoint_state()` into each checkpoint (`EXTRA_STATE_FILE`); `train(resume_from_checkpoint=...)` hands it
      back to `restore_checkpoint_state` (a subclass adds its own state by overriding both, calling `super()`).
      `train(resume_from_checkpoint=True)` resumes from the newest checkpoint whose weights are finite; a path to a
      non-finite one is refused in one line.
    - `skip_step` and `check_with_step` are a subclass's two calls into the step's check (no host transfer of their
      own). A stopped run raises `NonFiniteStepError` (one line; a script exits with `DIVERGED_EXIT_STATUS`).
    """

    skipped_steps_log_names = {reason: f"skipped_steps/{reason}" for reason in (NON_FINITE, FLAGGED, DEEPSPEED)}
    max_skipped_steps_name = "max_skipped_steps"  # how the stop message names the budget

    def __init__(self, *args, max_skipped_steps: int = 0, **kwargs):
        if not isinstance(max_skipped_steps, int) or isinstance(max_skipped_steps, bool) or max_skipped_steps < 0:
            raise ValueError(
                f"max_skipped_steps={max_skipped_steps!r}: it must be a whole number, 0 (stop at the first "
                "non-finite step) or more."
            )
        super().__init__(*args, **kwargs)
        self.step_guard = StepGuard(self.accelerator.gather, max_skipped_steps, self.max_skipped_steps_name)
        self._with_check = None  # (values, then) of `check_with_step` for the step in progress
        self._engine_skipped_seen = 0  # `DeepSpeedEngine.skipped_steps` at the last check

    def skip_step(self, flags: torch.Tensor) -> None:
        """Skip the optimizer step in progress (counted as `flagged`) if any of `flags` (device tensor) is positive on
        any process; beyond the budget, stop at it. Decided with the step's check, on every process."""
        self.step_guard.add_flag(flags)

    def check_with_step(self, values: torch.Tensor, then) -> None:
        """Check `values` (device tensor) with the step in progress (not finite: as a non-finite loss), and after the
        check, unless the step is skipped, call `then(list_of_floats)`: one host transfer with the step's own."""
        self._with_check = (values, then)

    def checkpoint_state(self) -> dict:
        """What each checkpoint keeps beyond the Trainer's own files (JSON, by owner): the guard's counts. A subclass
        adds its own entries to `super().checkpoint_state()`."""
        # The engine's counter at the save: DeepSpeed restores its own from the checkpoint, counted already.
        return {GUARD_STATE_KEY: {**self.step_guard.state(), "deepspeed_skipped_seen": self._engine_skipped_seen}}

    def restore_checkpoint_state(self, state: dict, checkpoint: str) -> None:
        """Restore what `checkpoint_state` saved in `checkpoint` (`state` is {} for a checkpoint without it)."""
        if GUARD_STATE_KEY in state:
            self.step_guard.restore(state[GUARD_STATE_KEY])
            self._engine_skipped_seen = state[GUARD_STATE_KEY].get("deepspeed_skipped_seen", 0)

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_guard.add_loss(loss)  # on the device until the step's check
        return loss

    def _engine_skipped_since_last_check(self) -> int:
        """Steps the DeepSpeed engine passed over since the last check (its public `skipped_steps` counter)."""
        total = getattr(self.model_wrapped, "skipped_steps", None) if self.is_deepspeed_enabled else None
        if total is None:
            return 0
        new, self._engine_skipped_seen = total - self._engine_skipped_seen, total
        return max(new, 0)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        (values, then), self._with_check = self._with_check or (None, None), None
        step, engine_skipped = self.state.global_step + 1, self._engine_skipped_since_last_check()
        outcome = self.step_guard.end_step(step, grad_norm, self.accelerator.device, values, engine_skipped)
        if not self.is_deepspeed_enabled:  # the engine keeps its own optimizer and schedule
            if outcome.skip:
                model.zero_grad(set_to_none=True)  # the optimizer passes over parameters without a gradient
            if hasattr(self.optimizer, "step_was_skipped"):  # accelerate's (none outside `train`): behind
                self.optimizer._is_overflow = outcome.skip  # `optimizer_step_was_skipped`, the schedule holds
        if then is not None and outcome.extra is not None:
            then(outcome.extra)
        return grad_norm

    def log(self, logs: dict, *args, **kwargs) -> None:
        if self.step_guard.max_skipped_steps > 0 and "loss" in logs:  # the training entries
            names = self.skipped_steps_log_names
            logs = {**logs, **{names[reason]: count for reason, count in self.step_guard.skipped.items()}}
        super().log(logs, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        # Every process calls it (checkpoints and the final save): a non-finite weight anywhere stops them all.
        where = output_dir or self.args.output_dir
        check_weights_finite(self.model.parameters(), self.accelerator.reduce, self.state.global_step, where)
        super().save_model(output_dir, _internal_call)
        if _internal_call and self.args.should_save:  # a checkpoint (before its trainer_state.json)
            with open(os.path.join(where, EXTRA_STATE_FILE), "w") as f:
                json.dump(self.checkpoint_state(), f, indent=2)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            found = finite_checkpoint_to_resume(self.args.output_dir, self.accelerator.print)
            if found is not None:
                self.accelerator.print(
                    f"Resuming from {found}, the newest finite checkpoint in {self.args.output_dir}."
                )
            checkpoint = found or True  # none: transformers' own error
        elif checkpoint is not None and (why := why_not_resumable(checkpoint)):
            raise ValueError(
                f"--resume_from_checkpoint {checkpoint}: {why}; resume from an earlier checkpoint (True, or left out "
                "in cegppo-train: the newest finite one)."
            )
        if checkpoint not in (None, True):
            self.restore_checkpoint_state(read_extra_state(checkpoint), checkpoint)
        return super().train(checkpoint, *args, **kwargs)
