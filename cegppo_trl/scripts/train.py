"""`cegppo-train`: train a causal LM with CE-GPPO on a math data set (TRL script conventions).

One script for every scale: the tiny CPU model, DeepSeek-R1-Distill-Qwen-1.5B/7B on GPUs, LoRA, DeepSpeed ZeRO-2/3,
several nodes, and vLLM generation (colocated or `trl vllm-serve`). Arguments come from three dataclasses, on the
command line or in a YAML recipe passed with ``--config`` (command-line values override the recipe):

* `CEGPPOScriptArguments` -- the data set (a Hub id, a local .jsonl/.json/.parquet/.csv file, or
  ``builtin:arithmetic``; read by `cegppo_trl.load_math_dataset`) and the reward;
* `cegppo_trl.CEGPPOConfig` -- TRL's `GRPOConfig` (batching, optimiser, vLLM, logging, saving) + the CE-GPPO fields;
* `trl.ModelConfig` -- the model (a Hub id, a local directory, or ``builtin:tiny``) and the LoRA / quantization options.

Examples::

    cegppo-train --config recipes/tiny/cegppo/config_cpu.yaml          # CPU, nothing downloaded
    accelerate launch --config_file accelerate_configs/zero2.yaml \\
        examples/train_cegppo.py --config recipes/DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_paper.yaml

``model_name_or_path: builtin:tiny`` builds the ~1M-parameter Qwen2-style model of `cegppo_trl.demo.tiny` locally, in
``<output_dir>/tiny-init`` (with ``tiny_sft_steps > 0`` it is first warm-started on ``builtin:arithmetic``), and then
trains it like any local checkpoint. At the end the model (or LoRA adapter), ``trainer_state.json`` and a model card
(``README.md``) are written to ``output_dir``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser

from ..config import CEGPPOConfig
from ..data import DEFAULT_INSTRUCTION
from ..resources import resolve_shipped_path


TINY_MODEL = "builtin:tiny"
REWARD_NAMES = ("math", "format")


@dataclass
class CEGPPOScriptArguments(ScriptArguments):
    """
    Script arguments of `cegppo-train` (TRL's `ScriptArguments` plus the data-set columns and the reward).

    Args:
        dataset_name (`str`):
            A Hub data set id (e.g. `Kwai-Klear/KlearReasoner-MathSub-30K`), a local `.jsonl`/`.json`/`.parquet`/`.csv`
            file, or `builtin:arithmetic` (the small arithmetic set shipped with the package).
        eval_dataset_name (`str`, *optional*):
            Data set for evaluation when `eval_strategy` is not `"no"`; defaults to `dataset_name` with split
            `dataset_test_split`. `builtin:arithmetic_eval` is the held-out arithmetic set.
        problem_column (`str`, *optional*):
            Column holding the problem (a string, or a conversational list of messages whose last user message is
            used). Default: the first of `problem`, `question`, `prompt`, `query`, `input`.
        answer_column (`str`, *optional*):
            Column holding the gold answer; `"a.b"` reads key `b` of dict column `a` (KlearReasoner's
            `reward_model.ground_truth`). Default: the first of `answer`, `final_answer`, `ground_truth`, ...
        system_prompt (`str`, *optional*):
            System message placed before each problem.
        instruction (`str`, *optional*, defaults to the DeepSeek-R1 "\\boxed{}" instruction):
            Text appended to each problem; a text containing `{problem}` is a template; `null` (YAML) or `none` keeps
            the problem as it is.
        max_train_samples (`int`, *optional*):
            Keep only the first N training rows (smoke tests).
        reward_funcs (`list[str]`, *optional*, defaults to `["math"]`):
            `math` (math-verify, `correct_reward` / `wrong_reward`; the paper's +1 / -1), `format` (1 if the completion
            has a closed, non-empty `\\boxed{}` after any think block, else 0), or a dotted import path `module.function`. Weight them with
            `reward_weights`.
        correct_reward (`float`, *optional*, defaults to `1.0`):
            Reward of a verified answer (`math`).
        wrong_reward (`float`, *optional*, defaults to `-1.0`):
            Reward of a wrong answer (`math`).
        unparseable_reward (`float`, *optional*):
            Reward when no answer is found or it cannot be parsed (`math`); default: `wrong_reward`, as in the paper.
        reward_timeout_s (`float`, *optional*, defaults to `3.0`):
            Hard bound on the grading time of one completion (`math`).
        tiny_sft_steps (`int`, *optional*, defaults to `0`):
            With `model_name_or_path: builtin:tiny`, SFT steps on `builtin:arithmetic` before RL (0: random weights).
    """

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub data set id, local .jsonl/.json/.parquet/.csv file, or builtin:arithmetic."},
    )
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Evaluation data set (default: dataset_name, split dataset_test_split)."}
    )
    problem_column: str | None = field(default=None, metadata={"help": "Column holding the problem."})
    answer_column: str | None = field(
        default=None, metadata={"help": "Column holding the gold answer ('a.b' = key b of dict column a)."}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message."})
    instruction: str | None = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "Appended to each problem ('{problem}' makes it a template); 'none' to disable."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training rows."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math"],
        metadata={"help": "Rewards: 'math' (+1/-1, math-verify), 'format', or dotted import paths."},
    )
    correct_reward: float = field(default=1.0, metadata={"help": "math reward of a verified answer (paper: +1)."})
    wrong_reward: float = field(default=-1.0, metadata={"help": "math reward of a wrong answer (paper: -1)."})
    unparseable_reward: float | None = field(
        default=None, metadata={"help": "math reward when no answer parses (default: wrong_reward)."}
    )
    reward_timeout_s: float = field(default=3.0, metadata={"help": "Grading time limit per completion (s)."})
    tiny_sft_steps: int = field(
        default=0, metadata={"help": "builtin:tiny only: SFT warm-start steps on builtin:arithmetic (0: none)."}
    )


def make_parser(prog: str | None = "cegppo-train") -> TrlParser:
    return TrlParser((CEGPPOScriptArguments, CEGPPOConfig, ModelConfig), prog=prog)


# ----------------------------------------------------------------------------------------------------------------
# Pieces (importable, so tests and other scripts can reuse them)
# ----------------------------------------------------------------------------------------------------------------


def build_reward_funcs(script_args: CEGPPOScriptArguments) -> list:
    """The reward functions named in `script_args.reward_funcs`, in order."""
    from ..rewards import format_reward, make_math_reward

    names = script_args.reward_funcs
    if isinstance(names, str):
        names = [names]
    funcs = []
    for name in names:
        if name == "math":
            funcs.append(
                make_math_reward(
                    correct=script_args.correct_reward,
                    wrong=script_args.wrong_reward,
                    unparseable=script_args.unparseable_reward,
                    timeout_s=script_args.reward_timeout_s,
                )
            )
        elif name == "format":
            funcs.append(format_reward)
        elif "." in name:
            module_path, func_name = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            funcs.append(getattr(importlib.import_module(module_path), func_name))
        else:
            raise ValueError(
                f"Unknown reward {name!r}: use one of {list(REWARD_NAMES)} or a dotted import path 'module.function'."
            )
    if not funcs:
        raise ValueError("reward_funcs is empty; the paper uses reward_funcs: [math].")
    return funcs


def _instruction(value: str | None) -> str | None:
    return None if value is None or value.strip().lower() in ("", "none", "null") else value


def load_datasets(script_args: CEGPPOScriptArguments, training_args: CEGPPOConfig):
    """(train_dataset, eval_dataset or None) with TRL's conversational `prompt` and a `solution` column."""
    from ..data import load_math_dataset

    if not script_args.dataset_name:
        raise ValueError(
            "dataset_name is required: a Hub id (e.g. Kwai-Klear/KlearReasoner-MathSub-30K), a local file, or "
            "builtin:arithmetic."
        )
    columns = dict(
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
        system_prompt=script_args.system_prompt,
        instruction=_instruction(script_args.instruction),
        name=script_args.dataset_config,
    )
    train = load_math_dataset(script_args.dataset_name, split=script_args.dataset_train_split, **columns)
    if script_args.max_train_samples is not None:
        train = train.select(range(min(script_args.max_train_samples, len(train))))
    evaluation = None
    if training_args.eval_strategy != "no":
        name = script_args.eval_dataset_name or script_args.dataset_name
        if script_args.eval_dataset_name:
            columns["name"] = None
        evaluation = load_math_dataset(name, split=script_args.dataset_test_split, **columns)
    return train, evaluation


def resolve_model(model_args: ModelConfig, script_args: CEGPPOScriptArguments, training_args: CEGPPOConfig) -> str:
    """`model_name_or_path`, with ``builtin:tiny`` replaced by a local directory built once per node."""
    name = model_args.model_name_or_path
    if not name:
        raise ValueError("model_name_or_path is required: a Hub id, a local directory, or builtin:tiny.")
    if not name.startswith("builtin:"):
        return name
    if name != TINY_MODEL:
        raise ValueError(f"Unknown built-in model {name!r}; the only one is {TINY_MODEL!r}.")
    from accelerate import PartialState

    path = os.path.join(training_args.output_dir, "tiny-init")
    state = PartialState()
    from ..demo.tiny import materialize_tiny  # the demo's tiny model; the only demo module this script uses

    with state.local_main_process_first():  # the first process of each node builds it, the others load it
        if state.is_local_main_process:
            materialize_tiny(path, seed=training_args.seed, sft_steps=script_args.tiny_sft_steps)
    return path


def _hub_dataset_name(name: str | None) -> str | None:
    """The data set name for the model card, if it is a Hub id (not a local file or a built-in set)."""
    if not name or name.startswith("builtin:") or os.path.exists(name) or name.count("/") != 1:
        return None
    return name


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------


def train(script_args: CEGPPOScriptArguments, training_args: CEGPPOConfig, model_args: ModelConfig):
    """Train with `CEGPPOTrainer`, then save the model (or adapter), `trainer_state.json` and a model card."""
    from trl import get_peft_config, get_quantization_config

    from ..trainer import CEGPPOTrainer

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    model = resolve_model(model_args, script_args, training_args)
    train_dataset, eval_dataset = load_datasets(script_args, training_args)
    trainer = CEGPPOTrainer(
        model=model,
        reward_funcs=build_reward_funcs(script_args),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")

    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    dataset_name = _hub_dataset_name(script_args.dataset_name)
    model_name = training_args.hub_model_id or os.path.basename(os.path.normpath(training_args.output_dir))
    trainer.create_model_card(model_name=model_name.split("/")[-1], dataset_name=dataset_name)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    if hasattr(trainer, "end"):  # transformers >= 5.18
        trainer.end()  # finish the trackers and destroy the process group
    return trainer


def _with_shipped_config(argv: list[str]) -> list[str]:
    """Point `--config recipes/...` at the shipped copy when the path does not exist here (a pip-installed user)."""
    if "--config" in argv[:-1]:  # TrlParser reads exactly `--config PATH`
        i = argv.index("--config") + 1
        argv[i] = resolve_shipped_path(argv[i])
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-train` (also run by `examples/train_cegppo.py`)."""
    parser = make_parser()
    argv = _with_shipped_config(list(sys.argv[1:] if argv is None else argv))
    script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    train(script_args, training_args, model_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
