"""How the real-model tier runs `cegppo-train`: the tier's recipe `smollm2_cpu.yaml` as a user would run it (the
console command on one process; `accelerate launch ... -m cegppo_trl.scripts.train`, the README's launch of the
installed command, on two gloo processes)."""

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from launching import launcher, subprocess_env
from shared import ROOT, run_checked


HERE = Path(__file__).resolve().parent
RECIPE = HERE / "smollm2_cpu.yaml"
RUN_TIMEOUT_S = 1800  # generous: one run takes 1-3 min on 2 idle cores, far more on a loaded machine
# What the runs add to the recipe: beside its own rewards (math, format), one that records the prompts, completions
# and token ids the trainer produced (completion_log.py: a constant 0.0, loaded by dotted path like a user's reward).
RECORDING_REWARDS = ("--reward_funcs", "math", "format", "completion_log.record_completions")
LORA = ("--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear")
LORA_LEARNING_RATE = "5.0e-4"  # LoRA moves only its low-rank factors: 10x the full-parameter rate


def real_model_env(**extra: str) -> dict[str, str]:
    """The tests' subprocess environment (offline, one torch thread per process) with this folder importable (the
    recording reward)."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_command(argv: list, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_checked(argv, ROOT, env, timeout=RUN_TIMEOUT_S)


@dataclass
class TrainRun:
    out: Path  # --output_dir: the model or adapter, trainer_state.json, cegppo_prompt.json
    completions: Path  # the recording reward's jsonl files, one per rank
    processes: int
    lora: bool
    seconds: float


def train(smollm2_dir: Path, out: Path, *, processes: int, lora: bool) -> TrainRun:
    """`cegppo-train` with the tier's recipe on `processes` CPU processes, full-parameter or LoRA."""
    if out.exists():
        shutil.rmtree(out)
    completions = out.parent / f"{out.name}-completions"
    args = ["--config", RECIPE, "--model_name_or_path", smollm2_dir, "--output_dir", out, *RECORDING_REWARDS]
    if lora:
        args += [*LORA, "--learning_rate", LORA_LEARNING_RATE]
    if processes == 1:
        command = [Path(sys.executable).parent / "cegppo-train", *args]
    else:
        command = [*launcher(processes, "multi_gpu.yaml"), "-m", "cegppo_trl.scripts.train", *args]
    start = time.perf_counter()
    run_command(command, real_model_env(COMPLETION_LOG_DIR=str(completions)))
    return TrainRun(out, completions, processes, lora, time.perf_counter() - start)
