"""The grading worker program, the status strings, and the math-verify graders of the named protocols.

:mod:`.grading` runs this file by path in a fresh interpreter, so it imports only the standard library and
math-verify. One JSON list per line: the worker writes ``["ready", pid]`` once warm, then reads ``[id, answer | null,
gold, soft_timeout, protocol?]`` and replies ``[id, status, seconds]``; a ``null`` answer only checks that the gold
parses (``gold_ok``); with a protocol the answer is the whole completion, graded under math-verify's own timeouts.
Why: docs/rewards_and_data.md, *Timeouts and worker processes*.
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


STATUSES = ("correct", "wrong", "no_answer", "unparseable", "timeout", "error", "bad_gold", "gold_timeout")
CORRECT, WRONG, NO_ANSWER, UNPARSEABLE, TIMEOUT, ERROR, BAD_GOLD, GOLD_TIMEOUT = STATUSES
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


@functools.lru_cache(maxsize=1)
def math_verify() -> Any:
    """The math-verify module, imported once with its loggers silenced (timeouts and parse failures are verdicts)."""
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    import math_verify

    return math_verify


def parse_boxed(s: str) -> list:
    """``\\boxed{s}`` parsed with math-verify's LaTeX extraction only (never ``ExprExtractionConfig``, which evaluates
    text) and no timeout of its own."""
    mv = math_verify()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0)]
    return mv.parse(
        "\\boxed{" + s + "}", config, fallback_mode="no_fallback", extraction_mode="first_match", parsing_timeout=None
    )


@functools.lru_cache(maxsize=50_000)  # a GRPO batch repeats each gold many times
def _parsed_gold(gold: str, soft: float) -> list:
    """The parsed gold (``[]`` if it does not parse); a soft timeout raises ``_GoldTimeout``, which is not cached."""
    parsed = _with_soft_timeout(lambda: parse_boxed(gold), soft)
    if isinstance(parsed, str):  # TIMEOUT: no verdict; the next task with this gold parses it again
        raise _GoldTimeout
    return parsed


def grade(answer: str | None, gold: str, soft: float) -> str:  # pragma: no cover - runs in the worker
    """The status of ``answer`` against ``gold`` (``gold_ok`` for a gold-only check) within ``soft`` seconds."""
    start = time.perf_counter()
    try:
        gold_parsed = _parsed_gold(gold, soft)
    except _GoldTimeout:
        return GOLD_TIMEOUT
    if not gold_parsed:
        return BAD_GOLD
    if answer is None:
        return GOLD_OK

    def grade_answer() -> str:
        answer_parsed = parse_boxed(answer)
        if not answer_parsed:
            return UNPARSEABLE
        return CORRECT if math_verify().verify(gold_parsed, answer_parsed, timeout_seconds=None) else WRONG

    return _with_soft_timeout(grade_answer, soft - (time.perf_counter() - start))


# ----------------------------------------------------------------------------------------------------------------
# The named protocols' graders (listed in .protocols): here because the worker runs them.
# ----------------------------------------------------------------------------------------------------------------

AUTHORS_TIMEOUT_S = 5
"""The authors' math-verify timeouts: ``parse(..., parsing_timeout=5)`` and ``verify(..., timeout_seconds=5)``."""

LIGHTEVAL_TIMEOUT_S = 5
"""``MultilingualExtractiveMatchMetric``'s ``timeout_seconds`` default (each extraction attempt and comparison)."""


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
    """The CE-GPPO authors' grader, ``math_verify_from_sky`` (reward ``+1`` if this returns ``correct``, else ``-1``).

    ``parse`` of the whole completion with math-verify's defaults; fewer than 2 results: ``no_answer``; ``parsed[1]``
    equal to the gold: ``correct``; else ``verify`` against ``parse("\\boxed{" + gold + "}")``, all with 5 s timeouts.
    A miss against a gold math-verify cannot parse is ``bad_gold`` (the authors score it ``-1``).
    """
    _require_main_thread("authors")
    if not completion or not completion.strip():
        return NO_ANSWER
    mv = math_verify()
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
    tag to the first end tag after it. A lone ``</think>`` or an unclosed ``<think>`` leaves the text as it is."""
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
    mv = math_verify()
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig

    normalization = NormalizationConfig(
        basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="all", equations=True
    )
    latex = mv.LatexExtractionConfig(boxed_match_priority=55, normalization_config=normalization)
    return [mv.ExprExtractionConfig(), latex]


def lighteval(completion: str, gold: str) -> str:
    """What lighteval 0.13's ``pass_at_k_math`` metric scores (math_500, aime24/aime25 pass@1): 1 if ``correct``.

    The think block is removed (:func:`remove_reasoning_tags`), then the rest is graded as :func:`lighteval_avg`.
    """
    return lighteval_avg(remove_reasoning_tags(completion or ""), gold)


def lighteval_avg(completion: str, gold: str) -> str:
    """What lighteval 0.13's ``avg_at_n_math`` metric scores (aime24_avg / aime25_avg): 1 if ``correct``.

    The whole completion (think block included, as that metric reads it) and the gold are extracted with lighteval's
    configs, ``fallback_mode="first_match"``, ``extraction_mode="any_match"``, 5 s, and compared with precision 6; a
    gold that extracts nothing is compared as its own string. Nothing extracted: ``no_answer``; a miss against a gold
    that does not parse: ``bad_gold``.
    """
    _require_main_thread("lighteval")
    if not completion or not completion.strip():
        return NO_ANSWER
    mv = math_verify()

    def extract(s: str) -> list:
        return mv.parse(s, _lighteval_configs(), parsing_timeout=LIGHTEVAL_TIMEOUT_S)  # first_match, any_match

    predicted = extract(completion)
    if not predicted:
        return NO_ANSWER
    gold_parsed = extract(gold)
    verdict = mv.verify(gold_parsed or [gold], predicted, float_rounding=6, timeout_seconds=LIGHTEVAL_TIMEOUT_S)
    return _verdict(verdict, gold_parsed)


PROTOCOL_GRADERS = {"authors": authors, "lighteval": lighteval, "lighteval_avg": lighteval_avg}
"""The protocols a worker grades by name (``boxed`` is :func:`grade`)."""


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
    """Warm up, say ``ready``, then grade the task lines of stdin until it closes."""
    out = _reply_stream()
    for answer, gold in WARM_UP:  # pay sympy's first comparisons now, not inside the first step's timeouts
        grade(answer, gold, 60.0)
    _parsed_gold.cache_clear()
    out.write(json.dumps(["ready", os.getpid()]) + "\n")
    while line := sys.stdin.buffer.readline():  # EOF: the parent closed our stdin (exit) or died
        task_id, answer, gold, soft, *protocol = json.loads(line)
        start = time.perf_counter()
        try:
            if protocol:  # math-verify's own timeouts (signal.alarm) bound it; our soft timer would clash with them
                status = PROTOCOL_GRADERS[protocol[0]](answer, gold)
            else:
                status = grade(answer, gold, float(soft))
        except Exception:  # noqa: BLE001 - a grading bug must cost one completion, not the worker
            status = ERROR
        except _SoftTimeout:
            status = TIMEOUT
        try:
            out.write(json.dumps([task_id, status, time.perf_counter() - start]) + "\n")
        except BrokenPipeError:
            return  # the parent is gone
