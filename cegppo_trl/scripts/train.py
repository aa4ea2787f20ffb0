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

``model_name_or_path: builtin:tiny`` builds the ~1M-parameter Qwen2-style model of `cegppo_trl.tiny_model` locally, in
``<output_dir>/tiny-init`` (with ``tiny_sft_steps > 0`` it is first warm-started on ``builtin:arithmetic``), and then
trains it like any local checkpoint. At the end the model (or LoRA adapter), ``trainer_state.json`` and a model card
(``README.md``) are written to ``output_dir``, with the prompt format and sampling the model was trained with
(``cegppo_prompt.json``, ``generation_config.json``; also in every ``checkpoint-N``), which ``cegppo-eval`` uses.

As in open-r1, a run resumes from the last checkpoint in ``output_dir`` (transformers' `get_last_checkpoint`) unless
``--resume_from_checkpoint`` names one. The library pieces live in `cegppo_trl.script_args` (the arguments, the reward
functions), `cegppo_trl.train_parser` (messages and help), `cegppo_trl.training_run` (model, data, resume, callbacks)
and `cegppo_trl.stopping` (signals).

Exit statuses: 0 done; 2 a wrong argument, recipe key or value, reward, model file or an uncached Hub kernel offline
(one line naming it and the fix, before the model loads where it can be checked); 130 after Ctrl-C (SIGINT) and 143
after SIGTERM: the run stops at the end of the current step, every process at the same step, and prints the last
complete checkpoint and the ``--resume_from_checkpoint`` command.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from ..stopping import StopRequest, interrupted_message, last_checkpoint  # light: installed before torch is imported


__all__ = ["DESCRIPTION", "interrupted_message", "last_checkpoint", "main", "make_parser", "train"]

DESCRIPTION = """\
Train a causal language model with CE-GPPO (TRL's GRPOTrainer with gradient-preserving clipping) on a math data
set with a verifiable reward. The model (or LoRA adapter), its checkpoints, trainer_state.json and a model card are
written to --output_dir; `cegppo-eval OUTPUT_DIR --datasets ...` evaluates it.

Every option is a field of CEGPPOScriptArguments (data, reward), CEGPPOConfig (TRL's GRPOConfig + the CE-GPPO
fields) or trl.ModelConfig (model, LoRA). Set them in a YAML recipe passed with --config (one `option: value` per
line), or as --option VALUE flags; a flag overrides the recipe.

examples:
  cegppo-train --config recipes/tiny/cegppo/config_cpu.yaml    # the tiny model on a CPU, nothing downloaded
  cegppo-train --config recipes/tiny/cegppo/config_cpu.yaml --max_steps 8 --output_dir outputs/tiny-8
  accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 8 \\
      examples/train_cegppo.py --config recipes/DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_paper.yaml

recipes: recipes/<model>/<method>/config_*.yaml in a clone of the repository (the paper's CE-GPPO, GRPO and DAPO
runs of DeepSeek-R1-Distill-Qwen-1.5B and -7B, LoRA, the tiny CPU recipe). `cegppo-recipes --list` lists the copies
shipped with the package, `cegppo-recipes DIR` copies them into DIR, and `--config recipes/...` reads the shipped
copy when the path does not exist here."""

KERNELS_FIX = "`model_init_kwargs: {use_kernels: false}` in the recipe"
# Names that moved into the library, still importable from here (loaded on first use: this module stays light).
_MOVED = {
    "CEGPPOScriptArguments": ("script_args", "CEGPPOScriptArguments"),
    "TrainArgumentError": ("script_args", "TrainArgumentError"),
    "build_reward_funcs": ("script_args", "build_reward_funcs"),
    "SavePromptAndSamplingCallback": ("training_run", "SavePromptAndSamplingCallback"),
    "save_prompt_and_sampling": ("training_run", "save_prompt_and_sampling"),
    "CEGPPOTrainParser": ("train_parser", "CEGPPOTrainParser"),
    "_with_shipped_config": ("train_parser", "with_shipped_config"),
    "_instruction": ("data", "resolve_instruction"),
}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _MOVED[name]
    return getattr(importlib.import_module(f"cegppo_trl.{module}"), attribute)


def make_parser(prog: str | None = "cegppo-train"):
    """The parser of `cegppo-train`: a `TrlParser` over `CEGPPOScriptArguments`, `CEGPPOConfig` and `ModelConfig`."""
    from ..train_parser import CEGPPOTrainParser

    return CEGPPOTrainParser(prog=prog, description=DESCRIPTION)


def train(script_args, training_args, model_args, stop: StopRequest | None = None) -> bool:
    """Train with `CEGPPOTrainer`, then save the model (or adapter), `trainer_state.json` and a model card.

    Returns True when a signal stopped training early (`stop`); then nothing is saved beyond the checkpoints."""
    from trl import get_peft_config, get_quantization_config

    from ..hub_kernels import explain_uncached_hub_kernels
    from ..script_args import build_reward_funcs
    from ..trainer import CEGPPOTrainer
    from ..training_run import (
        SavePromptAndSamplingCallback,
        StopOnSignalCallback,
        checkpoint_to_resume,
        explain_unreadable_weights,
        load_datasets,
        resolve_model,
    )

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    reward_funcs = build_reward_funcs(script_args)  # first: a wrong name fails before the model is built
    checkpoint = checkpoint_to_resume(training_args)
    with explain_uncached_hub_kernels(KERNELS_FIX):
        model = resolve_model(model_args.model_name_or_path, script_args, training_args)
        train_dataset, eval_dataset = load_datasets(script_args, training_args)
        with explain_unreadable_weights(model):
            trainer = CEGPPOTrainer(
                model=model,
                reward_funcs=reward_funcs,
                args=training_args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                quantization_config=get_quantization_config(model_args),
                peft_config=get_peft_config(model_args),
                callbacks=[SavePromptAndSamplingCallback(script_args)],
            )
    stop = stop or StopRequest(install=False)
    trainer.add_callback(StopOnSignalCallback(stop, trainer.accelerator))
    if checkpoint and training_args.resume_from_checkpoint is None:
        trainer.accelerator.print(f"Resuming from {checkpoint}, the last checkpoint in {training_args.output_dir}.")
    trainer.train(resume_from_checkpoint=checkpoint)
    if stop.stopped_early and trainer.state.global_step < trainer.state.max_steps:
        _end(trainer)
        return True
    trainer.accelerator.print("Training completed.")
    _save(trainer, script_args, training_args)
    _end(trainer)
    return False


def _save(trainer, script_args, training_args) -> None:
    """The model (or adapter), its prompt format and sampling, trainer_state.json, the model card; push if asked."""
    from ..training_run import hub_dataset_name, save_prompt_and_sampling

    trainer.save_model(training_args.output_dir)
    if trainer.args.should_save:
        save_prompt_and_sampling(training_args.output_dir, script_args, trainer.args)
    trainer.save_state()
    dataset_name = hub_dataset_name(script_args.dataset_name)
    model_name = training_args.hub_model_id or os.path.basename(os.path.normpath(training_args.output_dir))
    trainer.create_model_card(model_name=model_name.split("/")[-1], dataset_name=dataset_name)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")


def _end(trainer) -> None:
    if hasattr(trainer, "end"):  # transformers >= 5.18
        trainer.end()  # finish the trackers and destroy the process group


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-train` (also run by `examples/train_cegppo.py`); the exit statuses are in the
    module's docstring. The signal handlers come first, so a Ctrl-C during the imports gets the message too."""
    stop = StopRequest()
    user_argv = list(sys.argv[1:] if argv is None else argv)
    training_args, prog = None, "cegppo-train"
    try:
        from ..hub_kernels import HubKernelUnavailableError
        from ..training_run import UnreadableWeightsError

        parser = make_parser()
        prog = parser.prog
        try:
            script_args, training_args, model_args = parser.parse_args_and_config(args=user_argv)
            stopped = train(script_args, training_args, model_args, stop)
        except (ValueError, FileNotFoundError, HubKernelUnavailableError, UnreadableWeightsError) as error:
            if training_args is None or _ours(error):  # parsing, or one of ours: one line
                print(f"{prog}: error: {error}", file=sys.stderr)
                return 2
            raise
        if not stopped:
            return 0
    except KeyboardInterrupt:
        pass
    finally:
        stop.restore()
    if os.environ.get("RANK", "0") == "0":  # one message, not one per process
        print("\n" + interrupted_message(user_argv, training_args, prog, stop.name), file=sys.stderr, flush=True)
    return stop.exit_status


def _ours(error: BaseException) -> bool:
    """An error raised after parsing that `cegppo-train` words itself (others keep their traceback)."""
    from ..hub_kernels import HubKernelUnavailableError
    from ..script_args import TrainArgumentError
    from ..training_run import UnreadableWeightsError

    return isinstance(error, (TrainArgumentError, HubKernelUnavailableError, UnreadableWeightsError))


if __name__ == "__main__":
    sys.exit(main())
