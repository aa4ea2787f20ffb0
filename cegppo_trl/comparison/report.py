"""The report of `cegppo-compare`, from the run folders alone (so runs trained elsewhere, copied back, are compared
the same way): each model's `cegppo-eval` report (per problem its correct count), each run's ``trainer_state.json``
(its training log) and ``comparison.json`` (the settings). Pure Python but the figure.

Every held-out difference is paired per problem (the same problems, sampled with the same seed): its standard error
is over problems. Between arms, each arm is compared with the reference arm (the first of --arms) seed by seed, then
over seeds: mean, spread and standard error over seeds, and `verdict`'s rule (docs/comparison.md). Which pair of arms
tests which claim of a paper is the study's business (experiments/study_claims.py), not the library's.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any


#: Means over a run's training log (TRL's `reward`, `entropy`; CE-GPPO's clipped sets).
TRAINING_METRICS = {"train_reward": "reward", "train_entropy": "entropy", "beta1_set": "cegppo/beta1_token_frac",
                    "beta2_set": "cegppo/beta2_token_frac"}  # fmt: skip


# --------------------------------------------------------------------------------------------------- reading
def measurement(path: Path) -> dict[str, Any] | None:
    """A finished `cegppo-eval` report as per-problem avg (the share of its samples right) and pass (any right),
    over every data set in order; None if not finished."""
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    if report.get("pending", [None]):
        return None
    avg, best, ks = [], [], []
    for metrics in report["datasets"].values():
        k = metrics["k"]
        ks.append(k)
        avg += [p["num_correct"] / k for p in metrics["problems"]]
        best += [float(p["num_correct"] > 0) for p in metrics["problems"]]
    return {"k": ks[0] if len(set(ks)) == 1 else "set's", "avg": avg, "pass": best, "sets": list(report["datasets"])}


def load(out: Path) -> tuple[dict, dict | None, list[dict]]:
    """(settings, the start's measurements or None, the finished runs in --arms then --seeds order) of a comparison
    folder."""
    settings = json.loads((out / "comparison.json").read_text())
    protocols = settings["shaping"]["protocols"]
    start = {p: measurement(out / "start" / f"eval-{p}.json") for p in protocols}
    runs = []
    for arm in settings["arms"]:
        for seed in settings["seeds"]:
            folder = out / "runs" / f"{arm}-seed{seed}"
            state, described = folder / "trainer_state.json", folder / "compare_run.json"
            if not (state.is_file() and described.is_file()):
                continue
            grades = {p: measurement(folder / f"eval-{p}.json") for p in protocols}
            if None in grades.values():
                continue
            history = json.loads(state.read_text())["log_history"]
            runs.append({**json.loads(described.read_text()), "grades": grades, "log_history": history,
                         "train_runtime": next((e["train_runtime"] for e in history if "train_runtime" in e), None),
                         "process_seconds": _seconds(folder / "engine_time.json")})  # fmt: skip
    return settings, (None if None in start.values() else start), runs


def _seconds(path: Path) -> float | None:
    return json.loads(path.read_text())["process_seconds"] if path.is_file() else None


# --------------------------------------------------------------------------------------------------- statistics
def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def se(values: list[float]) -> float:
    """Standard error of the mean (NaN for fewer than 2 values, or any value not finite)."""
    if len(values) < 2 or not all(map(finite, values)):
        return float("nan")
    return statistics.stdev(values) / math.sqrt(len(values))


def paired(after: list[float], before: list[float]) -> tuple[float, float]:
    """(mean, standard error over problems) of `after - before`, problem by problem."""
    diffs = [x - y for x, y in zip(after, before, strict=True)]
    return statistics.fmean(diffs), se(diffs)


def series(history: list[dict], metric: str) -> list[tuple[int, float]]:
    """(step, value) of `metric`; a token metric only over the steps that trained on something: with dynamic
    sampling a step whose batch kept no group logs 0 for TRL's token means, which is not a measurement."""
    trained_only = metric != "reward"
    return [(e["step"], float(e[metric])) for e in history if "step" in e and finite(e.get(metric))
            and not (trained_only and e.get("cegppo/batch_fill", 1) == 0)]  # fmt: skip


def run_mean(history: list[dict], metric: str) -> float:
    values = [v for _, v in series(history, metric)]
    return statistics.fmean(values) if values else float("nan")


def verdict(diffs: list[float], direction: int = 1) -> str:
    """The rule docs/comparison.md fixed before the study ran: ``yes`` when every seed's difference has the claimed
    sign (`direction`) and the mean is at least 2 standard errors over seeds from 0; ``no`` when every seed's has the
    other sign with the same margin; else ``inside the noise`` (always with fewer than 2 seeds)."""
    if len(diffs) < 2 or not all(map(finite, diffs)):
        return "inside the noise"
    mean, err = statistics.fmean(diffs) * direction, se(diffs)
    signed = [d * direction for d in diffs]
    if all(d > 0 for d in signed) and mean >= 2 * err:
        return "yes"
    if all(d < 0 for d in signed) and -mean >= 2 * err:
        return "no"
    return "inside the noise"


def direction(diffs: list[float]) -> str:
    """``above`` / ``below`` / ``inside the noise``: `verdict`'s rule read without a claim."""
    return {"yes": "above", "no": "below"}.get(verdict(diffs), "inside the noise")


def spread(values: list[float]) -> dict[str, Any]:
    """The values, their mean, spread (standard deviation) and standard error over seeds (NaN where not finite)."""
    if not values or not all(map(finite, values)):
        return {"values": values, "mean": float("nan"), "spread": float("nan"), "se": float("nan")}
    return {"values": values, "mean": statistics.fmean(values),
            "spread": statistics.stdev(values) if len(values) > 1 else 0.0, "se": se(values)}  # fmt: skip


def summarize(start: dict, runs: list[dict], protocols: list[str]) -> dict[str, Any]:
    """Per run (each against the start, paired), per arm over seeds, and each arm minus the reference arm (the
    first run's) seed by seed and over seeds."""
    per_run = {}
    for r in runs:
        row = {"arm": r["arm"], "label": r["label"], "seed": r["seed"],
               **{key: run_mean(r["log_history"], m) for key, m in TRAINING_METRICS.items()}}  # fmt: skip
        for p in protocols:
            g, s = r["grades"][p], start[p]
            row[p] = {w: statistics.fmean(g[w]) for w in ("avg", "pass")}
            row[p].update({f"{w}_se": se(g[w]) for w in ("avg", "pass")})
            row[p].update({f"{w}_vs_start": paired(g[w], s[w]) for w in ("avg", "pass")})
        per_run[r["name"]] = row
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rows = [per_run[r["name"]] for r in runs if r["arm"] == arm]
        arms[arm] = {"label": rows[0]["label"], "seeds": [x["seed"] for x in rows]}
        arms[arm].update({key: spread([x[key] for x in rows]) for key in TRAINING_METRICS})
        for p in protocols:
            arms[arm][p] = {w: spread([x[p][w] for x in rows]) for w in ("avg", "pass")}
            arms[arm][p]["avg_vs_start"] = spread([x[p]["avg_vs_start"][0] for x in rows])
    reference = runs[0]["arm"] if runs else None
    by_seed = {(r["arm"], r["seed"]): r for r in runs}
    versus = {}
    for arm in arms:
        seeds = [s for s in arms[arm]["seeds"] if (reference, s) in by_seed]
        if arm == reference or not seeds:
            continue
        per_seed = []
        for seed in seeds:
            mine, ref = by_seed[(arm, seed)], by_seed[(reference, seed)]
            entry = {"seed": seed, "train_entropy": per_run[mine["name"]]["train_entropy"]
                     - per_run[ref["name"]]["train_entropy"]}  # fmt: skip
            for p in protocols:
                entry[p] = {w: paired(mine["grades"][p][w], ref["grades"][p][w]) for w in ("avg", "pass")}
            per_seed.append(entry)
        over = {"train_entropy": spread([e["train_entropy"] for e in per_seed])}
        over.update({p: {w: spread([e[p][w][0] for e in per_seed]) for w in ("avg", "pass")} for p in protocols})
        versus[arm] = {"per_seed": per_seed, "over_seeds": over}
    return {"reference": reference, "per_run": per_run, "arms": arms, "versus": versus}


# --------------------------------------------------------------------------------------------------- text
def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _pm(mean: float, err: float, scale: float = 100.0, digits: int = 1, sign: str = "+") -> str:
    """`mean +- se`, or the mean alone where there is no spread to show (one seed)."""
    text = f"{scale * mean:{sign}.{digits}f}"
    return text if math.isnan(err) else f"{text} +- {scale * err:.{digits}f}"


def describe(settings: dict[str, Any]) -> str:
    t, s = settings["training"], settings["shaping"]
    held_out = f"--preset {s['eval_preset']}" if s["eval_preset"] else ", ".join(f"`{d}`" for d in s["eval_datasets"])
    first = "" if s["eval_problems"] is None else f"the first {s['eval_problems']} problems of "
    return (f"Held-out: {first}{held_out}, k = {s['eval_k']}, graded `{'`, `'.join(s['protocols'])}`; +- one "
            "standard error over problems; differences paired per problem. Training (`cegppo-train`): "
            f"{t['model']}, {t['max_steps']} optimizer steps, {t['per_device_train_batch_size']} completions per device "
            f"and step in groups of {t['num_generations']}, {t['steps_per_generation']} steps per generation batch, "
            f"learning rate {t['learning_rate']:g}, temperature {t['temperature']:g}, {t['max_completion_length']} "
            f"new tokens{', LoRA' if t['use_peft'] else ''}.")  # fmt: skip


def markdown(settings: dict[str, Any], start: dict, runs: list[dict], summary: dict[str, Any]) -> str:
    """The table of a comparison: the start, every run, every arm over seeds, and each arm minus the reference."""
    protocols = settings["shaping"]["protocols"]
    main, k = protocols[0], start[protocols[0]]["k"]
    lines = [describe(settings), "",
             f"| model | avg@{k} % | pass@{k} % | avg@{k} vs start (pp) | " + "".join(f"avg@{k} `{p}` % | " for p in
             protocols[1:]) + "training entropy | training reward | beta1 set % | beta2 set % |",
             "|---|" + "---|" * (7 + len(protocols) - 1),
             f"| start | {_pct(statistics.fmean(start[main]['avg']))} | {_pct(statistics.fmean(start[main]['pass']))} "
             "| | " + "".join(f"{_pct(statistics.fmean(start[p]['avg']))} | " for p in protocols[1:]) + "| | | |"]  # fmt: skip
    for r in runs:
        row = summary["per_run"][r["name"]]
        m = row[main]
        lines.append(
            f"| {row['label']} seed {row['seed']} | {_pct(m['avg'])} +- {_pct(m['avg_se'])} | {_pct(m['pass'])} +- "
            f"{_pct(m['pass_se'])} | {_pm(*m['avg_vs_start'])} | " + "".join(f"{_pct(row[p]['avg'])} | " for p in
            protocols[1:]) + f"{row['train_entropy']:.3f} | {row['train_reward']:+.3f} | {_pct(row['beta1_set'])} | "
            f"{_pct(row['beta2_set'])} |"
        )  # fmt: skip
    lines += ["", f"Over seeds (mean +- standard error over seeds; `{main}` grading):", "",
              f"| arm | seeds | avg@{k} % | pass@{k} % | avg@{k} vs start (pp) | training entropy | beta1 set % | "
              "beta2 set % |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in summary["arms"].values():
        m = arm[main]
        lines.append(
            f"| {arm['label']} | {len(arm['seeds'])} | {_pm(m['avg']['mean'], m['avg']['se'], sign='')} | "
            f"{_pm(m['pass']['mean'], m['pass']['se'], sign='')} | {_pm(m['avg_vs_start']['mean'], m['avg_vs_start']['se'])} | "
            f"{_pm(arm['train_entropy']['mean'], arm['train_entropy']['se'], 1.0, 3, '')} | "
            f"{_pct(arm['beta1_set']['mean'])} | {_pct(arm['beta2_set']['mean'])} |"
        )  # fmt: skip
    return "\n".join(lines + _versus_rows(summary, protocols, k)) + "\n"


def _versus_rows(summary: dict[str, Any], protocols: list[str], k) -> list[str]:
    """Each arm minus the reference: mean +- standard error over seeds, with `direction`'s word."""
    if not summary["versus"]:
        return []
    main, reference = protocols[0], summary["arms"][summary["reference"]]["label"]
    lines = ["", f"Each arm minus {reference}, seed by seed, paired (held-out per problem): mean +- standard "
             "error over seeds, and where every seed agrees by 2 standard errors (docs/comparison.md):", "",
             "| arm | " + "".join(f"avg@{k} `{p}` (pp) | " for p in protocols) + f"pass@{k} `{main}` (pp) | "
             "training entropy |", "|---|" + "---|" * (len(protocols) + 2)]  # fmt: skip
    for arm, v in summary["versus"].items():
        o, per_seed = v["over_seeds"], v["per_seed"]
        cells = [f"{_pm(o[p]['avg']['mean'], o[p]['avg']['se'])} ({direction(o[p]['avg']['values'])})"
                 for p in protocols]  # fmt: skip
        cells.append(f"{_pm(o[main]['pass']['mean'], o[main]['pass']['se'])} ({direction(o[main]['pass']['values'])})")
        te = o["train_entropy"]
        cells.append(f"{_pm(te['mean'], te['se'], 1.0, 3)} ({direction([e['train_entropy'] for e in per_seed])})")
        lines.append(f"| {summary['arms'][arm]['label']} | " + " | ".join(cells) + " |")
    return lines


def time_report(runs: list[dict]) -> str:
    """Per run: the training command's wall time beside the trainer's own (`train_runtime`); the difference is
    what starting the processes, the imports, loading and saving cost."""
    timed = [r for r in runs if r["process_seconds"] is not None and r["train_runtime"] is not None]
    if not timed:
        return "Time: not recorded here (runs launched elsewhere)."
    parts = [f"{r['name']} {r['process_seconds']:.0f} s ({r['train_runtime']:.0f} s training)" for r in timed]
    overhead = statistics.fmean(r["process_seconds"] - r["train_runtime"] for r in timed)
    return (
        f"Time per training command (wall, of which the trainer's train_runtime): {', '.join(parts)}; outside "
        f"training (process start, imports, model load and save) {overhead:.1f} s per run on average."
    )


# --------------------------------------------------------------------------------------------------- figure
def figure(settings: dict[str, Any], start: dict, runs: list[dict], path) -> str:
    """Curves of every arm (thin: each seed; thick: the mean over seeds): training reward, entropy and the beta1 /
    beta2 sets' token shares; held-out avg@k and pass@k from the start to the end."""
    from ..figures import panels, save_figure, style_panel

    main, steps = settings["shaping"]["protocols"][0], settings["training"]["max_steps"]
    names = ("training reward", "held-out avg@k", "held-out pass@k", "training entropy (nats)",
             "beta1 set (share of tokens)", "beta2 set (share of tokens)")  # fmt: skip
    fig, axes = panels(6, ncols=3, width=4.2, height=3.0)
    for index, arm in enumerate(dict.fromkeys(r["arm"] for r in runs)):
        mine = [r for r in runs if r["arm"] == arm]
        color, label = f"C{index}", mine[0]["label"]
        for ax, metric in ((axes[0], "reward"), (axes[3], "entropy"), (axes[4], TRAINING_METRICS["beta1_set"]),
                           (axes[5], TRAINING_METRICS["beta2_set"])):  # fmt: skip
            _draw(
                ax, [tuple(map(list, zip(*series(r["log_history"], metric)))) or ([], []) for r in mine], color, label
            )
        for ax, key in ((axes[1], "avg"), (axes[2], "pass")):
            ends = [([0, steps], [statistics.fmean(start[main][key]), statistics.fmean(r["grades"][main][key])])
                    for r in mine]  # fmt: skip
            _draw(ax, ends, color, label, marker="o")
    for ax, name in zip(axes, names):
        style_panel(ax, name)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, "cegppo-compare")


def _draw(ax, curves, color, label, marker=None) -> None:
    curves = [c for c in curves if c[0]]
    for steps, values in curves:
        ax.plot(steps, values, color=color, linewidth=0.6, alpha=0.35)
    length = min((len(c[0]) for c in curves), default=0)
    if length:
        mean = [statistics.fmean(c[1][i] for c in curves) for i in range(length)]
        ax.plot(curves[0][0][:length], mean, color=color, linewidth=1.8, marker=marker, markersize=3, label=label)
