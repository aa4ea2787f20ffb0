"""The statistics, table, figure and time split of `cegppo-compare` (pure Python; matplotlib for the figure only).

Every held-out difference is paired per problem (the same problems, sampled with the same seed): its standard error
is over problems. Between arms, each arm is compared with the reference arm (the first of --arms) seed by seed, then
over seeds: mean, spread (standard deviation) and standard error over seeds; `verdict` is the rule that
docs/comparison.md fixed before the study ran.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


#: Means over a run's training log: what "over training" means here (TRL's `reward`, `entropy`; CE-GPPO's clipped sets).
TRAINING_METRICS = {"train_reward": "reward", "train_entropy": "entropy", "beta1_set": "cegppo/beta1_token_frac",
                    "beta2_set": "cegppo/beta2_token_frac"}  # fmt: skip
#: Seed-level figures compared between arms (arm - reference): the training means and the held-out entropy.
COMPARED = ("train_entropy", "heldout_entropy", "train_reward", "beta1_set", "beta2_set")


def se(values: list[float]) -> float:
    """Standard error of the mean (NaN for fewer than 2 values, or any value not finite)."""
    if len(values) < 2 or not all(map(finite, values)):
        return float("nan")
    return statistics.stdev(values) / math.sqrt(len(values))


def per_problem(num_correct: list[int], k: int, what: str) -> list[float]:
    """Each problem's avg@k (``avg``: the share of its k samples that are right) or pass@k (``pass``: any right)."""
    return [c / k if what == "avg" else float(c > 0) for c in num_correct]


def paired(after: dict, before: dict, what: str) -> tuple[float, float]:
    """(mean, standard error over problems) of `after - before` for ``avg`` or ``pass``, problem by problem."""
    a = per_problem(after["num_correct"], after.get("k", before.get("k")), what)
    b = per_problem(before["num_correct"], before.get("k", after.get("k")), what)
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    return statistics.fmean(diffs), se(diffs)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(history: list[dict], metric: str) -> list[tuple[int, float]]:
    """(step, value) of `metric`; a token metric only over the steps that trained on something: with dynamic
    sampling a step whose batch kept no group logs 0 for TRL's token means (entropy, clip shares), which is not a
    measurement. The reward is of every generated completion."""
    trained_only = metric != "reward"
    return [(e["step"], float(e[metric])) for e in history if "step" in e and finite(e.get(metric))
            and not (trained_only and e.get("cegppo/batch_fill", 1) == 0)]  # fmt: skip


def run_mean(history: list[dict], metric: str) -> float:
    """`metric`'s mean over the whole run's log (NaN when never logged): entropy "over training"."""
    values = [v for _, v in series(history, metric)]
    return statistics.fmean(values) if values else float("nan")


def verdict(diffs: list[float], direction: int = 1) -> str:
    """The pre-registered rule (docs/comparison.md): ``yes`` when every seed's difference has the claimed sign
    (`direction`) and the mean is at least 2 standard errors over seeds from 0; ``no`` when every seed's has the
    other sign with the same margin; else ``inside the noise``. Fewer than 2 seeds: ``inside the noise``."""
    if len(diffs) < 2 or not all(map(finite, diffs)):
        return "inside the noise"
    mean, err = statistics.fmean(diffs) * direction, se(diffs)
    signed = [d * direction for d in diffs]
    if all(d > 0 for d in signed) and mean >= 2 * err:
        return "yes"
    if all(d < 0 for d in signed) and -mean >= 2 * err:
        return "no"
    return "inside the noise"


def _spread(values: list[float]) -> dict[str, float]:
    """Mean, spread (standard deviation), standard error, min and max over seeds (NaN where a value is not finite)."""
    if not all(map(finite, values)):
        return dict.fromkeys(("mean", "spread", "se", "min", "max"), float("nan"))
    return {"mean": statistics.fmean(values), "spread": statistics.stdev(values) if len(values) > 1 else 0.0,
            "se": se(values), "min": min(values), "max": max(values)}  # fmt: skip


def summarize(start: dict, runs: list[dict], protocols: list[str]) -> dict[str, Any]:
    """Per run, per arm (over seeds) and each arm versus the reference arm (the first run's: seed by seed, then over
    seeds)."""
    per_run = {}
    for r in runs:
        end, k = r["end"], r["end"]["k"]
        row = {"arm": r["arm"], "label": r["label"], "seed": r["seed"], "heldout_entropy": end["entropy"],
               "boxed_rate": end["boxed_rate"], **{key: run_mean(r["log_history"], m) for key, m in TRAINING_METRICS.items()}}  # fmt: skip
        for p in protocols:
            g, s = {**end["grades"][p], "k": k}, {**start["grades"][p], "k": start["k"]}
            row[p] = {"avg": g["avg"], "avg_se": se(per_problem(g["num_correct"], k, "avg")), "pass": g["pass"],
                      "pass_se": se(per_problem(g["num_correct"], k, "pass")),
                      "avg_vs_start": paired(g, s, "avg"), "pass_vs_start": paired(g, s, "pass")}  # fmt: skip
        per_run[r["name"]] = row
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rows = [per_run[r["name"]] for r in runs if r["arm"] == arm]
        arms[arm] = {"label": rows[0]["label"], "seeds": [x["seed"] for x in rows]}
        arms[arm].update({key: _spread([x[key] for x in rows]) for key in COMPARED})
        for p in protocols:
            arms[arm][p] = {key: _spread([x[p][key] for x in rows]) for key in ("avg", "pass")}
            arms[arm][p].update(
                {key: _spread([x[p][key][0] for x in rows]) for key in ("avg_vs_start", "pass_vs_start")}
            )
    reference = runs[0]["arm"] if runs else None
    by_seed = {(r["arm"], r["seed"]): per_run[r["name"]] for r in runs}
    versus = {}
    for arm in arms:
        seeds = [s for s in arms[arm]["seeds"] if (reference, s) in by_seed]
        if arm == reference or not seeds:
            continue
        per_seed = []
        for seed in seeds:
            mine, ref = by_seed[(arm, seed)], by_seed[(reference, seed)]
            entry = {"seed": seed, **{key: mine[key] - ref[key] for key in COMPARED}}
            for p in protocols:
                g = [{**next(r for r in runs if (r["arm"], r["seed"]) == (a, seed))["end"]["grades"][p],
                      "k": start["k"]} for a in (arm, reference)]  # fmt: skip
                entry[p] = {"avg": paired(g[0], g[1], "avg"), "pass": paired(g[0], g[1], "pass")}
            per_seed.append(entry)
        over = {key: _spread([e[key] for e in per_seed]) for key in COMPARED}
        for p in protocols:
            over[p] = {key: _spread([e[p][key][0] for e in per_seed]) for key in ("avg", "pass")}
        versus[arm] = {"per_seed": per_seed, "over_seeds": over}
    return {"reference": reference, "per_run": per_run, "arms": arms, "versus": versus}


def direction(diffs: list[float]) -> str:
    """``above`` / ``below`` / ``inside the noise``: `verdict`'s rule read without a claim."""
    return {"yes": "above", "no": "below"}.get(verdict(diffs), "inside the noise")


def claims(summary: dict[str, Any], protocols: list[str]) -> list[dict[str, Any]]:
    """The paper's claims that docs/comparison.md tests, each with its verdict (`verdict`'s rule), where the arms it
    needs were run against a GRPO reference: (i) CE-GPPO's training entropy above GRPO's; (ii) beta2 alone (0, 1)
    above GRPO, beta1 alone (1, 0) below it; (iii) CE-GPPO's avg@k higher, with pass@k not lower."""
    if summary["reference"] != "grpo":
        return []
    versus, found = summary["versus"], []

    def seeds(arm, *path):
        values = []
        for entry in versus[arm]["per_seed"]:
            value = entry
            for key in path:
                value = value[key]
            values.append(value[0] if isinstance(value, tuple | list) else value)
        return values

    if "cegppo" in versus:
        d = seeds("cegppo", "train_entropy")
        found.append({"claim": "(i) CE-GPPO's entropy stays above GRPO's over training", "diffs": d,
                      "verdict": verdict(d)})  # fmt: skip
    for arm, sign, text in (("b0-1", 1, "(ii) beta2 alone (0, 1): entropy above GRPO's"),
                            ("b1-0", -1, "(ii) beta1 alone (1, 0): entropy below GRPO's")):  # fmt: skip
        if arm in versus:
            d = seeds(arm, "train_entropy")
            found.append({"claim": text, "diffs": d, "verdict": verdict(d, sign)})
    if "cegppo" in versus:
        for p in protocols:
            avg, best = seeds("cegppo", p, "avg"), seeds("cegppo", p, "pass")
            avg_verdict, pass_verdict = verdict(avg), verdict(best)
            if avg_verdict == "no" or pass_verdict == "no":
                overall = "no"
            else:
                overall = "yes" if avg_verdict == "yes" else "inside the noise"
            found.append({"claim": f"(iii) CE-GPPO's avg@k above GRPO's, pass@k not lower ({p} grading)",
                          "diffs": avg, "pass_diffs": best, "verdict": overall})  # fmt: skip
    return found


# --------------------------------------------------------------------------------------------------- text
def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _pm(pair: tuple[float, float], scale: float = 100.0, digits: int = 1) -> str:
    return f"{scale * pair[0]:+.{digits}f} +- {scale * pair[1]:.{digits}f}"


def _mean_se(mean: float, se: float, scale: float = 100.0, digits: int = 1, sign: str = "+") -> str:
    """`mean +- se`, or the mean alone where there is no spread to show (one seed)."""
    text = f"{scale * mean:{sign}.{digits}f}"
    return text if math.isnan(se) else f"{text} +- {scale * se:.{digits}f}"


def _over(stats: dict[str, float], scale: float = 100.0, digits: int = 1) -> str:
    return _mean_se(stats["mean"], stats["se"], scale, digits)


def markdown(start: dict, runs: list[dict], summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """The table of a comparison: the start, every run, every arm over seeds, each arm minus the reference, and the
    paper's claims where the arms were run."""
    protocols, k = settings["protocols"], start["k"]
    main, others = protocols[0], protocols[1:]
    lines = [
        f"Held-out: {start['num_problems']} problems of `{settings['eval_dataset']}`, k = {k} samples each at "
        f"temperature {settings['eval_temperature'] if settings['eval_temperature'] is not None else settings['temperature']}, "
        f"graded `{main}`" + (f" (and `{'`, `'.join(others)}`)" if others else "") + "; +- one standard error over "
        "problems; differences paired per problem. Training: " + describe_training(settings) + ".",
        "",
        f"| model | avg@{k} % | pass@{k} % | avg@{k} vs start (pp) | "
        + "".join(f"avg@{k} `{p}` % | " for p in others)
        + "boxed % | held-out entropy | training entropy | training reward | beta1 set % | beta2 set % |",
        "|---|" + "---|" * (9 + len(others)),
    ]  # fmt: skip
    s = start["grades"]
    lines.append(
        f"| start | {_pct(s[main]['avg'])} | {_pct(s[main]['pass'])} | | "
        + "".join(f"{_pct(s[p]['avg'])} | " for p in others)
        + f"{_pct(start['boxed_rate'])} | {start['entropy']:.3f} | | | | |"
    )
    for r in runs:
        row = summary["per_run"][r["name"]]
        lines.append(
            f"| {row['label']} seed {row['seed']} | {_pct(row[main]['avg'])} +- {_pct(row[main]['avg_se'])} | "
            f"{_pct(row[main]['pass'])} +- {_pct(row[main]['pass_se'])} | {_pm(row[main]['avg_vs_start'])} | "
            + "".join(f"{_pct(row[p]['avg'])} | " for p in others)
            + f"{_pct(row['boxed_rate'])} | {row['heldout_entropy']:.3f} | {row['train_entropy']:.3f} | "
            f"{row['train_reward']:+.3f} | {_pct(row['beta1_set'])} | {_pct(row['beta2_set'])} |"
        )
    lines += ["", f"Over seeds (mean +- standard error over seeds; `{main}` grading):", "",
              f"| arm | seeds | avg@{k} % | pass@{k} % | avg@{k} vs start (pp) | held-out entropy | training entropy "
              "| beta1 set % | beta2 set % |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in summary["arms"].values():
        m = arm[main]
        lines.append(
            f"| {arm['label']} | {len(arm['seeds'])} | {_mean_se(m['avg']['mean'], m['avg']['se'], sign='')} | "
            f"{_mean_se(m['pass']['mean'], m['pass']['se'], sign='')} | {_over(m['avg_vs_start'])} | "
            f"{_mean_se(arm['heldout_entropy']['mean'], arm['heldout_entropy']['se'], 1.0, 3, '')} | "
            f"{_mean_se(arm['train_entropy']['mean'], arm['train_entropy']['se'], 1.0, 3, '')} | "
            f"{_pct(arm['beta1_set']['mean'])} | {_pct(arm['beta2_set']['mean'])} |"
        )
    return "\n".join(lines + _versus_rows(summary, protocols, k) + _claim_rows(summary, protocols)) + "\n"


def _versus_rows(summary: dict[str, Any], protocols: list[str], k: int) -> list[str]:
    """Each arm minus the reference: mean +- standard error over seeds, with `direction`'s word."""
    if not summary["versus"]:
        return []
    main, reference = protocols[0], summary["arms"][summary["reference"]]["label"]
    lines = ["", f"Each arm minus {reference}, seed by seed, paired (held-out per problem): mean +- standard "
             "error over seeds, and where every seed agrees by 2 standard errors (docs/comparison.md):", "",
             "| arm | " + "".join(f"avg@{k} `{p}` (pp) | " for p in protocols) + f"pass@{k} `{main}` (pp) | "
             "training entropy | held-out entropy |", "|---|" + "---|" * (len(protocols) + 3)]  # fmt: skip
    for arm, v in summary["versus"].items():
        o, per_seed = v["over_seeds"], v["per_seed"]
        cells = [f"{_over(o[p]['avg'])} ({direction([e[p]['avg'][0] for e in per_seed])})" for p in protocols]
        cells.append(f"{_over(o[main]['pass'])} ({direction([e[main]['pass'][0] for e in per_seed])})")
        for key in ("train_entropy", "heldout_entropy"):
            cells.append(f"{_over(o[key], 1.0, 3)} ({direction([e[key] for e in per_seed])})")
        lines.append(f"| {summary['arms'][arm]['label']} | " + " | ".join(cells) + " |")
    return lines


def _claim_rows(summary: dict[str, Any], protocols: list[str]) -> list[str]:
    found = claims(summary, protocols)
    if not found:
        return []
    lines = ["", "| the paper's claim | per seed (arm - GRPO) | verdict |", "|---|---|---|"]
    for c in found:
        scale, unit = (100.0, " pp") if c["claim"].startswith("(iii)") else (1.0, " nats")
        values = ", ".join(f"{scale * d:+.{1 if scale == 100 else 3}f}" for d in c["diffs"]) + unit
        if "pass_diffs" in c:
            values += "; pass@k " + ", ".join(f"{100 * d:+.1f}" for d in c["pass_diffs"]) + " pp"
        lines.append(f"| {c['claim']} | {values} | **{c['verdict']}** |")
    return lines


def describe_training(settings: dict[str, Any]) -> str:
    s = settings
    sampling = (
        f"dynamic sampling (oversampling {s['oversampling']:g})" if s["dynamic_sampling"] else "no dynamic sampling"
    )
    return (f"{s['max_steps']} optimizer steps of {s['prompts_per_step']} prompts x {s['num_generations']}, "
            f"{s['steps_per_generation']} per generation batch, {sampling}, "
            f"{'LoRA r ' + str(s['lora_r']) if s['use_peft'] else 'full fine-tuning'}, learning rate "
            f"{s['learning_rate']:g}, temperature {s['temperature']:g}, {s['max_completion_length']} new tokens")  # fmt: skip


def time_report(start: dict, runs: list[dict], wall: float | None) -> str:
    """Where the time went: process seconds summed over runs, by part, and the start's measurement."""
    from .jobs import TIME_KEYS

    sums = {key: sum(r["time"][key] for r in runs) for key in TIME_KEYS}
    ends = sum(r["end"]["seconds"] for r in runs)
    parts = ", ".join(f"{key.replace('_', ' ')} {sums[key]:.0f} s" for key in TIME_KEYS)
    return (f"Time (process seconds summed over {len(runs)} runs, each of one torch thread): {parts}; the final "
            f"measurements {ends:.0f} s; the start's {start['seconds']:.0f} s; this call's wall time "
            + ("not recorded" if wall is None else f"{wall:.0f} s") + ".")  # fmt: skip


# --------------------------------------------------------------------------------------------------- figure
def _smooth(points: list[tuple[int, float]], window: int) -> tuple[list[int], list[float]]:
    """The mean of each generation batch's entries (`window` optimizer steps; the reward has one per batch), at the
    batch's last logged step: a curve a reader can follow."""
    batches: dict[int, list[tuple[int, float]]] = {}
    for step, value in points:
        batches.setdefault((step - 1) // window, []).append((step, value))
    chunks = [batches[b] for b in sorted(batches)]
    return [c[-1][0] for c in chunks], [statistics.fmean(v for _, v in c) for c in chunks]


def figure(start: dict, runs: list[dict], settings: dict[str, Any], path) -> str:
    """Curves of every arm side by side (thin: each seed; thick: the mean over seeds): training reward, held-out
    avg@k and pass@k, training entropy, and the beta1 / beta2 sets' token shares."""
    from ..figures import panels, save_figure, style_panel

    k, window = start["k"], settings["steps_per_generation"]
    names = ("training reward", f"held-out avg@{k}", f"held-out pass@{k}", "training entropy (nats)",
             "beta1 set (share of tokens)", "beta2 set (share of tokens)")  # fmt: skip
    fig, axes = panels(6, ncols=3, width=4.2, height=3.0)
    main = settings["protocols"][0]
    for index, arm in enumerate(dict.fromkeys(r["arm"] for r in runs)):
        mine = [r for r in runs if r["arm"] == arm]
        color, label = f"C{index}", mine[0]["label"]
        for ax, metric in ((axes[0], "reward"), (axes[3], "entropy"), (axes[4], TRAINING_METRICS["beta1_set"]),
                           (axes[5], TRAINING_METRICS["beta2_set"])):  # fmt: skip
            curves = [_smooth(series(r["log_history"], metric), window) for r in mine]
            _draw(ax, curves, color, label)
        for ax, key in ((axes[1], "avg"), (axes[2], "pass")):
            first = (0, start["grades"][main][key])
            curves = [tuple(map(list, zip(first, *[(p["step"], p[key]) for p in r["curve"]]))) for r in mine]
            _draw(ax, curves, color, label, marker="o")
    for ax, name in zip(axes, names):
        style_panel(ax, name)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, f"cegppo-compare: {describe_training(settings)}")


def _draw(ax, curves, color, label, marker=None) -> None:
    curves = [c for c in curves if c[0]]
    for steps, values in curves:
        ax.plot(steps, values, color=color, linewidth=0.6, alpha=0.35)
    length = min((len(c[0]) for c in curves), default=0)
    if length:
        mean = [statistics.fmean(c[1][i] for c in curves) for i in range(length)]
        ax.plot(curves[0][0][:length], mean, color=color, linewidth=1.8, marker=marker, markersize=3, label=label)
