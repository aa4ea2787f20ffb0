"""Answer extraction: the text of a completion, its final answer, and the gold answer as a string.

Pure, linear-time string functions, safe on any input, run in the calling process; public for code that must find
answers exactly as the reward does. The rules: docs/rewards_and_data.md, *How an answer is found*.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from .worker import NO_ANSWER, UNPARSEABLE


__all__ = ["completion_text", "extract_answer", "has_boxed_answer", "normalize_gold"]

_UNCLOSED = object()  # sentinel: a \boxed{ whose brace is never closed
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS_RE = re.compile(r"(?i)\banswer\s*(?:is\b\s*:?|:|=)[ \t]*([^\n]{1,300})")
_HASHES_RE = re.compile(r"####[ \t]*([^\n]{1,300})")
_FINAL_NUMBER_RE = re.compile(r"(?<![\w.,])(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)[\s$*.)\]]*\Z")


def completion_text(completion: Any) -> str | None:
    """The text to grade: a string completion, or the content of the last assistant message of a conversational one.

    ``completion`` may be a string, one message dict, or a list of messages (the last ``assistant`` message wins;
    messages without a role count as assistant; with no assistant message, the last message). Content given as
    parts (``[{"type": "text", "text": ...}]``) is joined. Anything else gives ``None``.
    """
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
    group = braced(text, i)
    return _UNCLOSED if group is None else group


def braced(text: str, i: int) -> str | None:
    """The content of the balanced ``{...}`` group opening at ``text[i]`` (escaped characters skipped), or ``None``
    if it is never closed."""
    depth = 0
    j = i
    while j < len(text):
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
    return None


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


def answer_and_status(text: str) -> tuple[str | None, str]:
    """The answer in a completion's ``text`` and its status: ``ok``, ``no_answer``, or ``unparseable`` (an unclosed
    final box); what :func:`extract_answer` and the reward both use."""
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
        found = pattern.findall(tail)
        if found and (answer := _answer_from_line(found[-1])):
            return answer, "ok"
    m = _FINAL_NUMBER_RE.search(tail[-200:])
    if m:
        return m.group(1), "ok"
    return None, NO_ANSWER


def extract_answer(completion: Any) -> str | None:
    """Return the final answer of a completion as a string, or ``None`` when there is none.

    ``completion`` is a string or a conversational completion (see :func:`completion_text`). The answer is the
    last ``\\boxed{...}`` after any ``</think>``; without a box, the last ``#### X``, then the last "answer is X" /
    "Answer: X", then a number ending the text. An unclosed ``<think>`` or an unclosed final ``\\boxed{`` gives
    ``None``.
    """
    text = completion_text(completion)
    return None if text is None else answer_and_status(text)[0]


def normalize_gold(solution: Any) -> str | None:
    """A gold answer as the string the reward grades against, or ``None`` if it cannot be used.

    Integers and finite floats become strings (``27.0`` -> ``"27"``); a worked solution gives the content of its
    last ``\\boxed{}``, a GSM8K solution what follows its last ``####``; surrounding ``$...$`` is removed. ``None``,
    bools, lists, NaN, an empty string or an unclosed final box give ``None``.
    """
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
    elif found := _HASHES_RE.findall(s):  # GSM8K style "... #### 72"
        s = found[-1]
    s = _strip_math_delimiters(s)
    return s or None


def has_boxed_answer(completion: Any) -> bool:
    """Whether a completion has a closed, non-empty ``\\boxed{...}`` after any think block (:func:`format_reward`)."""
    text = completion_text(completion)
    tail = None if text is None else _after_think(text.replace("\x00", ""))
    boxed = None if tail is None else _last_boxed(tail)
    return isinstance(boxed, str) and bool(boxed.strip())
