"""Plot the training logs of one or more CE-GPPO / GRPO runs side by side.

`load_log_history(path)` reads a run's `log_history` (from a run directory, a checkpoint directory or a
`trainer_state.json`), and `plot_log_histories({label: history, ...}, "plot.png")` draws one panel per metric with the
runs overlaid against the optimizer step. The console command is

    cegppo-plot RUN [RUN ...] --out plot.png [--metrics reward entropy ...] [--labels a b ...] [--title T]

Only matplotlib's non-interactive Agg backend is used, so this works on a headless machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
from collections.abc import Sequence


QUADRANT_METRICS = tuple(
    f"cegppo/quadrant/{quadrant}/{stat}"
    for stat in ("token_frac", "grad_share", "clip_frac", "restored_grad_share")
    for quadrant in ("pos_high", "pos_low", "neg_high", "neg_low")
)
DEFAULT_METRICS = (
    "reward",
    "entropy",
    "clip_ratio/region_mean",
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
) + QUADRANT_METRICS

_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)$")


def _find_trainer_state(path: str) -> str:
    """The `trainer_state.json` that `path` designates (the file, its directory, or the run's latest checkpoint)."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is neither a trainer_state.json nor a run / checkpoint directory.")
    direct = os.path.join(path, "trainer_state.json")
    if os.path.isfile(direct):
        return direct
    checkpoints = []
    for candidate in glob.glob(os.path.join(path, "checkpoint-*")):
        match = _CHECKPOINT_RE.search(candidate)
        if match and os.path.isfile(os.path.join(candidate, "trainer_state.json")):
            checkpoints.append((int(match.group(1)), candidate))
    if not checkpoints:
        raise FileNotFoundError(
            f"No trainer_state.json in {path!r} or in any checkpoint-* below it. Pass a run directory saved by the "
            "Trainer (trainer.save_state() writes it), a checkpoint directory, or the json file itself."
        )
    return os.path.join(max(checkpoints)[1], "trainer_state.json")


def load_log_history(path: str | os.PathLike) -> list[dict]:
    """Return the `log_history` list of a run.

    `path` may be a `trainer_state.json`, a checkpoint directory containing one, or a run directory (its own
    `trainer_state.json` if it has one, else the one of its highest-numbered `checkpoint-*`). A json file holding a
    bare list (an already extracted log history) or a dict with `log_history` is accepted too.
    """
    state_path = _find_trainer_state(os.fspath(path))
    with open(state_path) as f:
        state = json.load(f)
    if isinstance(state, list):
        return state
    if isinstance(state, dict) and isinstance(state.get("log_history"), list):
        return state["log_history"]
    raise ValueError(f"{state_path!r} has no `log_history` list.")


def _series(history: Sequence[dict], metric: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `metric` in `history`, skipping entries without it or with a non-finite value."""
    steps, values = [], []
    for index, entry in enumerate(history):
        if metric not in entry:
            continue
        value = entry[metric]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(entry.get("step", index))
        values.append(float(value))
    return steps, values


def style_panel(ax, title: str) -> None:
    """The look of every panel of a runs-over-steps figure (also used by `experiments/`)."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def plot_log_histories(
    histories: dict[str, list[dict]],
    path: str | os.PathLike,
    metrics: Sequence[str] | None = None,
    title: str | None = None,
) -> str:
    """Draw a PNG grid with one panel per metric and every run overlaid (x = optimizer step); return the path.

    `metrics=None` uses `DEFAULT_METRICS` (reward, entropy, clip_ratio/region_mean, the beta1 / beta2 token fractions
    and the quadrant metrics). Metrics that no run logged are skipped; if none is left a ValueError names what the
    runs did log.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    if not histories:
        raise ValueError("plot_log_histories needs at least one run.")
    wanted = list(DEFAULT_METRICS if metrics is None else metrics)
    present = [m for m in wanted if any(_series(h, m)[0] for h in histories.values())]
    if not present:
        logged = sorted({k for h in histories.values() for e in h for k in e if not isinstance(e[k], (str, bool))})
        raise ValueError(f"None of the metrics {wanted} was logged by any run. Logged metrics: {logged}")

    ncols = min(3, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    colors = {label: cycle[i % len(cycle)] for i, label in enumerate(histories)}  # same colour in every panel
    legend = {}
    for ax, metric in zip(axes.flat, present):
        for label, history in histories.items():
            steps, values = _series(history, metric)
            if steps:
                (line,) = ax.plot(
                    steps,
                    values,
                    label=label,
                    color=colors[label],
                    linewidth=1.2,
                    marker="." if len(steps) < 30 else None,
                )
                legend.setdefault(label, line)
        style_panel(ax, metric)
    for ax in list(axes.flat)[len(present) :]:
        ax.set_visible(False)
    fig.tight_layout()
    if legend:
        labels = [label for label in histories if label in legend]
        handles = [legend[label] for label in labels]
        fig.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=min(len(labels), 5),
            fontsize=8,
            frameon=False,
        )
    if title:
        fig.suptitle(title, y=1.02, fontsize=11)

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


#: Colours of the demo's figures: one per toy setting, and CE-GPPO / GRPO in the LM figure.
SETTING_COLORS = {
    (0.0, 0.0): "black",
    (1.0, 0.5): "tab:red",
    (0.5, 1.0): "tab:blue",
    (0.0, 1.0): "tab:green",
    (1.0, 1.0): "tab:purple",
}
RUN_COLORS = {"cegppo": "tab:blue", "grpo": "black"}


def _figure(nrows: int, ncols: int, width: float = 4.6, height: float = 3.4):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return plt, fig, list(axes.flat)


def _save(plt, fig, path: str | os.PathLike, title: str | None) -> str:
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_toy_grid(runs: Sequence[dict], path: str | os.PathLike, title: str | None = None) -> str:
    """The demo's toy figure from `toy.summarize_toy_run` results: entropy over RL steps per (beta1, beta2) (mean over
    seeds, thin lines per seed), the first-order predicted against the measured entropy change of every RL step, and
    the entropy change carried by each set of tokens (mean over seeds, one dot per seed)."""
    plt, fig, (curves, scatter, bars) = _figure(1, 3)
    settings = list(dict.fromkeys((r["beta1"], r["beta2"]) for r in runs))
    for index, setting in enumerate(settings):
        rs = [r for r in runs if (r["beta1"], r["beta2"]) == setting]
        color, label = SETTING_COLORS.get(setting, f"C{index}"), f"({setting[0]:g}, {setting[1]:g})"
        mean = [sum(values) / len(values) for values in zip(*(r["entropy"] for r in rs))]
        for r in rs:
            curves.plot(r["entropy"], color=color, linewidth=0.5, alpha=0.35)
        curves.plot(mean, color=color, linewidth=2, label=label)
        predicted = [v for r in rs for v in r["predicted_dH"]]
        scatter.scatter(predicted, [v for r in rs for v in r["measured_dH"]], s=4, color=color, alpha=0.5)
        for offset, key in zip((-0.25, 0.0, 0.25), ("dH_beta1", "dH_beta2", "dH_unclipped")):
            values = [r[key] for r in rs]
            bars.bar(index + offset, sum(values) / len(values), width=0.24, color=color,
                     alpha={"dH_beta1": 1.0, "dH_beta2": 0.6, "dH_unclipped": 0.25}[key])  # fmt: skip
            bars.scatter([index + offset] * len(values), values, s=6, color="grey", zorder=3)
    style_panel(curves, "entropy (nats), mean over seeds (thin: each seed)")
    curves.legend(title="(beta1, beta2)", fontsize=7, title_fontsize=7)
    low, high = scatter.get_xlim()
    scatter.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--", label="measured = predicted")
    style_panel(scatter, "entropy change of each RL step")
    scatter.set_xlabel("first-order prediction, sum of -eta*F*A*s_a", fontsize=8)
    scatter.set_ylabel("measured", fontsize=8)
    scatter.legend(fontsize=7)
    style_panel(bars, "entropy change carried by each set, summed over a run")
    bars.axhline(0, color="grey", linewidth=0.8)
    bars.set_xticks(range(len(settings)), [f"({b1:g}, {b2:g})" for b1, b2 in settings], fontsize=7)
    bars.set_xlabel("(beta1, beta2); bars: beta1 set, beta2 set, unclipped tokens", fontsize=8)
    return _save(plt, fig, path, title)


def plot_paired_runs(
    pairs: Sequence[dict], differences: dict, path: str | os.PathLike, title: str | None = None
) -> str:
    """The demo's LM figure: training entropy and reward over the steps of CE-GPPO and GRPO (thin: each seed; thick:
    the mean), and the held-out CE-GPPO - GRPO differences of accuracy and entropy (one dot per seed, the mean with
    +- std and the 95% interval)."""
    plt, fig, axes = _figure(2, 2)
    for ax, metric in zip(axes[:2], ("entropy", "reward")):
        for name, color in RUN_COLORS.items():
            series = [_series(p[name]["log_history"], metric) for p in pairs]
            for steps, values in series:
                ax.plot(steps, values, color=color, linewidth=0.6, alpha=0.4)
            common = min(len(values) for _, values in series)
            if common:
                mean = [sum(values[i] for _, values in series) / len(series) for i in range(common)]
                ax.plot(series[0][0][:common], mean, color=color, linewidth=2, label=pairs[0][name]["label"],
                        marker="o" if common < 30 else None)  # fmt: skip
        style_panel(ax, f"training {metric} (thin: each seed; thick: mean)")
        ax.legend(fontsize=7)
    for ax, metric in zip(axes[2:], ("accuracy", "entropy")):
        diff = differences[metric]
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.scatter(range(diff["n"]), diff["values"], color="tab:blue", zorder=3, label="one paired seed")
        ax.errorbar([diff["n"] + 0.5], [diff["mean"]], yerr=[diff["std"]], fmt="o", color="black", capsize=5,
                    label="mean +- std")  # fmt: skip
        if diff["low"] is not None:
            ax.plot([diff["n"] + 1] * 2, [diff["low"], diff["high"]], color="tab:red", linewidth=3,
                    label="95% interval of the mean")  # fmt: skip
        ax.set_xticks(range(diff["n"]), [str(p["seed"]) for p in pairs], fontsize=7)
        style_panel(ax, f"held-out {metric} after training, CE-GPPO - GRPO")
        ax.set_xlabel("seed", fontsize=8)
        ax.legend(fontsize=7)
    return _save(plt, fig, path, title)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cegppo-plot",
        description="Plot reward, entropy, clip ratio and CE-GPPO token metrics of one or more runs (x = step).",
    )
    parser.add_argument("runs", nargs="+", help="run directories, checkpoint directories or trainer_state.json files")
    parser.add_argument("--out", required=True, help="output PNG path")
    parser.add_argument("--metrics", nargs="+", default=None, help="metrics to plot (default: reward, entropy, ...)")
    parser.add_argument("--labels", nargs="+", default=None, help="one legend label per run (default: run paths)")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args(argv)

    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels got {len(args.labels)} labels for {len(args.runs)} runs.")
    labels = args.labels or [os.path.normpath(run) for run in args.runs]
    if len(set(labels)) != len(labels):
        parser.error(f"labels must be distinct, got {labels}.")
    try:
        histories = {label: load_log_history(run) for label, run in zip(labels, args.runs)}
        out = plot_log_histories(histories, args.out, metrics=args.metrics, title=args.title)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(2, f"cegppo-plot: error: {error}\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
