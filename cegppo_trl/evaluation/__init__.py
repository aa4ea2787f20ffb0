"""Evaluation: avg@k and pass@k of a model on math data sets, graded by a named protocol
(`cegppo_trl.rewards.protocols`: the training reward's, the paper authors', lighteval's), from the command line
(`cegppo-eval`, `cegppo_trl/scripts/eval.py`) or during training (`AvgAtKCallback`).

The modules, in reading order (each can be read on its own):

- :mod:`.metrics` -- pass@k, grading samples, the figures of a set (pure Python);
- :mod:`.settings` -- `EvalSettings` (every setting, declared once and checked in `__post_init__`) and
  `EvalArguments` (the command's model, data sets and report), parsed by TRL's `TrlParser` like cegppo-train's
  dataclasses; no torch. The prompt and sampling that travel with a saved model: `cegppo_trl.prompt_settings`;
  where the model comes from (full model, LoRA adapter, Hub id): `cegppo_trl.model_source`;
- :mod:`.datasets` -- the ``--datasets`` entries (``ID:SPLIT``, files, built-in sets, ``@K``), loaded and checked
  first; the presets (``--preset paper``);
- :mod:`.generation` -- seeded batched `generate`, the model loader and adapter merge, one vLLM engine per run;
- :mod:`.run` -- `evaluate_model`: check everything, load once, write each set's result as soon as it is done;
- :mod:`.compare` -- what makes two reports comparable (protocol, math-verify version, sampling), and `--compare`;
- :mod:`.callback` -- `AvgAtKCallback`, split across processes and logged through the trainer.

Names load on first use (PEP 562): `from cegppo_trl.evaluation import pass_at_k` does not import torch. How to
evaluate, LoRA adapters, the paper's five benchmarks in one command: docs/evaluation.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names


# public name -> submodule that defines it
_NAMES = {
    "pass_at_k": "metrics",
    "evaluate_completions": "metrics",
    "format_summary": "metrics",
    "summarize_counts": "metrics",
    "CHECKPOINT_SETTINGS": "settings",
    "DEFAULT_BATCH_SIZE": "settings",
    "DEFAULT_MAX_NEW_TOKENS": "settings",
    "DEFAULT_TEMPERATURE": "settings",
    "DEFAULT_TOP_P": "settings",
    "PROMPT_FILE": "settings",
    "EvalArguments": "settings",
    "EvalSettings": "settings",
    "load_eval_settings": "settings",  # defined in cegppo_trl.prompt_settings
    "save_eval_settings": "settings",
    "parse_dataset_spec": "datasets",
    "generate_completions": "generation",
    "generate_with_entropy": "generation",
    "load_model": "generation",
    "merge_adapter": "generation",
    "prompt_token_ids": "generation",
    "evaluate_model": "run",
    "AvgAtKCallback": "callback",
}

__all__ = sorted(_NAMES)


__getattr__, __dir__ = lazy_names(__name__, globals(), _NAMES)


if TYPE_CHECKING:  # static analysers and IDEs see the names eagerly
    from .callback import AvgAtKCallback  # noqa: F401
    from .datasets import parse_dataset_spec  # noqa: F401
    from .generation import (  # noqa: F401
        generate_completions,
        generate_with_entropy,
        load_model,
        merge_adapter,
        prompt_token_ids,
    )
    from .metrics import evaluate_completions, format_summary, pass_at_k, summarize_counts  # noqa: F401
    from .run import evaluate_model  # noqa: F401
    from .settings import (  # noqa: F401
        CHECKPOINT_SETTINGS,
        DEFAULT_BATCH_SIZE,
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_TEMPERATURE,
        DEFAULT_TOP_P,
        PROMPT_FILE,
        EvalArguments,
        EvalSettings,
        load_eval_settings,
        save_eval_settings,
    )
