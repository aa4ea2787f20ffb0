"""Clean stops of `cegppo-train` on SIGINT (Ctrl-C) and SIGTERM (SLURM, Kubernetes, `timeout`): exit status 130 / 143.

Before training a signal stops the run at once. During training the first one only sets a flag, and the callback of
`stop_on_signal_callback` ends training at the next step end or checkpoint save, on every process at the same step; a
checkpoint being written is finished. A second signal, `REPEAT_S` or more after the first, stops at once; an earlier
one is the same request relayed by a launcher (torchrun forwards what a terminal's Ctrl-C already sent each worker).
Only the standard library is imported at the top: the handlers are installed before torch and TRL load.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence


REPEAT_S = 3.0


class StopRequest:
    """The signal handlers of a run: `signum` (None until a signal came); `deferred` while training runs (a first
    signal then waits for the step end); `started` once training began; `announce` on the process that prints. A
    SIGINT ignored at start (a background job of a non-interactive shell) stays ignored, as Python leaves it."""

    def __init__(self, install: bool = True):
        self.signum: int | None = None
        self.received_at = 0.0
        self.deferred = self.started = self.stopped_early = False
        self.announce = True
        self._previous: dict[int, object] = {}
        if install:
            self.install()

    def install(self) -> None:
        """Handle SIGINT and SIGTERM (from the main thread only: `signal.signal`'s own condition)."""
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers found at start (`main` called from Python, e.g. pytest)."""
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
        if self.announce:
            print(
                f"\n{self.name}: stopping at the end of this training step (a checkpoint being written is finished "
                f"first). Send it again, {REPEAT_S:.0f} s or more from now, to stop at once.",
                file=sys.stderr,
                flush=True,
            )

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports it: 130 (SIGINT, also a KeyboardInterrupt), 143 (SIGTERM)."""
        return 128 + (self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return "SIGTERM" if self.signum == signal.SIGTERM else "Ctrl-C"


def stop_on_signal_callback(request: StopRequest, accelerator):
    """A `TrainerCallback` that ends training at the first step end or checkpoint save after a signal, on every
    process at once: the flags of all processes are max-reduced at each of these points, which every process reaches
    in the same order."""
    import torch
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            request.deferred = request.started = True

        def on_train_end(self, args, state, control, **kwargs):
            request.deferred = False  # the final save: a signal now stops at once, training is complete

        def on_step_end(self, args, state, control, **kwargs):
            asked = torch.tensor([request.signum or 0], device=accelerator.device)
            signum = int(accelerator.reduce(asked, reduction="max").item())  # the same answer on every process
            if signum:
                request.signum, request.stopped_early = request.signum or signum, True
                control.should_training_stop = True
            return control

        on_save = on_step_end

    return StopOnSignal()


def last_complete_checkpoint(output_dir: str, complete: bool = True) -> str | None:
    """transformers' `get_last_checkpoint`, passing over (`complete`) incomplete checkpoints."""
    from ..divergence import complete_checkpoints

    found = complete_checkpoints(output_dir, complete)
    return found[-1] if found else None


def interrupted_message(argv: Sequence[str], training_args, prog: str, signal_name: str) -> str:
    """What a stopped run prints: the last complete checkpoint and the command that resumes from it."""
    lines = [f"{prog}: interrupted ({signal_name})."]
    if training_args is None:
        return lines[0]
    output_dir = training_args.output_dir
    last, newest = last_complete_checkpoint(output_dir), last_complete_checkpoint(output_dir, complete=False)
    incomplete = [f"{newest} was being written when the run stopped and is incomplete."] if newest != last else []
    if last is None and training_args.save_strategy == "no":
        lines.append(
            "This run saves no checkpoints (save_strategy: no), so it cannot be resumed; run the same command to "
            "start over (with --save_strategy steps --save_steps N to resume next time)."
        )
    elif last is None:
        lines.append(f"No checkpoint was saved in {output_dir} yet; run the same command to start over.")
    if last is None:
        return "\n".join([*lines, *incomplete])
    flag = f"--resume_from_checkpoint {shlex.quote(last)}"
    kept, skip = [], False
    for arg in argv:  # the command as given, less an earlier --resume_from_checkpoint
        resume = arg.replace("-", "_").startswith("__resume_from_checkpoint")
        kept += [] if skip or resume else [arg]
        skip = resume and "=" not in arg
    return "\n".join(
        [*lines, f"Last checkpoint saved: {last}", *incomplete]
        + [f"To resume from it, run the same command with {flag} added, e.g.:", f"  {prog} {shlex.join(kept)} {flag}"]
    )
