"""The script arguments of `cegppo-train` and the reward functions they name.

- `CEGPPOScriptArguments` -- TRL's `ScriptArguments` plus the data-set columns, the prompt and the reward; bad values
  fail in `__post_init__` (TRL's way) with one line naming the flag and the fix.
- `check_training_args` -- the same for the `CEGPPOConfig` fields a user gets wrong in ways other libraries would
  report in their own words, later (`max_completion_length`, `per_device_train_batch_size`, `temperature`).
- `build_reward_funcs` -- the functions `reward_funcs` names: `math`, `format` or `module.function`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field

from trl import ScriptArguments

from .data import DEFAULT_INSTRUCTION, resolve_instruction
from .prompt_settings import resolve_system_prompt


__all__ = [
    "REWARD_NAMES",
    "TINY_MODEL",
    "CEGPPOScriptArguments",
    "TrainArgumentError",
    "build_reward_funcs",
    "check_training_args",
    "require_a_reward",
]

TINY_MODEL = "builtin:tiny"
REWARD_NAMES = ("math", "format")
_REWARDS_ACCEPTED = (
    f"reward_funcs takes the built-in rewards {', '.join(REWARD_NAMES)} or `module.function`, a function in a module "
    "importable from the current directory or PYTHONPATH (e.g. my_rewards.length_penalty for def length_penalty in "
    "./my_rewards.py)."
)


class TrainArgumentError(ValueError):
    """A recipe key or value, a command-line argument or a `reward_funcs` entry that `cegppo-train` cannot use.

    The message names the file, key or flag and the fix; `cegppo-train` prints it without a traceback (exit status 2)."""


@dataclass
class CEGPPOScriptArguments(ScriptArguments):
    """
    Script arguments of `cegppo-train` (TRL's `ScriptArguments` plus the data-set columns and the reward).

    Args:
        dataset_name (`str`):
            A Hub data set id (e.g. `Kwai-Klear/KlearReasoner-MathSub-30K`), a local `.jsonl`/`.json`/`.parquet`/`.csv`
            file, or `builtin:arithmetic` (the small arithmetic set shipped with the package).
        eval_dataset_name (`str`, *optional*):
            Data set for evaluation when `eval_strategy` is not `"no"`; defaults to `dataset_name` with split
            `dataset_test_split`. `builtin:arithmetic_eval` is the held-out arithmetic set.
        problem_column (`str`, *optional*):
            Column holding the problem (a string, or a conversational list of messages whose last user message is
            used). Default: the first of `problem`, `question`, `prompt`, `query`, `input`.
        answer_column (`str`, *optional*):
            Column holding the gold answer; `"a.b"` reads key `b` of dict column `a` (KlearReasoner's
            `reward_model.ground_truth`). Default: the first of `answer`, `final_answer`, `ground_truth`, ...
        system_prompt (`str`, *optional*):
            System message placed before each problem.
        instruction (`str`, *optional*, defaults to the DeepSeek-R1 "\\boxed{}" instruction):
            The words of `cegppo_trl.data.resolve_instruction`, as in `cegppo-eval`: `default` (the "\\boxed{}"
            instruction), `none` (the problem as it is; also YAML `null`), a text containing `{problem}` (a template),
            or a text appended to each problem. Another `{placeholder}` is an error.
        max_train_samples (`int`, *optional*):
            Keep only the first N training rows (smoke tests); at least 1.
        reward_funcs (`list[str]`, *optional*, defaults to `["math"]`):
            `math` (math-verify, `correct_reward` / `wrong_reward`; the paper's +1 / -1), `format` (1 if the completion
            has a closed, non-empty `\\boxed{}` after any think block, else 0), or a dotted import path
            `module.function`. Weight them with `reward_weights`.
        correct_reward (`float`, *optional*, defaults to `1.0`):
            Reward of a verified answer (`math`).
        wrong_reward (`float`, *optional*, defaults to `-1.0`):
            Reward of a wrong answer (`math`).
        unparseable_reward (`float`, *optional*):
            Reward when no answer is found or it cannot be parsed (`math`); default: `wrong_reward`, as in the paper.
        reward_timeout_s (`float`, *optional*, defaults to `3.0`):
            Hard bound on the grading time of one completion (`math`).
        tiny_sft_steps (`int`, *optional*, defaults to `0`):
            With `model_name_or_path: builtin:tiny`, SFT steps on `builtin:arithmetic` before RL (0: random weights).
    """

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub data set id, local .jsonl/.json/.parquet/.csv file, or builtin:arithmetic."},
    )
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Evaluation data set (default: dataset_name, split dataset_test_split)."}
    )
    problem_column: str | None = field(default=None, metadata={"help": "Column holding the problem."})
    answer_column: str | None = field(
        default=None, metadata={"help": "Column holding the gold answer ('a.b' = key b of dict column a)."}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message ('none': none)."})
    instruction: str | None = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "'default', 'none', a template with {problem}, or text appended to each problem."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep only the first N training rows."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math"],
        metadata={"help": "Rewards: 'math' (+1/-1, math-verify), 'format', or dotted import paths."},
    )
    correct_reward: float = field(default=1.0, metadata={"help": "math reward of a verified answer (paper: +1)."})
    wrong_reward: float = field(default=-1.0, metadata={"help": "math reward of a wrong answer (paper: -1)."})
    unparseable_reward: float | None = field(
        default=None, metadata={"help": "math reward when no answer parses (default: wrong_reward)."}
    )
    reward_timeout_s: float = field(default=3.0, metadata={"help": "Grading time limit per completion (s)."})
    tiny_sft_steps: int = field(
        default=0, metadata={"help": "builtin:tiny only: SFT warm-start steps on builtin:arithmetic (0: none)."}
    )

    def __post_init__(self):
        """Resolve the instruction words and refuse values that would train on nothing, before any model loads."""
        if hasattr(super(), "__post_init__"):
            super().__post_init__()
        self.instruction = resolve_instruction(self.instruction)  # ValueError names an unknown {placeholder}
        self.system_prompt = resolve_system_prompt(self.system_prompt)  # "none": no system message, as in cegppo-eval
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(
                f"--max_train_samples {self.max_train_samples}: it keeps the first N training rows and must be at "
                "least 1; leave it out to train on the whole data set."
            )
        if self.reward_timeout_s <= 0:
            raise ValueError(f"--reward_timeout_s {self.reward_timeout_s}: the grading time limit must be > 0 s.")
        if self.tiny_sft_steps < 0:
            raise ValueError(f"--tiny_sft_steps {self.tiny_sft_steps}: SFT steps must be 0 (none) or more.")


def check_training_args(training_args) -> None:
    """Refuse `CEGPPOConfig` values that TRL accepts and a later library reports in its own words, after the model
    has loaded: one line naming the flag and the fix (`ValueError`)."""
    if training_args.max_completion_length is not None and training_args.max_completion_length < 1:
        raise ValueError(
            f"--max_completion_length {training_args.max_completion_length}: the longest completion, in tokens, must "
            "be at least 1 (the paper's recipes use 8192; the tiny recipe 16)."
        )
    if training_args.per_device_train_batch_size < 1:
        raise ValueError(
            f"--per_device_train_batch_size {training_args.per_device_train_batch_size}: completions per process and "
            "micro-batch must be at least 1."
        )
    if training_args.temperature <= 0:
        raise ValueError(
            f"--temperature {training_args.temperature}: CE-GPPO samples num_generations completions per prompt and "
            "learns from their differences, so the sampling temperature must be > 0 (the paper: 1.0); greedy "
            "decoding gives every completion of a group the same answer and no gradient."
        )


def build_reward_funcs(script_args: CEGPPOScriptArguments) -> list:
    """The reward functions named in `script_args.reward_funcs`, in order (`TrainArgumentError` names a bad one)."""
    from .rewards import format_reward, make_math_reward

    names = [script_args.reward_funcs] if isinstance(script_args.reward_funcs, str) else script_args.reward_funcs
    funcs = []
    for name in names:
        if name == "math":
            funcs.append(
                make_math_reward(
                    correct=script_args.correct_reward,
                    wrong=script_args.wrong_reward,
                    unparseable=script_args.unparseable_reward,
                    timeout_s=script_args.reward_timeout_s,
                )
            )
        elif name == "format":
            funcs.append(format_reward)
        elif "." in name and "," not in name:
            funcs.append(_import_reward(name))
        else:
            hint = " Separate several rewards with spaces: --reward_funcs math format." if "," in name else ""
            raise TrainArgumentError(f"reward_funcs: unknown reward {name!r}. {_REWARDS_ACCEPTED}{hint}")
    if not funcs:
        raise TrainArgumentError("reward_funcs is empty; the paper uses reward_funcs: [math].")
    return require_a_reward(funcs)  # `math` gives None where a gold does not parse; a user's function anywhere


class _RewardCoverage:
    """Which completions of the batch in progress some reward function rewarded (a value other than None)."""

    def __init__(self, names: list[str]):
        self.names = names
        self.covered: list[bool] = []
        self.calls = 0

    def record(self, rewards) -> None:
        if self.calls == 0:
            self.covered = [False] * len(rewards)
        self.covered = [c or r is not None for c, r in zip(self.covered, rewards, strict=False)]
        self.calls = (self.calls + 1) % len(self.names)
        if self.calls == 0 and self.covered and not any(self.covered):
            raise TrainArgumentError(
                f"reward_funcs: every reward function ({', '.join(self.names)}) returned None for all "
                f"{len(self.covered)} completions of a batch, so there is nothing to learn from. A reward function "
                "returns one float per completion (None only for a completion it does not apply to): fix it, or add "
                "one that does."
            )


class _CheckedReward:
    """A reward function that reports what it returned to a `_RewardCoverage` (picklable, its name kept)."""

    def __init__(self, func, coverage: _RewardCoverage):
        functools.update_wrapper(self, func)
        self.func, self.coverage = func, coverage

    def __repr__(self) -> str:
        return repr(self.func)

    def __call__(self, *args, **kwargs):
        rewards = self.func(*args, **kwargs)
        self.coverage.record(rewards)
        return rewards


def require_a_reward(funcs: list) -> list:
    """`funcs`, each wrapped so that a batch in which no function rewarded any completion (every value None) raises
    `TrainArgumentError`: TRL would only warn, train on nothing, and save the model as a success.

    TRL calls the reward functions one after the other on the same batch, so the last call of a batch checks. Only
    lists of synchronous functions are wrapped (TRL runs async ones in its own loop)."""
    if any(inspect.iscoroutinefunction(f) for f in funcs):
        return funcs
    coverage = _RewardCoverage([getattr(f, "__name__", repr(f)) for f in funcs])
    return [_CheckedReward(f, coverage) for f in funcs]


def _import_reward(name: str):
    """The function `module.function` named in `reward_funcs`, imported from the current directory or PYTHONPATH."""
    module_path, func_name = name.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as error:
        if error.name and (module_path == error.name or module_path.startswith(error.name + ".")):
            raise TrainArgumentError(
                f"reward_funcs: {name!r}: no module named {error.name!r} in the current directory ({os.getcwd()}) or "
                f"on PYTHONPATH. {_REWARDS_ACCEPTED}"
            ) from error
        raise TrainArgumentError(
            f"reward_funcs: {name!r}: module {module_path!r} was found, but it imports {error.name!r}, which is not "
            "installed."
        ) from error
    func = getattr(module, func_name, None)
    if not callable(func):
        where = getattr(module, "__file__", None) or module_path
        raise TrainArgumentError(
            f"reward_funcs: {name!r}: module {module_path!r} ({where}) has no function {func_name!r}. {_REWARDS_ACCEPTED}"
        )
    return func
