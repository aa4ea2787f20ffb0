"""Cheap checks in the calling process, before any answer reaches a grading worker.

- :func:`reject_reason`: answers (and golds) that sympy cannot grade in bounded time (too long, nested too deep,
  exponent towers, factorials or binomials of huge numbers) are rejected; they count as unparseable.
- :func:`fast_verdict`: pairs of plain numbers (``72``, ``-3``, ``1,000``, ``0.5``, ``\\frac{3}{4}``) are compared
  exactly, without sympy; a test checks these verdicts against math-verify.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .worker import CORRECT, WRONG


MAX_ANSWER_CHARS = 1000
"""Extracted answers (and golds) longer than this are not sent to sympy; the longest MATH-500 answer is ~160."""

MAX_NESTING = 10
"""Deeper ``{}`` / ``()`` / ``[]`` nesting is rejected: sympy's time on nested fractions grows steeply with depth."""

MAX_SMALL_INT = 10_000
"""Exponents and binomial arguments above this are rejected before sympy sees them."""

MAX_FACTORIAL = 1000
"""Factorial arguments above this are rejected before sympy sees them."""

_INT_TOKEN_RE = re.compile(r"\d+|[{}()+\-*^!]|\s+")
_NUMERIC_ONLY_RE = re.compile(r"[\d{}()+\-*^!\s]+")


class _TooBig(Exception):
    pass


class _SmallIntParser:
    """Recursive descent over the tokens of a tiny integer expression; every value is checked against the bound.

    Grammar: ``expr := factor (('+' | '-' | '*') factor)*``, ``factor := atom '!'* ('^' factor)?``,
    ``atom := '-' atom | digits | '{' expr '}' | '(' expr ')'``. Malformed input raises ``ValueError`` or
    ``IndexError``; a value above ``MAX_SMALL_INT`` raises ``_TooBig`` before it is computed.
    """

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        self.pos += 1
        return self.tokens[self.pos - 1]

    def expr(self) -> int:
        v = self.factor()
        while self.peek() in ("+", "-", "*"):
            op = self.take()
            rhs = self.factor()
            v = _checked(v + rhs if op == "+" else v - rhs if op == "-" else v * rhs)
        return v

    def factor(self) -> int:
        base = self.atom()
        while self.peek() == "!":
            self.take()
            if base < 0 or base > 20:  # 21! > 10**19, far beyond the bound anyway
                raise _TooBig
            base = _checked(math.factorial(base))
        if self.peek() == "^":
            self.take()
            return _power(base, self.factor())  # right associative
        return base

    def atom(self) -> int:
        t = self.take()
        if t == "-":
            return -self.atom()
        if t.isdigit():
            if len(t) > 6:
                raise _TooBig
            return _checked(int(t))
        closing = {"{": "}", "(": ")"}.get(t)
        if closing is None:
            raise ValueError(t)
        v = self.expr()
        if self.take() != closing:
            raise ValueError(closing)
        return v


def _checked(v: int) -> int:
    if abs(v) > MAX_SMALL_INT:
        raise _TooBig
    return v


def _power(base: int, exponent: int) -> int:
    """``base ** exponent``, or ``_TooBig`` when its magnitude would pass the bound (checked with logarithms)."""
    if base in (0, 1):
        return base
    if base == -1:
        return 1 if exponent % 2 == 0 else -1
    if exponent < 0:
        return 0  # a fraction; magnitude is small, which is all the pre-filter needs
    if exponent * math.log10(abs(base)) > math.log10(MAX_SMALL_INT):
        raise _TooBig
    return _checked(base**exponent)


def _small_int_value(expr: str) -> int | None:
    """Value of a tiny integer expression (digits, ``+ - *``, ``^``, ``!``, braces), bounded by ``MAX_SMALL_INT``.

    Returns ``None`` if ``expr`` is not such an expression; raises ``_TooBig`` as soon as any intermediate value
    exceeds the bound, without computing it.
    """
    tokens = [t for t in _INT_TOKEN_RE.findall(expr) if not t.isspace()]
    if "".join(tokens) != re.sub(r"\s+", "", expr) or not tokens:
        return None
    parser = _SmallIntParser(tokens)
    try:
        value = parser.expr()
    except (ValueError, IndexError):
        return None
    return value if parser.pos == len(tokens) else None


def _value_over(expr: str, bound: int, *, magnitude: bool = True) -> bool:
    """Whether ``expr`` is a small integer expression above ``bound`` (its absolute value unless ``magnitude`` is
    false), or one too big to evaluate."""
    if not _NUMERIC_ONLY_RE.fullmatch(expr.strip() or "x"):
        return False
    try:
        value = _small_int_value(expr)
    except _TooBig:
        return True
    return value is not None and (abs(value) if magnitude else value) > bound


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


def reject_reason(s: str) -> str | None:
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
        if ch == "^" and _value_over(_group_after(s, i + 1), MAX_SMALL_INT):
            return "huge exponent"
        if ch == "!" and (i == 0 or s[i - 1] != "\\"):  # "\!" is a TeX thin space, not a factorial
            if _value_over(_operand_before(s, i), MAX_FACTORIAL, magnitude=False):
                return "huge factorial"
    for m in re.finditer(r"\\[dt]?binom|\\choose", s):
        operands = (_group_after(s, m.end()), _operand_before(s, m.start()))
        if any(_value_over(operand, MAX_SMALL_INT) for operand in operands):
            return "huge binomial"
    return None


_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PLAIN_FRACTION_RE = re.compile(r"([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}|([+-]?\d+)/(\d+)")


def exact_number(s: str) -> Fraction | None:
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


def fast_verdict(answer: str, gold: str) -> str | None:
    """Decide plain-number pairs without sympy; ``None`` means "ask math-verify".

    Equal exact values are correct. Two different integers are wrong (math-verify agrees: they differ by at least 1,
    far above its 1e-6 rounding). Other unequal numbers go to math-verify, which accepts e.g. 0.333333 for 1/3.
    """
    a = exact_number(answer)
    if a is None:
        return None
    g = exact_number(gold)
    if g is None:
        return None
    if a == g:
        return CORRECT
    if a.denominator == 1 and g.denominator == 1:
        return WRONG
    return None
