"""`cegppo-demo` (README, *The offline demo*): the exact toy (`toy.py`: CE-GPPO's loss on tabular policies in
float64, the same figures on every machine), then CE-GPPO vs GRPO from one SFT warm start of the tiny LM over several
seeds (`lm.py`), with their differences' mean +- std. Writes ``results.md``, ``results.json``, the two figures, the
warm start and the first seed's models and ``heldout.jsonl`` for the printed `cegppo-eval` commands; CPU, offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from ..data import write_jsonl
from ..figures import machine_description
from ..run_checks import first_problem
from ..tiny_model import DEFAULT_PROBLEMS, PROBLEM_SETS
from . import lm


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
    add("--steps", type=_count, default=lm.DEFAULT_RL_STEPS, help="RL optimizer steps per LM run")
    add("--sft-steps", type=_count, default=lm.DEFAULT_SFT_STEPS, help="SFT warm-start steps")
    add("--beta1", type=float, default=0.5, help="CE-GPPO beta1 (the paper's, 1.5B)")
    add("--beta2", type=float, default=1.0, help="CE-GPPO beta2 (the paper's)")
    add("--learning-rate", type=float, default=lm.RL_DEFAULTS["learning_rate"], help="RL learning rate")
    add("--prompts-per-step", type=_count, default=8, help="prompts per optimizer step")
    add("--num-generations", type=_count, default=8, help="completions per prompt")
    add("--problems", choices=sorted(PROBLEM_SETS), default=DEFAULT_PROBLEMS,
        help="built-in problems: 'sums' (What is a+b?) or 'all' (also a-b, word problems)")  # fmt: skip
    add("--eval-size", type=_count, help="held-out problems evaluated (None: all)")
    add("--eval-samples", type=_count, default=lm.DEFAULT_EVAL_SAMPLES, help="samples per held-out problem")
    size = parser.add_mutually_exclusive_group().add_argument
    size("--quick", action="store_true", help=f"a smoke run (defaults become {QUICK}); explicit flags still win")
    size("--long", action="store_true", help=f"the longer demo (defaults become {LONG}); explicit flags still win")
    add("--threads", type=int, default=0, help="torch intra-op threads (0: one per core that other jobs leave idle)")
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
    torch.set_num_threads(args.threads or _idle_cores())
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
    eval_rows = lm.load_rows("builtin:arithmetic_eval", sizes["eval_size"], problems=args.problems)
    heldout = write_jsonl(
        ({"problem": r["problem"], "answer": r["answer"]} for r in eval_rows), os.path.join(out, lm.HELDOUT_FILE)
    )
    warm = timed("warm start", _warm_start, args, sizes, out, eval_rows)
    pairs = _lm_runs(args, sizes, out, eval_rows, warm, timed)
    differences = {m: _spread([p["cegppo"][f"end_{m}"] - p["grpo"][f"end_{m}"] for p in pairs])
                   for m in ("accuracy", "entropy")}  # fmt: skip
    gains = _gains(pairs)
    lm_text = _lm_text(pairs, warm, differences, gains, sizes)
    print(lm_text, flush=True)
    plots = timed("figures", _figures, args, sizes, out, toy, pairs, differences)
    shown = args.output_dir.rstrip(os.sep) or out  # the printed commands name the paths as the user gave them
    models = {"warm_start": os.path.join(shown, "warm_start")}
    models.update({name: os.path.join(shown, "runs", name, "final") for name in ("cegppo", "grpo")})
    data = os.path.join(shown, lm.HELDOUT_FILE)
    timings["total"] = time.perf_counter() - start
    summary = {
        "seed": args.seed, "problems": args.problems, "sizes": sizes, "machine": machine_description(), "toy": toy,
        "warm_start": warm, "pairs": [{"seed": p["seed"], **{n: _no_history(p[n]) for n in ("cegppo", "grpo")}}
                                      for p in pairs],
        "runs": [_no_history(pairs[0][name]) for name in ("cegppo", "grpo")],  # the saved models' runs
        "differences": differences, "gains": gains, "plots": plots, "heldout": heldout, "timings": timings,
        "eval_commands": {n: lm.eval_command(p, data, sizes["eval_samples"], args.seed) for n, p in models.items()},
    }  # fmt: skip
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"## Exact toy\n\n{toy_text}\n\n## Tiny LM\n\n{lm_text}\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n[cegppo-demo] figures: {plots['toy']}, {plots['lm']}\n[cegppo-demo] tables: {out}/results.md, "
          "results.json\n[cegppo-demo] the first seed's models, saved with their prompt format and sampling, "
          "evaluate again with cegppo-eval (the same prompts, samples and grader: the same figures):")  # fmt: skip
    print("\n".join(f"  {command}" for command in summary["eval_commands"].values()))
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in timings.items() if name != "total")
    print(f"[cegppo-demo] time: {phases}; total {timings['total'] // 60:.0f} min {timings['total'] % 60:.0f} s wall")


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


def _spread(values) -> dict:
    return {"values": list(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}  # fmt: skip


def _gains(pairs: list[dict]) -> dict:
    """Per arm, held-out accuracy at the end minus at the start (the warm start), over the seeds."""
    return {name: _spread([p[name]["end_accuracy"] - p[name]["start_accuracy"] for p in pairs])
            for name in ("cegppo", "grpo")}  # fmt: skip


def _warm_start(args, sizes: dict, out: str, eval_rows: list[dict]) -> dict:
    _, _, warm = lm.warm_start(
        seed=args.seed, sft_steps=sizes["sft_steps"], progress=not args.no_progress, cache_dir=f"{out}/warm_start",
        train_rows=lm.load_rows("builtin:arithmetic", problems=args.problems), eval_rows=eval_rows,
        eval_samples=sizes["eval_samples"],
    )  # fmt: skip
    when = "cached" if warm["cached"] else f"{warm['seconds']:.0f} s"
    print(f"[cegppo-demo] warm start ({when}): held-out accuracy {warm['accuracy']:.3f}, entropy "
          f"{warm['entropy']:.4f}", flush=True)  # fmt: skip
    return warm


def _lm_runs(args, sizes: dict, out: str, eval_rows: list[dict], warm: dict, timed) -> list[dict]:
    """CE-GPPO and GRPO from the warm start for each seed; the first seed's models are saved."""
    runs = (("cegppo", f"CE-GPPO (beta1={args.beta1:g}, beta2={args.beta2:g})", args.beta1, args.beta2),
            ("grpo", "GRPO (beta1=beta2=0)", 0.0, 0.0))  # fmt: skip
    train_dataset, pairs = lm.demo_train_dataset(args.problems), []
    for index in range(sizes["seeds"]):
        seed, first = args.seed + index, index == 0
        pair = {"seed": seed}
        start_eval = {k: warm[k] for k in ("accuracy", "entropy")} if first else None
        for name, label, beta1, beta2 in runs:
            model, tokenizer = lm.load_tiny(f"{out}/warm_start")  # identical starting weights
            pair[name] = timed(
                f"{name}, seed {seed}", lm.run_rl, model, tokenizer, beta1=beta1, beta2=beta2, seed=seed,
                max_steps=sizes["steps"], output_dir=f"{out}/runs/{name if first else f'{name}-seed{seed}'}",
                train_dataset=train_dataset, eval_rows=eval_rows, eval_samples=sizes["eval_samples"],
                progress=not args.no_progress, label=label, save_final=first, start_eval=start_eval,
                learning_rate=args.learning_rate, num_generations=sizes["num_generations"],
                per_device_train_batch_size=sizes["prompts_per_step"] * sizes["num_generations"],
            )  # fmt: skip
            start_eval = {k: pair[name][f"start_{k}"] for k in ("accuracy", "entropy")}
        pairs.append(pair)
    return pairs


def _lm_text(pairs: list[dict], warm: dict, differences: dict, gains: dict, sizes: dict) -> str:
    lines = [
        "| seed | held-out accuracy: CE-GPPO | GRPO | CE-GPPO - GRPO | held-out entropy: CE-GPPO | GRPO "
        "| CE-GPPO - GRPO | train reward, last 10%: CE-GPPO | GRPO |",
        "|" + "---|" * 9,
        f"| start (warm start) | {warm['accuracy']:.3f} | {warm['accuracy']:.3f} | | {warm['entropy']:.4f} "
        f"| {warm['entropy']:.4f} | | | |",
    ]
    for p in pairs:
        c, g = p["cegppo"], p["grpo"]
        reward = " | ".join(f"{r['end_reward']:+.3f}" if r["end_reward"] is not None else "-" for r in (c, g))
        lines.append(f"| {p['seed']} | {c['end_accuracy']:.3f} | {g['end_accuracy']:.3f} "
                     f"| {c['end_accuracy'] - g['end_accuracy']:+.3f} | {c['end_entropy']:.4f} | {g['end_entropy']:.4f} "
                     f"| {c['end_entropy'] - g['end_entropy']:+.4f} | {reward} |")  # fmt: skip
    acc, ent = differences["accuracy"], differences["entropy"]
    lines.append(f"| mean +- std | | | {acc['mean']:+.3f} +- {acc['std']:.3f} | | | "
                 f"{ent['mean']:+.4f} +- {ent['std']:.4f} | | |")  # fmt: skip
    cegppo = [p["cegppo"] for p in pairs]
    share = {k: 100 * statistics.fmean(r[k] for r in cegppo) for k in ("beta1_token_frac", "beta2_token_frac",
                                                                         "beta1_grad_share", "beta2_grad_share")}  # fmt: skip
    return "\n".join(lines) + (
        f"\n\nStart (the warm start, {warm['sft']['steps']} SFT steps): held-out accuracy {warm['accuracy']:.3f} "
        f"(sampled, T=1), entropy {warm['entropy']:.4f} nats. RL from it, held-out accuracy at the end minus the "
        f"start: {_gain_text(gains['cegppo'], 'CE-GPPO')}; {_gain_text(gains['grpo'], 'GRPO')}.\n\n"
        f"What this part shows: the trainer on a real model. Off-policy updates put {share['beta1_token_frac']:.2f}% "
        f"/ {share['beta2_token_frac']:.2f}% of CE-GPPO's tokens in the beta1 / beta2 sets, carrying "
        f"{share['beta1_grad_share']:.2f}% / {share['beta2_grad_share']:.2f}% of its gradient weight. CE-GPPO - GRPO "
        f"over {len(pairs)} seeds: held-out entropy {ent['mean']:+.4f} +- {ent['std']:.4f} nats (higher in "
        f"{sum(v > 0 for v in ent['values'])} of {len(pairs)}), accuracy {acc['mean']:+.3f} +- {acc['std']:.3f} "
        f"(higher in {sum(v > 0 for v in acc['values'])} of {len(pairs)}).\n\n" + LM_LIMITS.format(**sizes)
    )


def _gain_text(gain: dict, name: str) -> str:
    values = gain["values"]
    return (f"{name} {gain['mean']:+.3f} +- {gain['std']:.3f} (above the start in {sum(v > 0 for v in values)} of "
            f"{len(values)} seeds, {min(values):+.3f} to {max(values):+.3f})")  # fmt: skip


def _figures(args, sizes: dict, out: str, toy: dict, pairs: list[dict], differences: dict) -> dict:
    from .plotting import plot_paired_runs, plot_toy_grid

    toy_title = f"Exact toy: entropy under CE-GPPO's (beta1, beta2), {len(toy['seeds'])} seeds"
    lm_title = (f"Tiny LM, {args.problems}: CE-GPPO ({args.beta1:g}, {args.beta2:g}) vs GRPO, {len(pairs)} seeds, "
                f"{sizes['steps']} steps of {sizes['prompts_per_step']} x {sizes['num_generations']} completions")  # fmt: skip
    return {
        "toy": plot_toy_grid(toy["runs"], os.path.join(out, "toy_entropy.png"), title=toy_title),
        "lm": plot_paired_runs(pairs, differences, os.path.join(out, "cegppo_vs_grpo.png"), lm_title),
    }


def _no_history(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "log_history"}


def _idle_cores() -> int:
    """The cores other jobs leave idle (by the last minute's load average), at least one: two intra-op threads on one
    free core spin against the other job and run several times slower; 1 or 2 threads give the same figures."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - round(os.getloadavg()[0]))


if __name__ == "__main__":
    sys.exit(main())
