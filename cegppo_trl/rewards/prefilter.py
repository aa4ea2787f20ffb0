"""Cheap checks in the calling process, before any answer reaches a grading worker.

- :func:`reject_reason`: answers (and golds) that sympy cannot grade in bounded time (too long, nested too deep,
  exponent towers, factorials or binomials of huge numbers) are rejected; they count as unparseable.
- :func:`fast_verdict`: pairs of plain numbers (``72``, ``-3``, ``1,000``, ``0.5``, ``\\frac{3}{4}``) are compared
  exactly, without sympy; a test checks these verdicts against math-verify.
"""

from __future__ import annotations

import ast
import itertools
import math
import operator
import re
from fractions import Fraction

from .extract import braced
from .worker import CORRECT, WRONG


MAX_ANSWER_CHARS = 1000
"""Extracted answers (and golds) longer than this are not sent to sympy; the longest MATH-500 answer is ~160."""

MAX_NESTING = 10
"""Deeper ``{}`` / ``()`` / ``[]`` nesting is rejected: sympy's time on nested fractions grows steeply with depth."""

MAX_SMALL_INT = 10_000
"""Exponents and binomial arguments above this are rejected before sympy sees them."""

MAX_FACTORIAL = 1000
"""Factorial arguments above this are rejected before sympy sees them."""

_NUMERIC_ONLY_RE = re.compile(r"[\d{}()+\-*^!\s]+")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class _TooBig(Exception):
    pass


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


def _bounded(node: ast.AST) -> int:
    """The value of a parsed integer expression; ``_TooBig`` as soon as a value would pass the bound, before it is
    computed; ``ValueError`` / ``KeyError`` for anything but integers, ``+ - * ** !``."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_bounded(node.operand)
    if isinstance(node, ast.Subscript):  # "n!", written "n[0]": postfix, binding tighter than "**"
        n = _bounded(node.value)
        if not 0 <= n <= 20:  # 21! > 10**19, far beyond the bound anyway
            raise _TooBig
        return _checked(math.factorial(n))
    if not isinstance(node, ast.BinOp):
        raise ValueError(node)
    left, right = _bounded(node.left), _bounded(node.right)
    if isinstance(node.op, ast.Pow):
        return _power(left, right)
    return _checked(_BINARY[type(node.op)](left, right))


def _value_over(expr: str, bound: int, *, magnitude: bool = True) -> bool:
    """Whether ``expr`` is a small integer expression (digits, ``+ - *``, ``^``, ``!``, braces) above ``bound`` (its
    absolute value unless ``magnitude`` is false), or one too big to evaluate. Python's parser reads it, with ``{}``
    as ``()``, ``^`` as ``**`` and the factorial as ``[0]``; :func:`_bounded` evaluates it."""
    if not _NUMERIC_ONLY_RE.fullmatch(expr.strip() or "x"):
        return False
    python = re.sub(r"\b0+(?=\d)", "", expr).translate(str.maketrans("{}", "()"))
    python = " ".join(python.replace("^", "**").replace("!", "[0]").split())
    try:
        value = _bounded(ast.parse(python, mode="eval").body)
    except _TooBig:
        return True
    except (SyntaxError, ValueError, KeyError):
        return False
    return (abs(value) if magnitude else value) > bound


def _group_after(s: str, i: int) -> str:
    """The TeX argument starting at ``s[i]``: a ``{...}`` group's content (the rest if unclosed), else one character."""
    rest = s[i:].lstrip(" \t")
    group = braced(rest, 0) if rest.startswith("{") else rest[:1]
    return rest[1:] if group is None else group


def _operand_before(s: str, i: int) -> str:
    """The operand ending just before ``s[i]``: a digit run or a balanced ``{...}`` / ``(...)`` group."""
    head = s[:i].rstrip(" \t")
    if digits := re.search(r"\d+\Z", head):
        return digits.group()
    close = head[-1:]
    if close in ("}", ")"):
        open_ = "{" if close == "}" else "("
        depth = 0
        for k in range(len(head) - 1, -1, -1):
            depth += (head[k] == close) - (head[k] == open_)
            if depth == 0:
                return head[k + 1 : -1]
    return ""


def reject_reason(s: str) -> str | None:
    """Why ``s`` must not reach sympy (unbounded time or memory), or ``None`` if it is safe to grade."""
    if len(s) > MAX_ANSWER_CHARS:
        return "too long"
    for open_, close in ("{}", "()", "[]"):
        if max(itertools.accumulate((ch == open_) - (ch == close) for ch in s), default=0) > MAX_NESTING:
            return "nested too deep"
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
