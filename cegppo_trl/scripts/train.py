"""`cegppo-train`: CE-GPPO on a math data set, in the shape of TRL's `trl/scripts/grpo.py`: a `TrlParser` over
`CEGPPOScriptArguments`, `CEGPPOConfig` and `trl.ModelConfig` (flags, or a YAML recipe with ``--config PATH`` or
``--config=PATH``; a ``recipes/...`` path missing here is read from the package's copy), TRL's `main` and open-r1's
auto-resume. ``builtin:tiny`` builds the model of `cegppo_trl.tiny_model` in ``<output_dir>/tiny-init``. The model (or
adapter), ``trainer_state.json``, a model card and the prompt and sampling it was trained with (also in every
``checkpoint-N``, for ``cegppo-eval``) go to ``output_dir``. Exit status 2: a bad input, in one line (raised where a
Python user of the library meets it too); 130 / 143: stopped by SIGINT / SIGTERM (`cegppo_trl.scripts.stopping`);
3: stopped by a non-finite step or a batch without rewards, or nothing finite to resume from (`cegppo_trl.divergence`).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl import ScriptArguments, TrlParser

from ..data import DEFAULT_INSTRUCTION, resolve_instruction
from ..prompt_settings import prompt_and_sampling_callback, resolve_system_prompt
from .stopping import StopRequest, interrupted_message, stop_on_signal_callback


PROG = "cegppo-train"
TINY_MODEL = "builtin:tiny"
DESCRIPTION = (
    "Train a causal language model with CE-GPPO on a math data set: flags, or a YAML recipe with --config (flags "
    "win), e.g. `cegppo-train --config recipes/tiny/cegppo/config_cpu.yaml`; `cegppo-recipes --list` lists them."
)


# TRL's script flags that `cegppo-train` refuses when set, and why (`tests/test_train_cli_messages.py`: every flag is
# read or refused).
UNUSED_SCRIPT_FLAGS = {
    "dataset_streaming": "cegppo-train loads the data set whole (--max_train_samples N keeps its first N rows)",
    "ignore_bias_buffers": "it is for DDP with boolean bias buffers in TRL's DPO script; cegppo-train never reads it",
}


@dataclass
class CEGPPOScriptArguments(ScriptArguments):
    """Script arguments of `cegppo-train`: TRL's `ScriptArguments` plus the data-set columns (read by
    `cegppo_trl.load_math_dataset`), the prompt (`instruction` and `system_prompt` take the words of `cegppo-eval`:
    `none`, `default`, a `{problem}` template) and the rewards (`math`: the paper's +1 / -1 by math-verify)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub id, .jsonl/.json/.parquet/.csv file."})
    eval_dataset_name: str | None = field(default=None, metadata={"help": "Evaluation set (default: dataset_name)."})
    problem_column: str | None = field(default=None, metadata={"help": "Column holding the problem."})
    answer_column: str | None = field(default=None, metadata={"help": "Gold answer column ('a.b': key b of dict a)."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message ('none': no system message)."})
    instruction: str | None = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "'default', 'none', a template with {problem}, or text appended to each problem."},
    )
    example_problem: str | None = field(
        default=None, metadata={"help": "A worked example before each problem (a user turn); needs example_answer."}
    )
    example_answer: str | None = field(default=None, metadata={"help": "The example's answer (an assistant turn)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training rows."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math"],
        metadata={
            "help": "Rewards: 'math' (+1/-1, math-verify), 'math_authors' (the authors' grader), 'format', a.b.f."
        },
    )
    correct_reward: float = field(default=1.0, metadata={"help": "math reward of a verified answer (paper: +1)."})
    wrong_reward: float = field(default=-1.0, metadata={"help": "math reward of a wrong answer (paper: -1)."})
    unparseable_reward: float | None = field(
        default=None, metadata={"help": "math reward, no answer (default: wrong)."}
    )
    reward_timeout_s: float = field(default=3.0, metadata={"help": "Grading time limit per completion (s)."})
    tiny_sft_steps: int = field(default=0, metadata={"help": "builtin:tiny: SFT steps on builtin:arithmetic first."})

    def __post_init__(self):
        self.instruction = resolve_instruction(self.instruction)  # ValueError names an unknown {placeholder}
        self.system_prompt = resolve_system_prompt(self.system_prompt)
        if (self.example_problem is None) != (self.example_answer is None):
            raise ValueError("--example_problem and --example_answer go together: pass both or neither.")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(
                f"--max_train_samples {self.max_train_samples}: it keeps the first N training rows and must be at "
                "least 1; leave it out to train on the whole data set."
            )
        refused = [
            f"--{flag} {getattr(self, flag)}: {why}"
            for flag, why in UNUSED_SCRIPT_FLAGS.items()
            if getattr(self, flag)
        ]
        if refused:  # TRL's `ScriptArguments` has them; no step of this command reads them
            raise ValueError(f"{refused[0]}; leave it out.")
        if self.tiny_sft_steps < 0:
            raise ValueError(f"--tiny_sft_steps {self.tiny_sft_steps}: SFT steps must be 0 (none) or more.")


class CEGPPOTrainParser(TrlParser):
    """TrlParser, also reading ``--config=PATH`` and the shipped copy of a ``recipes/...`` path missing here."""

    def parse_args_and_config(self, args=None, *rest, **kwargs):
        from ..resources import resolve_shipped_path

        args = list(sys.argv[1:] if args is None else args)
        for i, arg in enumerate(args):
            if arg.startswith("--config="):
                args[i : i + 1] = ["--config", arg.removeprefix("--config=")]
        if "--config" in args:  # TrlParser reads the word after the first --config as its path
            at = args.index("--config") + 1
            if at == len(args) or args[at].startswith("--"):
                raise ValueError("--config needs the path of a YAML recipe, e.g. recipes/tiny/cegppo/config_cpu.yaml.")
            args[at] = resolve_shipped_path(args[at])
        return super().parse_args_and_config(args, *rest, **kwargs)


def make_parser(prog: str | None = PROG) -> CEGPPOTrainParser:
    from trl import ModelConfig

    from ..config import CEGPPOConfig

    usage = "%(prog)s [--config RECIPE.yaml] [--option VALUE ...]"  # argparse's errors print it: all 230 are too many
    return CEGPPOTrainParser((CEGPPOScriptArguments, CEGPPOConfig, ModelConfig), prog=prog, usage=usage,
                             description=DESCRIPTION)  # fmt: skip


def build_reward_funcs(script_args: CEGPPOScriptArguments) -> list:
    """The reward functions `script_args.reward_funcs` names, in order (TRL's registry plus a dotted import path)."""
    from ..rewards import format_reward, make_math_reward

    funcs = []
    for name in script_args.reward_funcs:
        if name in ("math", "math_authors"):  # math_authors: the CE-GPPO authors' grading (docs/rewards_and_data.md)
            kwargs = dict(correct=script_args.correct_reward, wrong=script_args.wrong_reward)
            kwargs.update(unparseable=script_args.unparseable_reward, timeout_s=script_args.reward_timeout_s)
            kwargs.update({"protocol": "authors", "name": name} if name == "math_authors" else {})
            funcs.append(make_math_reward(**kwargs))
        elif name == "format":
            funcs.append(format_reward)
        elif "." in name and "," not in name:  # TRL's `module.function`, imported from the current directory too
            module, _, function = name.rpartition(".")
            sys.path.insert(0, os.getcwd()) if os.getcwd() not in sys.path else None
            try:
                funcs.append(getattr(importlib.import_module(module), function))
            except (ImportError, AttributeError) as error:
                raise ValueError(f"reward_funcs: cannot import {name!r} (here or on PYTHONPATH): {error}.") from None
        else:
            raise ValueError(
                f"reward_funcs: unknown reward {name!r}; use math, format or `module.function` (separate several "
                "with spaces: --reward_funcs math format)."
            )
    return funcs


def resolve_model(name: str | None, script_args: CEGPPOScriptArguments, training_args) -> str:
    """`model_args.model_name_or_path` checked by `cegppo_trl.model_source`, a local one by its absolute path (a LoRA
    adapter records it as its base); ``builtin:tiny`` built once in ``<output_dir>/tiny-init``, also by several nodes
    sharing output_dir (`materialize_tiny` locks: one node builds, the others wait and load)."""
    from ..model_source import resolve_model_source

    if name != TINY_MODEL:
        source = resolve_model_source(name or "")  # FileNotFoundError names a missing path
        path = source.adapter or source.path
        return os.path.abspath(path) if os.path.isdir(path) else path
    from ..tiny_model import materialize_tiny_in_job

    path = os.path.abspath(os.path.join(training_args.output_dir, "tiny-init"))
    return materialize_tiny_in_job(path, training_args.seed, script_args.tiny_sft_steps)


def worked_example(script_args) -> tuple[str, str] | None:
    """(problem, answer) of the worked example before each problem, or None."""
    return None if script_args.example_problem is None else (script_args.example_problem, script_args.example_answer)


def load_datasets(script_args: CEGPPOScriptArguments, training_args):
    """(train, eval or None): `load_math_dataset`'s conversational `prompt` and `solution` columns."""
    from ..data import load_math_dataset

    columns = dict(problem_column=script_args.problem_column, answer_column=script_args.answer_column,
                   system_prompt=script_args.system_prompt, instruction=script_args.instruction,
                   example=worked_example(script_args))  # fmt: skip
    name, config = script_args.dataset_name, script_args.dataset_config
    if not name:
        raise ValueError(
            "--dataset_name is required: a Hub id, a .jsonl/.json/.parquet/.csv file or builtin:arithmetic."
        )
    train = load_math_dataset(name, split=script_args.dataset_train_split, name=config, **columns)
    if script_args.max_train_samples is not None:
        train = train.select(range(min(script_args.max_train_samples, len(train))))
    if training_args.eval_strategy == "no":
        return train, None
    if script_args.eval_dataset_name:
        name, config = script_args.eval_dataset_name, None
    return train, load_math_dataset(name, split=script_args.dataset_test_split, name=config, **columns)


def build_trainer(script_args: CEGPPOScriptArguments, training_args, model_args, callbacks: list):
    """TRL's `main` up to the trainer: rewards, model options, data, `CEGPPOTrainer`."""
    if training_args.enable_jit_checkpoint:
        raise ValueError(
            "--enable_jit_checkpoint: transformers' SIGTERM handler would replace cegppo-train's, which stops every "
            "process at the same step end and prints the resume command; leave it off and save with --save_steps N "
            "(or use CEGPPOTrainer from Python with it)."
        )
    from ..run_checks import check_writable_path, missing_training_extra

    check_writable_path(training_args.output_dir, "--output_dir", folder=True)  # before builtin:tiny writes there
    if problem := missing_training_extra(training_args, model_args.use_peft):  # before data and model load
        raise ValueError(problem)
    reward_funcs = build_reward_funcs(script_args)  # first: a wrong name fails before the model is built
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)  # fmt: skip
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    train_dataset, eval_dataset = load_datasets(script_args, training_args)
    model = resolve_model(model_args.model_name_or_path, script_args, training_args)
    from trl import get_peft_config, get_quantization_config

    from ..trainer import CEGPPOTrainer

    return CEGPPOTrainer(model=model, reward_funcs=reward_funcs, args=training_args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, quantization_config=get_quantization_config(model_args),
                         peft_config=get_peft_config(model_args), callbacks=callbacks)  # fmt: skip


def train(script_args: CEGPPOScriptArguments, training_args, model_args, stop: StopRequest) -> bool:
    """TRL's `main` with open-r1's auto-resume (`--resume_from_checkpoint`, else the last complete checkpoint in
    `output_dir`): train, then save the model, its prompt settings, `trainer_state.json` and a model card. Returns
    True when a signal stopped training early; then only the checkpoints are saved."""
    from ..divergence import NonFiniteStepError, complete_checkpoints
    from ..model_source import can_be_hub_id
    from ..run_checks import RewardCoverageError

    checkpoint = training_args.resume_from_checkpoint  # checked by `DivergenceGuardMixin.train`
    settings = prompt_and_sampling_callback(script_args)
    trainer = build_trainer(script_args, training_args, model_args, [settings])
    trainer.add_callback(stop_on_signal_callback(stop, trainer.accelerator))
    if checkpoint is None and complete_checkpoints(training_args.output_dir):
        checkpoint = True  # the newest finite one (`DivergenceGuardMixin.train`)
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except (NonFiniteStepError, RewardCoverageError):  # raised on every process at the same step
        trainer.end()
        raise
    stopped = stop.stopped_early and trainer.state.global_step < trainer.state.max_steps
    if not stopped:
        trainer.accelerator.print("Training completed.")
        trainer.save_model(training_args.output_dir)
        if trainer.args.should_save:
            settings.write(training_args.output_dir, trainer.args)
        trainer.save_state()
        name = script_args.dataset_name
        dataset = name if can_be_hub_id(name) and not os.path.exists(name) else None
        model_name = training_args.hub_model_id or os.path.basename(os.path.normpath(training_args.output_dir))
        trainer.create_model_card(model_name=model_name.split("/")[-1], dataset_name=dataset)
        trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
        if training_args.push_to_hub:
            trainer.push_to_hub(dataset_name=dataset)
            trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    trainer.end()  # finish the trackers and destroy the process group (transformers >= 5.18)
    return stopped


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-train` (and `examples/train_cegppo.py`). The signal handlers come first, so a
    Ctrl-C during the imports gets the message too; a wrong input is one line and exit status 2."""
    stop, training_args = StopRequest(install=False), None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        stop.install()  # inside the try: a signal from here on is the message, never a traceback
        from ..divergence import DIVERGED_EXIT_STATUS, NoFiniteCheckpointError, NonFiniteStepError, stop_message
        from ..hub_kernels import HubKernelUnavailableError
        from ..model_source import UnreadableWeightsError
        from ..run_checks import RewardCoverageError

        try:
            script_args, training_args, model_args = make_parser().parse_args_and_config(argv)
            stop.announce = training_args.process_index == 0
            if not train(script_args, training_args, model_args, stop):
                return 0
            failure = None
        except (NonFiniteStepError, RewardCoverageError, NoFiniteCheckpointError) as error:
            # every process stopped at the same step; one message, from the process that prints
            failure = stop_message(error, PROG, training_args.output_dir) if stop.announce else ""
            status = DIVERGED_EXIT_STATUS
        except (ValueError, FileNotFoundError, HubKernelUnavailableError, UnreadableWeightsError) as error:
            if stop.started:
                raise  # raised while training: a fault, with its traceback
            failure, status = f"{PROG}: error: {error}", 2
        if failure is not None:
            gc.collect()  # the trainer the traceback held: its progress bar closes before the message, not after
            print(failure, file=sys.stderr, flush=True) if failure else None
            return status
    except KeyboardInterrupt:
        pass
    finally:
        stop.restore()
    if stop.announce:  # one message, not one per process
        print("\n" + interrupted_message(argv, training_args, PROG, stop.name), file=sys.stderr, flush=True)
    return stop.exit_status


if __name__ == "__main__":
    sys.exit(main())
