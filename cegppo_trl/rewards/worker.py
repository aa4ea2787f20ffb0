"""The grading worker program, and the status strings it replies with (used by the whole reward).

The parent (:mod:`.grading`) runs this file by path (``runpy.run_path``) in a fresh interpreter, so it imports
only the standard library and math-verify (and, for a named grading protocol, ``cegppo_trl.rewards.protocols`` from
the same checkout), never torch or TRL. Protocol, one JSON list per line: the worker writes ``["ready", pid]`` once
warm, then reads ``[id, answer | null, gold, soft_timeout]`` and replies ``[id, status, seconds]``; a ``null``
answer asks only whether the gold parses (status ``gold_ok``). A fifth item names a grading protocol: the answer is
then the whole completion, graded by :func:`.protocols.grade_in_worker` under math-verify's own timeouts (the soft
timer stays off; the parent's hard timeout still applies). Why a worker, and the two timeouts:
docs/rewards_and_data.md, *Timeouts and worker processes*.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any


# Statuses of one graded completion.
CORRECT, WRONG, NO_ANSWER, UNPARSEABLE, TIMEOUT, ERROR, BAD_GOLD, GOLD_TIMEOUT = (
    "correct",
    "wrong",
    "no_answer",
    "unparseable",
    "timeout",
    "error",
    "bad_gold",
    "gold_timeout",
)
STATUSES = (CORRECT, WRONG, NO_ANSWER, UNPARSEABLE, TIMEOUT, ERROR, BAD_GOLD, GOLD_TIMEOUT)
GOLD_OK = "gold_ok"  # reply to a gold-only check

ADDRESS_SPACE_LIMIT = 3 * 1024**3  # a runaway integer must not take the machine's memory before the parent's kill


class _SoftTimeout(BaseException):
    """Raised by the worker's timer; a BaseException so that math-verify's ``except Exception`` cannot swallow it."""


class _GoldTimeout(Exception):
    """Parsing a gold hit the soft timeout (never cached: a slow parse says nothing about the gold)."""


_ARMED = [False]


def _on_alarm(signum, frame):  # pragma: no cover - runs in the worker
    if _ARMED[0]:
        _ARMED[0] = False  # fire once: a second raise could land outside the guarded region
        raise _SoftTimeout


def _with_soft_timeout(fn: Callable[[], Any], seconds: float) -> Any:  # pragma: no cover - runs in the worker
    """``fn()``, or the string ``TIMEOUT`` if it is still running after ``seconds``."""
    try:
        try:
            _ARMED[0] = True
            signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
            return fn()
        finally:
            _ARMED[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
        return TIMEOUT


# Graded once before "ready": sympy's first comparison of each kind is many times slower than later ones.
WARM_UP = [
    ("1", "1"),
    ("(x+1)^2", "x^2+2x+1"),
    ("(x+2)^2", "x^2+2x+1"),
    ("[1, 2)", "(1,2)"),
    (r"\frac{3}{4}\pi", r"\frac{3\pi}{4}"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\frac{1}{3}", "0.5"),
    ("x=3", "3"),
    (r"\{1,2\}", r"\{2,1\}"),
]


def load_math_verify() -> tuple[Callable[[str], list], Callable[[list, list], bool]]:
    """Import math-verify with its loggers silenced; return ``(parse_latex, verify)`` as the worker calls them.

    ``parse_latex(s)`` parses ``\\boxed{s}`` with math-verify's LaTeX extraction only (never its
    ``ExprExtractionConfig``, which evaluates text); neither function has a timeout of its own.
    """
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)

    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0)]

    def parse_latex(s: str) -> list:
        return parse(
            "\\boxed{" + s + "}",
            extraction_config=config,
            fallback_mode="no_fallback",
            extraction_mode="first_match",
            parsing_timeout=None,
        )

    def verify_parsed(gold: list, answer: list) -> bool:
        return verify(gold, answer, timeout_seconds=None)

    return parse_latex, verify_parsed


class _Grader:
    """math-verify with the soft timeout, and an LRU of parsed golds (a GRPO batch repeats each gold many times)."""

    def __init__(self, parse_latex: Callable[[str], list], verify: Callable[[list, list], bool]) -> None:
        self.parse_latex = parse_latex
        self.verify = verify
        self.budget = 0.0  # soft timeout of the gold parse in progress (the LRU keys on the gold alone)
        self.parsed_gold = functools.lru_cache(maxsize=50_000)(self._parse_gold)

    def _parse_gold(self, gold: str) -> list:
        """The parsed gold (``[]`` if it does not parse); a soft timeout raises ``_GoldTimeout`` and is not cached."""
        parsed = _with_soft_timeout(lambda: self.parse_latex(gold), self.budget)
        if isinstance(parsed, str):  # TIMEOUT: a slow parse is no verdict; the next task with this gold retries it
            raise _GoldTimeout
        return parsed

    def grade(self, answer: str | None, gold: str, soft: float) -> str:
        """The status of ``answer`` against ``gold`` (``gold_ok`` for a gold-only check) within ``soft`` seconds."""
        start = time.perf_counter()
        self.budget = soft
        try:
            gold_parsed = self.parsed_gold(gold)
        except _GoldTimeout:
            return GOLD_TIMEOUT
        if not gold_parsed:
            return BAD_GOLD
        if answer is None:
            return GOLD_OK

        def grade_answer() -> str:
            answer_parsed = self.parse_latex(answer)
            if not answer_parsed:
                return UNPARSEABLE
            return CORRECT if self.verify(gold_parsed, answer_parsed) else WRONG

        return _with_soft_timeout(grade_answer, soft - (time.perf_counter() - start))

    def warm_up(self) -> None:
        """Pay sympy's first comparisons before announcing readiness, not inside the first step's timeouts."""
        for answer, gold in WARM_UP:
            self.grade(answer, gold, 60.0)
        self.parsed_gold.cache_clear()


def _protocol_grader() -> Callable[[str, str, str], str]:  # pragma: no cover - runs in the worker
    """``grade_in_worker`` of the ``protocols`` module beside this file, imported from this same checkout."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if package_root not in sys.path:
        sys.path.insert(0, package_root)
    from cegppo_trl.rewards.protocols import grade_in_worker

    return grade_in_worker


def _reply_stream() -> Any:  # pragma: no cover - runs in the worker
    """Take stdout for the replies alone, ignore Ctrl-C, arm the timer's handler and cap the address space."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the reply stream
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us if needed
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))
    except (ImportError, ValueError, OSError):
        pass
    return out


def _worker_main() -> None:  # pragma: no cover - runs in the worker (exercised by the tests through the pool)
    """Grade ``[id, answer|null, gold, soft_timeout]`` JSON lines from stdin, reply ``[id, status, seconds]``."""
    out = _reply_stream()
    grader = _Grader(*load_math_verify())
    grader.warm_up()
    out.write(json.dumps(["ready", os.getpid()]) + "\n")
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return  # the parent closed our stdin (exit) or died
        task_id, answer, gold, soft, *protocol = json.loads(line)
        start = time.perf_counter()
        try:
            if protocol:  # math-verify's own timeouts (signal.alarm) bound it; our soft timer would clash with them
                status = _protocol_grader()(protocol[0], answer, gold)
            else:
                status = grader.grade(answer, gold, float(soft))
        except Exception:  # noqa: BLE001 - a grading bug must cost one completion, not the worker
            status = ERROR
        except _SoftTimeout:
            status = TIMEOUT
        try:
            out.write(json.dumps([task_id, status, time.perf_counter() - start]) + "\n")
        except BrokenPipeError:
            return  # the parent is gone
