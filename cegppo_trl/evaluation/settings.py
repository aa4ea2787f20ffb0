"""What `cegppo-eval` can be told, declared once, and the settings that travel with a saved model.

`EvalSettings` is the one declaration of every setting: its fields are `evaluate_model`'s keywords, the command's
flags (`add_arguments`) and the report's ``"settings"`` (`dataclasses.asdict`); `EvalSettings.validate` is the one
check of their values. The prompt and sampling fields (`CHECKPOINT_SETTINGS`) may be left at None, meaning "the
model's own": a model directory (or LoRA adapter folder) with a ``cegppo_prompt.json`` declares the prompt it was
trained with there and its sampling in ``generation_config.json`` (`save_eval_settings`, called by ``cegppo-train``
and ``cegppo-demo``); without that file they take the paper's values (each field's ``fallback``).

Nothing here imports torch: the command line parses and checks its input before any model code loads.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any


__all__ = [
    "CHECKPOINT_SETTINGS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "PROMPT_FILE",
    "DatasetSpec",
    "EvalSettings",
    "ModelSource",
    "load_eval_settings",
    "parse_dataset_spec",
    "resolve_eval_settings",
    "resolve_model_source",
    "save_eval_settings",
]

#: The file in a model directory that declares its prompt format (see the module docstring).
PROMPT_FILE = "cegppo_prompt.json"
ADAPTER_FILE = "adapter_config.json"  # what peft's save_pretrained writes in a LoRA adapter folder
DEFAULT_TEMPERATURE = 0.6  # the paper's evaluation sampling
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_NEW_TOKENS = 32768  # the paper evaluates DeepSeek-R1-Distill-Qwen-1.5B / 7B with up to 32k tokens
DEFAULT_BATCH_SIZE = 64
GROUPS = {
    "prompt": "prompt and sampling (default: the model's own, from its cegppo_prompt.json and generation_config.json "
    "when it has the former, which cegppo-train and cegppo-demo write; else the paper's value shown)",
    "samples": "samples and figures",
    "data": "data sets",
    "model": "model and generation backend",
}


def _prompt_text(value: str) -> str:
    """The command line's words for a prompt part: 'none' = nothing, 'default' = load_math_dataset's instruction."""
    from ..data import DEFAULT_INSTRUCTION

    return {"none": "", "default": DEFAULT_INSTRUCTION}.get(value.strip().lower(), value)


def _setting(default: Any, help: str, group: str, *, type: Any = str, fallback: Any = MISSING, **argparse_kwargs):
    """One setting: its default, its help, its flag's group and argparse options, and (prompt and sampling) the
    paper's value used when neither the caller nor the model sets it."""
    metadata = {"help": help, "group": group, "type": type, "argparse": argparse_kwargs}
    if fallback is not MISSING:
        metadata["fallback"] = fallback
    return field(default=default, metadata=metadata)


@dataclass
class EvalSettings:
    """Every setting of `cegppo-eval` / `evaluate_model` (flag: ``--`` + the name with dashes, `pass_ks`:
    ``--pass-k``). The prompt and sampling fields default to None: the model's own settings, else the paper's."""

    # Prompt and sampling (CHECKPOINT_SETTINGS)
    instruction: str | None = _setting(
        None,
        "text appended to each problem; a text with {problem} is a template; 'none': nothing; 'default': "
        "load_math_dataset's 'Please reason step by step, and put your final answer within \\boxed{}.' (default: "
        "'default')",
        "prompt",
        fallback="default",
    )
    system_prompt: str | None = _setting(None, "system message ('none': no system message)", "prompt", fallback="")
    temperature: float | None = _setting(None, "sampling temperature, 0 = greedy", "prompt", type=float,
                                         fallback=DEFAULT_TEMPERATURE)  # fmt: skip
    top_p: float | None = _setting(None, "nucleus sampling top_p", "prompt", type=float, fallback=DEFAULT_TOP_P)
    top_k: int | None = _setting(None, "top-k cut, 0 = none", "prompt", type=int, fallback=0)
    max_new_tokens: int | None = _setting(
        None,
        "maximum completion length (DeepSeek-R1-Distill models reason for thousands of tokens; shorter caps cut "
        "their \\boxed{} answer off)",
        "prompt",
        type=int,
        fallback=DEFAULT_MAX_NEW_TOKENS,
    )
    # Samples and figures
    k: int = _setting(4, "samples per problem (the paper: 32; MATH500: 4)", "samples", type=int)
    pass_ks: list[int] | None = _setting(None, "pass@j values to report, each <= k (default: 1 and k)", "samples",
                                         type=int, nargs="+", flag="--pass-k", metavar="J")  # fmt: skip
    seed: int = _setting(0, "sampling seed; each data set starts from it", "samples", type=int)
    timeout_s: float | None = _setting(None, "grading time limit per completion (default 3 s)", "samples", type=float)
    # Data sets
    split: str = _setting(
        "test", "split of the Hub data sets written without one (ID:SPLIT sets its own)", "data", metavar="SPLIT"
    )
    problem_column: str | None = _setting(None, "problem column (default: found by load_math_dataset)", "data")
    answer_column: str | None = _setting(None, "answer column (default: found by load_math_dataset)", "data")
    max_problems: int | None = _setting(None, "evaluate only the first N problems of each set", "data", type=int)
    # Model and backend
    backend: str = _setting("hf", "generation backend", "model", choices=("hf", "vllm"))
    dtype: str = _setting("auto", "weights dtype", "model", choices=("auto", "float32", "bfloat16", "float16"))
    base_model: str | None = _setting(
        None, "base model of a LoRA adapter folder (default: base_model_name_or_path of its adapter_config.json)",
        "model",
    )  # fmt: skip
    batch_size: int = _setting(
        DEFAULT_BATCH_SIZE,
        "hf: sequences per generate call; it changes which samples are drawn, not their distribution (lower it "
        "for long completions)",
        "model",
        type=int,
    )
    device: str = _setting("auto", "hf: device (auto: cuda if available)", "model")
    max_model_len: int | None = _setting(None, "vllm: context length (default: the model's)", "model", type=int)
    gpu_memory_utilization: float = _setting(0.9, "vllm: fraction of GPU memory for the engine", "model", type=float)
    tensor_parallel_size: int = _setting(1, "vllm: GPUs per model (tensor parallelism)", "model", type=int)
    merge_dir: str | None = _setting(
        None, "vllm + LoRA adapter: where the merged model is written (default: a temporary directory, removed "
        "after the run)", "model",
    )  # fmt: skip

    def __post_init__(self):
        # The words 'none' and 'default' mean the same in Python as on the command line; None = not given.
        for name in ("instruction", "system_prompt"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, _prompt_text(getattr(self, name)))

    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of field `name`."""
        spec = next(f for f in fields(EvalSettings) if f.name == name)
        return spec.metadata["argparse"].get("flag") or "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field to `parser`, in groups; every default is None so that `from_namespace` keeps the
        dataclass's defaults and knows what was given."""
        groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
        for spec in fields(cls):
            options = dict(spec.metadata["argparse"])
            flag = options.pop("flag", None) or "--" + spec.name.replace("_", "-")
            default = spec.metadata.get("fallback", spec.default)
            help = spec.metadata["help"]
            if "(default" not in help:  # a help text that explains its default says it itself
                help += f" (default: {'none' if default in ('', None) else default})"
            groups[spec.metadata["group"]].add_argument(
                flag, dest=spec.name, type=spec.metadata["type"], default=None, help=help, **options
            )

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> EvalSettings:
        given = {f.name: getattr(namespace, f.name) for f in fields(cls) if getattr(namespace, f.name) is not None}
        return cls(**given)

    def resolve(self, *model_dirs: str | os.PathLike | None) -> tuple[EvalSettings, list[str]]:
        """Fill the prompt and sampling fields left at None: from the first of `model_dirs` that has a
        ``cegppo_prompt.json`` (`load_eval_settings`), else the paper's values. Returns the filled settings and the
        names taken from the model."""
        saved: dict[str, Any] = {}
        for directory in model_dirs:
            if directory is not None and os.path.isdir(os.path.expanduser(os.fspath(directory))):
                saved = load_eval_settings(directory) or {}
                if saved:
                    break
        values, from_checkpoint = {}, []
        for spec in fields(self):
            if "fallback" not in spec.metadata or getattr(self, spec.name) is not None:
                continue
            if saved.get(spec.name) is not None:
                values[spec.name] = saved[spec.name]
                from_checkpoint.append(spec.name)
            else:
                fallback = spec.metadata["fallback"]
                values[spec.name] = _prompt_text(fallback) if isinstance(fallback, str) else fallback
        return replace(self, **values), from_checkpoint

    def validate(self) -> EvalSettings:
        """Raise ValueError naming the flag and the fix for the first bad value; returns self."""

        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{self.flag(name)} ({name}) {what}, got {getattr(self, name)!r}.")

        def positive_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, "must be an integer >= 1"
            )

        for name in ("k", "batch_size", "tensor_parallel_size"):
            positive_int(name)
        for name in ("max_new_tokens", "max_problems", "max_model_len"):
            positive_int(name, allow_none=True)
        for name in ("instruction", "system_prompt", "problem_column", "answer_column", "base_model", "merge_dir"):
            need(getattr(self, name) is None or isinstance(getattr(self, name), str), name, "must be a string")
        if self.pass_ks is not None:
            need(
                bool(self.pass_ks) and all(isinstance(j, int) and 1 <= j <= self.k for j in self.pass_ks),
                "pass_ks",
                f"needs values between 1 and --k = {self.k}",
            )
        if self.temperature is not None:
            need(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
            need(
                self.temperature > 0 or self.k == 1,
                "temperature",
                f"0 is greedy decoding, so all --k {self.k} samples would be equal; pass --k 1 or a temperature > 0",
            )
        if self.top_p is not None:
            need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        if self.top_k is not None:
            need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 = no cut)")
        if self.timeout_s is not None:
            need(self.timeout_s > 0, "timeout_s", "must be > 0 seconds")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        need(isinstance(self.split, str) and bool(self.split), "split", "must be a split name such as test")
        for spec in fields(self):
            choices = spec.metadata["argparse"].get("choices")
            if choices:
                need(getattr(self, spec.name) in choices, spec.name, f"must be one of {', '.join(choices)}")
        return self

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: The settings a model directory may declare (None in `EvalSettings` = take the model's).
CHECKPOINT_SETTINGS = tuple(f.name for f in fields(EvalSettings) if "fallback" in f.metadata)


def resolve_eval_settings(
    model_name_or_path: str | os.PathLike, settings: EvalSettings | None = None, **given: Any
) -> tuple[dict[str, Any], list[str]]:
    """The prompt and sampling `cegppo-eval` uses for a model: given values (not None) win, then the model's
    (`load_eval_settings`), then the paper's. Returns ``({name: value} for CHECKPOINT_SETTINGS, names taken from the
    model)``."""
    settings = replace(settings or EvalSettings(), **given)
    resolved, from_checkpoint = settings.resolve(model_name_or_path)
    return {name: getattr(resolved, name) for name in CHECKPOINT_SETTINGS}, from_checkpoint


# ----------------------------------------------------------------------------------------------------------------
# Settings that travel with a checkpoint
# ----------------------------------------------------------------------------------------------------------------


def _holds_model(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json")) or os.path.isfile(
        os.path.join(directory, ADAPTER_FILE)
    )


def save_eval_settings(
    model_dir: str | os.PathLike,
    *,
    instruction: str | None,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int,
    system_prompt: str | None = None,
    note: str | None = None,
) -> str:
    """Record in a saved model directory (or LoRA adapter folder) how it is prompted and sampled, so that
    `cegppo-eval` uses it by default.

    The prompt (`instruction`, a `load_math_dataset` instruction or ``{problem}`` template, None or "" for none, and
    `system_prompt`) goes to ``cegppo_prompt.json``; the sampling (``do_sample``, ``temperature``, ``top_p``,
    ``top_k`` (0: no cut), ``max_new_tokens``; `temperature` 0 = greedy) to the directory's ``generation_config.json``,
    the standard place, which `model.generate()` and vLLM also read. Returns the path of ``cegppo_prompt.json``.
    """
    from transformers import GenerationConfig

    model_dir = os.fspath(model_dir)
    if not _holds_model(model_dir):
        raise FileNotFoundError(
            f"{model_dir!r} holds no saved model (no config.json or {ADAPTER_FILE}); save the model first."
        )
    EvalSettings(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens).validate()
    try:
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # no generation_config.json yet (e.g. an adapter folder)
        generation = GenerationConfig()
    generation.max_new_tokens = int(max_new_tokens)
    if temperature > 0:
        generation.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    else:
        generation.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    generation.save_pretrained(model_dir)
    path = os.path.join(model_dir, PROMPT_FILE)
    prompt = {
        "instruction": instruction or None,
        "system_prompt": system_prompt or None,
        "note": note
        or "Prompt format this model was trained with; cegppo-eval uses it, and the sampling in "
        "generation_config.json, unless --instruction / --system-prompt / --temperature / --top-p / --top-k / "
        "--max-new-tokens are given.",
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(prompt, f, indent=2)
        f.write("\n")
    return path


def load_eval_settings(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The settings `save_eval_settings` recorded in `model_dir`, or None if it has no ``cegppo_prompt.json``.

    Returns ``{"instruction", "system_prompt"}`` ("" for none) plus whichever of ``temperature`` (0 when
    ``do_sample`` is false), ``top_p``, ``top_k`` and ``max_new_tokens`` its ``generation_config.json`` sets.
    """
    from transformers import GenerationConfig

    model_dir = os.path.expanduser(os.fspath(model_dir))
    path = os.path.join(model_dir, PROMPT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        prompt = json.load(f)
    settings: dict[str, Any] = {
        "instruction": prompt.get("instruction") or "",
        "system_prompt": prompt.get("system_prompt") or "",
    }
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        if generation.max_new_tokens is not None:
            settings["max_new_tokens"] = int(generation.max_new_tokens)
        if generation.do_sample is False:
            settings["temperature"] = 0.0
        else:
            for name in ("temperature", "top_p"):
                if getattr(generation, name) is not None:
                    settings[name] = float(getattr(generation, name))
            if generation.top_k is not None:
                settings["top_k"] = int(generation.top_k)
    return settings


# ----------------------------------------------------------------------------------------------------------------
# What to load: the model (full or LoRA adapter) and the data sets
# ----------------------------------------------------------------------------------------------------------------


def _hub_id_error(name: str) -> str | None:
    """None if `name` is a valid Hub repo id (huggingface_hub's own check), else its message."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as error:
        return str(error)
    return None


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from. `path`: the full model to load (a local directory or a Hub id); `adapter`: a
    LoRA adapter folder applied on top of it (merged), or None. `settings_dirs`: where its settings may be."""

    given: str
    path: str
    adapter: str | None = None

    @property
    def settings_dirs(self) -> tuple[str, ...]:
        return tuple(d for d in (self.adapter, self.path) if d is not None)

    @property
    def tokenizer_dir(self) -> str:
        """The adapter folder when it has a tokenizer (Trainer.save_model writes it there), else the base model."""
        if self.adapter and any(
            os.path.isfile(os.path.join(self.adapter, name)) for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            return self.adapter
        return self.path


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
    if looks_local or _hub_id_error(name) is not None:
        raise FileNotFoundError(
            f"{what} {name!r} does not exist ({where}"
            + ("" if os.path.isdir(parent) else f"; its parent {parent} does not exist either")
            + f") and is not a Hugging Face Hub id ('org/name'). {fix}"
        )
    return name


def resolve_model_source(model_name_or_path: str, base_model: str | None = None) -> ModelSource:
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
            with open(os.path.join(path, ADAPTER_FILE), encoding="utf-8") as f:
                recorded = json.load(f).get("base_model_name_or_path")
            base = base_model or recorded
            if not base:
                raise FileNotFoundError(
                    f"LoRA adapter {name!r}: its {ADAPTER_FILE} names no base_model_name_or_path; pass --base-model."
                )
            source = "--base-model" if base_model else f"base_model_name_or_path in {os.path.join(name, ADAPTER_FILE)}"
            base_path = _check_local_or_hub(
                base, f"the base model of LoRA adapter {name!r} ({source})", "Pass --base-model PATH_OR_HUB_ID."
            )
            return ModelSource(given=name, path=base_path, adapter=path)
        inside = sorted(
            entry
            for entry in os.listdir(path)
            if _holds_model(os.path.join(path, entry)) and (entry == "final" or entry.startswith("checkpoint-"))
        )
        hint = f" It contains saved models: {', '.join(os.path.join(name, e) for e in inside)}." if inside else ""
        raise FileNotFoundError(
            f"model directory {name!r} ({os.path.abspath(path)}) holds no saved model (no config.json or "
            f"{ADAPTER_FILE}).{hint} {fix}"
        )
    if base_model is not None:
        raise ValueError(f"--base-model applies to LoRA adapter folders; {name!r} is not one.")
    return ModelSource(given=name, path=_check_local_or_hub(name, "model path", fix))


@dataclass(frozen=True)
class DatasetSpec:
    """One ``--datasets`` entry: `name` as given (the report's key), the `source` for `load_math_dataset`, and its
    `split` (Hub sets; `explicit` when written as ``ID:SPLIT``)."""

    name: str
    source: str
    split: str
    explicit: bool = False


def parse_dataset_spec(text: str, default_split: str = "test") -> DatasetSpec:
    """``ID``, ``ID:SPLIT`` (a Hub data set and its split, e.g. ``HuggingFaceH4/aime_2024:train``), a local file, or
    a built-in set. A split applies to Hub sets only: a file is one split."""
    from ..data import BUILTIN_DATASETS

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a data set name.")
    if text in BUILTIN_DATASETS or os.path.exists(os.path.expanduser(text)):
        return DatasetSpec(text, text, default_split)
    prefix = "builtin:" if text.startswith("builtin:") else ""
    source, colon, split = text[len(prefix) :].partition(":")
    source = prefix + source
    if colon and not split:
        raise ValueError("empty split after ':'; write ID:SPLIT, e.g. math-ai/aime25:test.")
    if source in BUILTIN_DATASETS or os.path.exists(os.path.expanduser(source)):
        if colon:
            raise ValueError(
                f"a split applies to Hub data sets; {source} is a local file (one split). "
                f"Write {source} without ':{split}'."
            )
        return DatasetSpec(text, source, default_split)
    return DatasetSpec(text, source, split or default_split, explicit=bool(colon))
