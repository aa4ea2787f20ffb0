"""What `cegppo-eval` can be told, declared once in TRL's way: two dataclasses parsed by TRL's `TrlParser` as
``cegppo-train`` parses its own, so a flag has one name and both spellings (``--top_p``, ``--top-p``).
`EvalSettings` says how to evaluate (its fields are `evaluate_model`'s keywords, the flags and the report's
``"settings"``; `__post_init__` checks them), `EvalArguments` what to evaluate and where the report goes. The prompt
and sampling fields may be None: the model's own (`cegppo_trl.prompt_settings`), else the paper's. No torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..prompt_settings import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    PAPER_SETTINGS,
    PROMPT_FILE,
    SAMPLING_RULES,
    is_integer,
    is_number,
    prompt_word,
    saved_example,
    settings_for_model,
)
from ..rewards.protocols import DEFAULT_PROTOCOL, PROTOCOLS


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


_COUNT = (lambda v: is_integer(v) and v >= 1, "must be an integer >= 1")
_TEXT = (lambda v: isinstance(v, str), "must be a string")
#: ``field: (ok, what a bad value is told)``; a field whose default is None may also be None (not given).
_RULES = {
    **SAMPLING_RULES,
    **dict.fromkeys(("k", "batch_size", "tensor_parallel_size", "max_problems", "max_model_len"), _COUNT),
    **dict.fromkeys(
        (
            "instruction",
            "system_prompt",
            "problem_column",
            "answer_column",
            "base_model",
            "merge_dir",
            "example_problem",
            "example_answer",
        ),
        _TEXT,
    ),
    "timeout_s": (lambda v: is_number(v) and v > 0, "must be > 0 seconds"),
    "gpu_memory_utilization": (lambda v: is_number(v) and 0 < v <= 1, "must be in (0, 1]"),
    "split": (lambda v: isinstance(v, str) and bool(v), "must be a split name such as test"),
    "use_kernels": (lambda v: v in (True, False), "must be true or false"),
}


@dataclass
class EvalSettings:
    """How `cegppo-eval` and `evaluate_model` evaluate: one field per flag (``--name`` or ``--name-with-dashes``;
    a field's other spellings are ``cegppo-train``'s names for the same thing), each explained by its help
    (``cegppo-eval --help``). Grading protocols, the prompt and sampling a model declares, the backends:
    docs/evaluation.md."""

    _argument_group_name = (
        "evaluation settings (EvalSettings); a prompt or sampling flag not given takes the model's own value (its "
        f"{PROMPT_FILE}, generation_config.json), else the one after 'else'"
    )

    # Prompt and sampling (the names of PAPER_SETTINGS)
    instruction: str | None = _option(
        None,
        "text appended to each problem; a text with {problem} is a template; 'none': nothing; 'default': "
        "'Please reason step by step, and put your final answer within \\boxed{}.' (else: 'default')",
    )
    system_prompt: str | None = _option(None, "system message; 'none': no system message (else: none)")
    example_problem: str | None = _option(
        None, "a worked example before each problem (a user turn), with --example-answer (else: the model's, if any)"
    )
    example_answer: str | None = _option(None, "the worked example's answer (an assistant turn)")
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

    def validate(self) -> EvalSettings:
        """Raise ValueError naming the flag and the fix for the first bad value (called by `__post_init__`, so
        every instance is valid); returns self."""
        for spec in fields(self):
            value, choices = getattr(self, spec.name), spec.metadata.get("choices")
            if value is None and spec.default is None:
                continue
            if choices:
                self._need(value in choices, spec.name, f"must be one of {', '.join(choices)}")
            elif spec.name in _RULES:
                self._need(_RULES[spec.name][0](value), spec.name, _RULES[spec.name][1])
        self._need(
            self.temperature is None or self.temperature > 0 or self.k == 1,
            "temperature",
            f"0 is greedy decoding, so all --k {self.k} samples would be equal; pass --k 1 or a temperature > 0",
        )
        self._need(
            (self.example_problem is None) == (self.example_answer is None),
            "example_problem",
            "goes with --example-answer: pass both or neither",
        )
        self._need(
            self.pass_ks is None
            or bool(self.pass_ks)
            and all(is_integer(j) and 1 <= j <= self.k for j in self.pass_ks),
            "pass_ks",
            f"needs values between 1 and --k = {self.k}",
        )
        return self

    def resolve(self, *model_dirs: str | os.PathLike | None) -> tuple[EvalSettings, list[str]]:
        """Fill the prompt and sampling fields left at None: from the first of `model_dirs` that has a
        ``cegppo_prompt.json`` (`load_eval_settings`), else `PAPER_SETTINGS`. Returns the filled settings and the
        names taken from the model."""
        given = {name: getattr(self, name) for name in PAPER_SETTINGS}
        if self.protocol != DEFAULT_PROTOCOL:  # the protocol's own prompt, in place of the model's
            given["instruction"] = (
                self.instruction if self.instruction is not None else PROTOCOLS[self.protocol].instruction
            )
            given["system_prompt"] = self.system_prompt if self.system_prompt is not None else ""
        values, from_checkpoint = settings_for_model(given, model_dirs)
        if self.example_problem is None and self.example_answer is None:  # the model's worked example, if any
            values["example_problem"], values["example_answer"] = saved_example(model_dirs) or (None, None)
        return replace(self, **values), from_checkpoint


@dataclass
class EvalArguments:
    """What `cegppo-eval` evaluates (the model, usually the positional MODEL, and ``--datasets``) and where its
    report goes (``--output``, rewritten after every set; ``--save-completions``; ``--no-progress``)."""

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
