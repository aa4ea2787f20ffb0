"""The grading API and the reward functions for TRL's ``GRPOTrainer``.

:func:`grade_completions` gives a status per completion, decided in the calling process when that is cheap and exact
(no answer, a pre-filtered answer, the answer string equal to the gold, plain numbers on both sides, a verdict
remembered from an earlier call), else by the grading workers once per distinct ``(answer, gold)`` pair;
:func:`grade_with_protocol` grades with a named protocol (:mod:`.protocols`). :func:`math_reward`,
:func:`make_math_reward` and :func:`format_reward` are the reward functions built on them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .extract import answer_and_status, completion_text, has_boxed_answer, normalize_gold
from .grading import GradingMemory, default_num_workers, pool_for
from .prefilter import exact_number, fast_verdict, reject_reason
from .protocols import DEFAULT_PROTOCOL, resolve_protocol
from .worker import BAD_GOLD, CORRECT, ERROR, GOLD_TIMEOUT, NO_ANSWER, TIMEOUT, UNPARSEABLE, WRONG


logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 3.0
"""Default hard bound, in seconds, on grading one completion."""

MAX_GOLD_TIMEOUTS = 3
"""Grading calls on which parsing one gold may hit the soft timeout (status ``gold_timeout``, retried on the next
call) before the gold counts as unparseable for the rest of the process (docs/rewards_and_data.md, *Slow golds*)."""

_WARNED_GOLDS: set[str] = set()


class GradeResult(NamedTuple):
    """Outcome of grading one completion.

    ``status`` is one of ``correct``, ``wrong``, ``no_answer``, ``unparseable``, ``timeout``, ``error`` (the grading
    worker died), ``bad_gold`` (the gold answer could not be parsed), ``gold_timeout`` (parsing the gold hit the
    timeout on this call; retried on later calls, see :data:`MAX_GOLD_TIMEOUTS`). ``answer`` is the extracted answer
    (``None`` when there is none or the protocol extracts none) and ``seconds`` the time spent grading it.
    """

    status: str
    answer: str | None
    seconds: float


def check_batch(completions: Any, golds: Any, golds_arg: str) -> None:
    """``TypeError`` naming the argument unless both are sequences of items (a string would be read one character
    per completion and silently mis-grade), ``ValueError`` unless there is one gold per completion."""
    for value, arg, what in ((completions, "completions", "completions (strings or message lists)"),
                             (golds, golds_arg, "gold answers, one per completion")):  # fmt: skip
        if isinstance(value, (str, bytes)) or not (hasattr(value, "__len__") and hasattr(value, "__iter__")):
            is_text = isinstance(value, (str, bytes))
            shown = f"the string {value[:40]!r}" if is_text else repr(value)[:60]
            hint = (
                f" For one answer repeated, pass [{value[:40]!r}] * len(completions)."
                if is_text and arg == golds_arg
                else ""
            )
            raise TypeError(
                f"{arg} must be a list of {what} (TRL passes the batch's completions and the dataset's `solution` "
                f"column as lists); got {shown}.{hint}"
            )
    if len(completions) != len(golds):
        raise ValueError(
            f"got {len(completions)} completions but {len(golds)} gold answers ({golds_arg}); pass one gold answer "
            "per completion (TRL repeats the dataset's `solution` column for every generation)."
        )


def check_grading_settings(timeout_s: Any, num_workers: Any) -> None:
    """Raise ``ValueError`` unless ``timeout_s`` is a positive finite number and ``num_workers`` None or >= 1."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
        raise ValueError(f"num_workers must be a positive integer or None (auto), got {num_workers!r}.")


def grade_completions(
    completions: Sequence[Any],
    solutions: Sequence[Any],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    num_workers: int | None = None,
) -> list[GradeResult]:
    """Grade each completion against its gold answer; one :class:`GradeResult` per completion, in order.

    Never raises on the content of a completion or a gold answer, and never spends more than ``timeout_s`` seconds
    of a worker on one completion. ``num_workers`` defaults to the CPUs of this process divided by the number of
    local ranks (``LOCAL_WORLD_SIZE``), at most 8.
    """
    check_batch(completions, solutions, "solutions")
    check_grading_settings(timeout_s, num_workers)
    pool = pool_for(default_num_workers() if num_workers is None else num_workers)
    start = time.perf_counter()
    batch = _GradingBatch(pool.memory)
    for completion, solution in zip(completions, solutions, strict=True):
        batch.add_row(completion, solution)
    batch.add_gold_checks()
    batch.seconds = [(time.perf_counter() - start) / max(1, len(completions))] * len(completions)
    if batch.task_rows:
        batch.apply(pool.grade(list(batch.task_rows), float(timeout_s)))
    return batch.results(solutions)


class _GradingBatch:
    """One :func:`grade_completions` call: each row's status decided in-process where that is cheap and exact, the
    ``(answer, gold)`` tasks for the workers (once per distinct pair), then the workers' replies merged in."""

    def __init__(self, memory: GradingMemory) -> None:
        self.memory = memory
        self.statuses: list[str | None] = []
        self.answers: list[str | None] = []
        self.golds: list[str | None] = []
        self.seconds: list[float] = []
        self.task_rows: dict[tuple[str | None, str], list[int]] = {}  # each task, the rows that take its status
        self.needs_gold_check: list[int] = []  # rows decided locally whose gold is not yet known to parse
        self.timed_out: set[str] = set()  # golds whose parse timed out on this call and that nothing settled

    def add_row(self, completion: Any, solution: Any) -> None:
        """Extract the row's answer and decide its status locally, or queue a task for a worker."""
        row = len(self.statuses)
        gold = normalize_gold(solution)
        if gold is not None and reject_reason(gold):
            gold = None
        text = completion_text(completion)
        answer, extract_status = (None, NO_ANSWER) if text is None else answer_and_status(text)
        self.golds.append(gold)
        self.answers.append(answer)
        if gold is None or self.memory.gold_is_bad(gold):
            self.statuses.append(BAD_GOLD)
            return
        status = self._local_status(answer, extract_status, gold)
        self.statuses.append(status)
        if status is None:
            self.task_rows.setdefault((answer, gold), []).append(row)  # GRPO groups repeat the same answers a lot
        elif exact_number(gold) is None and not self.memory.gold_is_known(gold):
            self.needs_gold_check.append(row)  # graded locally: the gold still has to be known to parse

    def _local_status(self, answer: str | None, extract_status: str, gold: str) -> str | None:
        """The row's status when no worker is needed, else ``None``."""
        if answer is None:
            return extract_status
        if reject_reason(answer):
            return UNPARSEABLE
        if " ".join(answer.split()) == " ".join(gold.split()):
            return CORRECT  # the same string verifies whenever the gold parses (checked by add_gold_checks)
        return fast_verdict(answer, gold) or self.memory.verdict(answer, gold)

    def add_gold_checks(self) -> None:
        """A gold-only task for each gold of a locally graded row that no task of this batch already carries."""
        golds_in_tasks = {gold for _, gold in self.task_rows}
        for row in self.needs_gold_check:
            if self.golds[row] not in golds_in_tasks:
                self.task_rows.setdefault((None, self.golds[row]), [])  # type: ignore[arg-type]

    def apply(self, outcomes: Sequence[tuple[str, float]]) -> None:
        """Take each task's ``(status, seconds)`` for its rows, remember what it says, count slow golds once."""
        slow_golds: set[str] = set()  # golds whose parse timed out in some task of this call
        for (task, rows), (status, spent) in zip(self.task_rows.items(), outcomes, strict=True):
            self.memory.learn(task, status)
            if status == GOLD_TIMEOUT:
                slow_golds.add(task[1])
            for row in rows:
                self.statuses[row] = status
                self.seconds[row] = spent
        self.timed_out = {gold for gold in slow_golds if not self.memory.gold_is_known(gold)}
        for gold in self.timed_out:  # one count per call, however many tasks carried the gold
            count = self.memory.count_gold_timeout(gold, MAX_GOLD_TIMEOUTS)
            settled = " and, from now on, it is treated as unparseable" if count >= MAX_GOLD_TIMEOUTS else ""
            _warn_gold_once(
                gold,
                f"math_reward: parsing gold answer {gold[:200]!r} hit the timeout ({count} of {MAX_GOLD_TIMEOUTS}); "
                f"its completions get reward None on this call{settled}.",
            )

    def results(self, solutions: Sequence[Any]) -> list[GradeResult]:
        """One result per row; a locally decided row whose gold turned out bad or slow takes the gold's status."""
        results = []
        for row, status in enumerate(self.statuses):
            gold = self.golds[row]
            if gold is not None and status not in (BAD_GOLD, GOLD_TIMEOUT):
                if gold in self.timed_out:
                    status = GOLD_TIMEOUT  # decided locally, but the gold could not be checked in time
                elif self.memory.gold_is_bad(gold):
                    status = BAD_GOLD
            if status == BAD_GOLD:
                shown = repr(solutions[row])
                message = f"math_reward: gold answer {shown[:200]} cannot be parsed; its completions get reward None"
                _warn_gold_once(shown, message + " (skipped by TRL).")
            results.append(GradeResult(status, self.answers[row], self.seconds[row]))  # type: ignore[arg-type]
        return results


def _warn_gold_once(key: str, message: str) -> None:
    """Log ``message`` once per ``key``, for at most 20 keys per process (a bad data set must not flood the log)."""
    if len(_WARNED_GOLDS) < 20 and key not in _WARNED_GOLDS:
        _WARNED_GOLDS.add(key)
        logger.warning(message)


def grade_with_protocol(
    completions: Sequence[Any],
    golds: Sequence[Any],
    protocol: str = DEFAULT_PROTOCOL,
    *,
    timeout_s: float | None = None,
    num_workers: int | None = None,
) -> list[GradeResult]:
    """Grade each completion against its gold with ``protocol``: one :class:`GradeResult` per completion, in order.

    Runs in the grading pool: no completion takes a worker longer than ``timeout_s`` (default: the protocol's
    ``timeout_s``), and nothing a completion or gold holds can raise here. ``boxed`` is :func:`grade_completions`;
    the other protocols' ``answer`` is None. Completions may be strings or message lists.
    """
    spec = resolve_protocol(protocol)
    timeout_s = spec.timeout_s if timeout_s is None else timeout_s
    if spec.name == "boxed":
        return grade_completions(completions, golds, timeout_s=timeout_s, num_workers=num_workers)
    check_batch(completions, golds, "golds")
    check_grading_settings(timeout_s, num_workers)
    statuses: list[str | None] = []
    task_rows: dict[tuple[str, str, str], list[int]] = {}
    for row, (completion, gold) in enumerate(zip(completions, golds, strict=True)):
        text, gold_text = completion_text(completion), gold if isinstance(gold, str) else normalize_gold(gold)
        if gold_text is None or not gold_text.strip():  # a string gold as given: the authors compare the raw string
            statuses.append(BAD_GOLD)
        elif text is None or not text.strip():
            statuses.append(NO_ANSWER)
        else:
            statuses.append(None)
            task_rows.setdefault((text.replace("\x00", ""), gold_text, spec.name), []).append(row)
    seconds = [0.0] * len(statuses)
    if task_rows:
        pool = pool_for(default_num_workers() if num_workers is None else num_workers)
        for rows, (status, task_seconds) in zip(task_rows.values(), pool.grade(list(task_rows), float(timeout_s))):
            for row in rows:
                statuses[row], seconds[row] = status, task_seconds
    return [GradeResult(status, None, s) for status, s in zip(statuses, seconds, strict=True)]  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# The reward functions
# ----------------------------------------------------------------------------------------------------------------


class make_math_reward:  # a class, not a closure, so that it pickles (TRL's async rollout worker pickles rewards)
    """Build a math-verify reward function for ``GRPOTrainer(reward_funcs=[...])``, with other values than
    :func:`math_reward`'s +1 / -1, another timeout, worker count or grading protocol; the result is picklable.

    Call signature: ``reward(completions, solution, **kwargs) -> list[float | None]``. ``correct`` must be the
    highest value; ``unparseable`` (no answer, unparseable, timed out) ``None`` means ``wrong``, as in the paper;
    ``timeout_s`` bounds the grading of one completion (its worker is killed after it); ``num_workers``: grading
    processes of this rank (``None``: CPUs / local ranks, at most 8); ``name``: the ``__name__`` TRL logs
    (``rewards/<name>/mean``) and the prefix of this reward's metrics; ``protocol``: ``"boxed"`` or ``"authors"``
    (the CE-GPPO authors' training reward), see :mod:`.protocols`. A completion whose gold cannot be parsed, or whose
    gold's parse timed out on this call, gets ``None``. Details: docs/rewards_and_data.md, *Reward*.
    """

    def __init__(
        self,
        correct: float = 1.0,
        wrong: float = -1.0,
        unparseable: float | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_workers: int | None = None,
        name: str = "math_reward",
        protocol: str = DEFAULT_PROTOCOL,
    ) -> None:
        self.protocol = resolve_protocol(protocol).name  # ValueError naming the protocols
        values = {"correct": correct, "wrong": wrong, "unparseable": wrong if unparseable is None else unparseable}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value!r}.")
        if not correct > max(values["wrong"], values["unparseable"]):
            raise ValueError(
                f"correct={correct} must be the highest reward, above wrong={wrong} and unparseable={unparseable}; "
                "otherwise the policy is pushed away from right answers."
            )
        check_grading_settings(timeout_s, num_workers)
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string (TRL logs rewards/<name>/mean), got {name!r}.")
        self.correct, self.wrong, self.unparseable = (float(v) for v in values.values())
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self.__name__ = name  # TRL names the metrics after it

    def __repr__(self) -> str:
        protocol = "" if self.protocol == DEFAULT_PROTOCOL else f", protocol={self.protocol!r}"
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
        check_batch(completions, solution, "solution")
        graded = grade_with_protocol(
            completions, solution, self.protocol, timeout_s=self.timeout_s, num_workers=self.num_workers
        )
        value = {CORRECT: self.correct, WRONG: self.wrong, BAD_GOLD: None, GOLD_TIMEOUT: None}  # None: no usable gold
        prefix = self.__name__
        if callable(log_metric) and graded:
            counts = Counter(g.status for g in graded)
            gradable = len(graded) - counts[BAD_GOLD] - counts[GOLD_TIMEOUT]
            log_metric(f"{prefix}/unparseable_gold", float(counts[BAD_GOLD]))
            log_metric(f"{prefix}/gold_timeouts", float(counts[GOLD_TIMEOUT]))
            log_metric(f"{prefix}/timeouts", float(counts[TIMEOUT] + counts[ERROR]))
            if gradable:
                log_metric(f"{prefix}/accuracy", counts[CORRECT] / gradable)
                log_metric(f"{prefix}/no_answer_frac", counts[NO_ANSWER] / gradable)
                log_metric(f"{prefix}/unparseable_frac", counts[UNPARSEABLE] / gradable)
        if callable(log_extra):
            log_extra(f"{prefix}/answer", [None if g.answer is None else g.answer[:200] for g in graded])
            log_extra(f"{prefix}/status", [g.status for g in graded])
        return [value.get(g.status, self.unparseable) for g in graded]


_DEFAULT_MATH_REWARD = make_math_reward()


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
    """``1.0`` if the completion has a closed, non-empty ``\\boxed{...}`` after any think block, else ``0.0``."""
    return [1.0 if has_boxed_answer(completion) else 0.0 for completion in completions]
