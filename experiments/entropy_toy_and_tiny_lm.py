"""Sections 1-2 of `docs/entropy_results.md`, beyond what `cegppo-demo` runs: both toys ("sequence" with its filler
and rewarded positions, and "bandit") over the five (beta1, beta2) settings, the first-order check at four step
sizes, and the tiny LM at all five settings (the demo runs two) with each mini-batch used twice.

    python experiments/entropy_toy_and_tiny_lm.py --part toy       # both toys -> docs/entropy_results/toy.json
    python experiments/entropy_toy_and_tiny_lm.py --part lm        # the LM grid (long; resumes) -> .../lm_runs/
    python experiments/entropy_toy_and_tiny_lm.py --part report    # tables.md and docs/figures/entropy_*.png

`--part all` runs the three. Training outputs of the LM part go to `--work-dir` (default `outputs/entropy_exp`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "docs", "entropy_results")
FIGURES_DIR = os.path.join(REPO, "docs", "figures")
LABELS = {(0.0, 0.0): "GRPO (0, 0)", (1.0, 0.5): "(1, 0.5)", (0.5, 1.0): "paper (0.5, 1)", (0.0, 1.0): "(0, 1)",
          (1.0, 1.0): "GPPO (1, 1)"}  # fmt: skip
GRID = tuple(LABELS)
TOY_SERIES = ("entropy", "filler_entropy", "key_entropy", "correct_mass", "beta1_token_frac", "beta2_token_frac")
LM_SERIES = (
    ("reward", "entropy", "clip_ratio/region_mean")
    + tuple(
        f"cegppo/{name}" for name in ("beta1_token_frac", "beta2_token_frac", "beta1_grad_share", "beta2_grad_share")
    )
    + tuple(f"cegppo/quadrant/{q}/{s}" for s in ("token_frac", "restored_grad_share") for q in ("pos_low", "neg_low"))
)
# The settings section 2 was made with (the demo's defaults differ): all built-in problems, each mini-batch used
# twice (4 x 2 = 8 optimizer steps per generation batch), a constant learning rate from the first step.
PROBLEMS = "all"
LM_RL_SETTINGS = {"steps_per_generation": 4, "num_iterations": 2, "lr_scheduler_type": "constant", "warmup_steps": 0}


def key(betas) -> str:
    return f"b1={betas[0]:g},b2={betas[1]:g}"


def fmt(values, digits=3) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "nan ± nan"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {std:.{digits}f}"


def _json(name, payload=None, indent=1):
    path = os.path.join(RESULTS_DIR, name)
    if payload is None:
        with open(path) as f:
            return json.load(f)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=indent, separators=None if indent else (",", ":"))


def run_toy_part(seeds: int) -> None:
    from cegppo_trl.demo.toy import TOY_PRESETS, first_order_check, run_toy

    start, checks, presets = time.perf_counter(), {}, {}
    for lr in (1e-2, 1e-3, 1e-4, 1e-5):
        check = first_order_check(lr=lr, trials=64)
        by_branch = {}
        for row in check["rows"]:
            by_branch[row["branch"]] = max(by_branch.get(row["branch"], 0.0), row["rel_error"])
        checks[f"{lr:g}"] = {
            "max_rel_error": check["max_rel_error"],
            "by_branch": by_branch,
            "example": check["rows"][:4],
        }
        print(f"first-order check lr={lr:g}: max relative error {check['max_rel_error']:.2e}", flush=True)
    for preset, config in TOY_PRESETS.items():
        runs = {}
        for betas in GRID:
            runs[key(betas)] = [_compact(run_toy(*betas, seed=seed, config=config)) for seed in range(seeds)]
            print(f"toy {preset} {key(betas)}: final entropy {fmt(r['entropy'][-1] for r in runs[key(betas)])}")
        presets[preset] = {"config": dataclasses.asdict(config), "runs": runs}
    payload = {"seeds": seeds, "first_order": checks, "presets": presets, "seconds": time.perf_counter() - start}
    _json("toy.json", payload, indent=None)


def _compact(run) -> dict:
    out = {name: [round(v, 5) for v in getattr(run, name)] for name in TOY_SERIES}
    out.update(seed=run.seed, dH_beta1=sum(run.dH_beta1), dH_beta2=sum(run.dH_beta2),
               dH_unclipped=sum(run.dH_unclipped), mean_reward=sum(run.reward) / len(run.reward))  # fmt: skip
    return out


def run_lm_part(seeds: int, steps: int, work_dir: str, threads: int, eval_rows_n: int, sft_steps: int) -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(threads)
    from tiny_lm import demo_train_dataset, load_rows, load_tiny, run_rl, warm_start

    warm_dir, start = os.path.join(work_dir, "warm"), time.perf_counter()
    eval_rows = load_rows("builtin:arithmetic_eval", problems=PROBLEMS)[:eval_rows_n]
    _, _, info = warm_start(seed=0, sft_steps=sft_steps, progress=False, cache_dir=warm_dir, eval_rows=eval_rows,
                            train_rows=load_rows("builtin:arithmetic", problems=PROBLEMS))  # fmt: skip
    info["greedy_accuracy"] = greedy_accuracy(warm_dir, eval_rows)
    print(f"warm start: sampled accuracy {info['accuracy']:.3f}, greedy {info['greedy_accuracy']:.3f}", flush=True)
    train_dataset = demo_train_dataset(PROBLEMS)
    for seed in range(seeds):
        for betas in GRID:
            path = os.path.join(RESULTS_DIR, "lm_runs", f"{key(betas)}_seed{seed}.json")
            if os.path.exists(path):
                continue
            model, tokenizer = load_tiny(warm_dir)
            result = run_rl(model, tokenizer, beta1=betas[0], beta2=betas[1], seed=seed, max_steps=steps,
                            output_dir=os.path.join(work_dir, "lm", os.path.basename(path)[:-5]), eval_rows=eval_rows,
                            progress=False, logging_steps=1, train_dataset=train_dataset, **LM_RL_SETTINGS)  # fmt: skip
            history = result.pop("log_history")
            result["start_greedy_accuracy"] = info["greedy_accuracy"]
            result["end_greedy_accuracy"] = greedy_accuracy(result["final_dir"], eval_rows)
            result["series"] = {m: [[h["step"], h[m]] for h in history if isinstance(h.get(m), (int, float))]
                                for m in LM_SERIES}  # fmt: skip
            _json(os.path.join("lm_runs", os.path.basename(path)), result, indent=None)
            print(f"lm {key(betas)} seed {seed}: entropy {result['start_entropy']:.3f} -> {result['end_entropy']:.3f}")
    meta = {"seeds": seeds, "steps": steps, "eval_rows": eval_rows_n, "threads": threads, "sft_steps": sft_steps,
            "warm_start": info, "seconds_this_invocation": time.perf_counter() - start}  # fmt: skip
    _json("lm_meta.json", meta)


def greedy_accuracy(model_dir: str, rows: list[dict]) -> float:
    """Held-out greedy accuracy of a saved model with the demo's prompt (the demo itself reports sampled accuracy)."""
    from tiny_lm import DEMO_INSTRUCTION, MAX_NEW_TOKENS, load_tiny

    from cegppo_trl.data import build_prompt
    from cegppo_trl.evaluation import evaluate_completions, generate_completions

    model, tokenizer = load_tiny(model_dir)
    prompts = [build_prompt(row["problem"], instruction=DEMO_INSTRUCTION) for row in rows]
    completions = generate_completions(model, tokenizer, prompts, 1, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)
    return float(evaluate_completions(completions, [row["answer"] for row in rows])["avg@1"])


def _figure(panels, name, suptitle):
    import numpy as np

    from cegppo_trl.demo.plotting import SETTING_COLORS, save_figure, style_panel
    from cegppo_trl.demo.plotting import panels as new_panels

    fig, axes = new_panels(len(panels))
    for ax, (title, series) in zip(axes, panels):
        for betas, xs, curves in series:  # mean ± std over seeds
            data = np.array(curves, dtype=float)
            mean, std = data.mean(0), (data.std(0, ddof=1) if len(curves) > 1 else np.zeros(data.shape[1]))
            ax.plot(xs, mean, color=SETTING_COLORS[betas], label=LABELS[betas], linewidth=1.4)
            ax.fill_between(xs, mean - std, mean + std, color=SETTING_COLORS[betas], alpha=0.15, linewidth=0)
        style_panel(ax, title)
    fig.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(labels), fontsize=8,
               frameon=False)  # fmt: skip
    print(f"wrote {os.path.relpath(save_figure(fig, os.path.join(FIGURES_DIR, name), suptitle), REPO)}")


def _comparisons(header: str, values: dict, rows) -> list[str]:
    """Per-seed ordering checks: ``(text, higher setting or None for every other setting, lower setting)``."""
    n = min(len(v) for v in values.values())
    lines = [f"| {header} | seeds where it holds |", "|---|---|"]
    for text, hi, lo in rows:
        others = [hi] if hi is not None else [b for b in GRID if b != lo]
        wins = sum(all(values[b][s] > values[lo][s] for b in others) for s in range(n))
        lines.append(f"| {text} | {wins} / {n} |")
    return lines + [""]


DIRECTIONS = [("(0.5, 1) > (1, 1): larger beta1 lowers H", (0.5, 1.0), (1.0, 1.0)),
              ("(1, 1) > (1, 0.5): larger beta2 keeps H higher", (1.0, 1.0), (1.0, 0.5)),
              ("(0, 1) > (0, 0): larger beta2 keeps H higher", (0.0, 1.0), (0.0, 0.0)),
              ("(0.5, 1) > (0, 0): paper setting above GRPO", (0.5, 1.0), (0.0, 0.0))]  # fmt: skip


def toy_report(tail: int = 10) -> str:
    toy = _json("toy.json")
    lines = ["#### First-order check (one SGD step on one token through `cegppo_per_token_loss`)", "",
             "| lr | max relative error (64 random tokens, all branches) |", "|---|---|"]  # fmt: skip
    lines += [f"| {lr} | {check['max_rel_error']:.2e} |" for lr, check in toy["first_order"].items()] + [""]
    for preset, data in toy["presets"].items():
        lines += [f"#### Toy `{preset}` ({toy['seeds']} seeds, mean ± std over seeds)", "",
                  "| (beta1, beta2) | H start | H mean over run | H final | filler H final | key H final | correct mass "
                  "final | beta1 / beta2 token % | dH from beta1 set | dH from beta2 set | dH from unclipped |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for betas in GRID:
            runs = data["runs"][key(betas)]

            def last(name, runs=runs):
                return fmt([statistics.fmean(r[name][-tail:]) for r in runs if r[name]]) if runs[0][name] else "-"

            b1, b2 = (statistics.fmean(statistics.fmean(r[k]) for r in runs) for k in TOY_SERIES[4:])
            lines.append(f"| {LABELS[betas]} | {fmt(r['entropy'][0] for r in runs)} | "
                         f"{fmt([statistics.fmean(r['entropy']) for r in runs])} | {last('entropy')} | "
                         f"{last('filler_entropy')} | {last('key_entropy')} | {last('correct_mass')} | {100 * b1:.2f} / "
                         f"{100 * b2:.2f} | {fmt(r['dH_beta1'] for r in runs)} | {fmt(r['dH_beta2'] for r in runs)} | "
                         f"{fmt(r['dH_unclipped'] for r in runs)} |")  # fmt: skip
        lines.append("")
        mean_h = {b: [statistics.fmean(r["entropy"]) for r in data["runs"][key(b)]] for b in GRID}
        lines += _comparisons("comparison of the mean entropy over the run", mean_h,
                              DIRECTIONS + [("(1, 0.5) > (0, 0): GRPO lowest", (1.0, 0.5), (0.0, 0.0))])  # fmt: skip
        names = ["entropy"] + (
            ["filler_entropy", "key_entropy"] if data["runs"][key(GRID[0])][0]["filler_entropy"] else []
        )
        titles = {"entropy": "mean entropy (nats)", "filler_entropy": "entropy of filler positions",
                  "key_entropy": "entropy of the rewarded position", "correct_mass": "probability of a correct answer",
                  "beta1_token_frac": "beta1-set token fraction", "beta2_token_frac": "beta2-set token fraction"}  # fmt: skip
        panels = [(titles[name], [(b, range(len(data["runs"][key(b)][0][name])), [r[name] for r in data["runs"][key(b)]])
                                  for b in GRID]) for name in names + list(TOY_SERIES[3:])]  # fmt: skip
        _figure(panels, f"entropy_toy_{preset}.png", f"Softmax toy '{preset}': CE-GPPO (beta1, beta2), mean ± std "
                f"over {toy['seeds']} seeds")  # fmt: skip
    return "\n".join(lines)


def _window(series, first: bool, fraction: float = 0.2) -> float:
    values = [v for _, v in series]
    k = max(1, round(fraction * len(values)))
    return statistics.fmean(values[:k] if first else values[-k:])


def lm_report() -> str:
    runs = {b: [] for b in GRID}
    for b in GRID:
        while os.path.exists(path := os.path.join(RESULTS_DIR, "lm_runs", f"{key(b)}_seed{len(runs[b])}.json")):
            runs[b].append(_json(os.path.relpath(path, RESULTS_DIR)))
    meta = _json("lm_meta.json")
    lines = ["| (beta1, beta2) | seeds | train entropy, first 20% of steps | train entropy, last 20% | train reward, first "
             "20% | train reward, last 20% | held-out entropy end | held-out sampled acc. end | held-out greedy acc. end "
             "| beta1 / beta2 token % | seconds / run |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for b, rs in runs.items():
        b1, b2 = (statistics.fmean(_window(r["series"][f"cegppo/{k}"], True, 1.0) for r in rs) for k in TOY_SERIES[4:])
        windows = [
            fmt([_window(r["series"][m], first) for r in rs]) for m in ("entropy", "reward") for first in (1, 0)
        ]
        lines.append(f"| {LABELS[b]} | {len(rs)} | {windows[0]} | {windows[1]} | {windows[2]} | {windows[3]} | "
                     f"{fmt([r['end_entropy'] for r in rs])} | {fmt([r['end_accuracy'] for r in rs])} | "
                     f"{fmt([r['end_greedy_accuracy'] for r in rs])} | {100 * b1:.2f} / {100 * b2:.2f} | "
                     f"{statistics.fmean(r['seconds'] for r in rs):.0f} |")  # fmt: skip
    every = [r for rs in runs.values() for r in rs]
    lines += ["", "Start (one warm start shared by every run; the held-out sample differs by seed): held-out entropy "
              f"{fmt([r['start_entropy'] for r in every])}, sampled accuracy {fmt([r['start_accuracy'] for r in every])}"
              f", greedy accuracy {fmt([r['start_greedy_accuracy'] for r in every])} (first {meta['eval_rows']} "
              "problems of builtin:arithmetic_eval, temperature 1).", ""]  # fmt: skip
    late = {b: [_window(r["series"]["entropy"], False) for r in rs] for b, rs in runs.items()}
    lines += _comparisons("comparison of the training entropy over the last 20% of steps", late,
                          DIRECTIONS + [("every CE-GPPO setting > (0, 0): GRPO lowest", None, (0.0, 0.0))])  # fmt: skip

    def smoothed(metric, b, smooth=5):
        length = min(len(r["series"][metric]) for r in runs[b])
        curves = [[v for _, v in r["series"][metric][:length]] for r in runs[b]]
        xs = [s for s, _ in runs[b][0]["series"][metric][:length]]
        return b, xs, [[statistics.fmean(c[max(0, i - smooth + 1) : i + 1]) for i in range(length)] for c in curves]

    for names, name, title in ((LM_SERIES[:7], "entropy_tiny_lm.png", f"Tiny arithmetic LM: CE-GPPO (beta1, beta2), "
                                f"mean ± std over {min(map(len, runs.values()))} seeds"),
                               (LM_SERIES[7:], "entropy_tiny_lm_quadrants.png",
                                "Tiny LM: low-probability token quadrants (pi < 0.5)")):  # fmt: skip
        _figure([(f"{m} (moving mean of 5{' steps' if name.endswith('lm.png') else ''})",
                  [smoothed(m, b) for b in GRID]) for m in names], name, title)  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("toy", "lm", "report", "all"), default="all")
    parser.add_argument("--toy-seeds", type=int, default=5)
    parser.add_argument("--lm-seeds", type=int, default=3)
    parser.add_argument("--lm-steps", type=int, default=100)
    parser.add_argument("--lm-eval-rows", type=int, default=150, help="held-out problems evaluated per run")
    parser.add_argument("--sft-steps", type=int, default=800)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the LM part")
    parser.add_argument("--work-dir", default=os.path.join(REPO, "outputs", "entropy_exp"))
    args = parser.parse_args(argv)
    if args.part in ("toy", "all"):
        run_toy_part(args.toy_seeds)
    if args.part in ("lm", "all"):
        run_lm_part(args.lm_seeds, args.lm_steps, args.work_dir, args.threads, args.lm_eval_rows, args.sft_steps)
    if args.part in ("report", "all"):
        text = "### Toy\n\n" + toy_report() + "\n\n### Tiny language model\n\n" + lm_report() + "\n"
        with open(os.path.join(RESULTS_DIR, "tables.md"), "w") as f:
            f.write(text)
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
