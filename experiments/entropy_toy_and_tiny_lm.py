"""Entropy under CE-GPPO's (beta1, beta2): an exact softmax toy and the tiny arithmetic language model.

Reproduces every number and figure of `docs/entropy_results.md`:

    python experiments/entropy_toy_and_tiny_lm.py --part toy          # the exact toy
    python experiments/entropy_toy_and_tiny_lm.py --part lm           # the tiny language model (the long part)
    python experiments/entropy_toy_and_tiny_lm.py --part report       # tables + figures from the saved JSON

`--part all` runs the three in order. Results go to `docs/entropy_results/*.json` and the figures to
`docs/figures/entropy_*.png`; per-run training outputs of the language model go to `--work-dir`
(default `outputs/entropy_exp`, not committed). The LM part resumes: runs whose result JSON exists are skipped.

Grid: (beta1, beta2) in {(0, 0) = GRPO / PPO-clip gradient, (1, 0.5), (0.5, 1) = paper, (0, 1), (1, 1) = GPPO}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
RESULTS_DIR = os.path.join(DOCS, "entropy_results")
FIGURES_DIR = os.path.join(DOCS, "figures")

GRID = ((0.0, 0.0), (1.0, 0.5), (0.5, 1.0), (0.0, 1.0), (1.0, 1.0))
LABELS = {
    (0.0, 0.0): "GRPO (0, 0)",
    (1.0, 0.5): "(1, 0.5)",
    (0.5, 1.0): "paper (0.5, 1)",
    (0.0, 1.0): "(0, 1)",
    (1.0, 1.0): "GPPO (1, 1)",
}
COLORS = {
    (0.0, 0.0): "black",
    (1.0, 0.5): "tab:red",
    (0.5, 1.0): "tab:blue",
    (0.0, 1.0): "tab:green",
    (1.0, 1.0): "tab:purple",
}


def key(betas) -> str:
    return f"b1={betas[0]:g},b2={betas[1]:g}"


def mean_std(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(values, digits=3):
    m, s = mean_std(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def save_json(name, payload, indent=1):
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=indent, separators=None if indent else (",", ":"))
    return path


def rounded(values, digits=5):
    return [round(v, digits) for v in values]


TOY_SERIES = ("entropy", "filler_entropy", "key_entropy", "correct_mass", "beta1_token_frac", "beta2_token_frac")


def compact_toy_run(run) -> dict:
    """The traces the report needs, rounded (`cegppo_trl.demo.toy.run_toy` recomputes the full traces)."""
    out = {name: rounded(getattr(run, name)) for name in TOY_SERIES}
    out.update(
        seed=run.seed,
        dH_beta1=sum(run.dH_beta1),
        dH_beta2=sum(run.dH_beta2),
        dH_unclipped=sum(run.dH_unclipped),
        mean_reward=sum(run.reward) / len(run.reward),
    )
    return out


def load_json(name):
    with open(os.path.join(RESULTS_DIR, name)) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------------
# Toy
# ----------------------------------------------------------------------------------------------------------------


def run_toy_part(seeds: int) -> None:
    from cegppo_trl.demo.toy import TOY_PRESETS, first_order_check, run_toy

    start = time.perf_counter()
    checks = {}
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

    presets = {}
    for preset, config in TOY_PRESETS.items():
        runs = {}
        for betas in GRID:
            runs[key(betas)] = [compact_toy_run(run_toy(*betas, seed=seed, config=config)) for seed in range(seeds)]
            h = [r["entropy"][-1] for r in runs[key(betas)]]
            print(f"toy {preset} {key(betas)}: final entropy {fmt(h)}", flush=True)
        presets[preset] = {"config": dataclasses.asdict(config), "runs": runs}
    save_json(
        "toy.json",
        {"seeds": seeds, "first_order": checks, "presets": presets, "seconds": time.perf_counter() - start},
        indent=None,
    )
    print(f"toy part: {time.perf_counter() - start:.0f} s", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Tiny language model
# ----------------------------------------------------------------------------------------------------------------

LM_SERIES = (
    "reward",
    "entropy",
    "clip_ratio/region_mean",
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
    "cegppo/beta1_grad_share",
    "cegppo/beta2_grad_share",
    "cegppo/quadrant/pos_low/token_frac",
    "cegppo/quadrant/neg_low/token_frac",
    "cegppo/quadrant/pos_low/restored_grad_share",
    "cegppo/quadrant/neg_low/restored_grad_share",
)


# The settings docs/entropy_results.md was made with, pinned here so that the demo's defaults can move: all built-in
# problems (sums, differences, word problems) and each mini-batch used twice (4 x 2 = 8 optimizer steps per
# generation batch).
PROBLEMS = "all"
LM_RL_SETTINGS = {"steps_per_generation": 4, "num_iterations": 2}


def _lm_warm_start(warm_dir: str, sft_steps: int) -> dict:
    """The shared warm start of the LM part: the saved one as is, else `demo.lm.warm_start` (seed 0)."""
    from cegppo_trl.demo.lm import load_rows, warm_start

    info_path = os.path.join(warm_dir, "warm_start.json")
    if os.path.exists(os.path.join(warm_dir, "model.safetensors")) and os.path.exists(info_path):
        # Reuse the saved warm start as is: warm_start's own cache key changes whenever the demo gains an option,
        # and the SFT is the slowest step of this part.
        with open(info_path) as f:
            info = {**json.load(f)["info"], "cached": True}
    else:
        _, _, info = warm_start(
            seed=0,
            sft_steps=sft_steps,
            progress=False,
            cache_dir=warm_dir,
            train_rows=load_rows("builtin:arithmetic", problems=PROBLEMS),
            eval_rows=load_rows("builtin:arithmetic_eval", problems=PROBLEMS),
        )
    how = "cached" if info.get("cached") else f"{info['seconds']:.0f} s"
    print(
        f"warm start ({how}): sampled accuracy "
        f"{info['accuracy']:.3f}, greedy {info['greedy_accuracy']:.3f}, entropy {info['entropy']:.3f}",
        flush=True,
    )
    return info


def run_lm_part(seeds: int, steps: int, work_dir: str, threads: int, eval_rows_n: int, sft_steps: int) -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(threads)
    from cegppo_trl.demo.lm import demo_train_dataset, load_rows, load_tiny, run_rl

    warm_dir = os.path.join(work_dir, "warm")
    start = time.perf_counter()
    info = _lm_warm_start(warm_dir, sft_steps)
    eval_rows = load_rows("builtin:arithmetic_eval", problems=PROBLEMS)[:eval_rows_n]
    train_dataset = demo_train_dataset(PROBLEMS)
    os.makedirs(os.path.join(RESULTS_DIR, "lm_runs"), exist_ok=True)
    for seed in range(seeds):
        for betas in GRID:
            name = f"{key(betas)}_seed{seed}"
            result_path = os.path.join(RESULTS_DIR, "lm_runs", f"{name}.json")
            if os.path.exists(result_path):
                continue
            model, tokenizer = load_tiny(warm_dir)
            result = run_rl(
                model,
                tokenizer,
                beta1=betas[0],
                beta2=betas[1],
                seed=seed,
                max_steps=steps,
                output_dir=os.path.join(work_dir, "lm", name),
                eval_rows=eval_rows,
                progress=False,
                logging_steps=1,
                train_dataset=train_dataset,
                **LM_RL_SETTINGS,
            )
            history = result.pop("log_history")
            result["series"] = {
                metric: [[h["step"], h[metric]] for h in history if isinstance(h.get(metric), (int, float))]
                for metric in LM_SERIES
            }
            with open(result_path, "w") as f:
                json.dump(result, f)
            print(
                f"lm {name}: {result['seconds']:.0f} s, entropy {result['start_entropy']:.3f} -> "
                f"{result['end_entropy']:.3f}, accuracy {result['start_accuracy']:.3f} -> "
                f"{result['end_accuracy']:.3f}",
                flush=True,
            )
    save_json(
        "lm_meta.json",
        {
            "seeds": seeds,
            "steps": steps,
            "eval_rows": eval_rows_n,
            "threads": threads,
            "sft_steps": sft_steps,
            "warm_start": info,
            "seconds_this_invocation": time.perf_counter() - start,
        },
    )


# ----------------------------------------------------------------------------------------------------------------
# Report: tables and figures
# ----------------------------------------------------------------------------------------------------------------


def _band(ax, xs, runs, betas, label=None):
    import numpy as np

    data = np.array(runs, dtype=float)
    mean, std = data.mean(0), data.std(0, ddof=1) if len(runs) > 1 else np.zeros(data.shape[1])
    ax.plot(xs, mean, color=COLORS[betas], label=label or LABELS[betas], linewidth=1.4)
    ax.fill_between(xs, mean - std, mean + std, color=COLORS[betas], alpha=0.15, linewidth=0)


def _figure(panels, path, suptitle):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from cegppo_trl.demo.plotting import style_panel

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.3 * ncols, 3.1 * nrows), squeeze=False)
    for ax, (title, draw) in zip(axes.flat, panels):
        draw(ax)
        style_panel(ax, title)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(labels), fontsize=8, frameon=False
    )
    fig.suptitle(suptitle, y=1.02, fontsize=10)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {os.path.relpath(path, REPO)}")


def _toy_comparisons(data: dict, n: int) -> list[str]:
    """Per-seed ordering checks of the mean entropy over the run."""
    mean_h = {key(b): [statistics.fmean(r["entropy"]) for r in data["runs"][key(b)]] for b in GRID}
    comparisons = [
        ("(0.5, 1) > (1, 1): larger beta1 lowers H", (0.5, 1.0), (1.0, 1.0)),
        ("(1, 1) > (1, 0.5): larger beta2 keeps H higher", (1.0, 1.0), (1.0, 0.5)),
        ("(0, 1) > (0, 0): larger beta2 keeps H higher", (0.0, 1.0), (0.0, 0.0)),
        ("(0.5, 1) > (0, 0): paper setting above GRPO", (0.5, 1.0), (0.0, 0.0)),
        ("(1, 0.5) > (0, 0): GRPO lowest", (1.0, 0.5), (0.0, 0.0)),
    ]
    lines = ["| comparison of the mean entropy over the run | seeds where it holds |", "|---|---|"]
    for text, hi, lo in comparisons:
        wins = sum(a > b for a, b in zip(mean_h[key(hi)], mean_h[key(lo)]))
        lines.append(f"| {text} | {wins} / {n} |")
    return lines + [""]


def _toy_figure(preset: str, data: dict, n: int) -> None:
    steps = len(data["runs"][key(GRID[0])][0]["entropy"])
    xs = list(range(steps))
    xs_step = list(range(1, steps))

    def series_panel(field, xs_):
        return lambda ax: [_band(ax, xs_, [r[field] for r in data["runs"][key(b)]], b) for b in GRID]

    panels = [("mean entropy (nats)", series_panel("entropy", xs))]
    if data["runs"][key(GRID[0])][0]["filler_entropy"]:
        panels += [
            ("entropy of filler positions", series_panel("filler_entropy", xs)),
            ("entropy of the rewarded position", series_panel("key_entropy", xs)),
        ]
    panels += [
        ("probability of a correct answer", series_panel("correct_mass", xs)),
        ("beta1-set token fraction", series_panel("beta1_token_frac", xs_step)),
        ("beta2-set token fraction", series_panel("beta2_token_frac", xs_step)),
    ]
    _figure(
        panels,
        os.path.join(FIGURES_DIR, f"entropy_toy_{preset}.png"),
        f"Softmax toy '{preset}': CE-GPPO (beta1, beta2), mean ± std over {n} seeds",
    )


def toy_tables_and_figures(tail: int = 10) -> str:
    toy = load_json("toy.json")
    lines = [
        "#### First-order check (one SGD step on one token through `cegppo_per_token_loss`)",
        "",
        "| lr | max relative error (64 random tokens, all branches) |",
        "|---|---|",
    ]
    for lr, check in toy["first_order"].items():
        lines.append(f"| {lr} | {check['max_rel_error']:.2e} |")
    lines.append("")
    for preset, data in toy["presets"].items():
        lines += [
            f"#### Toy `{preset}` ({toy['seeds']} seeds, mean ± std over seeds)",
            "",
            "| (beta1, beta2) | H start | H mean over run | H final | filler H final | key H final | "
            "correct mass final | beta1 / beta2 token % | dH from beta1 set | dH from beta2 set | "
            "dH from unclipped |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for betas in GRID:
            runs = data["runs"][key(betas)]
            final = [statistics.fmean(r["entropy"][-tail:]) for r in runs]
            filler = [statistics.fmean(r["filler_entropy"][-tail:]) for r in runs if r["filler_entropy"]]
            keyh = [statistics.fmean(r["key_entropy"][-tail:]) for r in runs if r["key_entropy"]]
            b1 = statistics.fmean(statistics.fmean(r["beta1_token_frac"]) for r in runs)
            b2 = statistics.fmean(statistics.fmean(r["beta2_token_frac"]) for r in runs)
            lines.append(
                f"| {LABELS[betas]} | {fmt([r['entropy'][0] for r in runs])} | "
                f"{fmt([statistics.fmean(r['entropy']) for r in runs])} | {fmt(final)} | "
                f"{fmt(filler) if filler else '-'} | {fmt(keyh) if keyh else '-'} | "
                f"{fmt([statistics.fmean(r['correct_mass'][-tail:]) for r in runs])} | "
                f"{100 * b1:.2f} / {100 * b2:.2f} | {fmt([r['dH_beta1'] for r in runs])} | "
                f"{fmt([r['dH_beta2'] for r in runs])} | {fmt([r['dH_unclipped'] for r in runs])} |"
            )
        lines.append("")

        lines += _toy_comparisons(data, toy["seeds"])
        _toy_figure(preset, data, toy["seeds"])
    return "\n".join(lines)


def _lm_runs():
    directory = os.path.join(RESULTS_DIR, "lm_runs")
    runs = {}
    for betas in GRID:
        found = []
        seed = 0
        while os.path.exists(os.path.join(directory, f"{key(betas)}_seed{seed}.json")):
            with open(os.path.join(directory, f"{key(betas)}_seed{seed}.json")) as f:
                found.append(json.load(f))
            seed += 1
        runs[betas] = found
    return runs


def _window(series, first: bool, fraction: float = 0.2):
    values = [v for _, v in series]
    k = max(1, round(fraction * len(values)))
    return statistics.fmean(values[:k] if first else values[-k:])


def lm_tables_and_figures() -> str:
    runs = _lm_runs()
    if not any(runs.values()):
        return "(no language-model runs found)"
    meta = load_json("lm_meta.json") if os.path.exists(os.path.join(RESULTS_DIR, "lm_meta.json")) else {}
    lines = [
        "| (beta1, beta2) | seeds | train entropy, first 20% of steps | train entropy, last 20% | "
        "train reward, first 20% | train reward, last 20% | held-out entropy end | held-out sampled acc. end | "
        "held-out greedy acc. end | beta1 / beta2 token % | seconds / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for betas in GRID:
        rs = runs[betas]
        if not rs:
            continue
        b1 = statistics.fmean(_window(r["series"]["cegppo/beta1_token_frac"], True, 1.0) for r in rs)
        b2 = statistics.fmean(_window(r["series"]["cegppo/beta2_token_frac"], True, 1.0) for r in rs)
        lines.append(
            f"| {LABELS[betas]} | {len(rs)} | {fmt([_window(r['series']['entropy'], True) for r in rs])} | "
            f"{fmt([_window(r['series']['entropy'], False) for r in rs])} | "
            f"{fmt([_window(r['series']['reward'], True) for r in rs])} | "
            f"{fmt([_window(r['series']['reward'], False) for r in rs])} | "
            f"{fmt([r['end_entropy'] for r in rs])} | {fmt([r['end_accuracy'] for r in rs])} | "
            f"{fmt([r['end_greedy_accuracy'] for r in rs])} | {100 * b1:.2f} / {100 * b2:.2f} | "
            f"{statistics.fmean(r['seconds'] for r in rs):.0f} |"
        )
    every = [r for rs in runs.values() for r in rs]
    lines += [
        "",
        f"Start (one warm start shared by every run; the held-out sample differs by seed): held-out entropy "
        f"{fmt([r['start_entropy'] for r in every])}, sampled accuracy "
        f"{fmt([r['start_accuracy'] for r in every])}, greedy accuracy "
        f"{fmt([r['start_greedy_accuracy'] for r in every])} (first {meta.get('eval_rows', '?')} problems of "
        "builtin:arithmetic_eval, temperature 1).",
        "",
    ]

    lines += _lm_comparisons(runs)
    _lm_figures(runs)
    return "\n".join(lines)


def _lm_comparisons(runs: dict) -> list[str]:
    """Per-seed ordering of the late training entropy."""
    late = {b: [_window(r["series"]["entropy"], False) for r in runs[b]] for b in GRID}
    n = min(len(v) for v in late.values())
    if not n:
        return []
    comparisons = [
        ("(0.5, 1) > (1, 1): larger beta1 lowers H", (0.5, 1.0), (1.0, 1.0)),
        ("(1, 1) > (1, 0.5): larger beta2 keeps H higher", (1.0, 1.0), (1.0, 0.5)),
        ("(0, 1) > (0, 0): larger beta2 keeps H higher", (0.0, 1.0), (0.0, 0.0)),
        ("(0.5, 1) > (0, 0): paper setting above GRPO", (0.5, 1.0), (0.0, 0.0)),
        ("every CE-GPPO setting > (0, 0): GRPO lowest", None, (0.0, 0.0)),
    ]
    lines = ["| comparison of the training entropy over the last 20% of steps | seeds where it holds |", "|---|---|"]
    for text, hi, lo in comparisons:
        if hi is None:
            wins = sum(all(late[b][s] > late[lo][s] for b in GRID if b != lo) for s in range(n))
        else:
            wins = sum(late[hi][s] > late[lo][s] for s in range(n))
        lines.append(f"| {text} | {wins} / {n} |")
    return lines + [""]


def _lm_figures(runs: dict) -> None:
    def panel(metric, smooth=5):
        def draw(ax):
            for b in GRID:
                rs = runs[b]
                if not rs:
                    continue
                length = min(len(r["series"][metric]) for r in rs)
                xs = [s for s, _ in rs[0]["series"][metric][:length]]
                curves = []
                for r in rs:
                    values = [v for _, v in r["series"][metric][:length]]
                    curves.append([statistics.fmean(values[max(0, i - smooth + 1) : i + 1]) for i in range(length)])
                _band(ax, xs, curves, b)

        return draw

    panels = [(f"{m} (moving mean of 5 steps)", panel(m)) for m in LM_SERIES[:7]]
    seeds = min(len(rs) for rs in runs.values())
    _figure(
        panels,
        os.path.join(FIGURES_DIR, "entropy_tiny_lm.png"),
        f"Tiny arithmetic LM: CE-GPPO (beta1, beta2), mean ± std over {seeds} seeds",
    )
    quadrant_panels = [(f"{m} (moving mean of 5)", panel(m)) for m in LM_SERIES[7:]]
    _figure(
        quadrant_panels,
        os.path.join(FIGURES_DIR, "entropy_tiny_lm_quadrants.png"),
        "Tiny LM: low-probability token quadrants (pi < 0.5)",
    )


def run_report_part() -> None:
    sections = []
    if os.path.exists(os.path.join(RESULTS_DIR, "toy.json")):
        sections.append("### Toy\n\n" + toy_tables_and_figures())
    if os.path.isdir(os.path.join(RESULTS_DIR, "lm_runs")):
        sections.append("### Tiny language model\n\n" + lm_tables_and_figures())
    text = "\n\n".join(sections) + "\n"
    path = os.path.join(RESULTS_DIR, "tables.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {os.path.relpath(path, REPO)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("toy", "lm", "report", "all"), default="all")
    parser.add_argument("--toy-seeds", type=int, default=5)
    parser.add_argument("--lm-seeds", type=int, default=3)
    parser.add_argument("--lm-steps", type=int, default=100)
    parser.add_argument("--lm-eval-rows", type=int, default=150, help="held-out problems evaluated per run")
    parser.add_argument("--sft-steps", type=int, default=800)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for the LM part (docs/entropy_results.md)"
    )
    parser.add_argument("--work-dir", default=os.path.join(REPO, "outputs", "entropy_exp"))
    args = parser.parse_args(argv)
    if args.part in ("toy", "all"):
        run_toy_part(args.toy_seeds)
    if args.part in ("lm", "all"):
        run_lm_part(args.lm_seeds, args.lm_steps, args.work_dir, args.threads, args.lm_eval_rows, args.sft_steps)
    if args.part in ("report", "all"):
        run_report_part()
    return 0


if __name__ == "__main__":
    sys.exit(main())
