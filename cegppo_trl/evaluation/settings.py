"""What `cegppo-eval` can be told, declared once in TRL's way, and the settings that travel with a saved model.

Two dataclasses, parsed by TRL's `TrlParser` (transformers' `HfArgumentParser` + ``--config EVAL.yaml``) exactly as
``cegppo-train`` parses its own, so a flag has one name and both spellings (``--problem_column``,
``--problem-column``):

- `EvalSettings` -- how to evaluate: its fields are `evaluate_model`'s keywords, the command's flags and the report's
  ``"settings"``; `__post_init__` checks them (`validate`: one message naming the flag and the fix);
- `EvalArguments` -- what to evaluate and where the report goes (the model, ``--datasets``, ``--output``).

The prompt and sampling fields (`CHECKPOINT_SETTINGS`) may be left at None, meaning "the model's own": a model
directory (or LoRA adapter folder) with a ``cegppo_prompt.json`` declares the prompt it was trained with there and its
sampling in ``generation_config.json`` (`save_eval_settings`, called by ``cegppo-train`` and ``cegppo-demo``); without
that file they take the paper's values (`PAPER_SETTINGS`).

Nothing here imports torch: the command line parses and checks its input before any model code loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


__all__ = [
    "CHECKPOINT_SETTINGS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "PAPER_SETTINGS",
    "PROMPT_FILE",
    "DatasetSpec",
    "EvalArguments",
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
#: The prompt and sampling of a model that declares none (the paper's evaluation; "default": the DeepSeek-R1
#: instruction of `load_math_dataset`).
PAPER_SETTINGS = {
    "instruction": "default",
    "system_prompt": "",
    "temperature": DEFAULT_TEMPERATURE,
    "top_p": DEFAULT_TOP_P,
    "top_k": 0,
    "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
}
#: The settings a model directory may declare (None in `EvalSettings` = take the model's).
CHECKPOINT_SETTINGS = tuple(PAPER_SETTINGS)


def _option(default: Any, help: str, *aliases: str, **argparse_options: Any):
    """A field with TRL's metadata: its help, the other spellings it accepts (the training script's name for the
    same thing; `HfArgumentParser` adds the dashed spelling of every name itself) and argparse options (choices)."""
    if default is not None and not isinstance(default, bool) and "(default" not in help:
        help += f" (default: {default})"
    metadata = {"help": help, **argparse_options}
    if aliases:
        metadata["aliases"] = [spelling for alias in aliases for spelling in (alias, alias.replace("_", "-"))]
    return field(default=default, metadata=metadata)


def _prompt_words(name: str, value: Any) -> Any:
    """The command line's words for a prompt part: `resolve_instruction`'s vocabulary (shared with cegppo-train:
    'none', 'default', a ``{problem}`` template) for the instruction, 'none' for the system prompt; "" = nothing."""
    if not isinstance(value, str):
        return value
    if name == "instruction":
        from ..data import resolve_instruction

        return resolve_instruction(value) or ""
    if name == "system_prompt":
        return "" if value.strip().lower() == "none" else value
    return value


@dataclass
class EvalSettings:
    """
    How `cegppo-eval` and `evaluate_model` evaluate (flags: ``--name`` or ``--name-with-dashes``; a field's other
    spellings are ``cegppo-train``'s names for the same thing, e.g. ``--max_completion_length``).

    Parameters that control the prompt and sampling (None: the model's own, else `PAPER_SETTINGS`):

        instruction (`str`, *optional*):
            Text appended to each problem; a text with `{problem}` is a template; `none`: nothing; `default`:
            `load_math_dataset`'s DeepSeek-R1 `\\boxed{}` instruction (the words of `cegppo-train --instruction`).
        system_prompt (`str`, *optional*):
            System message (`none`: no system message).
        temperature (`float`, *optional*):
            Sampling temperature; 0 is greedy decoding and needs `k=1`.
        top_p (`float`, *optional*):
            Nucleus sampling, in (0, 1].
        top_k (`int`, *optional*):
            Top-k cut, 0 = none.
        max_new_tokens (`int`, *optional*):
            Maximum completion length (`cegppo-train`'s `max_completion_length`).

    Parameters that control the samples and figures:

        k (`int`, *optional*, defaults to `4`):
            Samples per problem (the paper: 32; MATH500: 4).
        pass_ks (`list[int]`, *optional*):
            pass@j values to report, each <= k (default: 1 and k); flag `--pass-k`.
        seed (`int`, *optional*, defaults to `0`):
            Sampling seed; each data set starts from it.
        timeout_s (`float`, *optional*):
            Grading time limit per completion (default 3 s; `cegppo-train`'s `reward_timeout_s`).

    Parameters that control the data sets:

        split (`str`, *optional*, defaults to `"test"`):
            Split of the Hub data sets written without one (`ID:SPLIT` sets its own).
        problem_column, answer_column (`str`, *optional*):
            The columns (default: found by `load_math_dataset`).
        max_problems (`int`, *optional*):
            Evaluate only the first N problems of each set.

    Parameters that control the model and the generation backend:

        backend (`str`, *optional*, defaults to `"hf"`):
            `hf` (transformers' `generate`) or `vllm`.
        dtype (`str`, *optional*, defaults to `"auto"`):
            Weights dtype: `auto`, `float32`, `bfloat16` or `float16`.
        base_model (`str`, *optional*):
            Base model of a LoRA adapter folder (default: `base_model_name_or_path` of its `adapter_config.json`).
        batch_size (`int`, *optional*, defaults to `64`):
            hf: sequences per `generate` call; it changes which samples are drawn, not their distribution.
        device (`str`, *optional*, defaults to `"auto"`):
            hf: device (auto: cuda if available).
        use_kernels (`bool`, *optional*):
            hf: transformers' Hub kernels (`false`: plain PyTorch layers, e.g. on a GPU machine without Hub access;
            default: transformers' choice, on unless `USE_HUB_KERNELS=0`).
        max_model_len, gpu_memory_utilization, tensor_parallel_size, merge_dir:
            vllm: the engine's context length, GPU memory fraction, GPUs per model, and where a LoRA adapter merged
            into its base is written (default: a temporary directory, removed after the run).
    """

    _argument_group_name = (
        "evaluation settings (EvalSettings); a prompt or sampling flag not given takes the model's own value (its "
        f"{PROMPT_FILE}, generation_config.json), else the one after 'else'"
    )

    # Prompt and sampling (CHECKPOINT_SETTINGS)
    instruction: str | None = _option(
        None,
        "text appended to each problem; a text with {problem} is a template; 'none': nothing; 'default': "
        "'Please reason step by step, and put your final answer within \\boxed{}.' (else: 'default')",
    )
    system_prompt: str | None = _option(None, "system message; 'none': no system message (else: none)")
    temperature: float | None = _option(None, f"sampling temperature, 0 = greedy (else: {DEFAULT_TEMPERATURE})")
    top_p: float | None = _option(None, f"nucleus sampling top_p (else: {DEFAULT_TOP_P})")
    top_k: int | None = _option(None, "top-k cut, 0 = none (else: 0)")
    max_new_tokens: int | None = _option(
        None,
        f"maximum completion length (else: {DEFAULT_MAX_NEW_TOKENS}; DeepSeek-R1-Distill models reason for thousands "
        "of tokens, and shorter caps cut their \\boxed{} answer off)",
        "--max_completion_length",
    )
    # Samples and figures
    k: int = _option(4, "samples per problem (the paper: 32; MATH500: 4)")
    pass_ks: list[int] | None = _option(None, "pass@j values to report, each <= k (default: 1 and k)", "--pass_k",
                                        metavar="J")  # fmt: skip
    seed: int = _option(0, "sampling seed; each data set starts from it")
    timeout_s: float | None = _option(None, "grading time limit per completion (default: 3 s)", "--reward_timeout_s")
    # Data sets
    split: str = _option("test", "split of the Hub data sets written without one (ID:SPLIT sets its own)",
                         "--dataset_test_split")  # fmt: skip
    problem_column: str | None = _option(None, "problem column (default: found by load_math_dataset)")
    answer_column: str | None = _option(None, "answer column (default: found by load_math_dataset)")
    max_problems: int | None = _option(None, "evaluate only the first N problems of each set")
    # Model and backend
    backend: str = _option("hf", "generation backend", choices=("hf", "vllm"))
    dtype: str = _option("auto", "weights dtype", choices=("auto", "float32", "bfloat16", "float16"))
    base_model: str | None = _option(
        None, "base model of a LoRA adapter folder (default: base_model_name_or_path of its adapter_config.json)"
    )
    batch_size: int = _option(
        DEFAULT_BATCH_SIZE,
        "hf: sequences per generate call; it changes which samples are drawn, not their distribution (lower it for "
        "long completions)",
    )
    device: str = _option("auto", "hf: device (auto: cuda if available)")
    use_kernels: bool | None = _option(
        None, "hf: transformers' Hub kernels; false on a GPU machine without Hub access (default: transformers' "
        "choice: on unless USE_HUB_KERNELS=0)",
    )  # fmt: skip
    max_model_len: int | None = _option(None, "vllm: context length (default: the model's)")
    gpu_memory_utilization: float = _option(0.9, "vllm: fraction of GPU memory for the engine")
    tensor_parallel_size: int = _option(1, "vllm: GPUs per model (tensor parallelism)")
    merge_dir: str | None = _option(
        None, "vllm + LoRA adapter: where the merged model is written (default: a temporary directory, removed after "
        "the run)",
    )  # fmt: skip

    def __post_init__(self):
        # The words 'none' and 'default' mean the same in Python as on the command line; None = not given.
        for name in ("instruction", "system_prompt"):
            setattr(self, name, _prompt_words(name, getattr(self, name)))
        self.validate()

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of field `name`, as messages spell it."""
        return "--pass-k" if name == "pass_ks" else "--" + name.replace("_", "-")

    def _need(self, ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{self.flag(name)} ({name}) {what}, got {getattr(self, name)!r}.")

    def _need_number(self, name: str, ok, what: str) -> None:
        """`ok(value)` for a number (an int or float, not a bool)."""
        value = getattr(self, name)
        self._need(isinstance(value, (int, float)) and not isinstance(value, bool) and ok(value), name, what)

    def _need_int(self, name: str, minimum: int, what: str) -> None:
        value = getattr(self, name)
        self._need(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, name, what)

    def validate(self) -> EvalSettings:
        """Raise ValueError naming the flag and the fix for the first bad value (called by `__post_init__`, so
        every instance is valid); returns self."""
        for name in ("k", "batch_size", "tensor_parallel_size", "max_new_tokens", "max_problems", "max_model_len"):
            if name in ("k", "batch_size", "tensor_parallel_size") or getattr(self, name) is not None:  # None: unset
                self._need_int(name, 1, "must be an integer >= 1")
        for name in ("instruction", "system_prompt", "problem_column", "answer_column", "base_model", "merge_dir"):
            self._need(getattr(self, name) is None or isinstance(getattr(self, name), str), name, "must be a string")
        self._check_sampling()
        if self.pass_ks is not None:
            self._need(
                bool(self.pass_ks) and all(isinstance(j, int) and 1 <= j <= self.k for j in self.pass_ks),
                "pass_ks",
                f"needs values between 1 and --k = {self.k}",
            )
        if self.timeout_s is not None:
            self._need_number("timeout_s", lambda t: t > 0, "must be > 0 seconds")
        self._need_number("gpu_memory_utilization", lambda f: 0 < f <= 1, "must be in (0, 1]")
        self._need(isinstance(self.split, str) and bool(self.split), "split", "must be a split name such as test")
        self._need(self.use_kernels in (None, True, False), "use_kernels", "must be true or false")
        for spec in fields(self):
            choices = spec.metadata.get("choices")
            if choices:
                self._need(getattr(self, spec.name) in choices, spec.name, f"must be one of {', '.join(choices)}")
        return self

    def _check_sampling(self) -> None:
        if self.temperature is not None:
            self._need_number("temperature", lambda t: t >= 0, "must be >= 0 (0 = greedy)")
            self._need(
                self.temperature > 0 or self.k == 1,
                "temperature",
                f"0 is greedy decoding, so all --k {self.k} samples would be equal; pass --k 1 or a temperature > 0",
            )
        if self.top_p is not None:
            self._need_number("top_p", lambda p: 0 < p <= 1, "must be in (0, 1]")
        if self.top_k is not None:
            self._need_int("top_k", 0, "must be an integer >= 0 (0 = no cut)")

    def resolve(self, *model_dirs: str | os.PathLike | None) -> tuple[EvalSettings, list[str]]:
        """Fill the prompt and sampling fields left at None: from the first of `model_dirs` that has a
        ``cegppo_prompt.json`` (`load_eval_settings`), else `PAPER_SETTINGS`. Returns the filled settings and the
        names taken from the model."""
        values, from_checkpoint = _fill_from_model(
            {name: getattr(self, name) for name in CHECKPOINT_SETTINGS}, model_dirs
        )
        return replace(self, **values), from_checkpoint

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalArguments:
    """
    What `cegppo-eval` evaluates and where its report goes (the command's arguments besides `EvalSettings`).

    Args:
        datasets (`list[str]`):
            Data sets: local `.jsonl`/`.json`/`.parquet`/`.csv` files, `builtin:arithmetic_eval`, Hub ids, or
            `ID:SPLIT` (e.g. `HuggingFaceH4/aime_2024:train`); all are checked before the model loads. Also
            `--dataset_name` (`cegppo-train`'s name).
        model_name_or_path (`str`, *optional*):
            The model: a saved model directory, a LoRA adapter folder, a `checkpoint-N` folder or a Hub id. On the
            command line it is usually the first, positional argument `MODEL`.
        output (`str`, *optional*, defaults to `"eval_report.json"`):
            The JSON report, rewritten after every set; its folder is checked to be writable before anything loads.
        save_completions (`bool`, *optional*, defaults to `False`):
            Store the completions and their grading statuses in the report.
        progress (`bool`, *optional*, defaults to `True`):
            A progress bar per set (`--no-progress`: none).
    """

    _argument_group_name = "what to evaluate and the report (EvalArguments)"

    datasets: list[str] = field(
        metadata={
            "help": "data sets: local .jsonl/.json/.parquet/.csv files, builtin:arithmetic_eval, Hub ids, or ID:SPLIT "
            "(e.g. HuggingFaceH4/aime_2024:train); all are checked before the model loads",
            "aliases": ["--dataset_name", "--dataset-name"],
            "metavar": "SET",
        }
    )
    model_name_or_path: str | None = _option(None, "the model, if not given as the first argument MODEL")
    output: str = _option("eval_report.json", "JSON report, rewritten after every set")
    save_completions: bool = _option(False, "store the completions in the report")
    progress: bool = _option(True, "a progress bar per set (--no-progress: none)")

    def __post_init__(self):
        if isinstance(self.datasets, str):
            self.datasets = [self.datasets]
        if not self.datasets or not all(isinstance(name, str) and name for name in self.datasets):
            raise ValueError(f"--datasets needs one or more data set names, got {self.datasets!r}.")
        if not isinstance(self.output, str) or not self.output.strip():
            raise ValueError(f"--output needs the path of the JSON report, got {self.output!r}.")


def _fill_from_model(given: dict[str, Any], model_dirs) -> tuple[dict[str, Any], list[str]]:
    """`given` (CHECKPOINT_SETTINGS, None = not given) with each None filled from the first of `model_dirs` that
    declares its settings, else from `PAPER_SETTINGS`; and the names taken from the model."""
    saved: dict[str, Any] = {}
    for directory in model_dirs:
        if directory is not None and os.path.isdir(os.path.expanduser(os.fspath(directory))):
            saved = load_eval_settings(directory) or {}
            if saved:
                break
    values, from_checkpoint = {}, []
    for name, value in given.items():
        if value is not None:
            values[name] = _prompt_words(name, value)
        elif saved.get(name) is not None:
            values[name] = saved[name]
            from_checkpoint.append(name)
        else:
            values[name] = _prompt_words(name, PAPER_SETTINGS[name])
    return values, from_checkpoint


def resolve_eval_settings(
    model_name_or_path: str | os.PathLike, settings: EvalSettings | None = None, **given: Any
) -> tuple[dict[str, Any], list[str]]:
    """The prompt and sampling `cegppo-eval` uses for a model: given values (not None) win, then those of
    `settings`, then the model's (`load_eval_settings`), then the paper's. Returns ``({name: value} for
    CHECKPOINT_SETTINGS, names taken from the model)``."""
    settings = settings or EvalSettings()
    EvalSettings(k=1, **given)  # checks the given values (k=1: greedy is a valid prompt and sampling here)
    current = {name: getattr(settings, name) for name in CHECKPOINT_SETTINGS}
    current.update({name: value for name, value in given.items() if value is not None})
    return _fill_from_model(current, [model_name_or_path])


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
    EvalSettings(k=1, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)  # checks
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
    from ..data import can_be_hub_id  # huggingface_hub's repo-id check, the one of the package

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
