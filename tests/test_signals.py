"""Clean stops on SIGINT (Ctrl-C) and SIGTERM (schedulers).

A signal during training stops `cegppo-train` at the end of the step (every process at the same step), never in the
middle of a checkpoint write; it exits 130 (SIGINT) or 143 (SIGTERM) within seconds, names the last complete
checkpoint and the resume command, leaves no process behind, and the checkpoint loads and resumes. The runs start
their child with SIGINT at its default, so the tests pass when the suite itself runs in the background (`nohup ... &`),
where SIGINT is ignored. The stress loop over many moments is `python tests/signal_runs.py --runs 20`.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from signal_runs import check_stop, complete_checkpoints, loads, start_run, stop_run

from cegppo_trl.scripts.stopping import REPEAT_S, StopRequest


STOP_WITHIN_S = 60  # signal to exit on a shared, loaded 2-core machine (about 5 s idle)


def _resume_one_more_step(cwd: Path, stderr: str, last: Path, monkeypatch) -> None:
    """Run the printed resume command for one step more, through the console function in this process (the stop
    itself needed a process of its own): it resumes from `last` and ends one step later."""
    from cegppo_trl.scripts.train import main

    command = next(line.strip() for line in stderr.splitlines() if line.strip().startswith("cegppo-train "))
    argv = shlex.split(command)[1:]
    assert argv[-2:] == ["--resume_from_checkpoint", str(last)]
    steps = int(last.name.split("-")[1]) + 1
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the rewards' module (signal_moments) is imported from cwd
    monkeypatch.delitem(sys.modules, "signal_moments", raising=False)
    try:
        assert main([*argv, "--max_steps", str(steps)]) == 0
    finally:
        sys.modules.pop("signal_moments", None)
    out = last.parent
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == steps and (out / "model.safetensors").is_file()


STOP_NAME = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM"}


def _stopped(cwd: Path, model_dir: Path, signal_name: str, moment: str, processes=1, launcher_only=False, **kwargs):
    """Start the tiny recipe and stop it with `signal_name` at `moment`, within STOP_WITHIN_S: (result, out, argv)."""
    out = cwd / "run"
    proc, argv = start_run(cwd, model_dir, signal_name, moment, 2, processes, **kwargs)
    result = stop_run(proc, cwd, signal_name, moment, launcher_only=launcher_only)
    assert result["seconds"] < STOP_WITHIN_S, result["seconds"]
    return result, out, argv


def _wait_for_the_sigterm_handler(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the process catches SIGTERM (Linux: bit 15 of SigCgt in /proc/PID/status), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)[1], 16)
        if caught >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"no SIGTERM handler within {timeout} s (exit status {proc.poll()})")


def test_sigint_during_the_imports_prints_the_ctrl_c_message(tmp_path):
    proc, _ = start_run(tmp_path, None, "SIGINT", "imports")  # stopped before any run starts
    _wait_for_the_sigterm_handler(proc)  # installed with the SIGINT one, before torch and TRL are imported
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "cegppo-train: interrupted (Ctrl-C).", stderr
    assert not (tmp_path / "run").exists()


def test_a_repeated_signal_is_a_relay_then_a_second_request_stops_at_once_and_an_ignored_sigint_stays_ignored():
    """torchrun relays the signal a terminal already sent each worker: a repeat within REPEAT_S is the same request;
    a later one stops at once (KeyboardInterrupt). Before training (not deferred) the first one stops at once."""
    previous = signal.getsignal(signal.SIGTERM)
    # As a terminal starts pytest: a background job of a non-interactive shell starts with SIGINT ignored, and a
    # StopRequest then leaves it ignored (its own rule, tested by the SIGINT runs).
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    stop = StopRequest()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.exit_status == 143 and stop.name == "SIGTERM"
        stop.signum, stop.deferred = None, True
        os.kill(os.getpid(), signal.SIGINT)  # during training: a flag only
        assert stop.signum == signal.SIGINT and stop.exit_status == 130
        os.kill(os.getpid(), signal.SIGTERM)  # relayed
        assert stop.signum == signal.SIGINT
        stop.received_at -= REPEAT_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
        signal.signal(signal.SIGINT, previous_sigint)
    assert signal.getsignal(signal.SIGTERM) == previous
    # A background job of a non-interactive shell starts with SIGINT ignored; as Python, the run leaves it so.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = StopRequest()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop.restore()
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "signal_name, moment",
    [("SIGTERM", "step")]
    + [pytest.param(s, m, marks=pytest.mark.slow) for m in ("grading", "checkpoint") for s in ("SIGINT", "SIGTERM")],
)
def test_a_signal_during_a_step_while_grading_or_writing_a_checkpoint_stops_cleanly_and_resumes(
    tiny_checkpoint, tmp_path, signal_name, moment, monkeypatch
):
    result, out, argv = _stopped(tmp_path, tiny_checkpoint, signal_name, moment)
    last = check_stop(result, out, signal_name, argv)
    assert f"{STOP_NAME[signal_name]}: stopping at the end of this training step" in result["stderr"]
    assert f"interrupted ({STOP_NAME[signal_name]})" in result["stderr"]
    assert not (out / "model.safetensors").exists()  # a stopped run is not saved as a finished one
    if moment == "checkpoint":  # the checkpoint being written when the signal came was finished, and is the last
        assert complete_checkpoints(out)[-1] == 2 and last.name == "checkpoint-2"
    assert all((p / "trainer_state.json").is_file() for p in out.glob("checkpoint-*")), "an incomplete checkpoint"
    loads(last)
    _resume_one_more_step(tmp_path, result["stderr"], last, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("launcher_only", [False, True], ids=["group", "launcher-alone"])
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_two_gloo_processes_stop_together(tiny_checkpoint, tmp_path, signal_name, launcher_only):
    """`accelerate launch` with 2 processes: the signal reaches the launcher and both ranks (and the launcher relays
    it again), or the launcher alone (Kubernetes signals the container's first process), which relays it to each
    rank; both ranks stop at the same step, the launcher exits with the run's status, nothing is left."""
    result, out, argv = _stopped(tmp_path, tiny_checkpoint, signal_name, "step", 2, launcher_only)
    last = check_stop(result, out, signal_name, argv)
    if not launcher_only:
        assert result["stderr"].count("Last checkpoint saved:") == 1  # one message, from rank 0
    loads(last)


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tiny_checkpoint, tmp_path):
    """SIGTERM to rank 1 alone, while it grades: rank 0 learns it from the all-reduce at the step end and both stop
    at the same step, rank 0 printing the message. torchrun, which was not signalled, then reports rank 1's status
    143 as a failed worker (its traceback, status 1): what it does for any worker that exits non-zero."""
    result, out, _ = _stopped(tmp_path, tiny_checkpoint, "SIGTERM", "grading", 2, only_rank=1)
    stderr = result["stderr"]
    assert not result["left"], stderr[-3000:]
    assert "cegppo-train: interrupted (SIGTERM)." in stderr and "exitcode: 143" in stderr, stderr[-3000:]
    last = Path(re.search(r"Last checkpoint saved: (\S+)", stderr)[1])
    assert last.name == f"checkpoint-{max(complete_checkpoints(out))}"
    assert all((p / "trainer_state.json").is_file() for p in out.glob("checkpoint-*"))
    loads(last)
