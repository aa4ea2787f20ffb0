"""Checks of a training run that TRL and transformers leave silent, or report late in other words, made where a Python
user of the library meets them too (`cegppo-train` prints each as one line, exit status 2):

- `first_problem` (a missing optional package: `missing_extra`; a path that cannot be written: `check_writable_path`),
  what every console command checks before any work; `missing_training_extra`: what `cegppo-train`'s options need;
- `check_writable_path`: `cegppo-eval --output`, and in `CEGPPOTrainer.__init__` an `output_dir` that cannot be one;
- in `CEGPPOTrainer.__init__` too: `explain_model_load_errors` (a truncated weights file, an uncached Hub kernel offline),
  `check_dataset_fills_a_generation_batch`, `warn_if_untested_trl`, and `RewardCoverageError` (a batch in which
  every reward is None).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator


__all__ = [
    "RewardCoverageError",
    "check_dataset_fills_a_generation_batch",
    "check_writable_path",
    "explain_model_load_errors",
    "first_problem",
    "missing_extra",
    "missing_training_extra",
    "warn_if_untested_trl",
]


def missing_extra(module: str, extra: str, purpose: str) -> str | None:
    """None when `module` imports; else the one line a command prints before any work: what `purpose` needs and the
    extra of this package that brings it."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return None
    return f"{purpose} needs {module}, which is not installed: pip install 'cegppo-trl[{extra}]' (in a clone: -e '.[{extra}]')."


def first_problem(extras=(), writable=()) -> str | None:
    """The first thing a command lacks, as the one line it prints before any work (None: nothing): `extras` are
    `missing_extra` argument triples, `writable` `check_writable_path` (path, flag, folder) triples."""
    for args in extras:
        if problem := missing_extra(*args):
            return problem
    for args in writable:
        try:
            check_writable_path(*args)
        except ValueError as error:
            return str(error)
    return None


def missing_training_extra(training_args, use_peft: bool) -> str | None:
    """What a training run's options need installed: TRL finds a missing peft or vLLM only after the data and the
    model have loaded."""
    needs = [("peft", "peft", "--use_peft true (LoRA)")] if use_peft else []
    needs += [("vllm", "vllm", "--use_vllm true")] if training_args.use_vllm else []
    return first_problem(extras=needs)


_CHECKED: set[tuple[str, bool]] = set()


def check_writable_path(path, flag: str, folder: bool) -> None:
    """The one writable-path check of `cegppo-train --output_dir` / `CEGPPOTrainer` (`folder`) and `cegppo-eval
    --output` (a file): nothing on the path is a file where a folder goes, and the nearest existing folder takes a new
    file. Made before any model loads, so that a bad path costs seconds, not a run; writes nothing that stays."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if (path, folder) in _CHECKED:  # once per run: `cegppo-train` checks before builtin:tiny writes, the trainer too
        return
    if not folder and os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; pass the path of the JSON report, e.g. {path}/eval.json.")
    existing = path if folder else os.path.dirname(path)
    while not os.path.exists(existing):  # the missing folders are created on the first write
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"is under the file {existing}"
        raise ValueError(f"{flag} {path!r} {where}; pass a path in a writable folder.")
    try:
        with tempfile.TemporaryFile(dir=existing):  # as root too: /proc takes no new files, whoever asks
            pass
    except OSError as error:
        raise ValueError(
            f"{flag} {path!r} cannot be written ({error.strerror or error} in {existing}); nothing was run. Pass "
            f"{flag} a path in a writable folder."
        ) from None
    _CHECKED.add((path, folder))


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
    from .config import over_generation  # here: the console commands' checks above must not import TRL

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
