"""`cegppo-demo`: what CE-GPPO does, first where it is exact, then the same trainer on a tiny language model; on a CPU,
offline.

1. **The exact toy** (`toy.py`): a tabular softmax policy trained with CE-GPPO's own loss (`core.py`) in float64, for
   several (beta1, beta2) settings (`toy.TOY_GRID`) and seeds. It checks the first-order entropy prediction against
   the measured change and the paper's two directions (larger beta1 lowers entropy faster, larger beta2 keeps it
   higher), counting the seeds where each holds.
2. **The tiny LM** (`lm.py`): one SFT warm start of the built-in ~1M-parameter model, then `CEGPPOTrainer` at
   (beta1, beta2) and at (0, 0) (GRPO's gradient) from it, with the same seed, data and budget, for several paired
   seeds; the held-out accuracy and entropy differences CE-GPPO - GRPO with their spread (mean +- std, paired 95%
   interval). ``--seeds 1`` is the single-seed run.

The conclusions are rules applied to the printed numbers (`report.py`), so each run states what it measured.
Outputs in ``--output-dir``: ``results.md``, ``results.json``, ``toy_entropy.png``, ``cegppo_vs_grpo.png``, the warm
start (``warm_start/``), the first seed's trained models (``runs/cegppo/final``, ``runs/grpo/final``, each with its
prompt format and sampling settings) and the held-out problems (``heldout.jsonl``) for the printed `cegppo-eval`
commands.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..tiny_model import DEFAULT_PROBLEMS, PROBLEM_SETS
from . import report
from .lm import (
    DEFAULT_EVAL_SAMPLES,
    DEFAULT_RL_STEPS,
    DEFAULT_SFT_STEPS,
    DEMO_INSTRUCTION,
    HELDOUT_FILE,
    PLOT_METRICS,
    RL_DEFAULTS,
    _progress_callback,
    demo_train_dataset,
    eval_command,
    evaluate_policy,
    load_rows,
    load_tiny,
    run_rl,
    save_demo_model,
    warm_start,
    write_rows,
)


__all__ = [
    "DEMO_INSTRUCTION",
    "HELDOUT_FILE",
    "PLOT_METRICS",
    "RL_DEFAULTS",
    "build_parser",
    "demo_train_dataset",
    "eval_command",
    "evaluate_policy",
    "load_rows",
    "load_tiny",
    "main",
    "run_demo",
    "run_rl",
    "run_toy_part",
    "save_demo_model",
    "warm_start",
    "write_rows",
]
_ = _progress_callback  # re-exported for the tests

#: The demo's sizes; each has a flag of the same name. The choice (6 minutes on a lightly loaded 2-core CPU):
#: docs/entropy_results.md, section 3.
DEFAULTS = {
    "toy_seeds": 4,
    "toy_steps": 150,
    "sft_steps": DEFAULT_SFT_STEPS,
    "seeds": 3,
    "steps": DEFAULT_RL_STEPS,
    "prompts_per_step": 16,
    "num_generations": 8,
    "eval_size": None,
    "eval_samples": DEFAULT_EVAL_SAMPLES,
}
#: `--quick`: a smoke run with every part and option on, at small sizes.
QUICK = {
    "toy_seeds": 2,
    "toy_steps": 40,
    "sft_steps": 150,
    "seeds": 2,
    "steps": 16,
    "prompts_per_step": 8,
    "num_generations": 4,
    "eval_size": 64,
    "eval_samples": 1,
}
FIRST_ORDER_LRS = (1e-3, 1e-4)  # the single-token check at two step sizes: its error must shrink with the step


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cegppo-demo",
        description="What CE-GPPO does to entropy on an exact toy, then CE-GPPO vs GRPO on a tiny arithmetic model "
        "over paired seeds: CPU only, nothing downloaded.",
    )
    add = parser.add_argument
    add("--output-dir", default="cegppo-demo-output", help="where results, figures and models go")
    add("--seed", type=int, default=0, help="first seed: the warm start, the toy's and the LM runs' seeds count up")
    add("--seeds", type=int, default=None, help=f"paired LM seeds (default {DEFAULTS['seeds']}; 1: single-seed run)")
    add("--toy-seeds", type=int, default=None, help=f"seeds of the toy grid (default {DEFAULTS['toy_seeds']})")
    add("--toy-steps", type=int, default=None, help=f"RL steps per toy run (default {DEFAULTS['toy_steps']})")
    add("--steps", type=int, default=None, help=f"RL optimizer steps per LM run (default {DEFAULT_RL_STEPS})")
    add("--sft-steps", type=int, default=None, help=f"SFT warm-start steps (default {DEFAULT_SFT_STEPS})")
    add("--beta1", type=float, default=0.5, help="CE-GPPO beta1 (paper, 1.5B: 0.5)")
    add("--beta2", type=float, default=1.0, help="CE-GPPO beta2 (paper: 1)")
    add("--learning-rate", type=float, default=RL_DEFAULTS["learning_rate"], help="RL learning rate")
    add("--prompts-per-step", type=int, default=None, help="prompts per optimizer step (default 16)")
    add("--num-generations", type=int, default=None, help="completions per prompt (default 8)")
    add(
        "--problems",
        choices=sorted(PROBLEM_SETS),
        default=DEFAULT_PROBLEMS,
        help="built-in problems to train and evaluate on: 'sums' (What is a+b?) or 'all' (also a-b, word problems)",
    )
    add("--eval-size", type=int, default=None, help="held-out problems evaluated (default: all)")
    add(
        "--eval-samples", type=int, default=None, help=f"samples per held-out problem (default {DEFAULT_EVAL_SAMPLES})"
    )
    add("--quick", action="store_true", help=f"a smoke run (defaults become {QUICK}); explicit flags still win")
    add("--threads", type=int, default=0, help="torch intra-op threads (default 0: torch's default, one per core)")
    add("--no-progress", action="store_true", help="no progress bars")
    return parser


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    base = {**DEFAULTS, **(QUICK if args.quick else {})}
    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    for name in ("toy_seeds", "toy_steps", "sft_steps", "seeds", "steps", "prompts_per_step", "num_generations"):
        if sizes[name] < 1:
            build_parser().error(f"--{name.replace('_', '-')} must be at least 1, got {sizes[name]}")
    if sizes["eval_samples"] < 1 or (sizes["eval_size"] is not None and sizes["eval_size"] < 1):
        build_parser().error("--eval-size and --eval-samples must be at least 1")
    return sizes


def run_demo(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo with command-line arguments `argv`; return the summary (also written to ``results.json``)."""
    args = build_parser().parse_args(argv)
    sizes = _sizes(args)
    _stay_offline()
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


class _Clock:
    """Wall and CPU seconds (this process; the grading workers' CPU is not counted) of each named phase."""

    def __init__(self):
        self.phases: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.phases[name] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def _run(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    start, clock = time.perf_counter(), _Clock()
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    print(f"[cegppo-demo] output directory: {out}\n[cegppo-demo] machine: {_machine()}", flush=True)
    with clock.phase("toy"):
        toy = run_toy_part(range(args.seed, args.seed + sizes["toy_seeds"]), sizes["toy_steps"])
    print(_section("Part 1: the mechanism, on an exact toy (float64, the same on every CPU)"))
    print(TOY_INTRO.format(**toy["config"], seeds=sizes["toy_seeds"]) + "\n\n" + report.format_toy_table(toy["runs"]))
    print(_section("Part 2: the same trainer (CEGPPOTrainer) on a tiny language model"), flush=True)
    eval_rows = load_rows("builtin:arithmetic_eval", sizes["eval_size"], problems=args.problems)
    heldout = write_rows(eval_rows, os.path.join(out, HELDOUT_FILE))  # the held-out set, for cegppo-eval
    with clock.phase("warm start"):
        warm = _warm_start(args, sizes, out, eval_rows)
    pairs = _lm_runs(args, sizes, out, eval_rows, warm, clock)
    with clock.phase("figures"):
        plots = _figures(args, sizes, out, toy, pairs)
    conclusions = report.toy_conclusions(toy["runs"], toy["first_order"]) + report.lm_conclusions(pairs)
    summary = {
        "seed": args.seed,
        "problems": args.problems,
        "sizes": sizes,
        "machine": _machine(),
        "torch_threads": torch.get_num_threads(),
        "toy": toy,
        "warm_start": warm,
        "pairs": [{"seed": p["seed"], **{n: _without_history(p[n]) for n in ("cegppo", "grpo")}} for p in pairs],
        "runs": [_without_history(pairs[0][name]) for name in ("cegppo", "grpo")],  # the saved models' runs
        "differences": report.lm_differences(pairs),
        "conclusions": [c.to_dict() for c in conclusions],
        "plots": plots,
        "heldout": heldout,
        "eval_commands": _eval_commands(args, sizes),
    }
    tables = {"toy": report.format_toy_table(toy["runs"]), "lm": report.format_lm_table(pairs, warm)}
    summary["timings"] = {**clock.phases, "total": {"wall": time.perf_counter() - start, "cpu": time.process_time()}}
    summary["wall_seconds"] = summary["timings"]["total"]["wall"]
    _write_results(out, summary, tables, conclusions)
    _print_report(args, summary, tables, conclusions)
    return {**summary, "tables": tables, "pair_results": pairs}


TOY_INTRO = (
    "A tabular softmax policy ({num_states} prompts, answers of {seq_len} tokens over {num_actions} actions, only the "
    "first token rewarded) trained with CE-GPPO's loss (core.py), {num_minibatches} mini-batches x {num_epochs} epochs "
    "per RL step (off-policy after the first), {steps} steps, {seeds} seeds per (beta1, beta2). dH columns: the "
    "first-order entropy change carried by each set of tokens, summed over a run; measured dH: end - start."
)


def _section(title: str) -> str:
    return f"\n=== {title} ===\n"


def run_toy_part(seeds: Sequence[int], steps: int) -> dict[str, Any]:
    """The toy half: the single-token first-order check at `FIRST_ORDER_LRS` and the grid of `toy.run_toy_grid`
    (the "sequence" toy with `steps` RL steps) over `seeds`."""
    from .toy import TOY_PRESETS, first_order_check, run_toy_grid

    seeds = list(seeds)
    config = dataclasses.replace(TOY_PRESETS["sequence"], steps=steps)
    checks = []
    for lr in FIRST_ORDER_LRS:
        check = first_order_check(lr=lr, seed=seeds[0])
        checks.append({"lr": lr, "max_rel_error": check["max_rel_error"], "trials": check["trials"]})
    return {
        "config": dataclasses.asdict(config),
        "seeds": seeds,
        "first_order": checks,
        "runs": run_toy_grid(seeds, config=config),
    }


def _warm_start(args: argparse.Namespace, sizes: dict[str, Any], out: str, eval_rows: list[dict]) -> dict:
    train_rows = load_rows("builtin:arithmetic", problems=args.problems)
    _, _, warm = warm_start(
        seed=args.seed,
        sft_steps=sizes["sft_steps"],
        progress=not args.no_progress,
        cache_dir=os.path.join(out, "warm_start"),
        train_rows=train_rows,
        eval_rows=eval_rows,
        eval_samples=sizes["eval_samples"],
    )
    when = "cached" if warm["cached"] else f"{warm['seconds']:.0f} s"
    print(
        f"[cegppo-demo] warm start ({when}): held-out accuracy {warm['accuracy']:.3f} sampled / "
        f"{warm['greedy_accuracy']:.3f} greedy, entropy {warm['entropy']:.4f}",
        flush=True,
    )
    return warm


def _lm_runs(args, sizes, out: str, eval_rows: list[dict], warm: dict, clock: _Clock) -> list[dict]:
    """CE-GPPO and GRPO from the warm start for each paired seed; the first seed's models are saved."""
    runs = (("cegppo", f"CE-GPPO (beta1={args.beta1:g}, beta2={args.beta2:g})", args.beta1, args.beta2),
            ("grpo", "GRPO (beta1=beta2=0)", 0.0, 0.0))  # fmt: skip
    train_dataset = demo_train_dataset(args.problems)
    warm_figures = {k: warm[k] for k in ("accuracy", "entropy", "greedy_accuracy")}
    pairs = []
    for index in range(sizes["seeds"]):
        seed, first = args.seed + index, index == 0
        pair, start_eval = {"seed": seed}, (warm_figures if first else None)  # the warm start's figures: this seed
        for name, label, beta1, beta2 in runs:
            model, tokenizer = load_tiny(os.path.join(out, "warm_start"))  # identical starting weights
            with clock.phase(f"{name}, seed {seed}"):
                pair[name] = run_rl(
                    model, tokenizer, beta1=beta1, beta2=beta2, seed=seed, max_steps=sizes["steps"],
                    output_dir=os.path.join(out, "runs", name if first else f"{name}-seed{seed}"),
                    train_dataset=train_dataset, eval_rows=eval_rows, eval_samples=sizes["eval_samples"],
                    progress=not args.no_progress, label=label, save_final=first, start_eval=start_eval,
                    learning_rate=args.learning_rate, num_generations=sizes["num_generations"],
                    per_device_train_batch_size=sizes["prompts_per_step"] * sizes["num_generations"],
                )  # fmt: skip
            start_eval = {k: pair[name][f"start_{k}"] for k in warm_figures}  # the same for the pair's second run
        pairs.append(pair)
    return pairs


def _figures(args, sizes, out: str, toy: dict, pairs: list[dict]) -> dict[str, str]:
    from .plotting import plot_paired_runs, plot_toy_grid

    toy_title = f"Exact toy: entropy under CE-GPPO's (beta1, beta2), {len(toy['seeds'])} seeds"
    lm_title = (
        f"Tiny LM, {args.problems}: CE-GPPO ({args.beta1:g}, {args.beta2:g}) vs GRPO, {len(pairs)} paired seeds, "
        f"{sizes['steps']} steps of {sizes['prompts_per_step']} x {sizes['num_generations']} completions"
    )
    return {
        "toy": plot_toy_grid(toy["runs"], os.path.join(out, "toy_entropy.png"), title=toy_title),
        "lm": plot_paired_runs(pairs, report.lm_differences(pairs), os.path.join(out, "cegppo_vs_grpo.png"), lm_title),
    }


def _eval_commands(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, str]:
    """The commands that evaluate the saved models again, with the paths as the user gave them."""
    shown = args.output_dir.rstrip(os.sep) or os.path.abspath(args.output_dir)
    models = {"warm_start": os.path.join(shown, "warm_start")}
    models.update({name: os.path.join(shown, "runs", name, "final") for name in ("cegppo", "grpo")})
    data = os.path.join(shown, HELDOUT_FILE)
    return {name: eval_command(path, data, sizes["eval_samples"], args.seed) for name, path in models.items()}


def _without_history(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "log_history"}


def _write_results(out: str, summary: dict, tables: dict[str, str], conclusions: list[report.Conclusion]) -> None:
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"## Exact toy\n\n{tables['toy']}\n\n## Tiny LM\n\n{tables['lm']}\n\n## Conclusions\n\n")
        f.write("\n".join(c.text() for c in conclusions) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(_json_safe(summary), f, indent=1)


def _print_report(args, summary: dict, tables: dict[str, str], conclusions: list[report.Conclusion]) -> None:
    out = os.path.abspath(args.output_dir)
    print("\n" + tables["lm"])
    print(_section("Conclusions (each a rule applied to the numbers above)"))
    print("\n".join(c.text() for c in conclusions))
    print(f"\n[cegppo-demo] figures: {summary['plots']['toy']}, {summary['plots']['lm']}")
    print(f"[cegppo-demo] tables and conclusions: {os.path.join(out, 'results.md')}, results.json")
    print("[cegppo-demo] the first seed's models, each with its prompt format and sampling settings, evaluate again "
          "with cegppo-eval (same prompts, samples and grader: the same figures):")  # fmt: skip
    for command in summary["eval_commands"].values():
        print(f"  {command}")
    print(f"[cegppo-demo] {_time_split(summary['timings'])}", flush=True)


def _time_split(timings: dict[str, dict[str, float]]) -> str:
    """``time: toy 31 s, warm start 80 s, ...; total 7 min 3 s wall``."""
    parts = [f"{name} {t['wall']:.0f} s" for name, t in timings.items() if name != "total"]
    minutes, seconds = divmod(round(timings["total"]["wall"]), 60)
    return f"time: {', '.join(parts)}; total {minutes} min {seconds} s wall"


def _machine() -> str:
    """The CPU model (as `lscpu` names it), the cores this process may use and torch's version."""
    name = "unknown CPU"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores, torch {torch.__version__} with {torch.get_num_threads()} threads"


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


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-demo`."""
    run_demo(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
