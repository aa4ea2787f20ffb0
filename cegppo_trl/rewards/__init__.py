"""Verifiable math rewards for TRL's ``GRPOTrainer`` (and the CE-GPPO trainer built on it).

``math_reward`` is the paper's reward (``+1`` if the final answer verifies against the gold with math-verify, ``-1``
otherwise); ``make_math_reward`` builds it with other values, timeout, worker count or grading protocol. The modules,
in reading order: :mod:`.extract`, :mod:`.prefilter`, :mod:`.worker`, :mod:`.grading`, :mod:`.protocols`,
:mod:`.reward`; what each holds and how answers are found and graded: docs/rewards_and_data.md.
"""

from .extract import extract_answer
from .grading import shutdown_grading_workers
from .protocols import DEFAULT_PROTOCOL, PROTOCOLS
from .reward import (
    DEFAULT_TIMEOUT_S,
    MAX_GOLD_TIMEOUTS,
    GradeResult,
    format_reward,
    grade_completions,
    grade_with_protocol,
    make_math_reward,
    math_reward,
)


__all__ = [
    "DEFAULT_PROTOCOL",
    "DEFAULT_TIMEOUT_S",
    "MAX_GOLD_TIMEOUTS",
    "PROTOCOLS",
    "GradeResult",
    "extract_answer",
    "format_reward",
    "grade_completions",
    "grade_with_protocol",
    "make_math_reward",
    "math_reward",
    "shutdown_grading_workers",
]
