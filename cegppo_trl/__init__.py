"""CE-GPPO (gradient-preserving clipping policy optimization, paper Eq. 8) for TRL.

Every public name is importable from here. Submodules load on first use (PEP 562), so
`from cegppo_trl import math_reward` does not import torch or TRL: a reward worker or a data script pays only for
what it uses. `_PUBLIC_NAMES` is the one table of which name lives where; `__all__` is its keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names


__version__ = "0.1.0"

# public name -> submodule that defines it
_PUBLIC_NAMES = {
    # the method
    "CEGPPOConfig": "config",
    "CEGPPOTrainer": "trainer",
    "EntropyController": "controller",
    "ClipParams": "core",
    "cegppo_per_token_loss": "core",
    "gradient_preserving_correction": "core",
    "ppo_clip_per_token_loss": "trl_mirror",
    # the divergence guard, for any transformers Trainer
    "DivergenceGuardMixin": "divergence",
    "NonFiniteStepError": "divergence",
    # rewards
    "math_reward": "rewards",
    "make_math_reward": "rewards",
    "format_reward": "rewards",
    "extract_answer": "rewards",
    "grade_completions": "rewards",
    "shutdown_grading_workers": "rewards",
    # data
    "load_math_dataset": "data",
    "build_prompt": "data",
    "DatasetFormatError": "data",
    # evaluation
    "AvgAtKCallback": "evaluation.callback",
    "EvalSettings": "evaluation.settings",
    "evaluate_model": "evaluation.run",
    "evaluate_completions": "evaluation.metrics",
    "generate_completions": "evaluation.generation",
    "pass_at_k": "evaluation.metrics",
}

__all__ = sorted(_PUBLIC_NAMES)


__getattr__, __dir__ = lazy_names(__name__, globals(), _PUBLIC_NAMES)


if TYPE_CHECKING:  # static analysers and IDEs see the names eagerly
    from .config import CEGPPOConfig
    from .controller import EntropyController
    from .core import ClipParams, cegppo_per_token_loss, gradient_preserving_correction
    from .data import DatasetFormatError, build_prompt, load_math_dataset
    from .divergence import DivergenceGuardMixin, NonFiniteStepError
    from .evaluation.callback import AvgAtKCallback
    from .evaluation.generation import generate_completions
    from .evaluation.metrics import evaluate_completions, pass_at_k
    from .evaluation.run import evaluate_model
    from .evaluation.settings import EvalSettings
    from .rewards import (
        extract_answer,
        format_reward,
        grade_completions,
        make_math_reward,
        math_reward,
        shutdown_grading_workers,
    )
    from .trainer import CEGPPOTrainer
    from .trl_mirror import ppo_clip_per_token_loss
