"""Verifiable math rewards for TRL's ``GRPOTrainer`` (and the CE-GPPO trainer built on it).

``math_reward`` is the paper's reward (``+1`` if the final answer verifies against the gold with math-verify, ``-1``
otherwise); ``make_math_reward`` builds it with other values, timeout or worker count. The modules, in reading order:

- :mod:`.extract` -- the text of a completion, its final answer, the gold as a string (public helpers);
- :mod:`.prefilter` -- cheap in-process checks: answers sympy cannot grade in bounded time, exact plain numbers;
- :mod:`.worker` -- the grading worker program (math-verify with a soft timeout) and the status strings;
- :mod:`.grading` -- the pool of worker processes with a hard timeout, and what each pool remembers;
- :mod:`.reward` -- ``grade_completions``: a status per completion;
- :mod:`.protocols` -- the named grading protocols (``authors``, ``lighteval``, ``lighteval_avg``, ``boxed``) and
  ``grade_with_protocol``, which grades a batch with one of them in the same pool;
- :mod:`.reward_functions` -- ``math_reward``, ``make_math_reward``, ``format_reward``.

How answers are found and graded, and why in worker processes: docs/rewards_and_data.md.
"""

from .extract import extract_answer
from .grading import shutdown_grading_workers
from .protocols import DEFAULT_PROTOCOL, PROTOCOLS, grade_with_protocol
from .reward import DEFAULT_TIMEOUT_S, MAX_GOLD_TIMEOUTS, GradeResult, grade_completions
from .reward_functions import format_reward, make_math_reward, math_reward


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
