"""What the tests that start processes share: a free local port, the environment of a test subprocess, the metrics
every training step of a launched run must log, and the checks of a finished run of the tiny recipe (its logs, its
saved model)."""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch


MAX_STEPS = 4  # the tiny recipe's
ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "accelerate_configs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(processes: int, config: str | None = None, port: int | None = None) -> list[str]:
    """The command that starts a script on `processes` CPU processes, on `port` (default: a free one): torchrun (DDP
    over gloo) without `config`, else `accelerate launch` with accelerate_configs/`config`, in fp32 (the trainer runs
    with bf16=False on CPU; the shipped configs say bf16, for GPUs)."""
    port = str(port or free_port())
    if config is None:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                port]  # fmt: skip
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / config),
            "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", port]  # fmt: skip


def subprocess_env() -> dict[str, str]:
    """This environment, offline (nothing from the Hub), one torch thread per process (2 processes on 2 cores),
    unbuffered output."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TQDM_DISABLE="1",  # no progress bars: a failure's stderr tail shows the error, not bars
    )
    return env


# torchrun's report of each failed worker: "exitcode  : -6 (pid: ...)" for a signal, 1 for a Python error.
_EXIT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def _crashed(stderr: str) -> bool:
    """Workers that died by a signal only, one of them by SIGABRT or SIGSEGV (the others stopped by the launcher)."""
    codes = [int(code) for code in _EXIT_CODE.findall(stderr)]
    return bool(codes) and all(code < 0 for code in codes) and any(code in (-6, -11) for code in codes)


def run_launched(cmd, cwd=None, timeout: float = 1800, clean: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command (a worker or `accelerate launch`) in `subprocess_env()`; fail the test with the command and its
    output tails if it exits non-zero. A launch whose worker died by SIGABRT or SIGSEGV, with none failing in Python,
    is run once more (`clean`, the run's output_dir, removed first so it starts over), with a warning that carries the
    first stderr: a rank of a two-process ZeRO-3 launch died once by SIGABRT on a CI machine (never in 19 repeats on
    another), its message lost in progress bars. A second such death, or any Python error, fails the test."""
    cmd = [str(a) for a in cmd]
    for attempt in (1, 2):
        proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or not _crashed(proc.stderr) or attempt == 2:
            break
        warnings.warn(f"a worker was killed by a signal; running `{shlex.join(cmd)}` again:\n{proc.stderr[-6000:]}")
        if clean is not None:
            shutil.rmtree(clean, ignore_errors=True)
    if proc.returncode != 0:
        pytest.fail(
            f"`{shlex.join(cmd)}` failed ({proc.returncode})\n--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


# Logged at every optimizer step of a CE-GPPO run (CE-GPPO's own metrics and TRL's that it relies on).
STEP_METRICS = (
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
    "cegppo/beta1_grad_share",
    "cegppo/beta2_grad_share",
    "cegppo/beta1",
    "cegppo/beta2",
    "cegppo/quadrant/neg_low/token_frac",
    "cegppo/quadrant/pos_low/token_frac",
    "clip_ratio/region_mean",
    "entropy",
)


def logged_steps(output_dir: Path, max_steps: int) -> list[dict]:
    """The step entries of a finished run's log: steps 1 to `max_steps`, each with every `STEP_METRICS` value."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == max_steps
    steps = [e for e in state["log_history"] if "loss" in e]
    assert [e["step"] for e in steps] == list(range(1, max_steps + 1))
    for entry in steps:
        missing = [m for m in STEP_METRICS if m not in entry]
        assert not missing, f"step {entry['step']} lacks {missing}"
    return steps


def check_logs(output_dir: Path, world_size: int) -> list[dict]:
    steps = logged_steps(output_dir, MAX_STEPS)
    for entry in steps:
        assert 0.0 <= entry["cegppo/beta1_token_frac"] <= 1.0 and 0.0 <= entry["cegppo/beta2_token_frac"] <= 1.0
        assert (entry["cegppo/beta1"], entry["cegppo/beta2"]) == (0.5, 1.0)
    # The first optimizer step of a generation batch is on-policy: nothing is clipped there.
    assert steps[0]["cegppo/beta1_token_frac"] == 0.0 == steps[0]["cegppo/beta2_token_frac"]
    assert "reward" in steps[0] and "rewards/math_reward/mean" in steps[0] and "rewards/format_reward/mean" in steps[0]
    # Each of the `world_size` processes consumed its own share of the data: 8 completions = 2 prompts per step each.
    rows = 256  # max_train_samples
    assert steps[-1]["epoch"] == pytest.approx(MAX_STEPS * 2 * world_size / rows)
    # The completions were scored differently (format reward), so the policy gradient was not zero.
    assert any(e["grad_norm"] > 0 for e in steps)
    card = (output_dir / "README.md").read_text()
    assert "CE-GPPO" in card and "2509.20712" in card
    return steps


TIME_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def step_logs(output_dir: Path, max_steps: int) -> dict[int, dict]:
    """A finished run's `{step: log entry without its wall-clock figures}`, after checking it ran `max_steps`."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == max_steps
    return {e["step"]: {k: v for k, v in e.items() if k not in TIME_KEYS} for e in state["log_history"] if "loss" in e}


def saved_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(output_dir / "model.safetensors")


def controller_state(checkpoint: Path) -> dict:
    from cegppo_trl.divergence import EXTRA_STATE_FILE
    from cegppo_trl.trainer import CONTROLLER_STATE_KEY

    return json.loads((checkpoint / EXTRA_STATE_FILE).read_text())[CONTROLLER_STATE_KEY]


def assert_trained_full_model(output_dir: Path, init_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(output_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    init = AutoModelForCausalLM.from_pretrained(init_dir)
    trained, start = model.state_dict(), init.state_dict()
    assert trained.keys() == start.keys()
    assert all(trained[k].shape == start[k].shape for k in trained)
    assert any(not torch.equal(trained[k], start[k]) for k in trained), "the saved weights are the initial ones"
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    ids = tokenizer("What is 2+3?", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
