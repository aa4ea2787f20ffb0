"""Grading protocols: how a completion is graded against a gold answer, and how its prompt is written.

A number is only comparable with another graded the same way: ``boxed`` (default) is this package's reward,
:func:`~cegppo_trl.rewards.grade_completions`; :func:`authors` the CE-GPPO authors' grader (Kwai-Klear/CE-GPPO at
10558fe, ``verl/utils/reward_score/math_dapo.py``, ``math_verify_from_sky``); :func:`lighteval` /
:func:`lighteval_avg` lighteval 0.13's ``pass_at_k_math`` / ``avg_at_n_math``. Those three live in :mod:`.worker`,
which the grading workers run, and use math-verify's ``signal.alarm`` timeouts: call them in a main thread, or grade
a batch from anywhere with :func:`~cegppo_trl.rewards.grade_with_protocol`. How they differ, and their agreement with
the anchors: docs/rewards_and_data.md, *Grading protocols*.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .worker import authors, lighteval, lighteval_avg, remove_reasoning_tags


__all__ = [
    "DEFAULT_PROTOCOL",
    "LIGHTEVAL_MATH_TEMPLATE",
    "PROTOCOLS",
    "Protocol",
    "authors",
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


class Protocol(NamedTuple):
    """One way to grade and prompt: ``instruction`` is the ``--instruction`` word or ``{problem}`` template of its
    prompts (``cegppo_trl.data.resolve_instruction``); ``timeout_s`` the hard bound per completion that keeps the
    protocol's own timeouts intact in the grading pool."""

    name: str
    instruction: str
    timeout_s: float


PROTOCOLS: dict[str, Protocol] = {
    # authors / lighteval: parse 5 s + gold parse 5 s + verify (5 s per gold x answer pair, 2 x 2 pairs), a margin
    "authors": Protocol("authors", "none", 40.0),
    "lighteval": Protocol("lighteval", LIGHTEVAL_MATH_TEMPLATE, 40.0),
    "lighteval_avg": Protocol("lighteval_avg", LIGHTEVAL_MATH_TEMPLATE, 40.0),
    "boxed": Protocol("boxed", "default", 3.0),
}
"""The grading protocols by name (``cegppo-eval --protocol``)."""


def resolve_protocol(name: Any) -> Protocol:
    """The :class:`Protocol` called ``name``; ``ValueError`` naming the known ones otherwise."""
    protocol = PROTOCOLS.get(name) if isinstance(name, str) else None
    if protocol is None:
        raise ValueError(f"unknown grading protocol {name!r}; choose one of {', '.join(PROTOCOLS)}.")
    return protocol
