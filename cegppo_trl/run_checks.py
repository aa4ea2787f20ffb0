"""Checks of a training run that TRL and transformers leave silent, or report late in other words, made where a Python
user of the library meets them too (`cegppo-train` prints each as one line, exit status 2):

- `check_training_args`, from `CEGPPOConfig.__post_init__`: completion length, batch size, temperature, saving
  (`save_steps` 0, checkpoints inside a generation batch) and an `output_dir` that cannot be a directory;
- in `CEGPPOTrainer.__init__`: `explain_model_load_errors` (a truncated weights file, an uncached Hub kernel offline),
  `check_dataset_fills_a_generation_batch`, `warn_if_untested_trl`, and `RewardCoverageError` (a batch in which
  every reward is None).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator


__all__ = [
    "RewardCoverageError",
    "check_dataset_fills_a_generation_batch",
    "check_training_args",
    "explain_model_load_errors",
    "warn_if_untested_trl",
]


def check_training_args(args) -> None:
    """Refuse `GRPOConfig` values that TRL accepts and that train on nothing, save nothing or fail later in another
    library's words (`ValueError` naming the flag and the fix); warn once about checkpoints that do not resume the same
    run."""
    if args.max_completion_length is not None and args.max_completion_length < 1:
        raise ValueError(
            f"--max_completion_length {args.max_completion_length}: the longest completion, in tokens, must be at "
            "least 1 (the paper's recipes use 8192; the tiny recipe 16)."
        )
    if args.per_device_train_batch_size < 1:
        raise ValueError(
            f"--per_device_train_batch_size {args.per_device_train_batch_size}: completions per process and "
            "micro-batch must be at least 1."
        )
    if args.temperature <= 0:
        raise ValueError(
            f"--temperature {args.temperature}: CE-GPPO learns from the differences between the num_generations "
            "completions of a prompt, so the sampling temperature must be > 0 (the paper: 1.0)."
        )
    if args.save_strategy == "steps" and args.save_steps <= 0:
        raise ValueError(
            f"--save_steps {args.save_steps:g} with --save_strategy steps would save no checkpoint: set save_steps to "
            "a number of optimizer steps (a multiple of the steps per generation batch), or --save_strategy no."
        )
    per_generation = args.steps_per_generation * args.num_iterations  # micro-batches fed by one generation batch
    if args.save_strategy == "steps" and args.save_steps >= 1:
        if (args.save_steps * args.gradient_accumulation_steps) % per_generation:
            steps = per_generation / args.gradient_accumulation_steps
            warnings.warn(
                f"save_steps {args.save_steps:g} is not a multiple of the {steps:g} "
                "optimizer steps per generation batch (steps_per_generation x num_iterations / "
                "gradient_accumulation_steps): a run resumed from a checkpoint inside a generation batch generates "
                "fresh completions there, so it is not the uninterrupted run.",
                UserWarning,
                stacklevel=3,
            )
    _check_output_dir(args.output_dir)


def _check_output_dir(output_dir: str | None) -> None:
    """`output_dir` must be a directory that can be created and written to: a file on its path, or a folder that is
    not writable, would fail after the model has loaded (or at the first checkpoint)."""
    if not output_dir:
        return
    path = os.path.abspath(os.path.expanduser(output_dir))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"is under the file {existing}"
        raise ValueError(f"--output_dir {output_dir} {where}; pass a directory path.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {output_dir}: {existing} is not writable; pass a directory you can write to.")


@contextlib.contextmanager
def explain_model_load_errors(model) -> Iterator[None]:
    """Around a model load: a truncated or damaged weights file and a Hub kernel neither cached nor downloadable are
    one line naming the file or kernel and the fix (`UnreadableWeightsError`, `HubKernelUnavailableError`)."""
    from .hub_kernels import explain_uncached_hub_kernels
    from .model_source import explain_unreadable_weights

    with explain_uncached_hub_kernels(), explain_unreadable_weights(model if isinstance(model, str) else ""):
        yield


def check_dataset_fills_a_generation_batch(train_dataset, args) -> None:
    """TRL's sampler yields whole generation batches only: a data set with fewer prompts than one would train 0 steps
    and end as if it had trained."""
    if train_dataset is None or not hasattr(train_dataset, "__len__"):
        return
    from .dynamic_sampling import over_generation  # the one place the generation batch's prompts are computed

    oversampling, needed = args.cegppo_oversampling, int(over_generation(args)[0])
    if len(train_dataset) < needed:
        times = f" x cegppo_oversampling {oversampling:g}" if oversampling != 1 else ""
        raise ValueError(
            f"the training data set has {len(train_dataset)} prompts, fewer than the {needed} of one generation batch "
            f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}{times}), "
            "so no step would train: use more data, or a smaller per_device_train_batch_size or steps_per_generation."
        )


class RewardCoverageError(ValueError):
    """Every reward function returned None for every completion of a batch: nothing to learn from (TRL only warns,
    trains on nothing and saves the model as a success). Raised by `CEGPPOTrainer._calculate_rewards`."""


# The TRL minor versions whose `GRPOTrainer._compute_loss` `CEGPPOTrainer` mirrors, checked by tests/test_trl_parity.py.
TESTED_TRL_MINOR_VERSIONS = ("1.16",)


def warn_if_untested_trl() -> None:
    """Warn when the installed TRL is not a version the mirrored loss code was checked against."""
    import trl

    if ".".join(trl.__version__.split(".")[:2]) not in TESTED_TRL_MINOR_VERSIONS:
        warnings.warn(
            f"cegppo_trl mirrors GRPOTrainer._compute_loss of TRL {TESTED_TRL_MINOR_VERSIONS} but TRL "
            f"{trl.__version__} is installed; run tests/test_trl_parity.py before trusting the loss, or install "
            f"trl=={TESTED_TRL_MINOR_VERSIONS[-1]}.*",
            UserWarning,
            stacklevel=3,
        )
