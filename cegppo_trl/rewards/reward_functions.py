"""The reward functions for TRL's ``GRPOTrainer``: :func:`math_reward` (the paper's +1 / -1), :func:`make_math_reward`
(other values, timeout, workers or grading protocol) and :func:`format_reward`, built on :mod:`.reward`'s
``grade_completions`` and :mod:`.protocols`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .extract import has_boxed_answer
from .protocols import grade_with_protocol, resolve_protocol
from .reward import DEFAULT_TIMEOUT_S, check_batch, check_grading_settings, grade_completions
from .worker import BAD_GOLD, CORRECT, ERROR, GOLD_TIMEOUT, NO_ANSWER, STATUSES, TIMEOUT, UNPARSEABLE, WRONG


class _MathReward:
    """The callable :func:`make_math_reward` returns (a class, not a closure, so that it pickles: TRL's async rollout
    worker pickles reward functions). Build it with :func:`make_math_reward`; its arguments are documented there."""

    def __init__(
        self,
        correct: float = 1.0,
        wrong: float = -1.0,
        unparseable: float | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_workers: int | None = None,
        name: str = "math_reward",
        protocol: str = "boxed",
    ) -> None:
        self.protocol = resolve_protocol(protocol).name  # ValueError naming the protocols
        values = {"correct": correct, "wrong": wrong}
        if unparseable is not None:
            values["unparseable"] = unparseable
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value!r}.")
        if not correct > max(wrong, wrong if unparseable is None else unparseable):
            raise ValueError(
                f"correct={correct} must be the highest reward, above wrong={wrong} and unparseable={unparseable}; "
                "otherwise the policy is pushed away from right answers."
            )
        check_grading_settings(timeout_s, num_workers)
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string (TRL logs rewards/<name>/mean), got {name!r}.")
        self.correct = float(correct)
        self.wrong = float(wrong)
        self.unparseable = float(wrong if unparseable is None else unparseable)
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self.__name__ = name  # TRL names the metrics after it

    def __repr__(self) -> str:
        protocol = "" if self.protocol == "boxed" else f", protocol={self.protocol!r}"
        return (
            f"make_math_reward(correct={self.correct}, wrong={self.wrong}, unparseable={self.unparseable}, "
            f"timeout_s={self.timeout_s}, num_workers={self.num_workers}, name={self.__name__!r}{protocol})"
        )

    def __call__(
        self,
        completions: Sequence[Any],
        solution: Sequence[Any] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        if solution is None:
            raise ValueError(
                f"{self.__name__} needs the gold answers in a `solution` dataset column (TRL passes dataset columns "
                "as keyword arguments); load the data with cegppo_trl.load_math_dataset, which creates it."
            )
        check_batch(completions, solution, "completions", "solution")
        if self.protocol == "boxed":
            graded = grade_completions(completions, solution, timeout_s=self.timeout_s, num_workers=self.num_workers)
        else:
            graded = grade_with_protocol(
                completions, solution, self.protocol, timeout_s=self.timeout_s, num_workers=self.num_workers
            )
        value = {CORRECT: self.correct, WRONG: self.wrong}
        skipped = (BAD_GOLD, GOLD_TIMEOUT)  # no usable gold on this call: no score at all
        rewards = [None if g.status in skipped else value.get(g.status, self.unparseable) for g in graded]

        if callable(log_metric) and graded:
            counts = dict.fromkeys(STATUSES, 0)
            for g in graded:
                counts[g.status] = counts.get(g.status, 0) + 1
            n = len(graded)
            gradable = n - counts[BAD_GOLD] - counts[GOLD_TIMEOUT]
            prefix = self.__name__
            log_metric(f"{prefix}/unparseable_gold", float(counts[BAD_GOLD]))
            log_metric(f"{prefix}/gold_timeouts", float(counts[GOLD_TIMEOUT]))
            log_metric(f"{prefix}/timeouts", float(counts[TIMEOUT] + counts[ERROR]))
            if gradable:
                log_metric(f"{prefix}/accuracy", counts[CORRECT] / gradable)
                log_metric(f"{prefix}/no_answer_frac", counts[NO_ANSWER] / gradable)
                log_metric(f"{prefix}/unparseable_frac", counts[UNPARSEABLE] / gradable)
        if callable(log_extra):
            log_extra(f"{self.__name__}/answer", [None if g.answer is None else g.answer[:200] for g in graded])
            log_extra(f"{self.__name__}/status", [g.status for g in graded])
        return rewards


def make_math_reward(
    correct: float = 1.0,
    wrong: float = -1.0,
    unparseable: float | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    num_workers: int | None = None,
    name: str = "math_reward",
    protocol: str = "boxed",
) -> Callable[..., list[float | None]]:
    """Build a math-verify reward function for ``GRPOTrainer(reward_funcs=[...])``, with other values than
    :func:`math_reward`'s +1 / -1, another timeout or worker count; the result is picklable.

    Call signature: ``reward(completions, solution, **kwargs) -> list[float | None]``.

    Args:
        correct: reward of a verified answer; must be the highest value.
        wrong: reward of an answer that parses but does not verify.
        unparseable: reward when there is no answer, it cannot be parsed, or grading timed out;
            ``None`` (default) means the same as ``wrong``, as in the CE-GPPO paper.
        timeout_s: hard bound on the grading time of one completion (the worker is killed after it).
        num_workers: grading processes of this rank; ``None`` = CPUs / local ranks, at most 8.
        name: the function's ``__name__``; TRL logs ``rewards/<name>/mean`` and this reward logs ``<name>/...``
            metrics (``accuracy``, ``no_answer_frac``, ``unparseable_frac``, ``timeouts``, ``unparseable_gold``,
            ``gold_timeouts``).
        protocol: how a completion is graded (:data:`cegppo_trl.rewards.protocols.PROTOCOLS`): ``"boxed"`` (default:
            the last ``\\boxed{}`` after ``</think>``, with fallbacks) or ``"authors"`` (the CE-GPPO authors' own
            training reward: math-verify on the whole completion; see docs/rewards_and_data.md, *Grading
            protocols*). The authors' math-verify timeouts are 5 s each: with the default ``timeout_s`` a slow
            completion is cut at 3 s (status ``timeout``, scored ``unparseable``) where theirs would run on.

    Completions whose gold answer cannot be parsed get ``None`` (TRL ignores them) and are counted in
    ``<name>/unparseable_gold``. Completions whose gold's parse hit the timeout also get ``None`` on that call and
    are counted in ``<name>/gold_timeouts``; the gold is retried on later calls (see :data:`MAX_GOLD_TIMEOUTS`).
    """
    return _MathReward(
        correct=correct,
        wrong=wrong,
        unparseable=unparseable,
        timeout_s=timeout_s,
        num_workers=num_workers,
        name=name,
        protocol=protocol,
    )


_DEFAULT_MATH_REWARD = _MathReward()


def math_reward(
    completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """CE-GPPO's rule-based reward: ``+1.0`` if the final answer verifies, ``-1.0`` otherwise, ``None`` for bad gold.

    Use as ``GRPOTrainer(reward_funcs=[math_reward], ...)`` with a dataset that has a ``solution`` column (see
    :func:`cegppo_trl.load_math_dataset`). ``completions`` may be strings or conversational (lists of messages).
    No answer, an unparseable answer and a grading timeout (3 s) all score ``-1.0``. See :func:`make_math_reward`
    for other values, and docs/rewards_and_data.md for how answers are found and graded.
    """
    return _DEFAULT_MATH_REWARD(completions, solution, **kwargs)


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """``1.0`` if the completion has a closed, non-empty ``\\boxed{...}`` after any think block, else ``0.0``.

    An unclosed ``<think>`` or an unclosed final box scores ``0.0``. Cheap and in-process; an optional second reward.
    """
    return [1.0 if has_boxed_answer(completion) else 0.0 for completion in completions]
