"""The GPU check's `lora` and `paper` parts: the shipped DeepSeek-R1-Distill-Qwen-1.5B CE-GPPO recipes launched as a
user launches them (`accelerate launch ... examples/train_cegppo.py --config <recipe>`), on a random-init model of
that shape built locally, then `cegppo-eval` on what each run saved. Only size and hardware are swapped, by flags
after `--config`; docs/scaling.md ("GPU check") lists the swaps, and each `RECIPE` line says which (`swaps`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from harness import QWEN2_1_5B, TINY


ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "DeepSeek-R1-Distill-Qwen-1.5B" / "cegppo"
LAUNCH_CONFIG = "accelerate_configs/single_gpu.yaml"
TRAIN_SCRIPT = "examples/train_cegppo.py"
REWARDS = ["math", "split_reward.split_groups"]
# deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B's config.json (Qwen2-1.5B's shape with these): 1.78 B parameters with
# untied embeddings; tied here (as the GPU run of 2026-12-04 built it), 1.54 B.
R1_DISTILL_1_5B = dict(QWEN2_1_5B, num_hidden_layers=28, rope_theta=10000.0, max_position_embeddings=131072)
TINY_SHAPE = dict(TINY, num_hidden_layers=2, max_position_embeddings=4096)  # vocab_size: the tokenizer's


@dataclass
class RecipeRun:
    """One shipped recipe and the batch sizes the check swaps in (empty: the recipe's own)."""

    name: str
    recipe: Path
    batch: dict = field(default_factory=dict)


RUNS = [
    RecipeRun("lora", RECIPES / "config_lora.yaml", {"gradient_accumulation_steps": 2, "steps_per_generation": 16}),
    RecipeRun("paper", RECIPES / "config_paper.yaml"),
]


@dataclass
class Sizes:
    """What differs between the GPU check and its `--smoke` run on CPU."""

    smoke: bool
    completion_len: int
    max_steps: int = 8
    eval_problems: int = 32
    eval_k: int = 2
    eval_new_tokens: int = 128
    train_timeout_s: float = 300.0
    eval_timeout_s: float = 180.0

    @classmethod
    def for_mode(cls, smoke: bool, completion_len: int | None = None, timeout_scale: float = 1.0) -> Sizes:
        if smoke:
            sizes = cls(True, completion_len or 16, eval_problems=8, eval_new_tokens=16)
            sizes.train_timeout_s, sizes.eval_timeout_s = 1500.0, 600.0  # 2 shared CPU cores, other jobs running
        else:
            sizes = cls(False, completion_len or 256)
        sizes.train_timeout_s *= timeout_scale
        sizes.eval_timeout_s *= timeout_scale
        return sizes


def build_random_model(path: Path, smoke: bool) -> str:
    """A random-init Qwen2 model with the tiny local tokenizer saved to `path` (no download); returns a summary.

    GPU: DeepSeek-R1-Distill-Qwen-1.5B's shape in bf16, built on the GPU. `--smoke`: a tiny shape in fp32 on CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cegppo_trl.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    shape = dict(TINY_SHAPE, vocab_size=len(tokenizer)) if smoke else R1_DISTILL_1_5B
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    special["pad_token_id"] = tokenizer.pad_token_id
    config = Qwen2Config(**shape, initializer_range=0.02, use_cache=True, **special)
    torch.manual_seed(0)
    device = "cpu" if smoke else "cuda"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.float32 if smoke else torch.bfloat16)
    for key, value in special.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if not smoke:
        torch.cuda.empty_cache()
    label = "tiny shape" if smoke else "DeepSeek-R1-Distill-Qwen-1.5B shape"
    return (
        f"random-init {label}: {n_params / 1e6:,.1f}M params, vocab {shape['vocab_size']}, tokenizer {len(tokenizer)}"
    )


def recipe_launch_header(recipe: Path) -> str:
    """The accelerate config the recipe's header comment launches it with (e.g. 'zero2.yaml --num_processes 8')."""
    match = re.search(r"--config_file accelerate_configs/(\S+)( --num_processes \d+)?", recipe.read_text())
    return (match.group(1) + (match.group(2) or "")).strip() if match else "(none named)"


GENERATION = ("auto", "hf", "continuous_batching", "vllm")


def generation_backend(smoke: bool, choice: str = "auto") -> str:
    """How the recipe runs generate: "vllm" (the recipes' setting) on a GPU with vLLM installed; else "hf" (TRL's
    HF `generate`), or "continuous_batching" (TRL's `use_transformers_continuous_batching`) when asked for."""
    if choice != "auto":
        return choice
    return "vllm" if not smoke and importlib.util.find_spec("vllm") is not None else "hf"


def swaps(run: RecipeRun, sizes: Sizes, generation: str) -> list[str]:
    """The hardware swaps of one run, each with why (printed in its RECIPE line)."""
    out = []
    if generation != "vllm":
        why = "CPU" if sizes.smoke else ("vllm not installed" if importlib.util.find_spec("vllm") is None else "asked")
        how = "HF generate" if generation == "hf" else "use_transformers_continuous_batching=true"
        out.append(f"use_vllm=false ({how}; {why})")
    if sizes.smoke:
        out.append("bf16=false dtype=float32 use_cpu=true, launcher --cpu --mixed_precision no (CPU: no bf16)")
    header = recipe_launch_header(run.recipe)
    if header != Path(LAUNCH_CONFIG).name:
        out.append(f"single_gpu.yaml in place of {header} (one device)")
    out.append("USE_HUB_KERNELS=0 (offline)")
    return out


def train_command(run: RecipeRun, model_dir: Path, output_dir: Path, sizes: Sizes, generation: str) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/single_gpu.yaml examples/train_cegppo.py --config ...`."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCH_CONFIG]
    if sizes.smoke:
        launcher += ["--cpu", "--mixed_precision", "no"]
    args = ["--config", str(run.recipe.relative_to(ROOT)), "--model_name_or_path", str(model_dir)]
    args += ["--dataset_name", "builtin:arithmetic", "--problem_column", "problem", "--answer_column", "answer"]
    args += ["--reward_funcs", *REWARDS, "--max_completion_length", str(sizes.completion_len)]
    args += ["--max_steps", str(sizes.max_steps), "--output_dir", str(output_dir)]
    for key, value in run.batch.items():
        args += [f"--{key}", str(value)]
    if generation != "vllm":
        args += ["--use_vllm", "false"]
    if generation == "continuous_batching":
        args += ["--use_transformers_continuous_batching", "true"]
    if sizes.smoke:
        args += ["--use_cpu", "true", "--bf16", "false", "--dtype", "float32"]
    return launcher + [TRAIN_SCRIPT] + args


def eval_command(model_dir: Path, report: Path, sizes: Sizes) -> list[str]:
    """`cegppo-eval MODEL --datasets builtin:arithmetic_eval ...` (the console script next to this Python)."""
    script = Path(sys.executable).parent / "cegppo-eval"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "cegppo_trl.scripts.eval"]
    command += [str(model_dir), "--datasets", "builtin:arithmetic_eval", "--max-problems", str(sizes.eval_problems)]
    command += ["--k", str(sizes.eval_k), "--max-new-tokens", str(sizes.eval_new_tokens), "--no-progress"]
    return command + ["--output", str(report)]


def child_env(smoke: bool) -> dict[str, str]:
    """This environment, offline, with benchmarks/ (the split reward) and the repository on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(BENCHMARKS), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(PYTHONUNBUFFERED="1", HF_HUB_DISABLE_TELEMETRY="1")
    env.setdefault("USE_HUB_KERNELS", "0")
    if smoke:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_logged(command: list[str], log_path: Path, sizes: Sizes, timeout_s: float) -> tuple[int, float, str]:
    """Run `command` in the repository root (`child_env`) with its output in `log_path`: (exit status, 124 if timed
    out; seconds; on a GPU, the device-wide peak of used GPU memory, all processes and this one's CUDA context too,
    sampled every 0.5 s)."""
    peak, done, gpu = [0], threading.Event(), not sizes.smoke

    def sample():
        while not done.is_set():
            free, total = torch.cuda.mem_get_info()
            peak[0] = max(peak[0], total - free)
            done.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    env = child_env(sizes.smoke)
    with open(log_path, "w") as log:
        if gpu:
            sampler.start()
        start = time.perf_counter()
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        try:
            rc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            status = rc.returncode
        except subprocess.TimeoutExpired:
            status = 124
        seconds = time.perf_counter() - start
    done.set()
    if gpu:
        sampler.join()
    return status, seconds, f"gpu_peak_gib={peak[0] / 2**30:.1f}" if gpu else "gpu_peak_gib=nan"


def print_line(line: str, ok: bool, log_path: Path) -> None:
    """Print a RECIPE / EVAL line; a failed run's ends with the last error-looking lines of its log (or its last)."""
    if not ok:
        text = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
        errors = [entry for entry in text if re.search(r"Error|error:|Traceback|cegppo-(train|eval):", entry)]
        line += " | " + " | ".join((errors or text)[-8:])[-1500:]
    print(line, flush=True)


def read_recipe(run: RecipeRun) -> dict:
    """The recipe's values with the check's batch overrides applied."""
    import yaml

    return {**yaml.safe_load(run.recipe.read_text()), **run.batch}


def training_summary(output_dir: Path, recipe: dict) -> dict:
    """What the run's `trainer_state.json` and saved output say: steps, step times, generation, dynamic sampling."""
    state_path = output_dir / "trainer_state.json"
    if not state_path.exists():
        return {"steps": 0, "max_steps": -1, "saved": "none"}
    state = json.loads(state_path.read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    times = [entry["step_time"] for entry in steps if "step_time" in entry]
    kept = [entry["cegppo/informative_group_frac"] for entry in steps if "cegppo/informative_group_frac" in entry]
    kind = "adapter" if (output_dir / "adapter_config.json").exists() else "model"
    kind = kind if (output_dir / ("adapter_config.json" if kind == "adapter" else "config.json")).exists() else "none"
    prompts = recipe["per_device_train_batch_size"] * recipe["steps_per_generation"] // recipe["num_generations"]
    completions = round(prompts * recipe.get("cegppo_oversampling", 1.0)) * recipe["num_generations"]
    mean_len = steps[0].get("completions/mean_length", float("nan")) if steps else float("nan")
    later = sorted(times[1:])
    return {
        "steps": state.get("global_step", 0),
        "max_steps": state.get("max_steps", -1),
        "saved": kind,
        "step1_s": times[0] if times else float("nan"),
        "step_s": later[len(later) // 2] if later else float("nan"),
        "completions": completions,
        "mean_len": mean_len,
        "kept_groups": sum(kept) / len(kept) if kept else float("nan"),
        "reward_std": steps[0].get("reward_std", float("nan")) if steps else float("nan"),
        "groups_trained": steps[0].get("cegppo/groups_trained", float("nan")) if steps else float("nan"),
        "losses_finite": all(abs(entry["loss"]) < float("inf") for entry in steps) and bool(steps),
    }


def run_recipe(run: RecipeRun, model_dir: Path, workdir: Path, sizes: Sizes, generation: str) -> Path | None:
    """Launch one recipe, print its RECIPE line; the output folder when it trained every step and saved, else None."""
    output_dir = workdir / f"out_{run.name}"
    log_path = workdir / f"train_{run.name}.log"
    command = train_command(run, model_dir, output_dir, sizes, generation)
    rc, wall, memory = run_logged(command, log_path, sizes, sizes.train_timeout_s)
    s = training_summary(output_dir, read_recipe(run))
    ok = rc == 0 and s["steps"] == sizes.max_steps and s["saved"] != "none" and s["losses_finite"]
    line = f"RECIPE {run.name}: {'ok' if ok else 'FAILED'} rc={rc} steps={s['steps']}/{sizes.max_steps} "
    line += f"saved={output_dir if s['saved'] != 'none' else 'none'} ({s['saved']}) wall_s={wall:.0f}"
    if s["steps"]:
        tokens = s["completions"] * s["mean_len"]
        line += (
            f" | step1_s={s['step1_s']:.1f} (generation of {s['completions']} x {s['mean_len']:.0f} tokens + 1 step,"
            f" {tokens / s['step1_s']:.0f} tok/s) step_s={s['step_s']:.2f} | kept_groups={s['kept_groups']:.2f} "
            f"groups_trained={s['groups_trained']:.0f} "
            f"reward_std={s['reward_std']:.2f} losses_finite={int(s['losses_finite'])}"
        )
    line += f" | {memory} | recipe={run.recipe.relative_to(ROOT)} completion_len={sizes.completion_len}"
    line += " batch=" + (",".join(f"{k}={v}" for k, v in run.batch.items()) or "recipe's")
    line += " | swapped: " + "; ".join(swaps(run, sizes, generation)) + f" | log={log_path}"
    print_line(line, ok, log_path)
    return output_dir if ok else None


def eval_figures(report_path: Path) -> dict | None:
    """The built-in eval set's figures from a `cegppo-eval` report: problems, k, avg@k, pass@k, seconds."""
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    result = report.get("datasets", {}).get("builtin:arithmetic_eval")
    if not result:
        return None
    k, nan = result["k"], float("nan")
    figures = dict(problems=result["num_problems"], k=k, accuracy=result[f"avg@{k}"])
    return dict(figures, pass_k=result.get(f"pass@{k}", nan), seconds=result.get("seconds", nan))


def run_eval(name: str, model_dir: Path, workdir: Path, sizes: Sizes) -> bool:
    """`cegppo-eval` on a run's saved output; prints its EVAL line."""
    report = workdir / f"eval_{name}.json"
    log_path = workdir / f"eval_{name}.log"
    rc, wall, memory = run_logged(eval_command(model_dir, report, sizes), log_path, sizes, sizes.eval_timeout_s)
    figures = eval_figures(report)
    ok = rc == 0 and figures is not None and figures["problems"] == sizes.eval_problems
    ok = ok and 0.0 <= figures["accuracy"] <= 1.0
    line = f"EVAL {name}: {'ok' if ok else 'FAILED'} rc={rc} model={model_dir}"
    if figures:
        line += (
            f" problems={figures['problems']} k={figures['k']} accuracy={figures['accuracy']:.3f} "
            f"(avg@{figures['k']}) pass@{figures['k']}={figures['pass_k']:.3f} seconds={figures['seconds']:.1f}"
        )
    line += f" wall_s={wall:.0f} {memory} max_new_tokens={sizes.eval_new_tokens} report={report}"
    print_line(line, ok, log_path)
    return ok


def run_recipes(names: list[str], workdir: Path, sizes: Sizes, generation: str = "auto") -> tuple[int, int]:
    """Build the random-init model once, then each named recipe and `cegppo-eval` on its output.
    Returns (recipes ok, evaluations ok)."""
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / ("tiny-random" if sizes.smoke else "r1-distill-1.5b-shape-random")
    start = time.perf_counter()
    summary = build_random_model(model_dir, sizes.smoke)
    print(f"# model {model_dir}: {summary} ({time.perf_counter() - start:.0f} s)", flush=True)
    generation = generation_backend(sizes.smoke, generation)
    trained = evaluated = 0
    for run in [r for r in RUNS if r.name in names]:
        output_dir = run_recipe(run, model_dir, workdir, sizes, generation)
        if output_dir is None:
            print(f"EVAL {run.name}: SKIPPED (its recipe run failed)", flush=True)
            continue
        trained += 1
        evaluated += run_eval(run.name, output_dir, workdir, sizes)
    return trained, evaluated


# --------------------------------------------------------------------------------------------------- compare
TINY_RECIPE = ROOT / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml"


def compare_command(model_dir: Path, out: Path, sizes: Sizes, generation: str) -> list[str]:
    """`cegppo-compare` of GRPO and CE-GPPO, one seed, through the `accelerate` launcher, each model measured by
    `cegppo-eval`. GPU: the 1.5B LoRA recipe on the random-init model (vLLM generation and measurement where
    installed), with the recipe runs' size swaps. `--smoke`: the same path with the tiny CPU recipe (its own
    builtin:tiny start model) on 2 gloo processes."""
    script = Path(sys.executable).parent / "cegppo-compare"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "cegppo_trl.scripts.compare"]
    command += ["--arms", "grpo", "cegppo", "--seeds", "0", "--launcher", "accelerate", "--out", str(out)]
    command += ["--eval_problems", str(sizes.eval_problems), "--eval_k", str(sizes.eval_k)]
    if sizes.smoke:
        command += ["--recipe", str(TINY_RECIPE), "--accelerate_config", "multi_gpu", "--num_processes", "2"]
        return command + ["--max_steps", "4"]
    lora = RUNS[0]
    command += ["--recipe", str(lora.recipe), "--accelerate_config", "single_gpu", "--num_processes", "1"]
    command += ["--eval_backend", generation if generation == "vllm" else "hf"]
    command += ["--eval_args", f"--max-new-tokens {sizes.eval_new_tokens}"]
    train = train_command(lora, model_dir, out, sizes, generation)  # the recipe runs' flags after the recipe
    flags = train[train.index("--model_name_or_path") :]
    at = flags.index("--output_dir")
    return command + flags[:at] + flags[at + 2 :]


def run_compare(model_dir: Path, workdir: Path, sizes: Sizes, generation: str) -> bool:
    """The comparison smoke; prints its COMPARE line (runs measured, the arms' avg@k, the table)."""
    out, log_path = workdir / "compare", workdir / "compare.log"
    command = compare_command(model_dir, out, sizes, generation)
    rc, wall, memory = run_logged(command, log_path, sizes, 2 * (sizes.train_timeout_s + 2 * sizes.eval_timeout_s))
    result = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    runs = [r["name"] for r in result.get("runs", [])]
    per_run = result.get("summary", {}).get("per_run", {})
    figures = {name: row["boxed"]["avg"] for name, row in per_run.items()}
    ok = rc == 0 and runs == ["grpo-seed0", "cegppo-seed0"] and all(0.0 <= v <= 1.0 for v in figures.values())
    line = f"COMPARE: {'ok' if ok else 'FAILED'} rc={rc} runs={','.join(runs) or 'none'} "
    line += " ".join(f"{name}_avg={value:.3f}" for name, value in figures.items())
    line += f" wall_s={wall:.0f} {memory} table={out / 'results.md'} | log={log_path}"
    print_line(line, ok, log_path)
    return ok
