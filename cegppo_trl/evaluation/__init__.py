"""Evaluation: avg@k and pass@k of a model on math data sets, graded by a named protocol
(`cegppo_trl.rewards.protocols`), from the command line (`cegppo-eval`, `cegppo_trl/scripts/eval.py`) or during
training (`AvgAtKCallback`). How to use it: docs/evaluation.md.

Modules: `metrics` (pass@k, grading, the figures), `settings` (`EvalSettings`, `EvalArguments`), `datasets` (the
``--datasets`` entries, ``--preset``), `generation` (seeded `generate`, the model loader, vLLM), `run`
(`evaluate_model`), `compare` (``--compare``), `callback` (`AvgAtKCallback`). The names of `generation` and `callback`
load on first use (PEP 562), so `from cegppo_trl.evaluation import pass_at_k` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from ..prompt_settings import DEFAULT_MAX_NEW_TOKENS, PROMPT_FILE, load_eval_settings, save_eval_settings
from .datasets import parse_dataset_spec
from .metrics import evaluate_completions, format_summary, pass_at_k, summarize_counts
from .run import evaluate_model
from .settings import EvalSettings


# names whose module imports torch or transformers' Trainer -> that module
_LAZY = {
    "AvgAtKCallback": "callback",
    "generate_completions": "generation",
    "generate_with_entropy": "generation",
    "prompt_token_ids": "generation",
}

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "PROMPT_FILE",
    "AvgAtKCallback",
    "EvalSettings",
    "evaluate_completions",
    "evaluate_model",
    "format_summary",
    "generate_completions",
    "generate_with_entropy",
    "load_eval_settings",
    "parse_dataset_spec",
    "pass_at_k",
    "prompt_token_ids",
    "save_eval_settings",
    "summarize_counts",
]

__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)


if TYPE_CHECKING:  # static analysers and IDEs see the lazy names too
    from .callback import AvgAtKCallback  # noqa: F401
    from .generation import generate_completions, generate_with_entropy, prompt_token_ids  # noqa: F401
