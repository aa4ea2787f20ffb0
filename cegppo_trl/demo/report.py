"""What `cegppo-demo` concludes, computed from what it measured: statistics over seeds, the conclusions (claim +
verdict + the numbers behind it) and the printed tables.

Every verdict is a rule applied to numbers that the demo prints next to it, so a run on any machine states what that
run showed: the number of seeds (or runs) in which a claim holds, with the numbers behind it; for the tiny LM's
CE-GPPO - GRPO differences also the mean +- std and what their paired 95% interval says.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass


#: Two-sided 95% quantiles of Student's t by degrees of freedom (a paired interval over n seeds has n - 1).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired_difference(first: Sequence[float], second: Sequence[float]) -> dict:
    """`first - second` seed by seed: ``values``, ``mean``, ``std``, ``n`` and the 95% t-interval of the mean
    (``low`` / ``high``; None for a single seed or more than 11)."""
    values = [a - b for a, b in zip(first, second, strict=True)]
    mean, std = mean_std(values)
    half = T_975[len(values) - 1] * std / math.sqrt(len(values)) if len(values) - 1 in T_975 else None
    low, high = (None, None) if half is None else (mean - half, mean + half)
    return {"values": values, "mean": mean, "std": std, "n": len(values), "low": low, "high": high}


@dataclass
class Conclusion:
    """One printed conclusion: `claim` (what is checked), `verdict` (the rule's outcome; the same wording wherever
    the same outcome is measured) and `evidence` (the numbers the rule read)."""

    key: str
    claim: str
    verdict: str
    evidence: str

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        return f"  * {self.claim}: {self.verdict}\n      ({self.evidence})"


def count_verdict(holds: int, total: int, unit: str = "seeds") -> str:
    """ "yes, in every one of the N <unit>" / "no, in none of the N <unit>" / "only in k of the N <unit>"."""
    if holds == total:
        return f"yes, in every one of the {total} {unit}"
    if holds == 0:
        return f"no, in none of the {total} {unit}"
    return f"only in {holds} of the {total} {unit}"


def difference_verdict(diff: dict) -> str:
    """The verdict on a CE-GPPO - GRPO difference (`paired_difference`) from its 95% interval."""
    if diff["low"] is None:
        return "one seed gives no spread to judge by (use --seeds 2 or more)"
    if diff["low"] > 0:
        return "CE-GPPO higher (the 95% interval is above 0)"
    if diff["high"] < 0:
        return "CE-GPPO lower (the 95% interval is below 0)"
    return "no difference this run can measure (the 95% interval contains 0)"


def describe_difference(diff: dict, digits: int = 3) -> str:
    """``mean +- std over n seeds, 95% interval [low, high], per seed: a, b, c``."""
    text = f"{diff['mean']:+.{digits}f} +- {diff['std']:.{digits}f} over {diff['n']} seeds"
    if diff["low"] is not None:
        text += f", 95% interval [{diff['low']:+.{digits}f}, {diff['high']:+.{digits}f}]"
    return text + ", per seed " + ", ".join(f"{v:+.{digits}f}" for v in diff["values"])


# --------------------------------------------------------------------------------------------------------------
# The exact toy
# --------------------------------------------------------------------------------------------------------------


def _toy_by_setting(runs: Sequence[dict]) -> dict[tuple[float, float], dict[int, dict]]:
    table: dict[tuple[float, float], dict[int, dict]] = {}
    for run in runs:
        table.setdefault((run["beta1"], run["beta2"]), {})[run["seed"]] = run
    return table


def toy_conclusions(runs: Sequence[dict], first_order: Sequence[dict]) -> list[Conclusion]:
    """The toy's conclusions from `toy.summarize_toy_run` results over the grid (`toy.TOY_GRID`) and seeds, and from
    `first_order` (``[{"lr", "max_rel_error", "trials"}]`` of `toy.first_order_check`, larger lr first)."""
    coarse, fine = first_order[0], first_order[-1]
    ratio = coarse["max_rel_error"] / fine["max_rel_error"]
    step_ratio = coarse["lr"] / fine["lr"]
    exact = fine["max_rel_error"] < 1e-2 and step_ratio / 3 < ratio < step_ratio * 3
    correlation = min(statistics.correlation(r["measured_dH"], r["predicted_dH"]) for r in runs)
    by_setting = _toy_by_setting(runs)
    seeds = sorted(by_setting[(0.0, 0.0)])
    mean_h = {
        setting: {seed: run["mean_entropy"] for seed, run in per_seed.items()}
        for setting, per_seed in by_setting.items()
    }
    beta1_lower = sum(mean_h[(1.0, 1.0)][s] < mean_h[(0.5, 1.0)][s] for s in seeds)
    beta2_higher = sum(
        mean_h[(1.0, 1.0)][s] > mean_h[(1.0, 0.5)][s] and mean_h[(0.0, 1.0)][s] > mean_h[(0.0, 0.0)][s] for s in seeds
    )
    with_beta1 = [r for r in runs if r["beta1"] > 0]
    with_beta2 = [r for r in runs if r["beta2"] > 0]
    return [
        Conclusion(
            "toy_first_order",
            "Toy: one CE-GPPO step changes the entropy by the first-order prediction -eta*F*A*s_a",
            "yes, up to second order" if exact else "no",
            f"max relative error {coarse['max_rel_error']:.1e} at lr {coarse['lr']:g}, {fine['max_rel_error']:.1e} at "
            f"lr {fine['lr']:g}, over {fine['trials']} single-token steps in every branch; over whole RL steps the "
            f"predicted and measured changes correlate at {correlation:.3f} or more",
        ),
        Conclusion(
            "toy_beta1_set",
            "Toy: the gradient CE-GPPO gives back to the beta1 set (A < 0, r < 1-eps) lowers entropy",
            count_verdict(sum(r["dH_beta1"] < 0 for r in with_beta1), len(with_beta1), "runs with beta1 > 0"),
            "first-order entropy change carried by the set, summed over a run: "
            + _range_text([r["dH_beta1"] for r in with_beta1]),
        ),
        Conclusion(
            "toy_beta2_set",
            "Toy: the gradient CE-GPPO gives back to the beta2 set (A > 0, r > 1+eps) raises entropy",
            count_verdict(sum(r["dH_beta2"] > 0 for r in with_beta2), len(with_beta2), "runs with beta2 > 0"),
            "first-order entropy change carried by the set, summed over a run: "
            + _range_text([r["dH_beta2"] for r in with_beta2]),
        ),
        Conclusion(
            "toy_beta1_direction",
            "Toy: larger beta1 lowers entropy faster ((1, 1) below (0.5, 1), entropy averaged over the run)",
            count_verdict(beta1_lower, len(seeds)),
            _pair_text(mean_h, (1.0, 1.0), (0.5, 1.0), seeds),
        ),
        Conclusion(
            "toy_beta2_direction",
            "Toy: larger beta2 keeps entropy higher ((1, 1) above (1, 0.5) and (0, 1) above GRPO (0, 0))",
            count_verdict(beta2_higher, len(seeds)),
            _pair_text(mean_h, (1.0, 1.0), (1.0, 0.5), seeds)
            + "; "
            + _pair_text(mean_h, (0.0, 1.0), (0.0, 0.0), seeds),
        ),
    ]


def _range_text(values: Sequence[float]) -> str:
    return f"{min(values):+.3f} to {max(values):+.3f}"


def _pair_text(mean_h: dict, first: tuple[float, float], second: tuple[float, float], seeds: Sequence[int]) -> str:
    a, b = mean_std([mean_h[first][s] for s in seeds]), mean_std([mean_h[second][s] for s in seeds])
    return f"{_setting(first)} {a[0]:.3f} +- {a[1]:.3f} vs {_setting(second)} {b[0]:.3f} +- {b[1]:.3f}"


def _setting(betas: tuple[float, float]) -> str:
    return f"({betas[0]:g}, {betas[1]:g})"


def format_toy_table(runs: Sequence[dict]) -> str:
    """Per (beta1, beta2): entropy at the start, averaged over the run and at the end, and the first-order entropy
    change carried by each set (mean +- std over seeds)."""
    lines = [
        "| (beta1, beta2) | entropy start | entropy over the run | entropy end | dH from beta1 set | dH from beta2 set "
        "| dH from unclipped tokens | measured dH | clipped tokens beta1 / beta2 set |",
        "|" + "---|" * 9,
    ]
    for setting, per_seed in _toy_by_setting(runs).items():
        rs = list(per_seed.values())

        def cell(values, fmt="{:.3f}"):
            m, s = mean_std(values)
            return f"{fmt.format(m)} +- {s:.3f}"

        lines.append(
            f"| {_setting(setting)} | {cell([r['entropy'][0] for r in rs])} | {cell([r['mean_entropy'] for r in rs])} "
            f"| {cell([r['entropy'][-1] for r in rs])} | {cell([r['dH_beta1'] for r in rs], '{:+.3f}')} "
            f"| {cell([r['dH_beta2'] for r in rs], '{:+.3f}')} | {cell([r['dH_unclipped'] for r in rs], '{:+.3f}')} "
            f"| {cell([r['entropy'][-1] - r['entropy'][0] for r in rs], '{:+.3f}')} "
            f"| {100 * mean_std([r['beta1_token_frac'] for r in rs])[0]:.2f}% / "
            f"{100 * mean_std([r['beta2_token_frac'] for r in rs])[0]:.2f}% |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# The tiny LM
# --------------------------------------------------------------------------------------------------------------


def lm_differences(pairs: Sequence[dict]) -> dict[str, dict]:
    """CE-GPPO - GRPO, seed by seed, of the held-out ``accuracy`` (sampled) and ``entropy`` after training."""
    return {
        metric: paired_difference(
            [p["cegppo"][f"end_{metric}"] for p in pairs], [p["grpo"][f"end_{metric}"] for p in pairs]
        )
        for metric in ("accuracy", "entropy")
    }


def lm_conclusions(pairs: Sequence[dict]) -> list[Conclusion]:
    """The tiny LM's conclusions from the paired runs (``[{"seed", "cegppo": run_rl result, "grpo": ...}]``)."""
    cegppo = [p["cegppo"] for p in pairs]
    active = sum(
        min(r["beta1_token_frac"], r["beta2_token_frac"], r["beta1_grad_share"], r["beta2_grad_share"]) > 0
        for r in cegppo
    )
    shares = {k: 100 * mean_std([r[k] for r in cegppo])[0] for k in ("beta1_token_frac", "beta2_token_frac")}
    grads = {k: 100 * mean_std([r[k] for r in cegppo])[0] for k in ("beta1_grad_share", "beta2_grad_share")}
    diffs = lm_differences(pairs)
    return [
        Conclusion(
            "lm_clipped_sets",
            "Tiny LM: off-policy updates put tokens in CE-GPPO's clipped sets, and CE-GPPO gives them gradient",
            count_verdict(active, len(cegppo), "CE-GPPO runs"),
            f"beta1 / beta2 set: {shares['beta1_token_frac']:.2f}% / {shares['beta2_token_frac']:.2f}% of the "
            f"tokens, {grads['beta1_grad_share']:.2f}% / {grads['beta2_grad_share']:.2f}% of the gradient weight",
        ),
        Conclusion(
            "lm_entropy",
            "Tiny LM: CE-GPPO ends with higher held-out entropy than GRPO (the paper's direction)",
            count_verdict(sum(v > 0 for v in diffs["entropy"]["values"]), diffs["entropy"]["n"]),
            "CE-GPPO - GRPO: " + describe_difference(diffs["entropy"], 4) + f" nats; {_interval(diffs['entropy'])}",
        ),
        Conclusion(
            "lm_accuracy",
            "Tiny LM: CE-GPPO ends with higher held-out accuracy (sampled, T=1) than GRPO",
            count_verdict(sum(v > 0 for v in diffs["accuracy"]["values"]), diffs["accuracy"]["n"]),
            "CE-GPPO - GRPO: " + describe_difference(diffs["accuracy"]) + f"; {_interval(diffs['accuracy'])}",
        ),
    ]


def _interval(diff: dict) -> str:
    """What the 95% interval says, in the words of `difference_verdict`."""
    return "by the 95% interval: " + difference_verdict(diff).replace(" (", ", ").rstrip(")")


def format_lm_table(pairs: Sequence[dict], warm: dict | None = None) -> str:
    """One row per seed (CE-GPPO and GRPO side by side, their difference), then the mean +- std and 95% interval."""
    lines = [
        "| seed | held-out accuracy: CE-GPPO | GRPO | CE-GPPO - GRPO | held-out entropy: CE-GPPO | GRPO "
        "| CE-GPPO - GRPO | train reward, last 10%: CE-GPPO | GRPO | clipped tokens beta1 / beta2 set |",
        "|" + "---|" * 10,
    ]
    for p in pairs:
        c, g = p["cegppo"], p["grpo"]
        lines.append(
            f"| {p['seed']} | {c['end_accuracy']:.3f} | {g['end_accuracy']:.3f} "
            f"| {c['end_accuracy'] - g['end_accuracy']:+.3f} | {c['end_entropy']:.4f} | {g['end_entropy']:.4f} "
            f"| {c['end_entropy'] - g['end_entropy']:+.4f} | {c['end_reward']:+.3f} | {g['end_reward']:+.3f} "
            f"| {100 * c['beta1_token_frac']:.2f}% / {100 * c['beta2_token_frac']:.2f}% |"
        )
    diffs = lm_differences(pairs)
    for name, key in (("mean +- std", None), ("95% interval", "interval")):
        acc, ent = diffs["accuracy"], diffs["entropy"]
        if key is None:
            cells = (f"{acc['mean']:+.3f} +- {acc['std']:.3f}", f"{ent['mean']:+.4f} +- {ent['std']:.4f}")
        elif acc["low"] is not None:
            cells = (f"[{acc['low']:+.3f}, {acc['high']:+.3f}]", f"[{ent['low']:+.4f}, {ent['high']:+.4f}]")
        else:
            continue
        lines.append(f"| {name} | | | {cells[0]} | | | {cells[1]} | | | |")
    if warm is not None:
        lines.append("")
        lines.append(
            f"Start (the warm start, {warm['sft']['steps']} SFT steps): held-out accuracy {warm['accuracy']:.3f} "
            f"sampled (T=1) / {warm['greedy_accuracy']:.3f} greedy, entropy {warm['entropy']:.4f} nats."
        )
    return "\n".join(lines)
