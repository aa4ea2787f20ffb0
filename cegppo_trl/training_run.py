"""The pieces of a `cegppo-train` run that are library code: the model (``builtin:tiny`` built once per node), the
data sets, the checkpoint to resume, the model load with one-line errors, and the callbacks that write the prompt
format into every checkpoint and stop training cleanly on a signal (`cegppo_trl.stopping`)."""

from __future__ import annotations

import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .model_source import UnreadableWeightsError, explain_unreadable_weights  # re-exported for scripts/train.py
from .script_args import TINY_MODEL, CEGPPOScriptArguments, TrainArgumentError
from .stopping import StopRequest, last_checkpoint


__all__ = [
    "SavePromptAndSamplingCallback",
    "StopOnSignalCallback",
    "UnreadableWeightsError",
    "checkpoint_to_resume",
    "explain_unreadable_weights",
    "hub_dataset_name",
    "load_datasets",
    "resolve_model",
    "save_prompt_and_sampling",
]


def resolve_model(model_name_or_path: str | None, script_args: CEGPPOScriptArguments, training_args) -> str:
    """`model_name_or_path`, with ``builtin:tiny`` replaced by a local directory built once per node."""
    name = model_name_or_path
    if not name:
        raise TrainArgumentError("model_name_or_path is required: a Hub id, a local directory, or builtin:tiny.")
    if not name.startswith("builtin:"):
        # A local model by its absolute path: a LoRA adapter records it as its base, and cegppo-eval finds it anywhere.
        local = os.path.expanduser(name)
        return os.path.abspath(local) if os.path.isdir(local) else name
    if name != TINY_MODEL:
        raise TrainArgumentError(
            f"model_name_or_path: unknown built-in model {name!r}; the only one is {TINY_MODEL!r}."
        )
    from accelerate import PartialState

    from .tiny_model import materialize_tiny

    path = os.path.abspath(os.path.join(training_args.output_dir, "tiny-init"))
    state = PartialState()
    with state.local_main_process_first():  # the first process of each node builds it, the others load it
        if state.is_local_main_process and state.num_processes == 1:
            materialize_tiny(path, seed=training_args.seed, sft_steps=script_args.tiny_sft_steps)
        elif state.is_local_main_process:
            _materialize_tiny_alone(path, seed=training_args.seed, sft_steps=script_args.tiny_sft_steps)
    return path


# What makes a Python process join a launched job (torchrun's and accelerate's variables).
_LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _materialize_tiny_alone(path: str, seed: int, sft_steps: int) -> None:
    """Build ``builtin:tiny`` in a fresh single-process Python: its warm start is TRL's `SFTTrainer`, whose
    `Accelerator` would otherwise join this job's process group (and DeepSpeed config) while the other processes wait
    at the barrier."""
    import subprocess
    import sys

    env = {
        name: value
        for name, value in os.environ.items()
        if name not in _LAUNCH_VARIABLES and not name.startswith(("ACCELERATE_", "TORCHELASTIC_"))
    }
    code = "import sys; from cegppo_trl.tiny_model import materialize_tiny as m; m(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))"
    subprocess.run([sys.executable, "-c", code, path, str(seed), str(sft_steps)], env=env, check=True)


def load_datasets(script_args: CEGPPOScriptArguments, training_args):
    """(train_dataset, eval_dataset or None) with TRL's conversational `prompt` and a `solution` column."""
    from .data import load_math_dataset

    if not script_args.dataset_name:
        raise TrainArgumentError(
            "dataset_name is required: a Hub id (e.g. Kwai-Klear/KlearReasoner-MathSub-30K), a local file, or "
            "builtin:arithmetic."
        )
    columns = dict(
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
        system_prompt=script_args.system_prompt,
        instruction=script_args.instruction,  # resolved by CEGPPOScriptArguments
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


def checkpoint_to_resume(training_args) -> str | None:
    """The checkpoint to resume from: `resume_from_checkpoint` if given, else the last one in `output_dir` (open-r1's
    auto-resume with transformers' `get_last_checkpoint`), skipping one left incomplete by an interrupted save."""
    given = training_args.resume_from_checkpoint
    if given is not None:
        if not os.path.isfile(os.path.join(given, "trainer_state.json")):
            last, _ = last_checkpoint(os.path.dirname(os.path.normpath(given)) or ".")
            hint = f" The last complete checkpoint there is {last}." if last else ""
            raise TrainArgumentError(
                f"--resume_from_checkpoint {given}: not a complete checkpoint (no trainer_state.json; a save was "
                f"interrupted, or the path is wrong).{hint}"
            )
        return given
    found = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
    if found is not None and not os.path.isfile(os.path.join(found, "trainer_state.json")):
        found, _ = last_checkpoint(training_args.output_dir)  # the newest was being written when a run stopped
    return found


def hub_dataset_name(name: str | None) -> str | None:
    """The data set name for the model card, if it is a Hub id (not a local file or a built-in set)."""
    if not name or name.startswith("builtin:") or os.path.exists(name) or name.count("/") != 1:
        return None
    return name


def save_prompt_and_sampling(path: str, script_args: CEGPPOScriptArguments, training_args) -> str:
    """Write, next to the model or adapter in `path`, the prompt format and sampling it was trained with: the
    instruction and system prompt in ``cegppo_prompt.json``, temperature / top_p / top_k / max_completion_length in
    ``generation_config.json`` (`cegppo_trl.prompt_settings.save_eval_settings`). `cegppo-eval path` uses them."""
    from .prompt_settings import save_eval_settings

    return save_eval_settings(
        path,
        instruction=script_args.instruction,
        system_prompt=script_args.system_prompt,
        temperature=training_args.temperature,
        top_p=training_args.top_p,
        top_k=training_args.top_k or 0,
        max_new_tokens=training_args.max_completion_length,
        note="cegppo-train: the prompt format (instruction, system prompt) this model was trained with; "
        "generation_config.json holds its training sampling (temperature, top_p, top_k, max_completion_length as "
        "max_new_tokens; min_p, repetition_penalty and generation_kwargs are not carried). cegppo-eval uses them "
        "unless flags say otherwise.",
    )


class SavePromptAndSamplingCallback(TrainerCallback):
    """Write the prompt format and sampling (`save_prompt_and_sampling`) into every checkpoint-N folder too, so that
    `cegppo-eval` on a checkpoint prompts it as it was trained."""

    def __init__(self, script_args: CEGPPOScriptArguments):
        self.script_args = script_args

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save and os.path.isdir(path):
            save_prompt_and_sampling(path, self.script_args, args)


class StopOnSignalCallback(TrainerCallback):
    """End training at the first step end or checkpoint save after a signal, on every process at once: the flags of
    all processes are max-reduced at each of these points (they are reached by every process in the same order)."""

    def __init__(self, request: StopRequest, accelerator):
        self.request = request
        self.accelerator = accelerator

    def on_train_begin(self, args, state, control, **kwargs):
        self.request.deferred = True

    def on_train_end(self, args, state, control, **kwargs):
        self.request.deferred = False  # the final save: a signal now stops at once, training is complete

    def _stop_if_asked(self, control):
        import torch

        asked = torch.tensor(
            [0 if self.request.signum is None else self.request.signum], device=self.accelerator.device
        )
        signum = int(self.accelerator.reduce(asked, reduction="max").item())  # the same answer on every process
        if signum:
            self.request.signum = self.request.signum or signum
            self.request.stopped_early = True
            control.should_training_stop = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        return self._stop_if_asked(control)

    def on_save(self, args, state, control, **kwargs):
        return self._stop_if_asked(control)
