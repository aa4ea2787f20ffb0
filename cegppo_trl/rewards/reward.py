"""The grading API: :func:`grade_completions`, a status per completion (the reward functions build on it).

A completion is graded in the calling process when that is cheap and exact (no answer, a pre-filtered answer, the
answer string equal to the gold, plain numbers on both sides, a verdict remembered from an earlier call); every
other ``(answer, gold)`` pair goes to the grading workers once per batch. Golds whose parse times out are retried
on later calls, at most :data:`MAX_GOLD_TIMEOUTS` times (docs/rewards_and_data.md, *Slow golds*).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from .extract import answer_and_status, completion_text, normalize_gold
from .grading import GradingMemory, default_num_workers, pool_for
from .prefilter import exact_number, fast_verdict, reject_reason
from .worker import (
    BAD_GOLD,
    CORRECT,
    GOLD_TIMEOUT,
    NO_ANSWER,
    UNPARSEABLE,
)


logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 3.0
"""Default hard bound, in seconds, on grading one completion."""

MAX_GOLD_TIMEOUTS = 3
"""Grading calls on which parsing one gold may hit the soft timeout before the gold is treated as unparseable.

A timed-out gold is not cached (a loaded machine or a long gold is slow, not wrong): its completions get ``None`` on
that call (status ``gold_timeout``) and the gold is parsed again on the next call that needs it. After this many
calls that timed out, it counts as unparseable (``bad_gold``) for the rest of the process, like a gold that fails.
"""

_WARNED_GOLDS: set[str] = set()


class GradeResult(NamedTuple):
    """Outcome of grading one completion.

    ``status`` is one of ``correct``, ``wrong``, ``no_answer``, ``unparseable``, ``timeout``, ``error`` (the grading
    worker died), ``bad_gold`` (the gold answer could not be parsed), ``gold_timeout`` (parsing the gold hit the
    timeout on this call; retried on later calls, see :data:`MAX_GOLD_TIMEOUTS`). ``answer`` is the extracted answer
    (``None`` when there is none) and ``seconds`` the time spent grading this completion.
    """

    status: str
    answer: str | None
    seconds: float


def check_batch(completions: Any, solutions: Any, completions_arg: str, solutions_arg: str) -> None:
    """Raise TypeError naming the argument unless both are sequences (lists) of items, one per completion: a string
    would be read one character per completion and silently mis-grade, None would fail deep inside."""
    kinds = ((completions, completions_arg, "completions (strings or message lists)"),
             (solutions, solutions_arg, "gold answers, one per completion"))  # fmt: skip
    for value, arg, what in kinds:
        if isinstance(value, (str, bytes)) or not (hasattr(value, "__len__") and hasattr(value, "__iter__")):
            shown = f"the string {value[:40]!r}" if isinstance(value, (str, bytes)) else repr(value)[:60]
            hint = (
                f" For one answer repeated, pass [{value[:40]!r}] * len(completions)."
                if isinstance(value, (str, bytes)) and arg == solutions_arg
                else ""
            )
            raise TypeError(
                f"{arg} must be a list of {what} (TRL passes the batch's completions and the dataset's `solution` "
                f"column as lists); got {shown}.{hint}"
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
    check_batch(completions, solutions, "completions", "solutions")
    if len(completions) != len(solutions):
        raise ValueError(
            f"got {len(completions)} completions but {len(solutions)} solutions; pass one gold answer per "
            "completion (TRL repeats the dataset's `solution` column for every generation)."
        )
    check_grading_settings(timeout_s, num_workers)
    pool = pool_for(default_num_workers() if num_workers is None else num_workers)
    start = time.perf_counter()
    batch = _GradingBatch(pool.memory)
    for completion, solution in zip(completions, solutions, strict=True):
        batch.add_row(completion, solution)
    batch.add_gold_checks()
    batch.seconds = [(time.perf_counter() - start) / max(1, len(completions))] * len(completions)
    if batch.tasks:
        batch.apply(pool.grade(batch.tasks, float(timeout_s)))
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
        self.tasks: list[tuple[str | None, str]] = []
        self.task_rows: list[list[int]] = []  # rows that take their status from each task
        self.task_of_pair: dict[tuple[str | None, str], int] = {}
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
            self.add_task(answer, gold, row)
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

    def add_task(self, answer: str | None, gold: str, row: int | None = None) -> None:
        """Queue ``(answer, gold)`` for a worker once per batch: GRPO groups repeat the same answers a lot."""
        index = self.task_of_pair.get((answer, gold))
        if index is None:
            index = self.task_of_pair[(answer, gold)] = len(self.tasks)
            self.tasks.append((answer, gold))
            self.task_rows.append([])
        if row is not None:
            self.task_rows[index].append(row)

    def add_gold_checks(self) -> None:
        """A gold-only task for each gold of a locally graded row that no task of this batch already carries."""
        golds_in_tasks = {gold for _, gold in self.tasks}
        for row in self.needs_gold_check:
            if self.golds[row] not in golds_in_tasks:
                self.add_task(None, self.golds[row])  # type: ignore[arg-type]

    def apply(self, outcomes: Sequence[tuple[str, float]]) -> None:
        """Take each task's ``(status, seconds)`` for its rows, remember what it says, count slow golds once."""
        slow_golds: set[str] = set()  # golds whose parse timed out in some task of this call
        for task, rows, (status, spent) in zip(self.tasks, self.task_rows, outcomes, strict=True):
            self.memory.learn(task, status)
            if status == GOLD_TIMEOUT:
                slow_golds.add(task[1])
            for row in rows:
                self.statuses[row] = status
                self.seconds[row] = spent
        self.timed_out = {gold for gold in slow_golds if not self.memory.gold_is_known(gold)}
        for gold in self.timed_out:  # one count per call, however many tasks carried the gold
            count = self.memory.count_gold_timeout(gold, MAX_GOLD_TIMEOUTS)
            _warn_gold_once(
                gold,
                "math_reward: parsing gold answer %.200r hit the timeout (%d of %d); its completions get reward None "
                "on this call%s.",
                gold,
                count,
                MAX_GOLD_TIMEOUTS,
                " and, from now on, it is treated as unparseable" if count >= MAX_GOLD_TIMEOUTS else "",
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
                _warn_gold_once(
                    repr(solutions[row]),
                    "math_reward: gold answer %.200r cannot be parsed; its completions get reward None (skipped by "
                    "TRL).",
                    solutions[row],
                )
            results.append(GradeResult(status, self.answers[row], self.seconds[row]))  # type: ignore[arg-type]
        return results


def _warn_gold_once(key: str, message: str, *args: Any) -> None:
    """Log ``message`` once per ``key``, for at most 20 keys per process (a bad data set must not flood the log)."""
    if len(_WARNED_GOLDS) < 20 and key not in _WARNED_GOLDS:
        _WARNED_GOLDS.add(key)
        logger.warning(message, *args)
