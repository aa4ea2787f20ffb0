"""A run that diverges stops at its first non-finite optimizer step, before the step is applied (project issue 35).

At the end of each optimizer step's backward passes, before the optimizer applies the step, `StepGuard.end_step`
moves the step's loss and gradient norm of every process (and the entropy controller's sums) to the host in one
transfer, after one `gather`: every process sees every process's values and makes the same decision at the same
step, so none is left waiting in a collective. A non-finite loss, gradient norm or controller entropy on any process
raises `NonFiniteStepError` on all of them (the step is not applied), or, while fewer than
`cegppo_max_skipped_steps` steps were skipped, drops the step's gradients instead (DeepSpeed's loss scaler skips an
overflowing step the same way) and counts it in `cegppo/skipped_steps/*`. A generation batch whose rewards are all
None is stopped on (`RewardCoverageError`) or, within the same bound, its optimizer steps are skipped and counted.

No checkpoint is written with non-finite weights (`check_weights_finite`, before every save); auto-resume passes over
a checkpoint whose saved weights are not finite (`newest_finite_checkpoint`). `cegppo-train` exits with
`DIVERGED_EXIT_STATUS` after one message (`stop_message`). What to do: docs/launch.md, "When a run diverges".
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch


DIVERGED_EXIT_STATUS = 3  # cegppo-train's exit status for a run stopped by a non-finite step or an unscored batch
SKIPPED_NON_FINITE = "cegppo/skipped_steps/non_finite"
SKIPPED_UNSCORED = "cegppo/skipped_steps/unscored"
UNSCORED_KEY = "cegppo_unscored"  # per-row marker of a generation batch whose rewards were all None (skip mode)
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
    """Per-optimizer-step accumulators on the device (`add_loss`, `add_unscored`; no host transfer) and the check at
    the step's end (`end_step`: one gather, one host transfer). `gather` is `accelerator.gather`."""

    gather: object
    max_skipped_steps: int = 0
    skipped: dict = field(default_factory=lambda: {SKIPPED_NON_FINITE: 0, SKIPPED_UNSCORED: 0})
    last_finite: tuple[int, float, float] | None = None  # (step, loss, grad norm) of the last finite step
    _loss: torch.Tensor | None = None
    _unscored: torch.Tensor | None = None
    _carried: torch.Tensor | None = None

    def carry(self, values: torch.Tensor) -> None:
        """Values to move to the host with this step's check (the entropy controller's sums): `StepOutcome.extra`."""
        self._carried = values

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (the value TRL's loop sums into the logged loss)."""
        loss = loss.detach().float().reshape(())
        self._loss = loss if self._loss is None else self._loss + loss

    def add_unscored(self, rows: torch.Tensor) -> None:
        """A micro-batch's `UNSCORED_KEY` rows: its generation batch had no reward at all."""
        flag = rows.detach().float().amax() if rows.numel() else rows.new_zeros((), dtype=torch.float32)
        self._unscored = flag if self._unscored is None else torch.maximum(self._unscored, flag)

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def end_step(self, step: int, grad_norm, device, extra: torch.Tensor | None = None) -> StepOutcome:
        """Check optimizer step `step` (1-based) on every process. Raises `NonFiniteStepError` to stop; returns
        whether to skip it. `grad_norm`: a tensor, a float (DeepSpeed) or None (not computed). `extra`: values to
        move to the host with the check, default those `carry` was given this step."""
        extra, self._carried = (self._carried if extra is None else extra), None
        loss = self._loss if self._loss is not None else torch.zeros((), device=device)
        unscored = self._unscored if self._unscored is not None else torch.zeros((), device=device)
        self._loss = self._unscored = None
        if grad_norm is None:
            norm = torch.zeros((), device=loss.device)
        elif torch.is_tensor(grad_norm):
            norm = grad_norm.detach().float().reshape(()).to(loss.device)
        else:
            norm = torch.tensor(float(grad_norm), device=loss.device)
        local = torch.stack([loss, norm, unscored.to(loss.device)]).unsqueeze(0)
        values = self.gather(local)  # (processes, 3): the same on every process
        flat = [values.flatten()] + ([extra.detach().float().flatten().to(loss.device)] if extra is not None else [])
        host = torch.cat(flat).tolist()  # the step's one device-to-host transfer
        per_process = [host[i : i + 3] for i in range(0, 3 * values.size(0), 3)]
        extra_host = host[3 * values.size(0) :] if extra is not None else None
        bad = [i for i, (lo, gn, _) in enumerate(per_process) if not (math.isfinite(lo) and math.isfinite(gn))]
        bad_entropy = extra_host is not None and not all(math.isfinite(v) for v in extra_host)
        unscored_batch = any(u > 0 for _, _, u in per_process)
        losses = [lo for lo, _, _ in per_process]
        grad = per_process[0][1] if grad_norm is not None else math.nan
        if not bad and not bad_entropy and not unscored_batch:
            self.last_finite = (step, sum(losses) / len(losses), grad)
            return StepOutcome(False, extra_host)
        reason = SKIPPED_UNSCORED if unscored_batch and not bad and not bad_entropy else SKIPPED_NON_FINITE
        if self.total_skipped < self.max_skipped_steps:
            self.skipped[reason] += 1
            return StepOutcome(True, None)
        raise NonFiniteStepError(self._describe(step, per_process, bad, bad_entropy, grad_norm is not None), step)

    def _describe(self, step, per_process, bad, bad_entropy, norm_known) -> str:
        """The first line of the stop message (the checkpoint line is added by `stop_message`)."""
        if not bad and not bad_entropy:
            what = "its generation batch got no reward (every reward function returned None for every completion)"
        else:
            parts = []
            for i in bad or range(len(per_process)):
                loss, norm, _ = per_process[i]
                where = f"process {i}: " if len(per_process) > 1 else ""
                parts.append(f"{where}loss {loss:.6g}" + (f", grad norm {norm:.6g}" if norm_known else ""))
            what = "a non-finite value (" + "; ".join(parts) + ")"
            if bad_entropy:
                what += " (and a non-finite mean token entropy)"
        skipped = (
            f" after skipping {self.total_skipped} step(s) (cegppo_max_skipped_steps)" if self.total_skipped else ""
        )
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
    when it holds none (e.g. DeepSpeed shards only: not checked)."""
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


def newest_finite_checkpoint(checkpoints: list[str]) -> tuple[str | None, list[str]]:
    """The newest of `checkpoints` (oldest first) whose saved weights are all finite, and one line for each newer
    one passed over."""
    skipped = []
    for path in reversed(checkpoints):
        counts = non_finite_tensors(path)
        if counts is None or counts[0] == 0:
            return path, skipped
        skipped.append(f"Skipping {path}: {counts[0]} of its {counts[1]} weight tensors are not finite.")
    return None, skipped


def stop_message(error: Exception, prog: str, output_dir: str | None, checkpoint: str | None) -> str:
    """`cegppo-train`'s message for a run stopped by `NonFiniteStepError` or `RewardCoverageError`."""
    lines = [f"{prog}: {error}"]
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
