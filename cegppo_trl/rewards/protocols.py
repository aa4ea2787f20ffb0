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
main thread, as the grading workers do (the three math-verify graders live in :mod:`.worker`, which runs them and
imports nothing of the package; they are re-exported here). How they differ, and their agreement with the anchors:
docs/rewards_and_data.md, *Grading protocols*.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .extract import completion_text, normalize_gold
from .grading import default_num_workers, pool_for
from .reward import GradeResult, check_batch, check_grading_settings, grade_completions
from .worker import (
    BAD_GOLD,
    ERROR,
    NO_ANSWER,
    STATUSES,
    authors,
    lighteval,
    lighteval_avg,
    remove_reasoning_tags,
)


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


def _gold_string(gold: Any) -> str | None:
    """A gold as the protocols read it: a string as given (the authors compare the raw string), else normalised."""
    return gold if isinstance(gold, str) else normalize_gold(gold)


def boxed(completion: Any, gold: Any) -> str:
    """This package's reward grading (:func:`~cegppo_trl.rewards.grade_completions`): the answer in the last
    ``\\boxed{}`` after ``</think>`` (then ``####``, "answer is", a final number), verified against the gold with
    math-verify's LaTeX parsing. Runs in the grading pool, like the reward."""
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
