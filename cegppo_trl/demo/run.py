"""`cegppo-demo` (README, *The offline demo*): the exact toy (`toy.py`: CE-GPPO's loss on tabular policies in
float64, the same figures on every machine), then CE-GPPO vs GRPO from one SFT warm start of the tiny LM over several
seeds, run by `cegppo-compare` (every run `cegppo-train`, every model measured by `cegppo-eval`, in ``lm/``). Writes
``results.md``, ``results.json``, the two figures and ``heldout.jsonl`` for the printed `cegppo-eval` commands; CPU,
offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..comparison.settings import threads_per_process
from ..data import write_jsonl
from ..figures import machine_description
from ..run_checks import first_problem
from ..tiny_model import DEFAULT_PROBLEMS, PROBLEM_SETS, PROMPT_INSTRUCTION, load_rows
from .plotting import plot_toy_grid


#: The user message the tiny model is SFT-trained on: "What is 3+4? Put the final answer in \boxed{}."
DEMO_INSTRUCTION = "{problem} " + PROMPT_INSTRUCTION
HELDOUT_FILE = "heldout.jsonl"  # the held-out rows, for `cegppo-eval --datasets`
DEFAULT_SFT_STEPS, DEFAULT_RL_STEPS, DEFAULT_EVAL_SAMPLES = 200, 32, 8  # why: docs/entropy_results.md, section 4
MAX_NEW_TOKENS = 20  # the warm-started answer "49+27=76. \boxed{76}" + eos is 16 tokens


#: `--quick`: every part and option on, at small sizes (the full sizes, and why: docs/entropy_results.md, section 4).
QUICK = dict(toy_seeds=2, toy_steps=40, sft_steps=150, seeds=2, steps=16, prompts_per_step=8, num_generations=4,
             eval_size=64, eval_samples=1)  # fmt: skip
#: `--long`: the earlier, larger sizes (about 2.5x the time: 7-12 min on 2 idle cores): 4 toy seeds of 150 steps, LM
#: runs of 48 steps of 16 prompts.
LONG = dict(toy_seeds=4, toy_steps=150, steps=48, prompts_per_step=16)
FIRST_ORDER_LRS = (1e-3, 1e-4)  # the single-token check at two step sizes: its error must shrink with the step
LM_LIMITS = (
    "What this part cannot show: whether CE-GPPO beats GRPO. The model has ~1M parameters and trains {steps} steps "
    "(the paper: 1.5B-7B models over ~1000 steps), a few seeds give a wide spread, and the warm start, so everything "
    "after it, changes with the CPU's float kernels: another machine prints other numbers. The registered study of "
    "this model (README, 'Does CE-GPPO beat GRPO here?': 256 steps, dynamic sampling, 3 seeds) found GRPO ahead of "
    "CE-GPPO (0.5, 1) by 4.8 +- 0.8 points, from the beta1 set's restored gradient (beta1 alone: 17.9 points behind; "
    "beta2 alone: level): expect GRPO ahead here too. The mechanism is what Part 1 shows exactly."
)


def _count(text: str) -> int:
    """A size: an integer of at least 1."""
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cegppo-demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="What CE-GPPO does to entropy on an exact toy, then CE-GPPO vs GRPO on a tiny arithmetic model "
        "over several seeds: CPU only, nothing downloaded.",
    )
    add = parser.add_argument
    add("--output-dir", default="cegppo-demo-output", help="where results, figures and models go")
    add("--seed", type=int, default=0, help="first seed: the warm start, the toy's and the LM runs' seeds count up")
    add("--seeds", type=_count, default=3, help="LM seeds, each a CE-GPPO and a GRPO run")
    add("--toy-seeds", type=_count, default=3, help="seeds of the toy grid")
    add("--toy-steps", type=_count, default=100, help="RL steps per toy run")
    add("--steps", type=_count, default=DEFAULT_RL_STEPS, help="RL optimizer steps per LM run")
    add("--sft-steps", type=_count, default=DEFAULT_SFT_STEPS, help="SFT warm-start steps")
    add("--beta1", type=float, default=0.5, help="CE-GPPO beta1 (the paper's, 1.5B)")
    add("--beta2", type=float, default=1.0, help="CE-GPPO beta2 (the paper's)")
    add("--learning-rate", type=float, default=1e-4, help="RL learning rate")
    add("--prompts-per-step", type=_count, default=8, help="prompts per optimizer step")
    add("--num-generations", type=_count, default=8, help="completions per prompt")
    add("--problems", choices=sorted(PROBLEM_SETS), default=DEFAULT_PROBLEMS,
        help="built-in problems: 'sums' (What is a+b?) or 'all' (also a-b, word problems)")  # fmt: skip
    add("--eval-size", type=_count, help="held-out problems evaluated (None: all)")
    add("--eval-samples", type=_count, default=DEFAULT_EVAL_SAMPLES, help="samples per held-out problem")
    size = parser.add_mutually_exclusive_group().add_argument
    size("--quick", action="store_true", help=f"a smoke run (defaults become {QUICK}); explicit flags still win")
    size("--long", action="store_true", help=f"the longer demo (defaults become {LONG}); explicit flags still win")
    add("--threads", type=int, default=0, help="the toy's torch threads (0: the cores; the LM runs share them out)")
    add("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv=None) -> int:
    """Console entry point `cegppo-demo`: the summary goes to ``results.json``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick or args.long:  # other defaults; explicit flags still win
        parser.set_defaults(**(QUICK if args.quick else LONG))
        args = parser.parse_args(argv)
    problem = first_problem(extras=[("matplotlib", "plot", "cegppo-demo (its figures)")],
                            writable=[(args.output_dir, "--output-dir", True)])  # fmt: skip
    if problem:  # now, not after minutes of training
        parser.exit(2, f"cegppo-demo: error: {problem}\n")
    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):  # everything is built locally: no Hub access
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from huggingface_hub import constants
    from transformers.utils import logging as hf_logging

    constants.HF_HUB_OFFLINE = constants.HF_HUB_DISABLE_TELEMETRY = True
    torch.set_num_threads(args.threads or threads_per_process(1))
    hf_logging.disable_progress_bar()  # "Loading weights" bars; ours stay
    _run(args, {name: getattr(args, name) for name in QUICK})
    return 0


def _run(args: argparse.Namespace, sizes: dict) -> dict:
    start, timings = time.perf_counter(), {}

    def timed(name, function, *a, **kw):
        began = time.perf_counter()
        result = function(*a, **kw)
        timings[name] = time.perf_counter() - began
        return result

    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    print(f"[cegppo-demo] output directory: {out}\n[cegppo-demo] machine: {machine_description()}", flush=True)
    toy = timed("toy", run_toy_part, range(args.seed, args.seed + sizes["toy_seeds"]), sizes["toy_steps"])
    toy_text = _toy_text(toy, sizes)
    print(toy_text + "\n\n=== Part 2: the same trainer (CEGPPOTrainer) on a tiny language model ===\n", flush=True)
    lm = timed("tiny LM (cegppo-compare)", _lm_part, args, sizes, out)
    lm_text = _lm_text(lm, sizes)
    print(lm_text, flush=True)
    toy_title = f"Exact toy: entropy under CE-GPPO's (beta1, beta2), {len(toy['seeds'])} seeds"
    plots = {"toy": timed("figures", plot_toy_grid, toy["runs"], os.path.join(out, "toy_entropy.png"), toy_title),
             "lm": os.path.join(out, "lm", "curves.png")}  # fmt: skip
    shown = args.output_dir.rstrip(os.sep) or out  # the printed commands name the paths as the user gave them
    models = {"start": os.path.join(shown, "lm", "start-model")}
    models.update(
        {r["arm"]: os.path.join(shown, "lm", "runs", r["name"]) for r in lm["runs"] if r["seed"] == args.seed}
    )
    data = os.path.join(shown, HELDOUT_FILE)
    commands = {n: shlex.join(["cegppo-eval", m, "--datasets", data, "--k", str(sizes["eval_samples"])])
                for n, m in models.items()}  # fmt: skip
    timings["total"] = time.perf_counter() - start
    summary = {"seed": args.seed, "problems": args.problems, "sizes": sizes, "machine": machine_description(),
               "toy": toy, "lm": lm, "plots": plots, "heldout": os.path.join(out, HELDOUT_FILE), "timings": timings,
               "eval_commands": commands}  # fmt: skip
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"## Exact toy\n\n{toy_text}\n\n## Tiny LM\n\n{lm_text}\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n[cegppo-demo] figures: {plots['toy']}, {plots['lm']}\n[cegppo-demo] tables: {out}/results.md, "
          "results.json\n[cegppo-demo] the start and the first seed's models, saved with their prompt format and "
          "sampling, measure again with cegppo-eval (the same prompts, samples and grader: the same figures):")  # fmt: skip
    print("\n".join(f"  {command}" for command in commands.values()))
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items() if name != "total")
    print(f"[cegppo-demo] time: {phases}; total {timings['total'] // 60:.0f} min {timings['total'] % 60:.0f} s wall")
    return summary


def demo_recipe(args: argparse.Namespace, sizes: dict, train_file: str) -> dict:
    """The demo's language-model runs as a `cegppo-train` recipe: the paper's off-policy shape (one generation batch
    feeds 8 optimizer steps), the learning rate warmed up over the first batch (Adam's first steps from a fresh state
    move every weight by ~lr whatever the gradient: docs/entropy_results.md, section 3), no KL, the +1 / -1 reward."""
    return {"model_name_or_path": "builtin:tiny", "tiny_sft_steps": sizes["sft_steps"], "dtype": "float32",
            "dataset_name": train_file, "instruction": DEMO_INSTRUCTION, "reward_funcs": ["math"],
            "max_steps": sizes["steps"], "num_generations": sizes["num_generations"],
            "per_device_train_batch_size": sizes["prompts_per_step"] * sizes["num_generations"],
            "gradient_accumulation_steps": 1, "steps_per_generation": 8, "num_iterations": 1,
            "max_completion_length": MAX_NEW_TOKENS, "temperature": 1.0, "top_p": 1.0,
            "learning_rate": args.learning_rate, "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 8,
            "weight_decay": 0.0, "max_grad_norm": 1.0, "beta": 0.0, "epsilon": 0.2, "loss_type": "dapo",
            "use_cpu": True, "bf16": False, "activation_checkpointing": False, "report_to": "none",
            "save_strategy": "no", "logging_steps": max(1, sizes["steps"] // 50), "disable_tqdm": True,
            "seed": args.seed}  # fmt: skip


def _lm_part(args: argparse.Namespace, sizes: dict, out: str) -> dict:
    """CE-GPPO and GRPO from one SFT warm start over the seeds, through `cegppo-compare` (every run `cegppo-train`,
    every model measured by `cegppo-eval`); returns its summary, with the runs' arms and seeds."""
    import yaml

    from ..comparison.report import load, summarize

    folder = os.path.join(out, "lm")
    os.makedirs(folder, exist_ok=True)
    held_out = load_rows("builtin:arithmetic_eval", sizes["eval_size"], problems=args.problems)
    write_jsonl(({"problem": r["problem"], "answer": r["answer"]} for r in held_out), os.path.join(out, HELDOUT_FILE))
    train_file = write_jsonl(
        load_rows("builtin:arithmetic", problems=args.problems), os.path.join(folder, "train.jsonl")
    )
    recipe = os.path.join(folder, "recipe.yaml")
    with open(recipe, "w") as f:
        yaml.safe_dump(demo_recipe(args, sizes, train_file), f, sort_keys=False)
    arm = "cegppo" if (args.beta1, args.beta2) == (0.5, 1.0) else f"{args.beta1:g},{args.beta2:g}"
    seeds = [str(args.seed + i) for i in range(sizes["seeds"])]
    command = [sys.executable, "-m", "cegppo_trl.scripts.compare", "--recipe", recipe, "--arms", "grpo", arm,
               "--seeds", *seeds, "--eval_datasets", os.path.join(out, HELDOUT_FILE), "--eval_k",
               str(sizes["eval_samples"]), "--jobs", "2", "--out", folder]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as engine:
        for line in engine.stdout:  # its progress lines; the demo prints the table with its own sentences
            print(line, end="", flush=True) if line.startswith("[cegppo-compare]") else None
    status = engine.returncode
    if status != 0:
        raise SystemExit(f"cegppo-demo: the tiny-LM comparison failed (status {status}); its logs are in {folder}.")
    settings, start, runs = load(Path(folder))
    summary = summarize(start, runs, ["boxed"])
    with open(os.path.join(folder, "results.md")) as f:
        table = f.read()
    return {"table": table, "summary": summary, "runs": [{k: r[k] for k in ("name", "arm", "seed")} for r in runs],
            "start_accuracy": statistics.fmean(start["boxed"]["avg"])}  # fmt: skip


def run_toy_part(seeds, steps: int) -> dict:
    """The first-order check at `FIRST_ORDER_LRS` and the "sequence" toy's grid over `seeds` with `steps` RL steps,
    with `toy.toy_findings` of them."""
    from .toy import TOY_PRESETS, first_order_check, run_toy_grid, toy_findings

    seeds, config = list(seeds), dataclasses.replace(TOY_PRESETS["sequence"], steps=steps)
    checks = [
        {k: v for k, v in first_order_check(lr=lr, seed=seeds[0]).items() if k != "rows"} for lr in FIRST_ORDER_LRS
    ]
    runs = run_toy_grid(seeds, config=config)
    return {"config": dataclasses.asdict(config), "seeds": seeds, "first_order": checks, "runs": runs,
            "findings": toy_findings(runs, checks)}  # fmt: skip


def _toy_text(toy: dict, sizes: dict) -> str:
    c = toy["config"]
    lines = [
        "=== Part 1: the mechanism, on an exact toy (float64: the same figures on every machine) ===\n",
        f"A tabular softmax policy ({c['num_states']} prompts, answers of {c['seq_len']} tokens over "
        f"{c['num_actions']} actions, only the first token rewarded) trained with CE-GPPO's loss (core.py), "
        f"{c['num_minibatches']} mini-batches x {c['num_epochs']} epochs per RL step (off-policy after the first), "
        f"{c['steps']} steps, {sizes['toy_seeds']} seeds per (beta1, beta2); dH: the first-order entropy change "
        "carried by a set of tokens. Per setting: toy_entropy.png and results.json.\n",
        "What the toy shows (counted over its runs and seeds):",
    ]
    for f in toy["findings"]:
        count = ("yes" if f["holds"] else "no") if f["of"] == 1 else f"{f['holds']} of {f['of']}"
        lines.append(f"  * {f['finding']}: {count} ({f['numbers']})")
    return "\n".join(lines)


def _lm_text(lm: dict, sizes: dict) -> str:
    """The comparison's table, then each arm against the warm start and CE-GPPO - GRPO over the seeds, counted."""
    summary, reference = lm["summary"], lm["summary"]["reference"]
    arms = summary["arms"]
    cegppo = next(a for a in arms if a != reference)
    versus = summary["versus"][cegppo]["over_seeds"]
    gains = "; ".join(_gain_text(arms[a]["boxed"]["avg_vs_start"], arms[a]["label"]) for a in (cegppo, reference))
    accuracy, entropy = versus["boxed"]["avg"]["values"], versus["train_entropy"]["values"]
    return (
        lm["table"] + f"\nStart (the warm start, {sizes['sft_steps']} SFT steps): held-out accuracy "
        f"{lm['start_accuracy']:.3f} (avg@{sizes['eval_samples']}, sampled at T=1). RL from it, held-out accuracy at "
        f"the end minus the start: {gains}.\n\nCE-GPPO - GRPO over {len(accuracy)} seeds: training entropy "
        f"{_spread_text(entropy, 4)} nats (higher in {sum(v > 0 for v in entropy)} of {len(entropy)}), held-out "
        f"accuracy {_spread_text(accuracy, 3)} (higher in {sum(v > 0 for v in accuracy)} of {len(accuracy)}).\n\n"
        + LM_LIMITS.format(**sizes)
    )


def _spread_text(values: list[float], digits: int) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):+.{digits}f} +- {spread:.{digits}f}"


def _gain_text(gain: dict, name: str) -> str:
    values = gain["values"]
    return (f"{name} {_spread_text(values, 3)} (above the start in {sum(v > 0 for v in values)} of "
            f"{len(values)} seeds, {min(values):+.3f} to {max(values):+.3f})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
