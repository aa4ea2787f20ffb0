"""avg@k and pass@k from graded samples (pure Python: no torch, no model).

The paper reports avg@32 (MATH500: avg@4): `k` samples per problem graded by a protocol, accuracy averaged over
all `k x N` samples. pass@j (`j <= k`) is the unbiased estimator of Chen et al. (2021), `1 - C(k - c, j) / C(k, j)`
per problem with `c` correct samples, averaged over problems.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: `1 - C(n - c, k) / C(n, k)`.

    Computed as a product (`1 - prod_{i=n-c+1}^{n} (1 - k / i)`) so that large `n` does not overflow.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _pass_ks(pass_ks: Sequence[int] | None, k: int) -> list[int]:
    ks = sorted({1, k} if pass_ks is None else {int(j) for j in pass_ks})
    bad = [j for j in ks if not 1 <= j <= k]
    if bad:
        raise ValueError(f"pass@j needs 1 <= j <= k = {k}; got j = {bad}.")
    return ks


def summarize_counts(
    num_correct: Sequence[int], k: int, pass_ks: Sequence[int] | None = None, skipped: Sequence[bool] | None = None
) -> dict[str, Any]:
    """``{"num_problems", "num_skipped", "k", "avg@k", "pass@j" ...}`` from per-problem correct counts.

    `skipped[i]` marks a problem whose gold answer cannot be parsed: it is left out of the averages (NaN when nothing
    is left). `pass_ks` defaults to 1 and k. This is the one place the figures are computed, for `cegppo-eval` and for
    `AvgAtKCallback` (which gathers the counts of every rank first).
    """
    ks = _pass_ks(pass_ks, k)
    skipped = [False] * len(num_correct) if skipped is None else list(skipped)
    if len(skipped) != len(num_correct):
        raise ValueError(f"got {len(num_correct)} correct counts but {len(skipped)} skip flags.")
    scored = [c for c, skip in zip(num_correct, skipped) if not skip]
    if any(not 0 <= c <= k for c in scored):
        raise ValueError(f"every correct count must be between 0 and k = {k}.")
    report: dict[str, Any] = {"num_problems": len(num_correct), "num_skipped": len(num_correct) - len(scored), "k": k}
    report[f"avg@{k}"] = sum(scored) / (k * len(scored)) if scored else float("nan")
    for j in ks:
        report[f"pass@{j}"] = sum(pass_at_k(k, c, j) for c in scored) / len(scored) if scored else float("nan")
    return report


def evaluate_completions(
    completions: Sequence[Sequence[str]],
    solutions: Sequence[Any],
    pass_ks: Sequence[int] | None = None,
    *,
    protocol: str = "boxed",
    timeout_s: float | None = None,
    num_workers: int | None = None,
) -> dict[str, Any]:
    """Grade `completions[i]` (the `k` samples of problem `i`) against `solutions[i]` with the grading `protocol`
    (`cegppo_trl.rewards.protocols`: ``boxed``, the math reward's grading; ``authors``; ``lighteval``), in the
    grading pool with the hard time limit `timeout_s` per completion (default: the protocol's).

    Returns `summarize_counts`'s figures plus ``"status_counts": {status: count}``, ``"num_correct": [c_i]`` and
    ``"statuses": [[...]]``. Every sample has a status: an empty completion or one with no answer is ``no_answer``,
    never a silent 0. Problems whose gold answer cannot be parsed (status ``bad_gold``) are excluded from the averages
    and counted in ``num_skipped``.
    """
    from ..rewards import grade_with_protocol

    if len(completions) != len(solutions):
        raise ValueError(f"got completions for {len(completions)} problems but {len(solutions)} solutions.")
    ks = {len(c) for c in completions}
    if len(ks) != 1 or 0 in ks:
        raise ValueError(f"every problem needs the same number (>= 1) of completions, got {sorted(ks)}.")
    (k,) = ks
    _pass_ks(pass_ks, k)  # fail before grading
    flat = [text for group in completions for text in group]
    golds = [solution for solution in solutions for _ in range(k)]
    graded = grade_with_protocol(flat, golds, protocol, timeout_s=timeout_s, num_workers=num_workers)
    statuses = [[g.status for g in graded[i * k : (i + 1) * k]] for i in range(len(completions))]
    num_correct = [sum(s == "correct" for s in row) for row in statuses]
    report = summarize_counts(num_correct, k, pass_ks, skipped=["bad_gold" in row for row in statuses])
    report["status_counts"] = dict(Counter(g.status for g in graded))
    report["num_correct"] = num_correct
    report["statuses"] = statuses
    return report


def format_summary(name: str, metrics: dict[str, Any]) -> str:
    """One line: ``name: avg@k = xx.x% | pass@1 = ... | pass@k = ... (N problems x k samples; samples: 3 no_answer,
    T s)``: the samples neither right nor wrong are counted by status."""
    k = metrics["k"]
    parts = [f"avg@{k} = {100 * metrics[f'avg@{k}']:.1f}%"]
    parts += [f"{key} = {100 * value:.1f}%" for key, value in metrics.items() if key.startswith("pass@")]
    skipped = f", {metrics['num_skipped']} skipped (unparseable gold)" if metrics.get("num_skipped") else ""
    other = {s: n for s, n in metrics.get("status_counts", {}).items() if s not in ("correct", "wrong", "bad_gold")}
    samples = ", ".join(f"{n} {status}" for status, n in sorted(other.items()))
    samples = f"; samples: {samples}" if samples else ""
    seconds = f", {metrics['seconds']:.1f} s" if "seconds" in metrics else ""
    problems = f"{metrics['num_problems']} problems x {k} samples{skipped}{samples}{seconds}"
    return f"{name}: " + " | ".join(parts) + f" ({problems})"
