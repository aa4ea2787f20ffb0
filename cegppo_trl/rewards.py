"""Verifiable math rewards for TRL's ``GRPOTrainer`` (and the CE-GPPO trainer built on it).

Public API
----------
- :func:`math_reward` -- the paper's reward: ``+1`` if the final answer verifies against the gold, ``-1`` otherwise.
- :func:`make_math_reward` -- the same reward with configurable values, timeout and worker count.
- :func:`format_reward` -- ``1.0`` if the text after any think block has a closed, non-empty ``\\boxed{...}``.
- :func:`extract_answer` -- the answer string the reward grades (or ``None``).
- :func:`grade_completions` -- the grading core, returning a status and latency per completion.
- :func:`shutdown_grading_workers` -- stop the worker processes now (they are also stopped at exit).

How a completion is graded
--------------------------
1. The text after the last ``</think>`` is kept; a ``<think>`` that is never closed means "no answer".
2. The answer is the content of the *last* ``\\boxed{...}``; without a box, the last ``#### X``, then the last
   "answer is X" / "Answer: X", then a number ending the text.
3. Cheap pre-filters reject answers that cannot be graded in bounded time (over 1000 characters, nesting deeper than
   10, exponent towers or factorials of huge literals); they count as unparseable.
4. Plain numbers on both sides (``72``, ``-3``, ``1,000``, ``0.5``, ``\\frac{3}{4}``) are compared exactly in the
   calling process. Everything else goes to math-verify in worker processes with a hard per-completion timeout.

Why worker processes, always (no in-process grading with signal timeouts)
-------------------------------------------------------------------------
math-verify's own timeout uses ``signal.alarm`` (whole seconds), which raises ``ValueError`` outside the main thread
(TRL can call rewards from worker threads). In the main thread its ``TimeoutException`` is a ``BaseException``:
math-verify's inner ``except Exception`` handlers let it through, and ``parse`` / ``verify`` catch it at the top and
return ``[]`` / ``False``, so a timeout cannot be told from an unparseable or wrong answer. A signal handler runs only
between Python bytecodes, so C-level work (one huge big-integer operation, gmpy2) runs on until it returns, and a
runaway integer in the trainer's own process would take its memory. So every completion that is not a plain number is
graded in a small pool of worker processes (started with ``subprocess``: no ``multiprocessing`` start-method or
``__main__`` re-import issues under torchrun/accelerate). Inside a worker, a timer raising a ``BaseException`` of its
own (``_SoftTimeout``, which math-verify does not catch) ends a slow grade cleanly at about 0.8 x ``timeout_s``; if
that fails, the parent SIGKILLs the worker at ``timeout_s``, reaps it and starts a replacement. Workers have a 3 GiB
address-space limit, are started lazily, shared by all reward functions of a process (one pool per worker count),
dropped in children after ``fork``, and killed at interpreter exit. Plain-number pairs (most answers in practice)
never leave the calling process, so small batches and the demo pay no inter-process cost for them.

Slow golds are not bad golds
----------------------------
A gold whose parse hits the soft timeout is cached nowhere (neither in the worker's LRU of parsed golds nor in the
parent): its completions get ``None`` on that call (status ``gold_timeout``, metric ``<name>/gold_timeouts``) and the
gold is parsed again on the next call. After :data:`MAX_GOLD_TIMEOUTS` (3) calls on which it timed out, it is treated
as unparseable (``bad_gold``, metric ``<name>/unparseable_gold``) for the rest of the process.

Why not pebble
--------------
``benchmarks/bench_grader_pool.py`` (2 workers, timeout 3 s; pebble's parent pre-imports math-verify, its best case):

    row                              own pool                    pebble 5.2.3
    start-up to first result         8.3 s                       4.0 s
    ordinary step (96 pairs)         23 pairs/s                  21 pairs/s
    hostile batch (8, no pre-filter) 10.0 s, 7/8 cut, then ok    12.7 s, 7/8 cut, then ok
    2 ranks (torchrun)               15.5 s, 0 workers left      20.1 s, 0 workers left
    no __main__ guard, fork          ok                          ok
    no __main__ guard, forkserver    ok                          all tasks "error"
    forked DataLoader worker         ok                          RuntimeError in the pool

Pebble fails two rows (forkserver is Linux's default from Python 3.14), so the own pool stays.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import numbers
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple


__all__ = [
    "GradeResult",
    "MathReward",
    "extract_answer",
    "format_reward",
    "grade_completions",
    "make_math_reward",
    "math_reward",
    "shutdown_grading_workers",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 3.0
"""Default hard bound, in seconds, on grading one completion."""

MAX_ANSWER_CHARS = 1000
"""Extracted answers (and golds) longer than this are not sent to sympy; the longest MATH-500 answer is ~160."""

MAX_NESTING = 10
"""Deeper ``{}`` / ``()`` / ``[]`` nesting is rejected: sympy's time on nested fractions grows steeply with depth."""

MAX_SMALL_INT = 10_000
"""Exponents, factorial arguments and binomial arguments above this are rejected before sympy sees them."""

MAX_GOLD_TIMEOUTS = 3
"""Grading calls on which parsing one gold may hit the soft timeout before the gold is treated as unparseable.

A timed-out gold is not cached (a loaded machine or a long gold is slow, not wrong): its completions get ``None`` on
that call (status ``gold_timeout``) and the gold is parsed again on the next call that needs it. After this many
calls that timed out, it counts as unparseable (``bad_gold``) for the rest of the process, like a gold that fails.
"""

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
_GOLD_OK = "gold_ok"  # worker reply to a gold-only check


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


# ----------------------------------------------------------------------------------------------------------------
# Answer extraction (pure, linear-time string functions; safe on any input)
# ----------------------------------------------------------------------------------------------------------------

_UNCLOSED = object()  # sentinel: a \boxed{ whose brace is never closed
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS_RE = re.compile(r"(?i)\banswer\s*(?:is\b\s*:?|:|=)[ \t]*([^\n]{1,300})")
_HASHES_RE = re.compile(r"####[ \t]*([^\n]{1,300})")
_FINAL_NUMBER_RE = re.compile(r"(?<![\w.,])(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)[\s$*.)\]]*\Z")


def _completion_text(completion: Any) -> str | None:
    """The text to grade: a string completion, or the last assistant message of a conversational one."""
    if completion is None or isinstance(completion, str):
        return completion
    content: Any = None
    if isinstance(completion, dict):
        content = completion.get("content")
    elif isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        assistant = [m for m in messages if m.get("role", "assistant") == "assistant"]
        chosen = assistant or messages
        content = chosen[-1].get("content") if chosen else None
    if isinstance(content, (list, tuple)):  # content parts: [{"type": "text", "text": ...}, ...]
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else None


def _after_think(text: str) -> str | None:
    """Text after the last ``</think>``; ``None`` when a ``<think>`` block is opened and never closed."""
    end = text.rfind("</think>")
    if end >= 0:
        return text[end + len("</think>") :]
    if "<think>" in text:
        return None
    return text


def _last_boxed(text: str) -> str | None | object:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``): ``None`` if absent, ``_UNCLOSED`` if unbalanced."""
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len(command)
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i >= n or text[i] != "{":
        # "\boxed 5": TeX takes a single token as the argument.
        m = re.match(r"\s*([\w.+-]+)", text[i : i + 64])
        return m.group(1) if m else _UNCLOSED
    depth = 0
    j = i
    while j < n:
        ch = text[j]
        if ch == "\\":  # skip escaped characters (\{, \}, \\)
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return _UNCLOSED


def _strip_math_delimiters(s: str) -> str:
    """Remove one layer of surrounding ``$...$``, ``\\(...\\)``, ``\\[...\\]``, markdown bold, and a final period."""
    s = s.strip()
    for _ in range(3):
        before = s
        if s.endswith("."):  # sentence period; no math answer ends with one
            s = s[:-1].rstrip()
        if s.startswith("**") and s.endswith("**") and len(s) >= 4:
            s = s[2:-2].strip()
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
                s = s[len(left) : len(s) - len(right)].strip()
                break
        if s == before:
            break
    return s


def _answer_from_line(line: str) -> str:
    """Cut an anchored answer ("the answer is 72. Then ...") at the end of its sentence."""
    line = line.strip().strip("*:").strip()  # "**Answer:** 12", "Answer: **12**"
    # A sentence ends at ". " / "! " / "? " unless the period belongs to a number like "0.5".
    m = re.search(r"[.!?](?:\s|$)", line)
    if m:
        line = line[: m.start()]
    return _strip_math_delimiters(line.strip().strip("*").strip())


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    match = None
    for match in pattern.finditer(text):  # noqa: B007 - only the last one is wanted
        pass
    return match


def _extract(text: str) -> tuple[str | None, str]:
    """(answer, status) where status is ``ok``, ``no_answer`` or ``unparseable`` (unclosed final box)."""
    text = text.replace("\x00", "")
    tail = _after_think(text)
    if tail is None:
        return None, NO_ANSWER
    boxed = _last_boxed(tail)
    if boxed is _UNCLOSED:
        return None, UNPARSEABLE
    if boxed is not None:
        answer = _strip_math_delimiters(boxed)  # type: ignore[arg-type]
        return (answer, "ok") if answer else (None, NO_ANSWER)
    for pattern in (_HASHES_RE, _ANSWER_IS_RE):
        last = _last_match(pattern, tail)
        if last is not None:
            answer = _answer_from_line(last.group(1))
            if answer:
                return answer, "ok"
    m = _FINAL_NUMBER_RE.search(tail[-200:])
    if m:
        return m.group(1), "ok"
    return None, NO_ANSWER


def extract_answer(completion: Any) -> str | None:
    """Return the final answer of a completion as a string, or ``None`` when there is none.

    ``completion`` is a string or a conversational completion (list of messages; the last assistant message is used).
    The answer is the last ``\\boxed{...}`` after any ``</think>``; without a box, the last ``#### X``, then the last
    "answer is X" / "Answer: X", then a number ending the text. An unclosed ``<think>`` or an unclosed final
    ``\\boxed{`` gives ``None``.
    """
    text = _completion_text(completion)
    if text is None:
        return None
    return _extract(text)[0]


# ----------------------------------------------------------------------------------------------------------------
# Gold normalisation, pre-filters and the exact numeric fast path
# ----------------------------------------------------------------------------------------------------------------


def _normalize_gold(solution: Any) -> str | None:
    """Gold answer as a string for math-verify, or ``None`` if it cannot be used (None, list, NaN, empty...)."""
    if solution is None or isinstance(solution, bool):
        return None
    if isinstance(solution, numbers.Integral):
        solution = str(int(solution))
    elif isinstance(solution, numbers.Real):
        value = float(solution)
        if not math.isfinite(value):
            return None
        solution = str(int(value)) if value.is_integer() else repr(value)
    elif not isinstance(solution, str):
        return None
    s = solution.replace("\x00", "").strip()
    boxed = _last_boxed(s)  # full worked solutions (MATH style) carry the answer in the last box
    if boxed is _UNCLOSED:
        return None
    if boxed is not None:
        s = boxed  # type: ignore[assignment]
    else:
        last = _last_match(_HASHES_RE, s)  # GSM8K style "... #### 72"
        if last is not None:
            s = last.group(1)
    s = _strip_math_delimiters(s)
    return s or None


_INT_TOKEN_RE = re.compile(r"\d+|[{}()+\-*^!]|\s+")
_NUMERIC_ONLY_RE = re.compile(r"[\d{}()+\-*^!\s]+")


class _TooBig(Exception):
    pass


def _small_int_value(expr: str) -> int | None:
    """Value of a tiny integer expression (digits, ``+ - *``, ``^``, ``!``, braces), bounded by ``MAX_SMALL_INT``.

    Returns ``None`` if ``expr`` is not such an expression; raises ``_TooBig`` as soon as any intermediate value
    exceeds the bound, without computing it.
    """
    tokens = [t for t in _INT_TOKEN_RE.findall(expr) if not t.isspace()]
    if "".join(tokens) != re.sub(r"\s+", "", expr) or not tokens:
        return None
    pos = 0

    def check(v: int) -> int:
        if abs(v) > MAX_SMALL_INT:
            raise _TooBig
        return v

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def atom() -> int:
        t = take()
        if t == "-":
            return -atom()
        if t.isdigit():
            if len(t) > 6:
                raise _TooBig
            return check(int(t))
        closing = {"{": "}", "(": ")"}.get(t)
        if closing is None:
            raise ValueError(t)
        v = expr_()
        if take() != closing:
            raise ValueError(closing)
        return v

    def factor() -> int:
        base = atom()
        while peek() == "!":
            take()
            if base < 0 or base > 20:  # 21! > 10**19, far beyond the bound anyway
                raise _TooBig
            base = check(math.factorial(base))
        if peek() == "^":
            take()
            exponent = factor()  # right associative
            if base in (0, 1):
                return base
            if base == -1:
                return 1 if exponent % 2 == 0 else -1
            if exponent < 0:
                return 0  # a fraction; magnitude is small, which is all the pre-filter needs
            if exponent * math.log10(abs(base)) > math.log10(MAX_SMALL_INT):
                raise _TooBig
            return check(base**exponent)
        return base

    def expr_() -> int:
        v = factor()
        while peek() in ("+", "-", "*"):
            op = take()
            rhs = factor()
            v = check(v + rhs if op == "+" else v - rhs if op == "-" else v * rhs)
        return v

    try:
        value = expr_()
    except (ValueError, IndexError):
        return None
    return value if pos == len(tokens) else None


def _group_after(s: str, i: int) -> str:
    """The TeX argument starting at ``s[i]``: a balanced ``{...}`` group's content, else one character."""
    while i < len(s) and s[i] in " \t":
        i += 1
    if i >= len(s):
        return ""
    if s[i] != "{":
        return s[i]
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return s[i + 1 : j]
    return s[i + 1 :]


def _operand_before(s: str, i: int) -> str:
    """The operand ending just before ``s[i]``: a digit run or a balanced ``{...}`` / ``(...)`` group."""
    j = i - 1
    while j >= 0 and s[j] in " \t":
        j -= 1
    if j < 0:
        return ""
    if s[j].isdigit():
        k = j
        while k >= 0 and s[k].isdigit():
            k -= 1
        return s[k + 1 : j + 1]
    pairs = {"}": "{", ")": "("}
    if s[j] in pairs:
        close, open_ = s[j], pairs[s[j]]
        depth = 0
        for k in range(j, -1, -1):
            if s[k] == close:
                depth += 1
            elif s[k] == open_:
                depth -= 1
                if depth == 0:
                    return s[k + 1 : j]
    return ""


def _too_big(expr: str) -> bool:
    """Whether ``expr`` is a purely numeric expression whose value exceeds ``MAX_SMALL_INT``."""
    if not _NUMERIC_ONLY_RE.fullmatch(expr.strip() or "x"):
        return False
    try:
        value = _small_int_value(expr)
    except _TooBig:
        return True
    return value is not None and abs(value) > MAX_SMALL_INT


def _reject_reason(s: str) -> str | None:
    """Why ``s`` must not reach sympy (unbounded time or memory), or ``None`` if it is safe to grade."""
    if len(s) > MAX_ANSWER_CHARS:
        return "too long"
    for open_, close in (("{", "}"), ("(", ")"), ("[", "]")):
        depth = 0
        for ch in s:
            if ch == open_:
                depth += 1
                if depth > MAX_NESTING:
                    return "nested too deep"
            elif ch == close:
                depth -= 1
    for i, ch in enumerate(s):
        if ch == "^" and _too_big(_group_after(s, i + 1)):
            return "huge exponent"
        if ch == "!" and (i == 0 or s[i - 1] != "\\"):  # "\!" is a TeX thin space, not a factorial
            if _small_value_over(_operand_before(s, i), 1000):
                return "huge factorial"
    for m in re.finditer(r"\\[dt]?binom|\\choose", s):
        if _too_big(_group_after(s, m.end())) or _too_big(_operand_before(s, m.start())):
            return "huge binomial"
    return None


def _small_value_over(expr: str, bound: int) -> bool:
    """Whether ``expr`` is a numeric expression above ``bound`` (or too big to evaluate)."""
    try:
        value = _small_int_value(expr)
    except _TooBig:
        return True
    return value is not None and value > bound


_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PLAIN_FRACTION_RE = re.compile(r"([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}|([+-]?\d+)/(\d+)")


def _exact_number(s: str) -> Fraction | None:
    """Exact value of a plain number (``-12``, ``1,000``, ``0.25``, ``\\frac{3}{4}``, ``3/4``), else ``None``."""
    s = s.replace(" ", "").replace("\\!", "").replace("{,}", ",")
    if len(s) > 60:
        return None
    if _PLAIN_NUMBER_RE.fullmatch(s):
        return Fraction(s.replace(",", ""))
    m = _PLAIN_FRACTION_RE.fullmatch(s)
    if m:
        if m.group(4) is not None:
            num, den, sign = int(m.group(4)), int(m.group(5)), 1
        else:
            num, den, sign = int(m.group(2)), int(m.group(3)), -1 if m.group(1) == "-" else 1
        if den == 0:
            return None
        return sign * Fraction(num, den)
    return None


def _fast_verdict(answer: str, gold: str) -> str | None:
    """Decide plain-number pairs without sympy; ``None`` means "ask math-verify".

    Equal exact values are correct. Two different integers are wrong (math-verify agrees: they differ by at least 1,
    far above its 1e-6 rounding). Other unequal numbers go to math-verify, which accepts e.g. 0.333333 for 1/3.
    """
    a = _exact_number(answer)
    if a is None:
        return None
    g = _exact_number(gold)
    if g is None:
        return None
    if a == g:
        return CORRECT
    if a.denominator == 1 and g.denominator == 1:
        return WRONG
    return None


# ----------------------------------------------------------------------------------------------------------------
# Worker process side (this file is also the worker's program: it only needs the standard library and math-verify)
# ----------------------------------------------------------------------------------------------------------------


class _SoftTimeout(BaseException):
    """Raised by the worker's timer; a BaseException so that math-verify's ``except Exception`` cannot swallow it."""


_ARMED = [False]


def _on_alarm(signum, frame):  # pragma: no cover - runs in the worker
    if _ARMED[0]:
        _ARMED[0] = False  # fire once: a second raise could land outside the guarded region
        raise _SoftTimeout


class _GoldTimeout(Exception):
    """Parsing a gold hit the soft timeout (never cached: a slow parse says nothing about the gold)."""


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


_WARM_UP = [
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


def _worker_main() -> None:  # pragma: no cover - runs in the worker (exercised by the tests through the pool)
    """Grade ``[id, answer|null, gold, soft_timeout]`` JSON lines from stdin, reply ``[id, status, seconds]``."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the reply stream
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills us if needed
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        import resource

        limit = 3 * 1024**3  # a runaway integer must not take the machine's memory before the kill
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass
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

    budget = [0.0]  # soft timeout of the gold parse in progress (lru_cache keys on the gold alone)

    @functools.lru_cache(maxsize=50_000)
    def parsed_gold(gold: str) -> list:
        """The parsed gold (``[]`` if it does not parse); a soft timeout raises ``_GoldTimeout`` and is not cached."""
        parsed = _with_soft_timeout(lambda: parse_latex(gold), budget[0])
        if isinstance(parsed, str):  # TIMEOUT: a slow parse is no verdict; the next task with this gold retries it
            raise _GoldTimeout
        return parsed

    def grade(answer: str | None, gold: str, soft: float) -> str:
        start = time.perf_counter()
        budget[0] = soft
        try:
            gold_parsed = parsed_gold(gold)
        except _GoldTimeout:
            return GOLD_TIMEOUT
        if not gold_parsed:
            return BAD_GOLD
        if answer is None:
            return _GOLD_OK

        def grade_answer() -> str:
            answer_parsed = parse_latex(answer)
            if not answer_parsed:
                return UNPARSEABLE
            return CORRECT if verify(gold_parsed, answer_parsed, timeout_seconds=None) else WRONG

        return _with_soft_timeout(grade_answer, soft - (time.perf_counter() - start))

    # sympy loads and caches a lot on first use (the first polynomial comparison is many times slower than later
    # ones): pay that before announcing readiness, not inside the first step's timeouts.
    for answer, gold in _WARM_UP:
        grade(answer, gold, 60.0)
    parsed_gold.cache_clear()
    out.write(json.dumps(["ready", os.getpid()]) + "\n")
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return  # the parent closed our stdin (exit) or died
        task_id, answer, gold, soft = json.loads(line)
        start = time.perf_counter()
        try:
            status = grade(answer, gold, float(soft))
        except Exception:  # noqa: BLE001 - a grading bug must cost one completion, not the worker
            status = ERROR
        except _SoftTimeout:
            status = TIMEOUT
        try:
            out.write(json.dumps([task_id, status, time.perf_counter() - start]) + "\n")
        except BrokenPipeError:
            return  # the parent is gone


# ----------------------------------------------------------------------------------------------------------------
# Parent side: the worker pool
# ----------------------------------------------------------------------------------------------------------------

_WORKER_BOOT = (
    "import sys, runpy\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"  # never import modules from the caller's cwd
    "runpy.run_path(sys.argv[1], run_name='__cegppo_grader__')['_worker_main']()\n"
)
_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take many seconds
_PIPELINE_DEPTH = 4  # tasks queued per worker: hides the round trip, keeps load balanced


def _worker_argv() -> list[str]:
    if not sys.executable:
        raise RuntimeError("math_reward needs sys.executable to start its grading workers, and it is empty.")
    return [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(__file__)]


class _Worker:
    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            bufsize=0,
        )
        self.rfd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self.wfd = self.proc.stdin.fileno()  # type: ignore[union-attr]
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.rbuf = b""
        self.wbuf = b""
        self.queue: deque[int] = deque()
        self.ready = False
        self.started = time.monotonic()
        self.busy_since = 0.0

    def kill(self) -> None:
        """SIGKILL and reap (no zombie), then close our pipe ends."""
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - process stuck in the kernel
            logger.warning("grading worker %d did not exit after SIGKILL", self.proc.pid)
        self.close_pipes()

    def close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass


class _GraderPool:
    """A fixed number of grading worker processes owned by one process; ``grade`` is serialised by a lock."""

    def __init__(self, size: int, argv: Sequence[str] | None = None) -> None:
        self.size = size
        self.argv = list(argv) if argv is not None else _worker_argv()  # tests substitute a fake worker
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.failed_starts = 0

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def grade(self, tasks: Sequence[tuple[str | None, str]], timeout_s: float) -> list[tuple[str, float]]:
        """Grade ``(answer or None, gold)`` pairs; each task gets at most ``timeout_s`` seconds of a worker."""
        with self.lock:
            try:
                return self._grade(tasks, timeout_s)
            except BaseException:
                # Interrupted mid-batch: workers still holding tasks would reply later and confuse the next call.
                for w in [w for w in self.workers if w.queue]:
                    w.kill()
                    self.workers.remove(w)
                raise

    def _grade(self, tasks: Sequence[tuple[str | None, str]], timeout_s: float) -> list[tuple[str, float]]:
        results: list[tuple[str, float] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        remaining = len(tasks)
        # The worker's own timer fires first so the slow task ends cleanly; SIGKILL is the backstop at timeout_s.
        soft = max(0.05, timeout_s - min(0.5, 0.25 * timeout_s))
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.argv))

        def finish(i: int, status: str, seconds: float) -> None:
            nonlocal remaining
            if results[i] is None:
                results[i] = (status, seconds)
                remaining -= 1

        crashed: set[int] = set()

        def retire(w: _Worker, status: str, now: float) -> None:
            """Kill ``w``; its current task gets ``status``, its queued tasks go back to the front of the line.

            A worker that died on its own (``error``) may have died before starting its task (e.g. killed while
            idle), so the task gets one more try; a task that crashes two workers is reported as ``error``.
            """
            w.kill()
            self.workers.remove(w)
            if w.queue:
                head = w.queue.popleft()
                if status == ERROR and head not in crashed:
                    crashed.add(head)
                    w.queue.appendleft(head)
                else:
                    finish(head, status, now - w.busy_since)
                pending.extendleft(reversed(w.queue))
            if not w.ready:
                self.failed_starts += 1
                if self.failed_starts >= 3 * self.size:
                    raise RuntimeError(
                        f"math_reward: {self.failed_starts} grading workers exited during startup (see their error "
                        f"on stderr above). Check that `{sys.executable} -c 'import math_verify'` works."
                    )
            self.workers.append(_Worker(self.argv))

        while remaining:
            now = time.monotonic()
            for w in self.workers:
                while w.ready and pending and len(w.queue) < _PIPELINE_DEPTH:
                    i = pending.popleft()
                    if not w.queue:
                        w.busy_since = now
                    w.queue.append(i)
                    answer, gold = tasks[i]
                    w.wbuf += (json.dumps([i, answer, gold, soft]) + "\n").encode()

            poller = select.poll()  # poll, not select: fds above 1024 are common in training processes
            by_fd: dict[int, _Worker] = {}
            next_deadline = now + 1.0
            for w in self.workers:
                poller.register(w.rfd, select.POLLIN)
                by_fd[w.rfd] = w
                if w.wbuf:
                    poller.register(w.wfd, select.POLLOUT)
                    by_fd[w.wfd] = w
                if w.queue:
                    next_deadline = min(next_deadline, w.busy_since + timeout_s)
                elif not w.ready:
                    next_deadline = min(next_deadline, w.started + _STARTUP_TIMEOUT_S)
            wait_ms = max(0, math.ceil((next_deadline - now) * 1000))
            try:
                events = poller.poll(wait_ms)
            except InterruptedError:  # pragma: no cover - PEP 475 retries, but be safe
                events = []

            dead: list[_Worker] = []
            for fd, event in events:
                w = by_fd[fd]
                if w in dead:
                    continue
                if fd == w.wfd:
                    if event & select.POLLOUT and w.wbuf:
                        try:
                            written = os.write(w.wfd, w.wbuf)
                            w.wbuf = w.wbuf[written:]
                        except BlockingIOError:
                            pass
                        except OSError:
                            dead.append(w)
                    elif event & (select.POLLERR | select.POLLHUP):
                        dead.append(w)
                    continue
                chunks = []
                eof = False
                while True:
                    try:
                        chunk = os.read(w.rfd, 65536)
                    except BlockingIOError:
                        break
                    except OSError:
                        eof = True
                        break
                    if not chunk:
                        eof = True
                        break
                    chunks.append(chunk)
                w.rbuf += b"".join(chunks)
                *lines, w.rbuf = w.rbuf.split(b"\n")
                received = time.monotonic()
                for line in lines:
                    try:
                        message = json.loads(line)
                    except ValueError:  # never expected (stdout is private to the protocol); treat as a crash
                        eof = True
                        break
                    if message[0] == "ready":
                        w.ready = True
                        self.failed_starts = 0
                        continue
                    task_id, status, seconds = message
                    if w.queue and w.queue[0] == task_id:
                        w.queue.popleft()
                        finish(task_id, status, seconds)
                        w.busy_since = received  # the next queued task starts now
                if eof:
                    dead.append(w)

            now = time.monotonic()
            for w in dead:
                retire(w, ERROR, now)
            for w in list(self.workers):
                if w.queue and now - w.busy_since >= timeout_s:
                    retire(w, TIMEOUT, now)
                elif not w.ready and now - w.started > _STARTUP_TIMEOUT_S:
                    retire(w, ERROR, now)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Kill and reap every worker (they hold no state worth a graceful exit)."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.kill()


_POOLS: dict[int, _GraderPool] = {}
_POOLS_LOCK = threading.Lock()


def _default_num_workers() -> int:
    """CPUs available to this process divided among the local ranks of a torchrun/accelerate job (max 8)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # set by torchrun and accelerate
    except ValueError:
        local_ranks = 1
    return max(1, min(8, cpus // local_ranks))


def _get_pool(num_workers: int) -> _GraderPool:
    with _POOLS_LOCK:
        pool = _POOLS.get(num_workers)
        if pool is None:
            pool = _POOLS[num_workers] = _GraderPool(num_workers)
        return pool


def shutdown_grading_workers() -> None:
    """Stop and reap all grading worker processes of this process. They restart on the next grading call.

    Called automatically at interpreter exit; call it yourself to free the processes earlier.
    """
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        with pool.lock:
            pool.close()


def _forget_pools_in_child() -> None:
    """After fork, the child must not use or kill the parent's workers: drop its copies of their pipes."""
    for pool in _POOLS.values():
        for w in pool.workers:
            w.close_pipes()
            w.proc.returncode = 0  # keeps Popen.__del__ from touching the parent's child
    _POOLS.clear()
    global _POOLS_LOCK
    _POOLS_LOCK = threading.Lock()
    _GOLD_STATUS.clear()
    _GOLD_TIMEOUTS.clear()


if __name__ != "__cegppo_grader__":
    atexit.register(shutdown_grading_workers)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_pools_in_child)


# ----------------------------------------------------------------------------------------------------------------
# Grading entry point and the reward functions
# ----------------------------------------------------------------------------------------------------------------


class _LRU:
    """A small thread-safe mapping that forgets its least recently used entry beyond ``maxsize``."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if key not in self._data:
                return default
            self._data.move_to_end(key)
            return self._data[key]

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            return key in self._data

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def pop(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            return self._data.pop(key, default)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


_GOLD_STATUS = _LRU(200_000)  # gold string -> parses (learned from workers; saves gold-only checks)
_VERDICTS = _LRU(100_000)  # (answer, gold) -> verdict of a worker; eval sets repeat every epoch
_GOLD_TIMEOUTS = _LRU(10_000)  # gold string -> grading calls on which its parse hit the soft timeout
_WARNED_GOLDS: set[str] = set()


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
    if len(completions) != len(solutions):
        raise ValueError(
            f"got {len(completions)} completions but {len(solutions)} solutions; pass one gold answer per "
            "completion (TRL repeats the dataset's `solution` column for every generation)."
        )
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
    workers = _default_num_workers() if num_workers is None else num_workers
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"num_workers must be a positive integer or None (auto), got {num_workers!r}.")

    start = time.perf_counter()
    statuses: list[str | None] = [None] * len(completions)
    answers: list[str | None] = [None] * len(completions)
    golds: list[str | None] = []
    tasks: list[tuple[str | None, str]] = []
    task_rows: list[list[int]] = []  # rows that take their status from each task
    task_of_pair: dict[tuple[str | None, str], int] = {}
    needs_gold_check: list[int] = []

    def add_task(answer: str | None, gold: str, row: int | None = None) -> None:
        """Queue ``(answer, gold)`` for a worker once per batch: GRPO groups repeat the same answers a lot."""
        index = task_of_pair.get((answer, gold))
        if index is None:
            index = task_of_pair[(answer, gold)] = len(tasks)
            tasks.append((answer, gold))
            task_rows.append([])
        if row is not None:
            task_rows[index].append(row)

    for row, (completion, solution) in enumerate(zip(completions, solutions, strict=True)):
        gold = _normalize_gold(solution)
        if gold is not None and _reject_reason(gold):
            gold = None
        golds.append(gold)
        text = _completion_text(completion)
        answer, extract_status = (None, NO_ANSWER) if text is None else _extract(text)
        answers[row] = answer
        if gold is None or _GOLD_STATUS.get(gold) is False:
            statuses[row] = BAD_GOLD
            continue
        if answer is None:
            statuses[row] = extract_status
        elif _reject_reason(answer):
            statuses[row] = UNPARSEABLE
        elif " ".join(answer.split()) == " ".join(gold.split()):
            statuses[row] = CORRECT  # the same string verifies whenever the gold parses (checked below)
        else:
            verdict = _fast_verdict(answer, gold) or _VERDICTS.get((answer, gold))
            if verdict is None:
                add_task(answer, gold, row)
                continue
            statuses[row] = verdict
        # Graded locally: the gold still has to be known to parse, else the row must be skipped (None).
        if _exact_number(gold) is None and gold not in _GOLD_STATUS:
            needs_gold_check.append(row)
    golds_in_tasks = {gold for _, gold in tasks}
    for row in needs_gold_check:
        if golds[row] not in golds_in_tasks:
            add_task(None, golds[row])  # type: ignore[arg-type]
    local_seconds = (time.perf_counter() - start) / max(1, len(completions))

    seconds = [local_seconds] * len(completions)
    slow_golds: set[str] = set()  # golds whose parse timed out in some task of this call
    timed_out: set[str] = set()  # ... and that no task of this call (nor an earlier call) settled
    if tasks:
        outcomes = _get_pool(workers).grade(tasks, float(timeout_s))
        for (answer, gold), rows, (status, spent) in zip(tasks, task_rows, outcomes, strict=True):
            if status == BAD_GOLD:
                _GOLD_STATUS[gold] = False
            elif status == GOLD_TIMEOUT:
                slow_golds.add(gold)
            elif status in (CORRECT, WRONG, UNPARSEABLE, _GOLD_OK):
                _GOLD_STATUS[gold] = True
                if answer is not None and len(answer) + len(gold) <= 256:  # bounded memory per entry
                    _VERDICTS[(answer, gold)] = status
            for row in rows:
                statuses[row] = status
                seconds[row] = spent
        timed_out = {gold for gold in slow_golds if gold not in _GOLD_STATUS}
        for gold in timed_out:  # one count per call, however many tasks carried the gold
            count = _GOLD_TIMEOUTS.get(gold, 0) + 1
            _GOLD_TIMEOUTS[gold] = count
            if count >= MAX_GOLD_TIMEOUTS:
                _GOLD_STATUS[gold] = False  # settled: later calls skip it without a worker round trip
                _GOLD_TIMEOUTS.pop(gold)
            _warn_gold_once(
                gold,
                "math_reward: parsing gold answer %.200r hit the timeout (%d of %d); its completions get reward None "
                "on this call%s.",
                gold,
                count,
                MAX_GOLD_TIMEOUTS,
                " and, from now on, it is treated as unparseable" if count >= MAX_GOLD_TIMEOUTS else "",
            )

    results = []
    for row, status in enumerate(statuses):
        gold = golds[row]
        if gold is not None and status not in (BAD_GOLD, GOLD_TIMEOUT):
            if gold in timed_out:
                status = GOLD_TIMEOUT  # decided locally, but the gold could not be checked in time
            elif _GOLD_STATUS.get(gold) is False:
                status = BAD_GOLD
        if status == BAD_GOLD:
            _warn_gold_once(
                repr(solutions[row]),
                "math_reward: gold answer %.200r cannot be parsed; its completions get reward None (skipped by TRL).",
                solutions[row],
            )
        results.append(GradeResult(status, answers[row], seconds[row]))  # type: ignore[arg-type]
    return results


def _warn_gold_once(key: str, message: str, *args: Any) -> None:
    """Log ``message`` once per ``key``, for at most 20 keys per process (a bad data set must not flood the log)."""
    if len(_WARNED_GOLDS) < 20 and key not in _WARNED_GOLDS:
        _WARNED_GOLDS.add(key)
        logger.warning(message, *args)


class MathReward:
    """Picklable reward function for ``GRPOTrainer(reward_funcs=[...])``; build it with :func:`make_math_reward`.

    Call signature: ``reward(completions, solution, **kwargs) -> list[float | None]``.
    """

    def __init__(
        self,
        correct: float = 1.0,
        wrong: float = -1.0,
        unparseable: float | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_workers: int | None = None,
        name: str = "math_reward",
    ) -> None:
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
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
            raise ValueError(f"num_workers must be a positive integer or None (auto), got {num_workers!r}.")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string (TRL logs rewards/<name>/mean), got {name!r}.")
        self.correct = float(correct)
        self.wrong = float(wrong)
        self.unparseable = float(wrong if unparseable is None else unparseable)
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self.__name__ = name  # TRL names the metrics after it

    def __repr__(self) -> str:
        return (
            f"MathReward(correct={self.correct}, wrong={self.wrong}, unparseable={self.unparseable}, "
            f"timeout_s={self.timeout_s}, num_workers={self.num_workers}, name={self.__name__!r})"
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
        graded = grade_completions(completions, solution, timeout_s=self.timeout_s, num_workers=self.num_workers)
        value = {CORRECT: self.correct, WRONG: self.wrong}
        skipped = (BAD_GOLD, GOLD_TIMEOUT)  # no usable gold on this call: no score at all
        rewards = [None if g.status in skipped else value.get(g.status, self.unparseable) for g in graded]

        if callable(log_metric) and graded:
            counts = dict.fromkeys((CORRECT, WRONG, NO_ANSWER, UNPARSEABLE, TIMEOUT, ERROR, BAD_GOLD, GOLD_TIMEOUT), 0)
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
) -> MathReward:
    """Build a math-verify reward function for ``GRPOTrainer(reward_funcs=[...])``.

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

    Completions whose gold answer cannot be parsed get ``None`` (TRL ignores them) and are counted in
    ``<name>/unparseable_gold``. Completions whose gold's parse hit the timeout also get ``None`` on that call and
    are counted in ``<name>/gold_timeouts``; the gold is retried on later calls (see :data:`MAX_GOLD_TIMEOUTS`).
    """
    return MathReward(correct, wrong, unparseable, timeout_s, num_workers, name)


_DEFAULT_MATH_REWARD = MathReward()


def math_reward(
    completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """CE-GPPO's rule-based reward: ``+1.0`` if the final answer verifies, ``-1.0`` otherwise, ``None`` for bad gold.

    Use as ``GRPOTrainer(reward_funcs=[math_reward], ...)`` with a dataset that has a ``solution`` column (see
    :func:`cegppo_trl.load_math_dataset`). ``completions`` may be strings or conversational (lists of messages).
    No answer, an unparseable answer and a grading timeout (3 s) all score ``-1.0``. See :func:`make_math_reward`
    for other values, and the module docstring for how answers are found and graded.
    """
    return _DEFAULT_MATH_REWARD(completions, solution, **kwargs)


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """``1.0`` if the completion has a closed, non-empty ``\\boxed{...}`` after any think block, else ``0.0``.

    An unclosed ``<think>`` or an unclosed final box scores ``0.0``. Cheap and in-process; an optional second reward.
    """
    rewards = []
    for completion in completions:
        text = _completion_text(completion)
        tail = None if text is None else _after_think(text.replace("\x00", ""))
        boxed = None if tail is None else _last_boxed(tail)
        ok = isinstance(boxed, str) and bool(boxed.strip())
        rewards.append(1.0 if ok else 0.0)
    return rewards
