"""Grading protocols: how one completion is graded against one gold answer, and how its prompt is written.

A number is only comparable with another graded the same way. The protocols, each a small function over one
completion (a string) and one gold answer (a string) that returns a status of :mod:`.worker` (``correct``, ``wrong``,
``no_answer``, ``unparseable``, ``bad_gold``; the grading pool adds ``timeout`` and ``error``):

- :func:`authors` -- the CE-GPPO authors' grader (Kwai-Klear/CE-GPPO at 10558fe,
  ``verl/utils/reward_score/math_dapo.py``, ``math_verify_from_sky``), used for their training reward and their
  AIME evaluation; their prompt is the raw problem as one user message.
- :func:`lighteval` -- what lighteval 0.13's ``pass_at_k_math`` metric scores (``math_500``, ``aime24`` / ``aime25``
  pass@1: think block removed, extractive match); :func:`lighteval_avg` -- its ``avg_at_n_math`` (``aime24_avg`` /
  ``aime25_avg``), which grades the whole completion; their prompt is lighteval's AIME instruction template.
- :func:`boxed` -- this package's reward and ``cegppo-eval``'s historical grading (the last ``\\boxed{}`` after
  ``</think>``, with fallbacks; :mod:`.extract`), with the DeepSeek-R1 instruction appended.

:data:`PROTOCOLS` maps each name to a :class:`Protocol` (its grade function, its instruction and the hard timeout
it needs); :func:`grade_with_protocol` grades a batch in the grading pool (:mod:`.grading`: worker processes,
hard timeout). ``authors`` and ``lighteval`` use math-verify's own timeouts (``signal.alarm``), so call them in a
main thread, as the grading workers do. How they differ, and their agreement with the anchors:
docs/rewards_and_data.md, *Grading protocols*.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .extract import completion_text, normalize_gold
from .worker import BAD_GOLD, CORRECT, ERROR, NO_ANSWER, STATUSES, WRONG


__all__ = [
    "DEFAULT_PROTOCOL",
    "LIGHTEVAL_MATH_TEMPLATE",
    "PROTOCOLS",
    "Protocol",
    "authors",
    "boxed",
    "grade_with_protocol",
    "lighteval",
    "lighteval_avg",
    "remove_reasoning_tags",
    "resolve_protocol",
]

DEFAULT_PROTOCOL = "boxed"
"""The protocol of ``math_reward`` and of ``cegppo-eval`` when none is named."""

# lighteval 0.13, lighteval/tasks/tasks/aime.py, MATH_PROMPT_TEMPLATE (dedent, "{prompt}" -> "{problem}" and the
# escaped "{{ANSWER}}" -> "{ANSWER}" as str.format leaves it). .ci/lighteval_anchors.py checks it against lighteval.
LIGHTEVAL_MATH_TEMPLATE = (
    "\nSolve the following math problem efficiently and clearly.  The last line of your response should be of the "
    "following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct' (without quotes) "
    "where ANSWER is just the final number or expression that solves the problem. Think step by step before "
    "answering.\n\n{problem}\n"
)
"""lighteval 0.13's prompt for its AIME tasks, as a ``{problem}`` template for ``build_prompt``."""

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


def _gold_string(gold: Any) -> str | None:
    """A gold as the protocols read it: a string as given (the authors compare the raw string), else normalised."""
    return gold if isinstance(gold, str) else normalize_gold(gold)


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


def boxed(completion: Any, gold: Any) -> str:
    """This package's reward grading (:func:`~cegppo_trl.rewards.grade_completions`): the answer in the last
    ``\\boxed{}`` after ``</think>`` (then ``####``, "answer is", a final number), verified against the gold with
    math-verify's LaTeX parsing. Runs in the grading pool, like the reward."""
    from .reward import grade_completions

    return grade_completions([completion], [gold])[0].status


class Protocol(NamedTuple):
    """One way to grade and prompt.

    ``grade(completion, gold) -> status``; ``instruction``: the ``--instruction`` word or ``{problem}`` template the
    protocol's prompts use (``"none"``: the raw problem, ``"default"``: the DeepSeek-R1 ``\\boxed{}`` instruction;
    see ``cegppo_trl.data.resolve_instruction``); ``timeout_s``: the hard bound per completion that keeps the
    protocol's own timeouts intact in the grading pool. Accuracy is the share of ``correct`` in every protocol.
    """

    name: str
    grade: Callable[[Any, Any], str]
    instruction: str
    timeout_s: float
    description: str


PROTOCOLS: dict[str, Protocol] = {
    "authors": Protocol(
        "authors",
        authors,
        "none",
        # parse 5 s + gold parse 5 s + verify (5 s per gold x answer pair, 2 x 2 pairs), and a margin
        40.0,
        "the CE-GPPO authors' grader (math-verify on the whole completion, think block included; raw problem prompt)",
    ),
    "lighteval": Protocol(
        "lighteval",
        lighteval,
        LIGHTEVAL_MATH_TEMPLATE,
        40.0,
        "lighteval 0.13's pass@k math metric (think block removed, extractive match; its AIME instruction template)",
    ),
    "lighteval_avg": Protocol(
        "lighteval_avg",
        lighteval_avg,
        LIGHTEVAL_MATH_TEMPLATE,
        40.0,
        "lighteval 0.13's avg@n math metric of aime24_avg/aime25_avg (as lighteval, on the whole completion)",
    ),
    "boxed": Protocol(
        "boxed",
        boxed,
        "default",
        3.0,
        "the last \\boxed{} after </think> with fallbacks, the DeepSeek-R1 instruction (math_reward's grading)",
    ),
}
"""The grading protocols by name (``cegppo-eval --protocol``)."""


def resolve_protocol(name: Any) -> Protocol:
    """The :class:`Protocol` called ``name``; ``ValueError`` naming the known ones otherwise."""
    protocol = PROTOCOLS.get(name) if isinstance(name, str) else None
    if protocol is None:
        raise ValueError(f"unknown grading protocol {name!r}; choose one of {', '.join(PROTOCOLS)}.")
    return protocol


# ----------------------------------------------------------------------------------------------------------------
# A batch in the grading pool
# ----------------------------------------------------------------------------------------------------------------


def grade_in_worker(protocol: str, completion: str, gold: str) -> str:
    """A grading worker's entry for a protocol task (the worker imports this module by its package path)."""
    spec = PROTOCOLS.get(protocol)
    if spec is None or spec.name == "boxed":  # boxed batches go to grade_completions, never here
        return ERROR
    return spec.grade(completion, gold)


def grade_with_protocol(
    completions: Sequence[Any],
    golds: Sequence[Any],
    protocol: str = DEFAULT_PROTOCOL,
    *,
    timeout_s: float | None = None,
    num_workers: int | None = None,
) -> list:
    """Grade each completion against its gold with ``protocol``: one ``GradeResult`` per completion, in order.

    Runs in the grading pool (:mod:`.grading`): no completion takes a worker longer than ``timeout_s`` (default: the
    protocol's :attr:`Protocol.timeout_s`), and nothing a completion or gold holds can raise here. ``boxed`` is
    :func:`~cegppo_trl.rewards.grade_completions` itself; its results carry the extracted answer, the other
    protocols' ``answer`` is None. Completions may be strings or message lists (their last assistant message).
    """
    from .grading import default_num_workers, pool_for
    from .reward import GradeResult, check_batch, check_grading_settings, grade_completions

    spec = resolve_protocol(protocol)
    timeout_s = spec.timeout_s if timeout_s is None else timeout_s
    if spec.name == "boxed":
        return grade_completions(completions, golds, timeout_s=timeout_s, num_workers=num_workers)
    check_batch(completions, golds, "completions", "golds")
    if len(completions) != len(golds):
        raise ValueError(f"got {len(completions)} completions but {len(golds)} gold answers; pass one per completion.")
    check_grading_settings(timeout_s, num_workers)
    statuses: list[str | None] = []
    tasks: list[tuple[str, str, str]] = []
    task_rows: dict[tuple[str, str, str], list[int]] = {}
    for row, (completion, gold) in enumerate(zip(completions, golds, strict=True)):
        text, gold_text = completion_text(completion), _gold_string(gold)
        if gold_text is None or not gold_text.strip():
            statuses.append(BAD_GOLD)
        elif text is None or not text.strip():
            statuses.append(NO_ANSWER)
        else:
            statuses.append(None)
            task = (text.replace("\x00", ""), gold_text, spec.name)
            if task not in task_rows:
                task_rows[task] = []
                tasks.append(task)
            task_rows[task].append(row)
    seconds = [0.0] * len(statuses)
    if tasks:
        pool = pool_for(default_num_workers() if num_workers is None else num_workers)
        start = time.perf_counter()
        outcomes = pool.grade(tasks, float(timeout_s))
        spent = (time.perf_counter() - start) / len(tasks)
        for task, (status, task_seconds, *_) in zip(tasks, outcomes, strict=True):
            for row in task_rows[task]:
                statuses[row] = status if status in STATUSES else ERROR
                seconds[row] = task_seconds or spent
    return [GradeResult(status, None, s) for status, s in zip(statuses, seconds, strict=True)]  # type: ignore[arg-type]
