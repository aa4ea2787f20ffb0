"""What `cegppo-eval` can be told, declared once in TRL's way.

Two dataclasses, parsed by TRL's `TrlParser` (transformers' `HfArgumentParser` + ``--config EVAL.yaml``) exactly as
``cegppo-train`` parses its own, so a flag has one name and both spellings (``--problem_column``,
``--problem-column``):

- `EvalSettings` -- how to evaluate: its fields are `evaluate_model`'s keywords, the command's flags and the report's
  ``"settings"``; `__post_init__` checks them (`validate`: one message naming the flag and the fix);
- `EvalArguments` -- what to evaluate and where the report goes (the model, ``--datasets``, ``--output``).

The prompt and sampling fields (`CHECKPOINT_SETTINGS`) may be left at None, meaning "the model's own"
(`cegppo_trl.prompt_settings`: what a model saved by ``cegppo-train`` or ``cegppo-demo`` declares), else the paper's
values (`PAPER_SETTINGS`). Nothing here imports torch: the command line parses and checks its input before any model
code loads.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..prompt_settings import (
    CHECKPOINT_SETTINGS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    PAPER_SETTINGS,
    PROMPT_FILE,
    load_eval_settings,
    prompt_word,
    sampling_problem,
    save_eval_settings,
    settings_for_model,
)
from ..rewards.protocols import DEFAULT_PROTOCOL, PROTOCOLS


__all__ = [
    "CHECKPOINT_SETTINGS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "PAPER_SETTINGS",
    "PROMPT_FILE",
    "EvalArguments",
    "EvalSettings",
    "load_eval_settings",  # the settings saved with a model (cegppo_trl.prompt_settings), shown here too
    "save_eval_settings",
]

DEFAULT_BATCH_SIZE = 64


def _option(default: Any, help: str, *aliases: str, **argparse_options: Any):
    """A field with TRL's metadata: its help, the other spellings it accepts (the training script's name for the
    same thing; `HfArgumentParser` adds the dashed spelling of every name itself) and argparse options (choices)."""
    if default is not None and not isinstance(default, bool) and "(default" not in help:
        help += f" (default: {default})"
    metadata = {"help": help, **argparse_options}
    if aliases:
        metadata["aliases"] = [spelling for alias in aliases for spelling in (alias, alias.replace("_", "-"))]
    return field(default=default, metadata=metadata)


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
        protocol (`str`, *optional*, defaults to `"boxed"`):
            How completions are graded and prompted (`cegppo_trl.rewards.protocols`): `boxed` (the last `\\boxed{}`
            after `</think>`, the model's own or the DeepSeek-R1 instruction: `math_reward`'s grading), `authors` (the
            CE-GPPO authors' grader and raw-problem prompt: comparable with the paper's table), `lighteval`
            (lighteval 0.13's pass@k math metric and template) or `lighteval_avg` (its avg@n metric). All but `boxed`
            bring their own prompt in place of the model's (`--instruction` / `--system-prompt` still win).
        timeout_s (`float`, *optional*):
            Hard grading time limit per completion (default: the protocol's, 3 s for `boxed`, 40 s for the others;
            `cegppo-train`'s `reward_timeout_s`).

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
    protocol: str = _option(
        DEFAULT_PROTOCOL,
        "grading protocol and its prompt: 'boxed' (default: the last \\boxed{} after </think>; the model's own "
        "instruction, else the DeepSeek-R1 one), 'authors' (the CE-GPPO authors' grader and their raw-problem prompt: "
        "comparable with the paper's table), 'lighteval' (lighteval 0.13's pass@k math metric, think block removed, "
        "and its template) or 'lighteval_avg' (its avg@n metric of aime24_avg/aime25_avg, on the whole completion)",
        choices=tuple(PROTOCOLS),
    )
    timeout_s: float | None = _option(
        None, "hard grading time limit per completion (default: the protocol's: boxed 3 s, others 40 s)",
        "--reward_timeout_s",
    )  # fmt: skip
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
            setattr(self, name, prompt_word(name, getattr(self, name)))
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
        for name in ("k", "batch_size", "tensor_parallel_size", "max_problems", "max_model_len"):
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
        for name in ("temperature", "top_p", "top_k", "max_new_tokens"):  # None: the model's own
            problem = None if getattr(self, name) is None else sampling_problem(name, getattr(self, name))
            self._need(problem is None, name, problem or "")
        self._need(
            self.temperature is None or self.temperature > 0 or self.k == 1,
            "temperature",
            f"0 is greedy decoding, so all --k {self.k} samples would be equal; pass --k 1 or a temperature > 0",
        )

    def resolve(self, *model_dirs: str | os.PathLike | None) -> tuple[EvalSettings, list[str]]:
        """Fill the prompt and sampling fields left at None: from the first of `model_dirs` that has a
        ``cegppo_prompt.json`` (`load_eval_settings`), else `PAPER_SETTINGS`. Returns the filled settings and the
        names taken from the model."""
        given = {name: getattr(self, name) for name in CHECKPOINT_SETTINGS}
        if self.protocol != DEFAULT_PROTOCOL:  # the protocol's own prompt, in place of the model's
            given["instruction"] = (
                self.instruction if self.instruction is not None else PROTOCOLS[self.protocol].instruction
            )
            given["system_prompt"] = self.system_prompt if self.system_prompt is not None else ""
        values, from_checkpoint = settings_for_model(given, model_dirs)
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
