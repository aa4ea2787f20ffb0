"""`cegppo-demo`: CE-GPPO next to GRPO on the tiny arithmetic model, on a CPU, offline.

It warm-starts the built-in tiny model (`cegppo_trl.tiny_model`) so that it solves some but not all held-out problems, trains two copies with
the same seed, data and budget, CE-GPPO (beta1 = 0.5, beta2 = 1) and GRPO (beta1 = beta2 = 0), off-policy with the
+1 / -1 math-verify reward, and reports reward, held-out accuracy and entropy at start and end (``results.md``,
``results.json``, ``cegppo_vs_grpo.png``). Every model it trains is saved with its prompt format and sampling
settings, and the held-out figures are computed with `cegppo-eval`'s code, so the printed ``cegppo-eval`` commands
give them again. `warm_start`, `run_rl` and `evaluate_policy` are the building blocks of other experiments::

    model, tokenizer, info = warm_start(seed=0, cache_dir="out/warm")
    cegppo = run_rl(model, tokenizer, beta1=0.5, beta2=1.0, seed=0, max_steps=160, output_dir="out/cegppo")
    grpo = run_rl("out/warm", None, beta1=0.0, beta2=0.0, seed=0, max_steps=160, output_dir="out/grpo")
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..data import build_prompt, load_builtin_rows, load_math_dataset, write_jsonl
from ..evaluation import (
    DEFAULT_BATCH_SIZE,
    evaluate_completions,
    generate_completions,
    generate_with_entropy,
    save_eval_settings,
)
from ..tiny_model import (
    DEFAULT_PROBLEMS,
    PROBLEM_SETS,
    PROMPT_INSTRUCTION,
    load_rows,
    load_tiny,
    problem_indices,
    save_tiny,
    warm_tiny,
)


__all__ = [
    "DEMO_INSTRUCTION",
    "RL_DEFAULTS",
    "eval_command",
    "evaluate_policy",
    "format_table",
    "demo_train_dataset",
    "load_rows",
    "load_tiny",
    "main",
    "run_demo",
    "run_rl",
    "save_demo_model",
    "warm_start",
    "write_rows",
]

#: `load_math_dataset(..., instruction=DEMO_INSTRUCTION)` gives exactly the user message the tiny model is SFT-trained
#: on (`tiny.format_user_message`): "What is 3+4? Put the final answer in \boxed{}."
DEMO_INSTRUCTION = "{problem} " + PROMPT_INSTRUCTION

# The measurements behind these sizes: docs/entropy_results.md, section 4.
DEFAULT_SFT_STEPS = 300
DEFAULT_RL_STEPS = 160
DEFAULT_EVAL_SAMPLES = 2  # sampled completions per held-out problem
PLOT_METRICS = (
    "reward",
    "entropy",
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
    "cegppo/beta1_grad_share",
    "cegppo/beta2_grad_share",
)

#: CEGPPOConfig values of every demo run; `run_rl(**config_overrides)` replaces any of them.
RL_DEFAULTS: dict[str, Any] = dict(
    use_cpu=True,  # GRPOConfig's bf16 default fails on a CPU-only machine
    bf16=False,
    per_device_train_batch_size=128,  # completions per optimizer step: 16 prompts x 8 completions
    num_generations=8,
    gradient_accumulation_steps=1,
    # Off-policy, as in the paper: one generation batch feeds 8 mini-batches, each used once, so the ratio moves away
    # from 1 on 7 of every 8 optimizer steps (docs/entropy_results.md: why not 4 x 2 re-use).
    steps_per_generation=8,
    num_iterations=1,
    max_completion_length=20,  # the warm-started answer "49-27=22. \boxed{22}" + eos is 16 tokens
    temperature=1.0,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=1.0,
    beta=0.0,  # no KL term (paper)
    epsilon=0.2,
    loss_type="dapo",
    activation_checkpointing=False,  # nothing to save on a 1M-parameter model
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,  # run_rl draws its own progress bar instead of printing every log line
)


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


def demo_train_dataset(problems: str = DEFAULT_PROBLEMS):
    """``builtin:arithmetic`` as a TRL data set (``prompt``, ``solution``), restricted to `problems`, with exactly the
    user message the tiny model is warm-started on (`DEMO_INSTRUCTION`)."""
    dataset = load_math_dataset("builtin:arithmetic", instruction=DEMO_INSTRUCTION)
    keep = problem_indices(load_builtin_rows("builtin:arithmetic"), problems)
    return dataset if len(keep) == len(dataset) else dataset.select(keep)


# --------------------------------------------------------------------------------------------------------------
# Evaluation: sampled accuracy and entropy on held-out problems
# --------------------------------------------------------------------------------------------------------------


#: How the demo's held-out figures are sampled (the same as RL's rollouts: temperature 1, no top-p / top-k cut).
EVAL_TEMPERATURE = 1.0
EVAL_TOP_P = 1.0


def _prompt_and_solution(row: dict) -> tuple[list[dict[str, str]], str]:
    """A held-out row as `load_math_dataset(..., instruction=DEMO_INSTRUCTION)` gives it: ``{"problem", "answer"}``
    rows are turned into the tiny model's prompt; ``{"prompt", "solution"}`` rows are used as they are."""
    if "prompt" in row and "solution" in row:
        return row["prompt"], str(row["solution"])
    return build_prompt(str(row["problem"]).strip(), instruction=DEMO_INSTRUCTION), str(row["answer"]).strip()


def evaluate_policy(
    model,
    tokenizer,
    rows: Sequence[dict],
    *,
    temperature: float = EVAL_TEMPERATURE,
    top_p: float = EVAL_TOP_P,
    seed: int = 0,
    max_new_tokens: int = 20,
    samples_per_row: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> dict[str, float]:
    """Sample `samples_per_row` completions per held-out row; return ``{"accuracy", "entropy", "greedy_accuracy"}``.

    `accuracy`: avg@`samples_per_row`, the fraction of samples the math-verify reward grades correct, sampling at
    `temperature` (1.0 = what RL trains on); `entropy`: token-mean entropy (nats) of the policy along those samples
    (each generated token up to and including eos, as TRL's `entropy` metric);
    `greedy_accuracy`: the same check with greedy decoding (once per row). `rows` are ``{"problem", "answer"}``
    (prompted as the tiny model is trained, `DEMO_INSTRUCTION`) or ``{"prompt", "solution"}``.

    This is `cegppo-eval`'s code path (`generate_completions`, `evaluate_completions`; `generate_with_entropy` draws
    the same samples), so ``cegppo-eval MODEL_DIR
    --datasets ROWS.jsonl --k samples_per_row --seed seed`` on a model saved with `save_demo_model` gives the same
    `accuracy` (see `eval_command`).
    """
    pairs = [_prompt_and_solution(row) for row in rows]
    if not pairs:
        raise ValueError("no held-out rows")
    prompts, solutions = [p for p, _ in pairs], [s for _, s in pairs]
    generation = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
    sampled, entropy = generate_with_entropy(
        model, tokenizer, prompts, samples_per_row, temperature=temperature, top_p=top_p, **generation
    )
    report = evaluate_completions(sampled, solutions)
    greedy = generate_completions(model, tokenizer, prompts, 1, temperature=0.0, **generation)
    greedy_report = evaluate_completions(greedy, solutions)
    return {
        "accuracy": float(report[f"avg@{samples_per_row}"]),
        "entropy": entropy,
        "greedy_accuracy": float(greedy_report["avg@1"]),
    }


def write_rows(rows: Sequence[dict], path: str | os.PathLike) -> str:
    """Write ``{"problem", "answer"}`` rows as JSON lines (a data set for `cegppo-eval --datasets`)."""
    return write_jsonl(({"problem": row["problem"], "answer": row["answer"]} for row in rows), path)


def save_demo_model(model, tokenizer, path: str | os.PathLike, *, max_new_tokens: int = 20) -> str:
    """Save a demo model with its prompt format and held-out sampling settings (`save_eval_settings`), so that
    `cegppo-eval path` prompts and samples it as the demo does."""
    save_tiny(model, tokenizer, path)
    _save_demo_settings(path, max_new_tokens)
    return os.fspath(path)


def _save_demo_settings(path: str | os.PathLike, max_new_tokens: int = 20) -> None:
    save_eval_settings(
        path,
        instruction=DEMO_INSTRUCTION,
        temperature=EVAL_TEMPERATURE,
        top_p=EVAL_TOP_P,
        max_new_tokens=max_new_tokens,
        note="cegppo-demo: the tiny model is trained on '<problem> Put the final answer in \\boxed{}.' and evaluated "
        "sampling at temperature 1 (top_p 1, no top-k), 20 new tokens; cegppo-eval uses these unless flags say "
        "otherwise.",
    )


def eval_command(
    model_dir: str, data_path: str, samples_per_row: int, seed: int = 0, output: str | None = None
) -> str:
    """The `cegppo-eval` command that reproduces `evaluate_policy`'s accuracy for a model saved by `save_demo_model`."""
    import shlex

    words = ["cegppo-eval", model_dir, "--datasets", data_path, "--k", str(samples_per_row), "--seed", str(seed)]
    if output is not None:
        words += ["--output", output]
    return shlex.join(words)


# --------------------------------------------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------------------------------------------

_WARM_START_FILE = "warm_start.json"
#: The held-out rows of a demo run, written to its output directory for `cegppo-eval --datasets`.
HELDOUT_FILE = "heldout.jsonl"


def warm_start(
    seed: int = 0,
    sft_steps: int = DEFAULT_SFT_STEPS,
    progress: bool = True,
    *,
    cache_dir: str | os.PathLike | None = None,
    train_rows: Sequence[dict] | None = None,
    eval_rows: Sequence[dict] | None = None,
    batch_size: int = 64,
    lr: float = 3e-3,
    num_threads: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    evaluate: bool = True,
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
):
    """`tiny.warm_tiny` (build, SFT, cache) plus the held-out figures of the warm-started model.

    Returns ``(model, tokenizer, info)``; `info` has the SFT statistics (``sft``), the held-out ``accuracy`` (sampled,
    temperature 1), ``greedy_accuracy`` and ``entropy`` (see `evaluate_policy`; left out with ``evaluate=False``),
    ``seconds``, ``num_parameters`` and ``cached``. `train_rows` / `eval_rows` default to the "sums" of
    ``builtin:arithmetic`` / ``builtin:arithmetic_eval``. With `cache_dir` the model is saved there with its prompt
    format (`save_demo_model`) and a later call with the same arguments loads it and its figures.
    """
    eval_rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    model, tokenizer, build = warm_tiny(
        seed, sft_steps, train_rows=train_rows, cache_dir=cache_dir, batch_size=batch_size, lr=lr,
        model_kwargs=model_kwargs, progress=progress, num_threads=num_threads,
    )  # fmt: skip
    key = {
        **build["key"],
        "evaluate": evaluate,
        "eval_samples": eval_samples,
        "eval_rows": hashlib.sha256(json.dumps(eval_rows, sort_keys=True).encode()).hexdigest(),
    }
    info_path = os.path.join(os.fspath(cache_dir), _WARM_START_FILE) if cache_dir is not None else None
    if build["cached"] and info_path is not None and os.path.isfile(info_path):
        with open(info_path) as f:
            saved = json.load(f)
        if saved.get("key") == key:
            return model, tokenizer, {**saved["info"], "cached": True, "path": build["path"]}

    start = time.perf_counter()
    info = {"sft": build["sft"]}
    if evaluate:
        info.update(evaluate_policy(model, tokenizer, eval_rows, seed=seed, samples_per_row=eval_samples))
    info["seconds"] = build["seconds"] + time.perf_counter() - start
    info["num_parameters"] = build["num_parameters"]
    if info_path is not None:
        _save_demo_settings(cache_dir)
        with open(info_path, "w") as f:
            json.dump({"key": key, "info": info}, f, indent=2)
    return model, tokenizer, {**info, "cached": False, "path": build["path"]}


# --------------------------------------------------------------------------------------------------------------
# RL
# --------------------------------------------------------------------------------------------------------------


def _progress_callback(desc: str):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class _Progress(TrainerCallback):
        """One tqdm bar per run with the latest reward / entropy / clipped-token fractions as postfix."""

        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.bar = tqdm(total=state.max_steps, desc=desc, unit="step", dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs:
                shown = {
                    "reward": logs.get("reward"),
                    "entropy": logs.get("entropy"),
                    # fractions of tokens in the two clipped sets (r < 1 - eps, A < 0 / r > 1 + eps, A > 0)
                    "clip_lo": logs.get("cegppo/beta1_token_frac"),
                    "clip_hi": logs.get("cegppo/beta2_token_frac"),
                }
                self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if isinstance(v, (int, float))})

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return _Progress()


def _window_mean(history: Sequence[dict], metric: str, first: bool, fraction: float = 0.1) -> float:
    """Mean of `metric` over the first (or last) `fraction` of the log entries that have it (at least one)."""
    values = [e[metric] for e in history if isinstance(e.get(metric), (int, float)) and math.isfinite(e[metric])]
    if not values:
        return float("nan")
    k = max(1, round(fraction * len(values)))
    chosen = values[:k] if first else values[-k:]
    return sum(chosen) / len(chosen)


def run_rl(
    model,
    tokenizer,
    *,
    beta1: float,
    beta2: float,
    seed: int,
    max_steps: int,
    output_dir: str | os.PathLike,
    train_dataset=None,
    eval_rows: Sequence[dict] | None = None,
    progress: bool = True,
    label: str | None = None,
    reward_funcs=None,
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
    save_final: bool = True,
    **config_overrides,
) -> dict[str, Any]:
    """Train `model` (in place) with `CEGPPOTrainer` at (beta1, beta2) for `max_steps` optimizer steps.

    `model` is a model object (trained in place; pass a fresh copy per run, e.g. from `load_tiny`) or a path.
    `train_dataset` defaults to `demo_train_dataset()` (``builtin:arithmetic`` in the tiny model's prompt format),
    `eval_rows` to ``builtin:arithmetic_eval`` (`eval_samples`
    sampled completions each), `reward_funcs` to ``[math_reward]`` (+1 correct / -1 otherwise). Every other
    keyword is a `CEGPPOConfig` field and replaces the value in `RL_DEFAULTS` (e.g. ``learning_rate=3e-4``,
    ``steps_per_generation=8, num_iterations=1``). beta1 = beta2 = 0 is GRPO (PPO-clip's gradient).

    Returns a dict: ``label``, ``beta1``, ``beta2``, ``seed``, ``max_steps``, ``seconds`` (training only),
    ``log_history`` (`trainer.state.log_history`), held-out ``start_accuracy`` / ``end_accuracy`` (sampled at
    temperature 1), ``start_entropy`` / ``end_entropy`` (nats, along those samples), ``start_greedy_accuracy`` /
    ``end_greedy_accuracy``, and ``start_reward`` / ``end_reward`` (mean training reward over the first / last 10%
    of the logs), ``final_dir``. ``trainer_state.json`` is saved in `output_dir` and, with `save_final`, the trained
    model in ``output_dir/final`` (`save_demo_model`: with its prompt format and held-out sampling settings, so that
    ``cegppo-eval output_dir/final`` evaluates it as this function does; None without `save_final`).
    """
    from ..config import CEGPPOConfig
    from ..rewards import math_reward
    from ..trainer import CEGPPOTrainer

    if isinstance(model, (str, os.PathLike)):
        model, loaded_tokenizer = load_tiny(model)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    eval_rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    train_dataset = train_dataset if train_dataset is not None else demo_train_dataset()
    label = label or f"beta1={beta1:g}, beta2={beta2:g}"
    values = {
        **RL_DEFAULTS,
        "logging_steps": max(1, max_steps // 50),
        **config_overrides,
        "output_dir": os.fspath(output_dir),
        "seed": seed,
        "max_steps": max_steps,
        "cegppo_beta1": beta1,
        "cegppo_beta2": beta2,
    }
    args = CEGPPOConfig(**values)
    max_new_tokens = args.max_completion_length

    evaluate = dict(seed=seed, max_new_tokens=max_new_tokens, samples_per_row=eval_samples)
    start_eval = evaluate_policy(model, tokenizer, eval_rows, **evaluate)
    trainer = CEGPPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs) if reward_funcs is not None else [math_reward],
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)  # it would print every log dict
    trainer.remove_callback(ProgressCallback)
    if progress:
        trainer.add_callback(_progress_callback(label))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_state()
    final_dir = None
    if save_final:
        final_dir = save_demo_model(
            trainer.model, tokenizer, os.path.join(os.fspath(output_dir), "final"), max_new_tokens=max_new_tokens
        )
    end_eval = evaluate_policy(trainer.model, tokenizer, eval_rows, **evaluate)
    history = list(trainer.state.log_history)
    return {
        "label": label,
        "beta1": beta1,
        "beta2": beta2,
        "seed": seed,
        "max_steps": max_steps,
        "seconds": seconds,
        "output_dir": os.fspath(output_dir),
        "final_dir": final_dir,
        "log_history": history,
        **{f"start_{k}": v for k, v in start_eval.items()},
        **{f"end_{k}": v for k, v in end_eval.items()},
        "start_reward": _window_mean(history, "reward", first=True),
        "end_reward": _window_mean(history, "reward", first=False),
        "beta1_token_frac": _window_mean(history, "cegppo/beta1_token_frac", first=True, fraction=1.0),
        "beta2_token_frac": _window_mean(history, "cegppo/beta2_token_frac", first=True, fraction=1.0),
    }


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


def format_table(results: Sequence[dict], warm: dict | None = None) -> str:
    """A Markdown table of the runs: reward, held-out sampled accuracy and entropy, start -> end."""

    def arrow(a: float, b: float, fmt: str = "{:.3f}") -> str:
        return f"{fmt.format(a)} -> {fmt.format(b)}"

    header = (
        "| run | train reward (first -> last 10% of steps) | held-out accuracy, sampled T=1 (start -> end) "
        "| entropy, nats (start -> end) | clipped tokens beta1 / beta2 set | train time |"
    )
    lines = [header, "|" + "---|" * 6]
    for r in results:
        lines.append(
            f"| {r['label']} | {arrow(r['start_reward'], r['end_reward'], '{:+.3f}')} "
            f"| {arrow(r['start_accuracy'], r['end_accuracy'])} | {arrow(r['start_entropy'], r['end_entropy'])} "
            f"| {100 * r['beta1_token_frac']:.2f}% / {100 * r['beta2_token_frac']:.2f}% | {r['seconds']:.0f} s |"
        )
    if warm is not None:
        lines.append("")
        lines.append(
            f"Warm start: {warm['sft']['steps']} SFT steps, held-out accuracy {warm['accuracy']:.3f} sampled "
            f"(T=1) / {warm['greedy_accuracy']:.3f} greedy, entropy {warm['entropy']:.3f} nats."
        )
    return "\n".join(lines)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _stay_offline() -> None:
    """The demo builds everything locally: make any Hub access fail fast and send no telemetry."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    constants.HF_HUB_DISABLE_TELEMETRY = True


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

QUICK = {
    "sft_steps": 150,
    "steps": 16,
    "prompts_per_step": 8,
    "num_generations": 4,
    "eval_size": 64,
    "eval_samples": 1,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cegppo-demo",
        description="CE-GPPO vs GRPO on a tiny arithmetic model: CPU only, nothing downloaded.",
    )
    parser.add_argument("--output-dir", default="cegppo-demo-output", help="where results, plot and runs go")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"RL optimizer steps per run (default {DEFAULT_RL_STEPS})"
    )
    parser.add_argument(
        "--sft-steps", type=int, default=None, help=f"SFT warm-start steps (default {DEFAULT_SFT_STEPS})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, SFT and both RL runs")
    parser.add_argument("--beta1", type=float, default=0.5, help="CE-GPPO beta1 (paper, 1.5B: 0.5)")
    parser.add_argument("--beta2", type=float, default=1.0, help="CE-GPPO beta2 (paper: 1)")
    parser.add_argument("--learning-rate", type=float, default=RL_DEFAULTS["learning_rate"], help="RL learning rate")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="prompts per optimizer step (default 16)")
    parser.add_argument("--num-generations", type=int, default=None, help="completions per prompt (default 8)")
    parser.add_argument(
        "--problems",
        choices=sorted(PROBLEM_SETS),
        default=DEFAULT_PROBLEMS,
        help="built-in problems to train and evaluate on: 'sums' (What is a+b?) or 'all' (also a-b, word problems)",
    )
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems evaluated (default: all)")
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        help=f"sampled completions per held-out problem (default {DEFAULT_EVAL_SAMPLES})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a reduced run for smoke tests (defaults become {QUICK}); explicit flags still win",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (default 0: torch's default, one per core)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def run_demo(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo with command-line arguments `argv`; return the summary (also written to ``results.json``)."""
    args = build_parser().parse_args(argv)
    _stay_offline()
    base = {
        "sft_steps": DEFAULT_SFT_STEPS,
        "steps": DEFAULT_RL_STEPS,
        "prompts_per_step": 16,
        "num_generations": 8,
        "eval_size": None,
        "eval_samples": DEFAULT_EVAL_SAMPLES,
    }
    if args.quick:
        base.update(QUICK)
    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    from transformers.utils import logging as hf_logging

    previous_threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars; ours stay
    try:
        return _run(args, sizes)
    finally:
        torch.set_num_threads(previous_threads)
        if bars:
            hf_logging.enable_progress_bar()


def _run(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    progress = not args.no_progress
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    eval_rows = load_rows("builtin:arithmetic_eval", sizes["eval_size"], problems=args.problems)
    train_rows = load_rows("builtin:arithmetic", problems=args.problems)

    t0 = time.perf_counter()
    print(f"[cegppo-demo] output directory: {out}", flush=True)
    heldout = write_rows(eval_rows, os.path.join(out, HELDOUT_FILE))  # the held-out set, for cegppo-eval
    warm_dir = os.path.join(out, "warm_start")
    _, _, warm = warm_start(
        seed=args.seed,
        sft_steps=sizes["sft_steps"],
        progress=progress,
        cache_dir=warm_dir,
        train_rows=train_rows,
        eval_rows=eval_rows,
        eval_samples=sizes["eval_samples"],
    )
    when = "cached" if warm["cached"] else f"{warm['seconds']:.0f} s"
    print(
        f"[cegppo-demo] warm start ({when}): held-out accuracy "
        f"{warm['accuracy']:.3f} sampled / {warm['greedy_accuracy']:.3f} greedy, entropy {warm['entropy']:.3f}",
        flush=True,
    )

    runs = [
        ("cegppo", f"CE-GPPO (beta1={args.beta1:g}, beta2={args.beta2:g})", args.beta1, args.beta2),
        ("grpo", "GRPO (beta1=beta2=0)", 0.0, 0.0),
    ]
    completions_per_step = sizes["prompts_per_step"] * sizes["num_generations"]
    train_dataset = demo_train_dataset(args.problems)
    results = []
    for name, label, beta1, beta2 in runs:
        model, tokenizer = load_tiny(warm_dir)  # identical starting weights for both runs
        results.append(
            run_rl(
                model,
                tokenizer,
                beta1=beta1,
                beta2=beta2,
                seed=args.seed,
                max_steps=sizes["steps"],
                output_dir=os.path.join(out, "runs", name),
                train_dataset=train_dataset,
                eval_rows=eval_rows,
                eval_samples=sizes["eval_samples"],
                progress=progress,
                label=label,
                learning_rate=args.learning_rate,
                per_device_train_batch_size=completions_per_step,
                num_generations=sizes["num_generations"],
            )
        )

    from .plotting import plot_log_histories

    png = plot_log_histories(
        {r["label"]: r["log_history"] for r in results},
        os.path.join(out, "cegppo_vs_grpo.png"),
        metrics=PLOT_METRICS,
        title=(
            f"Tiny model on built-in arithmetic ({args.problems}), {sizes['prompts_per_step']} prompts x "
            f"{sizes['num_generations']} completions per step, seed {args.seed}"
        ),
    )
    table = format_table(results, warm)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    summary = {
        "wall_seconds": wall,
        "sizes": sizes,
        "problems": args.problems,
        "seed": args.seed,
        "warm_start": warm,
        "runs": [{k: v for k, v in r.items() if k != "log_history"} for r in results],
        "plot": png,
    }
    # The commands that evaluate the saved models again, with the paths as the user gave them.
    shown = args.output_dir.rstrip(os.sep) or out
    commands = {
        "warm_start": eval_command(
            os.path.join(shown, "warm_start"), os.path.join(shown, HELDOUT_FILE), sizes["eval_samples"], args.seed
        ),
        **{
            name: eval_command(
                os.path.join(shown, "runs", name, "final"),
                os.path.join(shown, HELDOUT_FILE),
                sizes["eval_samples"],
                args.seed,
            )
            for name, *_ in runs
        },
    }
    summary["heldout"] = heldout
    summary["eval_commands"] = commands
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(_json_safe(summary), f, indent=2)
    print()
    print(table)
    print(f"\n[cegppo-demo] plot: {png}\n[cegppo-demo] table: {os.path.join(out, 'results.md')}")
    print(
        "[cegppo-demo] saved models (each with its prompt format and sampling settings): "
        f"{os.path.join(shown, 'warm_start')}, " + ", ".join(os.path.join(shown, "runs", n, "final") for n, *_ in runs)
    )
    print(
        "[cegppo-demo] held-out accuracy again with cegppo-eval (same prompts, samples and grader: the same figures):"
    )
    for command in commands.values():
        print(f"  {command}")
    print(f"[cegppo-demo] wall time {wall:.0f} s", flush=True)
    return {**summary, "table": table, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-demo`."""
    run_demo(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
