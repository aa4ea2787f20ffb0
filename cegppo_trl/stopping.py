"""Clean stops of a training run on SIGINT (Ctrl-C) and SIGTERM (schedulers: SLURM, Kubernetes, `timeout`).

Before training starts (imports, model loading) a signal stops the run at once. Once training runs, the first signal
only sets a flag: `cegppo_trl.training_run.StopOnSignalCallback` ends training at the next optimizer-step end or checkpoint save, on every
process at the same step (one all-reduce of the flag per step), so a checkpoint being written is always finished and
the run stops within one step. A second signal, at least `REPEAT_S` seconds after the first, stops at once (a
checkpoint in progress is then left incomplete; `last_checkpoint` and the resume skip it). A repeat within
`REPEAT_S` is taken for the same request relayed by a launcher (torchrun forwards the signal it gets to each worker,
which a terminal's Ctrl-C has already reached).

This module imports nothing heavy, so that `cegppo-train` installs the handlers before importing torch and TRL.

Exit statuses (shell convention, 128 + the signal number): 130 after SIGINT, 143 after SIGTERM.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence


__all__ = [
    "EXIT_STATUS",
    "REPEAT_S",
    "StopRequest",
    "interrupted_message",
    "last_checkpoint",
]

EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""The exit status of a run stopped by each signal."""
REPEAT_S = 3.0
"""A second signal this many seconds or more after the first stops the run at once; an earlier one is a relay."""
_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopRequest:
    """The signal handlers of a run and what they were asked: `signum` (None until a signal came) and whether training
    is under way (`deferred`: then a first signal waits for a clean point).

    A SIGINT ignored when the process started (a background job of a non-interactive shell) stays ignored, as Python
    itself leaves it; SIGTERM is always handled."""

    def __init__(self, install: bool = True):
        self.signum: int | None = None
        self.received_at = 0.0
        self.deferred = False
        self.stopped_early = False  # set by StopOnSignalCallback when it ended training
        self._previous: dict[int, object] = {}
        if install and threading.current_thread() is threading.main_thread():  # signal.signal's own condition
            for signum in EXIT_STATUS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers found at start (`cegppo_trl.scripts.train.main` called from Python, e.g. pytest)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is not None and now - self.received_at < REPEAT_S:
            return  # the same request, relayed
        first = self.signum is None
        self.signum, self.received_at = signum, now
        if not (first and self.deferred):
            raise KeyboardInterrupt
        if os.environ.get("RANK", "0") == "0":
            print(
                f"\n{_NAMES.get(signum, signum)}: stopping at the end of this training step (a checkpoint being written "
                f"is finished first). Send it again, {REPEAT_S:.0f} s or more from now, to stop at once.",
                file=sys.stderr,
                flush=True,
            )

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 130)

    @property
    def name(self) -> str:
        return _NAMES.get(self.signum, "Ctrl-C")


def last_checkpoint(output_dir: str) -> tuple[str | None, str | None]:
    """(the last complete ``checkpoint-N`` in `output_dir`, a later one left incomplete), each None if there is none.

    The checkpoints come from transformers' `sort_checkpoints` (the Trainer's own order); a checkpoint is complete once
    its ``trainer_state.json`` is written, the last file the Trainer saves in it."""
    from transformers.trainer_utils import sort_checkpoints

    if not os.path.isdir(output_dir):
        return None, None
    found = sort_checkpoints(output_dir)
    complete = [path for path in found if os.path.isfile(os.path.join(path, "trainer_state.json"))]
    last = complete[-1] if complete else None
    incomplete = found[-1] if found and found[-1] != last else None
    return last, incomplete


def _without_resume_flag(argv: Sequence[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--resume_from_checkpoint", "--resume-from-checkpoint"):
            skip = True
        elif not arg.startswith(("--resume_from_checkpoint=", "--resume-from-checkpoint=")):
            kept.append(arg)
    return kept


def interrupted_message(
    argv: Sequence[str], training_args, prog: str = "cegppo-train", signal_name: str = "Ctrl-C"
) -> str:
    """What `cegppo-train` prints when a signal stops it: the last complete checkpoint and the command that resumes
    from it (`training_args`: anything with `output_dir` and `save_strategy`; None before the arguments parsed)."""
    lines = [f"{prog}: interrupted ({signal_name})."]
    if training_args is None:
        return lines[0]
    output_dir = training_args.output_dir
    last, incomplete = last_checkpoint(output_dir)
    if last is None:
        if str(training_args.save_strategy) in ("no", "SaveStrategy.NO"):
            lines.append(
                "This run saves no checkpoints (save_strategy: no), so it cannot be resumed; run the same command to "
                "start over (with --save_strategy steps --save_steps N to be able to resume next time)."
            )
        else:
            lines.append(f"No checkpoint was saved in {output_dir} yet; run the same command to start over.")
        if incomplete:
            lines.append(f"{incomplete} was being written when the run stopped and is incomplete.")
        return "\n".join(lines)
    flag = f"--resume_from_checkpoint {shlex.quote(last)}"
    lines.append(f"Last checkpoint saved: {last}")
    if incomplete:
        lines.append(
            f"({incomplete} was being written when the run stopped and is incomplete; do not resume from it.)"
        )
    lines.append(f"To resume from it, run the same command with {flag} added, e.g.:")
    lines.append(f"  {prog} {shlex.join(_without_resume_flag(argv))} {flag}")
    return "\n".join(lines)
