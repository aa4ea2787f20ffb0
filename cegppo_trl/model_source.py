"""Where a model comes from, checked before anything loads: the one model resolver (a saved directory, a LoRA adapter
folder and its base, a ``checkpoint-N`` folder or a Hub id), the one Hub-id check, and the one-line answer to a
truncated weights file. Shared by `cegppo-train`, `cegppo-eval` and the demo; imports nothing of the package, so any
module may import it (no cycle).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass


ADAPTER_FILE = "adapter_config.json"  # what peft's save_pretrained writes in a LoRA adapter folder


def can_be_hub_id(name: str) -> bool:
    """Whether the Hub would accept `name` as a repository id (`name` or `namespace/name`), by huggingface_hub's own
    validation: the one Hub-id check of the package (models and data sets)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def holds_model(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a saved model (``config.json``) or a LoRA adapter (``adapter_config.json``)."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in ("config.json", ADAPTER_FILE))


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from. `path`: the full model to load (a local directory or a Hub id); `adapter`: a
    LoRA adapter folder applied on top of it (merged), or None."""

    given: str
    path: str
    adapter: str | None = None

    @property
    def settings_dirs(self) -> tuple[str, ...]:
        """Where the model's prompt settings may be: the adapter folder first, then the base."""
        return tuple(d for d in (self.adapter, self.path) if d is not None)

    @property
    def tokenizer_dir(self) -> str:
        """The adapter folder when it has a tokenizer (Trainer.save_model writes it there), else the base model."""
        has_tokenizer = self.adapter and os.path.isfile(os.path.join(self.adapter, "tokenizer_config.json"))
        return self.adapter if has_tokenizer else self.path


def _check_local_or_hub(name: str, what: str, fix: str) -> str:
    """`name` as a local model directory (expanded) or a Hub id; a path that does not exist is an error naming it."""
    path = os.path.expanduser(name)
    where = os.path.abspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise FileNotFoundError(f"{what} {name!r} ({where}) holds no saved model (no config.json). {fix}")
    if os.path.exists(path):
        raise FileNotFoundError(f"{what} {name!r} is a file; pass a model directory or a Hub id. {fix}")
    parent = os.path.dirname(where.rstrip(os.sep))
    looks_local = name.startswith((".", "/", "~")) or (
        "/" in name.rstrip("/") and os.path.isdir(os.path.dirname(path.rstrip(os.sep)) or ".")
    )
    if looks_local or not can_be_hub_id(name):
        raise FileNotFoundError(
            f"{what} {name!r} does not exist ({where}"
            + ("" if os.path.isdir(parent) else f"; its parent {parent} does not exist either")
            + f") and is not a Hugging Face Hub id ('org/name'). {fix}"
        )
    return name


def _adapter_source(name: str, path: str, base_model: str | None) -> ModelSource:
    with open(os.path.join(path, ADAPTER_FILE), encoding="utf-8") as f:
        recorded = json.load(f).get("base_model_name_or_path")
    base = base_model or recorded
    if not base:
        raise FileNotFoundError(
            f"LoRA adapter {name!r}: its {ADAPTER_FILE} names no base_model_name_or_path; pass --base-model."
        )
    said_by = "--base-model" if base_model else f"base_model_name_or_path in {os.path.join(name, ADAPTER_FILE)}"
    base_path = _check_local_or_hub(
        base, f"the base model of LoRA adapter {name!r} ({said_by})", "Pass --base-model PATH_OR_HUB_ID."
    )
    return ModelSource(given=name, path=base_path, adapter=path)


def resolve_model_source(model_name_or_path: str | os.PathLike, base_model: str | None = None) -> ModelSource:
    """Check `model_name_or_path` (and, for a LoRA adapter folder, its base) before anything loads.

    A local directory with ``config.json`` is a full model; one with ``adapter_config.json`` and no ``config.json``
    (what ``cegppo-train --use_peft true`` saves) is a LoRA adapter whose base is `base_model` or the adapter's
    ``base_model_name_or_path``. Anything else must be a valid Hub id. Errors name the path and the fix.
    """
    name = os.fspath(model_name_or_path)
    path = os.path.expanduser(name)
    fix = "Pass a directory written by save_pretrained / Trainer.save_model (or a checkpoint-N folder), or a Hub id."
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.isfile(os.path.join(path, ADAPTER_FILE)):
            return _adapter_source(name, path, base_model)
        inside = sorted(
            entry
            for entry in os.listdir(path)
            if holds_model(os.path.join(path, entry)) and (entry == "final" or entry.startswith("checkpoint-"))
        )
        hint = f" It contains saved models: {', '.join(os.path.join(name, e) for e in inside)}." if inside else ""
        raise FileNotFoundError(
            f"model directory {name!r} ({os.path.abspath(path)}) holds no saved model (no config.json or "
            f"{ADAPTER_FILE}).{hint} {fix}"
        )
    if base_model is not None:
        raise ValueError(f"--base-model applies to LoRA adapter folders; {name!r} is not one.")
    return ModelSource(given=name, path=_check_local_or_hub(name, "model path", fix))


class UnreadableWeightsError(RuntimeError):
    """A weights file of the model cannot be read (truncated or damaged); the message names the file."""


@contextlib.contextmanager
def explain_unreadable_weights(model: str) -> Iterator[None]:
    """Turn safetensors' "Error while deserializing header" (a truncated or damaged file) into one line naming the
    file and the fix (`UnreadableWeightsError`): the one check of cegppo-train and cegppo-eval."""
    from safetensors import SafetensorError, safe_open

    try:
        yield
    except SafetensorError as error:
        bad = []
        for path in sorted(glob.glob(os.path.join(glob.escape(model), "*.safetensors"))):
            try:
                with safe_open(path, "pt"):
                    pass
            except SafetensorError:
                bad.append(path)
        where = ", ".join(bad) if bad else f"a .safetensors file of {model}"
        raise UnreadableWeightsError(
            f"cannot read the weights in {where} ({error}): the file is truncated or damaged (an interrupted copy or "
            "download?). Copy or download the model again."
        ) from None
