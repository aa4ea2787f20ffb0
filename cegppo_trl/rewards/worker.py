"""The grading worker program, and the status strings it replies with (used by the whole reward).

The parent (:mod:`.grading`) runs this file by path (``runpy.run_path``) in a fresh interpreter, so it imports
only the standard library and math-verify, never the package, torch or TRL. Protocol, one JSON list per line: the worker writes ``["ready", pid]`` once
warm, then reads ``[id, answer | null, gold, soft_timeout]`` and replies ``[id, status, seconds]``; a ``null``
answer asks only whether the gold parses (status ``gold_ok``). A fifth item names a grading protocol: the answer is
then the whole completion, graded by :func:`grade_in_worker` under math-verify's own timeouts (the soft
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
import threading
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


# ----------------------------------------------------------------------------------------------------------------
# The named grading protocols (cegppo_trl.rewards.protocols lists them): pure functions of one completion and one gold,
# here because the worker runs them and imports nothing of the package.
# ----------------------------------------------------------------------------------------------------------------

AUTHORS_TIMEOUT_S = 5
"""The authors' math-verify timeouts: ``parse(..., parsing_timeout=5)`` and ``verify(..., timeout_seconds=5)``."""

LIGHTEVAL_TIMEOUT_S = 5
"""``MultilingualExtractiveMatchMetric``'s ``timeout_seconds`` default (each extraction attempt and comparison)."""


@functools.lru_cache(maxsize=1)
def _math_verify() -> Any:
    """The math-verify module, imported once with its loggers silenced (timeouts and parse failures are verdicts)."""
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    import math_verify

    return math_verify


def _require_main_thread(protocol: str) -> None:
    """math-verify's timeouts (``signal.alarm``) raise outside the main thread, and the authors' ``except Exception``
    would turn that into a silent -1: refuse instead, naming the call that works from any thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"protocols.{protocol}() runs math-verify with its signal-based timeouts, which work only in the main "
            f"thread; from other threads use grade_with_protocol(completions, golds, {protocol!r}), which grades in "
            "the grading worker processes."
        )


def authors(completion: str, gold: str) -> str:
    """The CE-GPPO authors' grader, ``math_verify_from_sky``: reward ``+1`` if this returns ``correct``, else ``-1``.

    math-verify's ``parse`` (default extraction: LaTeX then plain expressions, first-match fallback) runs on the
    whole completion, think block included, with ``parsing_timeout=5``. Fewer than 2 parse results (nothing
    extracted, or a parse that raised or timed out): ``no_answer``. The fallback string ``parsed[1]`` equal to the
    gold: ``correct`` (their fast path). Otherwise ``verify(parse("\\boxed{" + gold + "}"), parsed,
    timeout_seconds=5)``: ``correct`` or ``wrong``; a miss against a gold math-verify cannot parse is ``bad_gold``
    (the authors score it ``-1``; here it is counted apart). An empty completion is ``no_answer``.
    """
    _require_main_thread("authors")
    if not completion or not completion.strip():
        return NO_ANSWER
    mv = _math_verify()
    try:
        parsed = mv.parse(completion, parsing_timeout=AUTHORS_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the authors' `except Exception: return incorrect_score`
        return NO_ANSWER
    if len(parsed) < 2:
        return NO_ANSWER
    if parsed[1] in [gold]:
        return CORRECT
    try:
        gold_parsed = mv.parse("\\boxed{" + gold + "}", parsing_timeout=AUTHORS_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the authors skip a gold whose parse raises
        return BAD_GOLD
    try:
        verdict = bool(gold_parsed) and mv.verify(gold_parsed, parsed, timeout_seconds=AUTHORS_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the authors' `except Exception: continue` -> incorrect
        verdict = False
    return _verdict(verdict, gold_parsed)


def _verdict(verdict: bool, gold_parsed: list) -> str:
    """``correct`` / ``wrong``, or ``bad_gold`` for a miss against a gold math-verify only matched as a string (a
    parsed gold is ``[expression, string]``; the string alone means its LaTeX/expression parse failed)."""
    if verdict:
        return CORRECT
    return BAD_GOLD if len(gold_parsed) < 2 else WRONG


def remove_reasoning_tags(text: str, start_tag: str = "<think>", end_tag: str = "</think>") -> str:
    """lighteval 0.13's ``remove_reasoning_tags`` for one tag pair: while both tags occur, cut from the first start
    tag to the first end tag after it. A lone ``</think>`` (the start tag was in the prompt) or an unclosed
    ``<think>`` leaves the text as it is."""
    while start_tag in text and end_tag in text:
        start = text.find(start_tag)
        end = text.find(end_tag, start)
        if end == -1:
            break
        text = text[:start] + text[end + len(end_tag) :]
    return text


@functools.lru_cache(maxsize=1)
def _lighteval_configs() -> list:
    """lighteval 0.13's ``[ExprExtractionConfig(), LatexExtractionConfig()]`` in math-verify's classes: lighteval's
    LaTeX defaults differ from math-verify's (boxed priority 55, not 50; ``equations=True``)."""
    mv = _math_verify()
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig

    normalization = NormalizationConfig(
        basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="all", equations=True
    )
    latex = mv.LatexExtractionConfig(boxed_match_priority=55, normalization_config=normalization)
    return [mv.ExprExtractionConfig(), latex]


def lighteval(completion: str, gold: str) -> str:
    """What lighteval 0.13's ``pass_at_k_math`` metric scores (math_500, aime24/aime25 pass@1): 1 if ``correct``.

    ``<think>...</think>`` is removed first (lighteval's ``--remove-reasoning-tags``, on by default; see
    :func:`remove_reasoning_tags`), then the rest is graded by :func:`lighteval_avg`'s extractive match.
    """
    return lighteval_avg(remove_reasoning_tags(completion or ""), gold)


def lighteval_avg(completion: str, gold: str) -> str:
    """What lighteval 0.13's ``avg_at_n_math`` metric scores (aime24_avg / aime25_avg, avg@64): 1 if ``correct``.

    That metric reads each sample through ``ModelResponse.__getitem__``, which drops the post-processed text, so the
    think block is NOT removed: the whole completion is graded. The completion and the gold are extracted with
    ``[ExprExtractionConfig(), LatexExtractionConfig()]``, ``fallback_mode="first_match"``,
    ``extraction_mode="any_match"``, timeout 5 s, and compared with precision 6. The gold is read as lighteval's AIME
    tasks pass it (the bare answer); a gold that extracts nothing is compared as its own string, as lighteval does;
    a miss against a gold that does not parse is ``bad_gold``. Nothing extracted from the completion: ``no_answer``. Computed
    with math-verify, not lighteval's own copy of the extraction code (which pins latex2sympy2_extended 1.0.6); the
    anchors count where the two differ.
    """
    _require_main_thread("lighteval")
    if not completion or not completion.strip():
        return NO_ANSWER
    mv = _math_verify()
    configs = _lighteval_configs()

    def extract(s: str) -> list:
        return mv.parse(
            s,
            extraction_config=configs,
            fallback_mode="first_match",
            extraction_mode="any_match",
            parsing_timeout=LIGHTEVAL_TIMEOUT_S,
        )

    predicted = extract(completion)
    if not predicted:
        return NO_ANSWER
    gold_parsed = extract(gold)
    verdict = mv.verify(gold_parsed or [gold], predicted, float_rounding=6, timeout_seconds=LIGHTEVAL_TIMEOUT_S)
    return _verdict(verdict, gold_parsed)


PROTOCOL_GRADERS: dict[str, Callable[[str, str], str]] = {
    "authors": authors,
    "lighteval": lighteval,
    "lighteval_avg": lighteval_avg,
}
"""The protocols a worker grades by name (``boxed`` is :class:`_Grader`'s own grading)."""


def grade_in_worker(protocol: str, completion: str, gold: str) -> str:
    """A grading worker's entry for a protocol task."""
    grade = PROTOCOL_GRADERS.get(protocol)
    return ERROR if grade is None else grade(completion, gold)


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
                status = grade_in_worker(protocol[0], answer, gold)
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
