"""Figures of training runs (`cegppo-plot`) and of the demo, with matplotlib's headless Agg backend.

    cegppo-plot RUN [RUN ...] --out plot.png [--metrics reward entropy ...] [--labels a b ...] [--title T]

draws one panel per metric with the runs overlaid against the optimizer step; a RUN is a run directory (its own
``trainer_state.json``, else its latest ``checkpoint-N``'s), a checkpoint directory or a json file.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from ..figures import panels, save_figure, style_panel


QUADRANT_METRICS = tuple(
    f"cegppo/quadrant/{quadrant}/{stat}"
    for stat in ("token_frac", "grad_share", "clip_frac", "restored_grad_share")
    for quadrant in ("pos_high", "pos_low", "neg_high", "neg_low")
)
DEFAULT_METRICS = ("reward", "entropy", "clip_ratio/region_mean", "cegppo/beta1_token_frac", "cegppo/beta2_token_frac")
DEFAULT_METRICS += QUADRANT_METRICS
#: The demo's colours: one per toy setting, and CE-GPPO / GRPO in the LM figure.
SETTING_COLORS = {(0.0, 0.0): "black", (1.0, 0.5): "tab:red", (0.5, 1.0): "tab:blue", (0.0, 1.0): "tab:green",
                  (1.0, 1.0): "tab:purple"}  # fmt: skip


def load_log_history(path: str | os.PathLike) -> list[dict]:
    """The `log_history` of a run directory, a checkpoint directory, a ``trainer_state.json`` or a json file holding
    the list itself."""
    from transformers.trainer_utils import get_last_checkpoint

    path = os.fspath(path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "trainer_state.json")):
        path = get_last_checkpoint(path) or path
    if os.path.isdir(path):
        path = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} does not exist: pass a run or checkpoint directory or a trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    history = state.get("log_history") if isinstance(state, dict) else state
    if not isinstance(history, list):
        raise ValueError(f"{path!r} has no `log_history` list.")
    return history


def _series(history, metric: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `metric`, skipping entries without it or with a non-numeric or non-finite value."""
    points = [(e.get("step", i), float(e[metric])) for i, e in enumerate(history) if _number(e.get(metric))]
    return [s for s, _ in points], [v for _, v in points]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot_log_histories(histories: dict[str, list[dict]], path, metrics=None, title: str | None = None) -> str:
    """One panel per metric (default `DEFAULT_METRICS`) with every run overlaid; metrics no run logged are skipped
    (none left: a ValueError naming what the runs logged). Returns the PNG's path."""
    if not histories:
        raise ValueError("plot_log_histories needs at least one run.")
    wanted = list(DEFAULT_METRICS if metrics is None else metrics)
    present = [m for m in wanted if any(_series(h, m)[0] for h in histories.values())]
    if not present:
        logged = sorted({k for h in histories.values() for e in h for k, v in e.items() if _number(v)})
        raise ValueError(f"None of the metrics {wanted} was logged by any run. Logged metrics: {logged}")
    fig, axes = panels(len(present))
    for ax, metric in zip(axes, present):
        for index, (label, history) in enumerate(histories.items()):  # the same colour in every panel
            steps, values = _series(history, metric)
            ax.plot(
                steps, values, label=label, color=f"C{index}", linewidth=1.2, marker="." if len(steps) < 30 else None
            )
        style_panel(ax, metric)
    fig.tight_layout()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(labels), 5), fontsize=8,
               frameon=False)  # fmt: skip
    return save_figure(fig, path, title)


def plot_toy_grid(runs, path, title: str | None = None) -> str:
    """The demo's toy figure (`toy.summarize_toy_run` results): entropy over RL steps per (beta1, beta2) (thin: each
    seed), the first-order predicted against the measured entropy change of every RL step, and the change carried by
    each set of tokens (bars: mean over seeds, dots: each seed)."""
    fig, (curves, scatter, bars) = panels(3, width=4.6, height=3.4)
    settings = list(dict.fromkeys((r["beta1"], r["beta2"]) for r in runs))
    for index, setting in enumerate(settings):
        rs = [r for r in runs if (r["beta1"], r["beta2"]) == setting]
        color = SETTING_COLORS.get(setting, f"C{index}")
        for r in rs:
            curves.plot(r["entropy"], color=color, linewidth=0.5, alpha=0.35)
        mean = [sum(values) / len(values) for values in zip(*(r["entropy"] for r in rs))]
        curves.plot(mean, color=color, linewidth=2, label=f"({setting[0]:g}, {setting[1]:g})")
        predicted, measured = [v for r in rs for v in r["predicted_dH"]], [v for r in rs for v in r["measured_dH"]]
        scatter.scatter(predicted, measured, s=4, color=color, alpha=0.5)
        for offset, key, alpha in ((-0.25, "dH_beta1", 1.0), (0.0, "dH_beta2", 0.6), (0.25, "dH_unclipped", 0.25)):
            values = [r[key] for r in rs]
            bars.bar(index + offset, sum(values) / len(values), width=0.24, color=color, alpha=alpha)
            bars.scatter([index + offset] * len(values), values, s=6, color="grey", zorder=3)
    style_panel(curves, "entropy (nats), mean over seeds (thin: each seed)")
    curves.legend(title="(beta1, beta2)", fontsize=7, title_fontsize=7)
    low, high = scatter.get_xlim()
    scatter.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--", label="measured = predicted")
    style_panel(scatter, "entropy change of each RL step", "first-order prediction, sum of -eta*F*A*s_a")
    scatter.set_ylabel("measured", fontsize=8)
    scatter.legend(fontsize=7)
    style_panel(bars, "entropy change carried by each set, summed over a run",
                "(beta1, beta2); bars: beta1 set, beta2 set, unclipped tokens")  # fmt: skip
    bars.axhline(0, color="grey", linewidth=0.8)
    bars.set_xticks(range(len(settings)), [f"({b1:g}, {b2:g})" for b1, b2 in settings], fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, title)


def main(argv=None) -> int:
    """Console entry point `cegppo-plot`."""
    parser = argparse.ArgumentParser(
        prog="cegppo-plot",
        description="Plot reward, entropy, clip ratio and CE-GPPO token metrics of runs (x = step).",
    )
    parser.add_argument("runs", nargs="+", help="run directories, checkpoint directories or trainer_state.json files")
    parser.add_argument("--out", required=True, help="output PNG path")
    parser.add_argument("--metrics", nargs="+", help="metrics to plot (default: reward, entropy, ...)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: run paths)")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    from ..run_checks import first_problem

    problem = first_problem(extras=[("matplotlib", "plot", "cegppo-plot")], writable=[(args.out, "--out", False)])
    if problem:
        parser.exit(2, f"cegppo-plot: error: {problem}\n")
    labels = args.labels or [os.path.normpath(run) for run in args.runs]
    if len(labels) != len(args.runs) or len(set(labels)) != len(labels):
        parser.error(f"--labels needs one distinct label per run: got {labels} for {len(args.runs)} runs.")
    try:
        histories = {label: load_log_history(run) for label, run in zip(labels, args.runs)}
        print(f"wrote {plot_log_histories(histories, args.out, metrics=args.metrics, title=args.title)}")
    except (FileNotFoundError, ValueError) as error:
        parser.exit(2, f"cegppo-plot: error: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
