"""Stopping `cegppo-train` with SIGINT or SIGTERM at a chosen moment of the tiny recipe, and checking what it left
(tests/test_signals.py); run as a script, a stress loop over random moments, each of which must pass `check_stop`:

    python tests/signal_runs.py --runs 20   # 20 SIGTERM + 20 SIGINT; one line per run, a summary, exit 1 on a failure

A moment is ``step`` (the caller signals once checkpoint-`after` exists), ``grading`` (the first reward function
signals at its `after`-th call) or ``checkpoint`` (while the `after`-th checkpoint's ``optimizer.pt`` is written). The
signal goes to the run's process group, as a terminal's Ctrl-C or a scheduler's stop does, or (`only_rank`) to one
rank alone. The in-run moments come through `--reward_funcs signal_moments.zero`, so the command is the user's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from launching import launcher, subprocess_env


ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml"
CEGPPO_TRAIN = str(Path(sys.executable).parent / "cegppo-train")
EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}
MOMENTS = ("step", "grading", "checkpoint")

MOMENTS_MODULE = '''"""Sends STOP_SIGNAL to this run's process group at STOP_MOMENT (grading or checkpoint), the STOP_AFTER-th time."""
import os, signal, time

_SIGNAL = getattr(signal, os.environ.get("STOP_SIGNAL", "SIGTERM"))
_MOMENT = os.environ.get("STOP_MOMENT", "")
_AFTER = int(os.environ.get("STOP_AFTER", "2"))
_seen = [0]


def _send_once():
    _seen[0] += 1
    if _seen[0] == _AFTER and os.environ.get("RANK", "0") == os.environ.get("STOP_RANK", "0"):
        with open(os.environ["STOP_MARKER"], "w") as f:
            f.write(str(time.time()))
        if os.environ.get("STOP_SCOPE") == "process":
            os.kill(os.getpid(), _SIGNAL)  # this process only: the others learn it from the step-end all-reduce
        else:
            os.killpg(os.getpgid(0), _SIGNAL)


if _MOMENT == "checkpoint":
    import torch

    _save = torch.save

    def _save_and_signal(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            _send_once()
            time.sleep(0.5)  # the signal arrives well inside the checkpoint write
        return _save(obj, f, *args, **kwargs)

    torch.save = _save_and_signal


def zero(completions, **kwargs):
    if _MOMENT == "grading":
        _send_once()
    return [0.0] * len(completions)
'''


def _sigint_default() -> None:
    """In the child: SIGINT at its default, even when the suite runs as a background job (which ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run(
    cwd: Path, model_dir: Path | None, signal_name: str = "SIGTERM", moment: str = "step",
    after: int = 2, processes: int = 1, *extra: str, only_rank: int | None = None,
) -> tuple[subprocess.Popen, list[str]]:  # fmt: skip
    """Start the tiny recipe (saving to cwd / "run" every step, endless) in its own process group; (process, the
    training argv)."""
    (cwd / "signal_moments.py").write_text(MOMENTS_MODULE)
    argv = [
        "--config", str(TINY_RECIPE), "--output_dir", str(cwd / "run"), "--max_steps", "100000", "--tiny_sft_steps", "0",
        "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1000",
        "--reward_funcs", "signal_moments.zero", "math", *extra,
    ]  # fmt: skip
    if model_dir is not None:
        argv += ["--model_name_or_path", str(model_dir)]
    script = [*launcher(processes, "multi_gpu.yaml"), str(ROOT / "examples" / "train_cegppo.py")]
    cmd = [*([CEGPPO_TRAIN] if processes == 1 else script), *argv]
    env = subprocess_env()
    env.update(STOP_SIGNAL=signal_name, STOP_MOMENT=moment, STOP_AFTER=str(after), STOP_MARKER=str(cwd / "sent"))
    if only_rank is not None:  # the signal reaches this rank alone
        env.update(STOP_RANK=str(only_rank), STOP_SCOPE="process")
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_sigint_default,
    )  # fmt: skip
    return proc, argv


def complete_checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file())


def stop_run(
    proc: subprocess.Popen, cwd: Path, signal_name: str, moment: str, after=2, delay=0.0, launcher_only=False
) -> dict:
    """Send the signal (moment ``step``; to the group, or `launcher_only` to the started process alone, as Kubernetes
    does) or wait for the run to send it; return what the stop gave: ``returncode``,
    ``stderr``, ``seconds`` (signal to exit), ``left`` (processes of the group still alive after the exit)."""
    timeout, marker = 300, cwd / "sent"
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            if moment == "step" and (cwd / "run" / f"checkpoint-{after}" / "trainer_state.json").is_file():
                time.sleep(delay)  # somewhere in the step after the checkpoint
                marker.write_text(str(time.time()))
                (os.kill if launcher_only else os.killpg)(proc.pid, getattr(signal, signal_name))
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                _, stderr = proc.communicate(timeout=60)
                raise AssertionError(f"the run ended or stalled before the signal (rc {proc.returncode}):\n{stderr}")
            time.sleep(0.1)
        sent = float(marker.read_text())
        _, stderr = proc.communicate(timeout=timeout)
        seconds = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(0.5)
    try:
        os.killpg(proc.pid, 0)
        left = True
    except ProcessLookupError:
        left = False
    return {"returncode": proc.returncode, "stderr": stderr, "seconds": seconds, "left": left}


def check_stop(result: dict, out: Path, signal_name: str, argv: list[str]) -> Path:
    """Assert the stop was clean: the status, no traceback, no process left, the last complete checkpoint named with
    the resume command; return that checkpoint."""
    stderr = result["stderr"]
    assert result["returncode"] == EXIT_STATUS[signal_name], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not result["left"], "a process of the run outlived it"
    match = re.search(r"Last checkpoint saved: (\S+)", stderr)
    assert match, stderr[-3000:]
    last = Path(match[1])
    assert last.parent == out and last.name == f"checkpoint-{max(complete_checkpoints(out))}", stderr[-3000:]
    assert f"--resume_from_checkpoint {last}" in stderr
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["global_step"] == int(last.name.split("-")[1])
    return last


def loads(checkpoint: Path) -> None:
    """The checkpoint's model loads, every tensor finite."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def stress(runs: int, seed: int = 0) -> int:
    """The stress loop: `runs` SIGTERM and `runs` SIGINT stops at random moments; 1 if any failed."""
    import random
    import tempfile

    rng, failures, seconds, model_dir = random.Random(seed), 0, [], None
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(2 * runs):
            signal_name, moment, delay = ("SIGTERM", "SIGINT")[index % 2], rng.choice(MOMENTS), rng.uniform(0, 1.5)
            after = rng.randint(2 if moment == "grading" else 1, 3)  # grading #1 is before checkpoint-1
            cwd, started = Path(tmp) / f"{index:03d}-{signal_name}-{moment}", time.monotonic()
            cwd.mkdir()
            try:
                proc, argv = start_run(cwd, model_dir, signal_name, moment, after)
                result = stop_run(proc, cwd, signal_name, moment, after, delay=delay)
                loads(check_stop(result, cwd / "run", signal_name, argv))
                seconds.append(result["seconds"])
                status = f"ok, exited {seconds[-1]:.1f} s after the signal"
            except AssertionError as error:
                failures, status = failures + 1, f"FAILED: {str(error)[-500:]}"
            print(f"run {index + 1:2d} {signal_name:7s} {moment:10s} after={after} delay={delay:.2f}: {status} "
                  f"({time.monotonic() - started:.0f} s in all)", flush=True)  # fmt: skip
            if model_dir is None and (cwd / "run" / "tiny-init").is_dir():
                model_dir = cwd / "run" / "tiny-init"  # the first run built builtin:tiny; the others reuse it
    print(f"RESULT clean stops: {2 * runs - failures}/{2 * runs}; signal to exit: max {max(seconds, default=0):.1f} "
          f"s, median {sorted(seconds)[len(seconds) // 2] if seconds else 0:.1f} s")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="SIGTERM and SIGINT at random moments of the tiny recipe.")
    parser.add_argument("--runs", type=int, default=20, help="runs per signal")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()
    sys.exit(stress(arguments.runs, arguments.seed))
