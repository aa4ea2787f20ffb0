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

Messages (`CEGPPOTrainParser`, `main`): a wrong value or an unknown key in the recipe, an unknown flag or a
`reward_funcs` entry that does not import is one short message naming the file and line, key or flag and the fix
(exit status 2); Ctrl-C names the last checkpoint and the ``--resume_from_checkpoint`` flag (exit status 130).
``--help`` describes the command and lists the CE-GPPO, data and reward options and the most-used TRL ones;
``--help-all`` lists all of them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, ModelConfig, ScriptArguments, TrlParser

from ..config import CEGPPOConfig
from ..data import DEFAULT_INSTRUCTION
from ..resources import resolve_shipped_path


TINY_MODEL = "builtin:tiny"
REWARD_NAMES = ("math", "format")


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
            Text appended to each problem; a text containing `{problem}` is a template; `null` (YAML) or `none` keeps
            the problem as it is.
        max_train_samples (`int`, *optional*):
            Keep only the first N training rows (smoke tests).
        reward_funcs (`list[str]`, *optional*, defaults to `["math"]`):
            `math` (math-verify, `correct_reward` / `wrong_reward`; the paper's +1 / -1), `format` (1 if the completion
            has a closed, non-empty `\\boxed{}` after any think block, else 0), or a dotted import path `module.function`. Weight them with
            `reward_weights`.
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
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message."})
    instruction: str | None = field(
        default=DEFAULT_INSTRUCTION,
        metadata={"help": "Appended to each problem ('{problem}' makes it a template); 'none' to disable."},
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


class TrainArgumentError(ValueError):
    """A recipe key or value, a command-line argument or a `reward_funcs` entry that `cegppo-train` cannot use.

    The message names the file, key or flag and the fix; `main` prints it without a traceback (exit status 2)."""


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

# The TRL / transformers / model options the short `--help` lists (all of them: `--help-all`).
COMMON_OPTIONS = (
    "model_name_or_path", "dtype", "output_dir", "max_steps", "num_train_epochs", "learning_rate",
    "lr_scheduler_type", "warmup_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_generations", "steps_per_generation", "num_iterations", "max_completion_length", "temperature", "epsilon",
    "epsilon_high", "delta", "beta", "loss_type", "reward_weights", "use_vllm", "vllm_mode", "bf16", "use_cpu",
    "activation_checkpointing", "logging_steps", "report_to", "save_strategy", "save_steps",
    "resume_from_checkpoint", "eval_strategy", "seed", "use_peft", "lora_r", "lora_alpha",
)  # fmt: skip

_DATACLASS_NAMES = {
    CEGPPOScriptArguments: "CEGPPOScriptArguments",
    CEGPPOConfig: "CEGPPOConfig",
    ModelConfig: "trl.ModelConfig",
}
_FIELDS_OF = "CEGPPOScriptArguments, CEGPPOConfig (TRL's GRPOConfig + CE-GPPO) or trl.ModelConfig"
_USAGE = "%(prog)s [--config RECIPE.yaml] [--option VALUE ...]"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks (examples), shows the defaults."""


def _display_action(option: str, help: str, metavar: str | None = None) -> argparse.Action:
    """An entry of the help that the parser does not parse (TrlParser reads `--config` itself)."""
    return argparse.Action([option], dest=option.lstrip("-"), nargs=None if metavar else 0, default=argparse.SUPPRESS,
                           metavar=metavar, help=help)  # fmt: skip


def _kind(action: argparse.Action) -> str:
    """The type of `action`'s values: int, float, bool, str, ... (TRL wraps the converter of an optional field and
    copies the inner type's name onto the wrapper)."""
    name = getattr(action.type, "__name__", "value")
    return "bool" if name == "string_to_bool" else name


def _expected(action: argparse.Action) -> str:
    """What a value of `action`'s option must be, in words."""
    kind = _kind(action)
    if action.choices is not None:
        one = "one of " + ", ".join(str(choice) for choice in action.choices)
    else:
        one = {"int": "an integer", "float": "a number (float, e.g. 0.5 or 1.0e-6)", "bool": "true or false"}.get(
            kind, f"a {kind}"
        )
    if "_accept_none" in getattr(action.type, "__qualname__", ""):  # TRL's wrapper of an optional field
        one += " or null"
    return (
        f"a list, e.g. [a, b], of {one.removeprefix('a ').removeprefix('an ')} values"
        if action.nargs in ("+", "*")
        else one
    )


class CEGPPOTrainParser(TrlParser):
    """`TrlParser` for `cegppo-train`: the same parsing (a YAML recipe with ``--config``, command-line values win),
    with errors that name the file, key or flag and the fix (`TrainArgumentError`), a short ``--help`` (the CE-GPPO,
    data and reward options and the most-used TRL ones) and ``--help-all``."""

    def __init__(self, prog: str | None = "cegppo-train"):
        super().__init__((CEGPPOScriptArguments, CEGPPOConfig, ModelConfig), prog=prog, usage=_USAGE,
                         description=DESCRIPTION, formatter_class=_HelpFormatter)  # fmt: skip
        grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
        self.field_owner: dict[str, str] = {}  # field name -> the dataclass it belongs to
        for cls, name in _DATACLASS_NAMES.items():
            for f in dataclasses.fields(cls):
                if f.init:
                    self.field_owner.setdefault(f.name, name)
        self.cegppo_fields = [f.name for f in dataclasses.fields(CEGPPOConfig) if f.init and f.name not in grpo_fields]
        # the `--name` action of each field (a bool field defaulting to True also has a `--no_name` one)
        self.field_action = {a.dest: a for a in reversed(self._actions) if f"--{a.dest}" in a.option_strings}

    # -- errors ------------------------------------------------------------------------------------------------

    def error(self, message: str):
        """argparse's error without the usage dump (it lists every option)."""
        self.exit(2, f"{self.prog}: error: {message}\n{self._help_hint()}\n")

    def _help_hint(self) -> str:
        return f"`{self.prog} --help` lists the main options, `{self.prog} --help-all` all {len(self.field_owner)}."

    def _suggest(self, word: str, names: Iterable[str]) -> list[str]:
        names = list(names)
        normal = {name.lower().replace("-", "_"): name for name in names}
        matches = difflib.get_close_matches(word.lower().replace("-", "_"), list(normal), n=3, cutoff=0.75)
        return [normal[m] for m in matches]

    def _check_recipe(self, path: str, cli_args: Sequence[str], fail_with_unknown_args: bool) -> None:
        """Raise `TrainArgumentError` listing every unknown key and every value of the wrong type in the recipe
        (argparse would report the first wrong value after a usage dump, TrlParser an unknown key as a ValueError
        without a suggestion)."""
        import yaml

        try:
            with open(path) as file:
                text = file.read()
        except FileNotFoundError:
            raise TrainArgumentError(
                f"--config {path}: no such file. The recipes are recipes/<model>/<method>/config_*.yaml in a clone of "
                "the repository; `cegppo-recipes --list` lists the ones shipped with the package."
            ) from None
        except (OSError, UnicodeDecodeError) as error:
            raise TrainArgumentError(f"--config {path}: cannot read it ({error}).") from None
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise TrainArgumentError(f"{path} is not valid YAML: {error}") from None
        if not isinstance(config, dict):
            raise TrainArgumentError(
                f"{path}: a recipe is a YAML mapping, one `option: value` per line (e.g. `learning_rate: 1.0e-6`); "
                f"got {type(config).__name__}."
            )
        lines = text.splitlines()

        def where(key: Any) -> str:
            pattern = re.compile(rf"['\"]?{re.escape(str(key))}['\"]?\s*:")  # a top-level key: no indentation
            number = next((i for i, line in enumerate(lines, 1) if pattern.match(line)), None)
            return f"{path}:{number}" if number else path

        overridden = {
            self._option_string_actions[arg.split("=", 1)[0]].dest
            for arg in cli_args
            if arg.startswith("--") and arg.split("=", 1)[0] in self._option_string_actions
        }
        problems = []
        for key, value in config.items():
            if key == "env":  # TrlParser: environment variables to set
                continue
            if key not in self.field_owner:
                if fail_with_unknown_args:
                    close = self._suggest(str(key), self.field_owner)
                    hint = (
                        "did you mean " + " or ".join(f"`{c}` ({self.field_owner[c]})" for c in close) + "?"
                        if close
                        else f"it is no field of {_FIELDS_OF}."
                    )
                    problems.append(f"{where(key)}: unknown key `{key}`: {hint}")
                continue
            if key in overridden or key not in self.field_action:
                continue  # argparse never converts a default that the command line replaces
            problem = self._recipe_value_problem(key, value)
            if problem:
                problems.append(f"{where(key)}: {problem}")
        if problems:
            raise TrainArgumentError(
                "\n".join(problems) + f"\nFix the recipe {path}, or override a value on the command line "
                f"(--option VALUE). {self._help_hint()}"
            )

    def _recipe_value_problem(self, key: str, value: Any) -> str | None:
        """Why argparse (or the dataclass) would reject `value` for field `key`, or None."""
        action = self.field_action[key]
        if value is None or isinstance(value, dict):
            return None
        listed = isinstance(value, list) and action.nargs in ("+", "*")
        if isinstance(value, list) and not listed:
            return None  # a field that takes several forms (e.g. a string or a list); its dataclass checks it
        for item in value if listed else [value]:
            bad = False
            if isinstance(item, str) and callable(action.type):
                try:
                    converted = action.type(item)
                except (argparse.ArgumentTypeError, TypeError, ValueError):
                    bad = True
                else:
                    bad = action.choices is not None and converted not in action.choices
            elif _kind(action) in ("int", "float") and isinstance(item, bool):
                bad = True
            elif _kind(action) == "int" and isinstance(item, float) and not item.is_integer():
                bad = True
            if bad:
                shown = f"`{key}: {value!r}`" if not listed else f"`{key}` item {item!r}"
                close = self._suggest(str(item), [str(c) for c in action.choices or ()])
                hint = f" Did you mean {' or '.join(close)}?" if close else ""
                return f"{shown} is not valid: {key} takes {_expected(action)}.{hint}"
        return None

    def _unknown_arguments(self, rest: Sequence[str]) -> TrainArgumentError:
        flags = [arg.split("=", 1)[0] for arg in rest if arg.startswith("-")]
        lines = [f"unknown argument(s) on the command line: {shlex.join(rest)}"]
        for flag in flags:
            close = self._suggest(flag, [f"--{name}" for name in self.field_owner])
            lines.append(f"{flag}: did you mean {' or '.join(close)}?" if close else f"{flag}: no such option.")
        return TrainArgumentError("\n".join(lines) + f"\n{self._help_hint()}")

    # -- parsing -----------------------------------------------------------------------------------------------

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ):
        """TrlParser's parsing, after checking the recipe (`TrainArgumentError` names the file, key and fix)."""
        args = _split_config_flag(list(sys.argv[1:] if args is None else args))
        if "--help-all" in args:
            self._print_message(self.format_full_help(), sys.stdout)
            self.exit(0)
        helping = "-h" in args or "--help" in args
        if "--config" in args and not helping:
            i = args.index("--config")
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise TrainArgumentError(
                    "--config needs the path of a YAML recipe, e.g. --config recipes/tiny/cegppo/config_cpu.yaml."
                )
            if args.count("--config") > 1:
                raise TrainArgumentError("--config is given twice; pass one recipe (flags override its values).")
            self._check_recipe(args[i + 1], args[:i] + args[i + 2 :], fail_with_unknown_args)
        if return_remaining_strings or not fail_with_unknown_args:
            return super().parse_args_and_config(args, return_remaining_strings, fail_with_unknown_args,
                                                 separate_remaining_strings)  # fmt: skip
        *outputs, config_rest, cli_rest = super().parse_args_and_config(args, True, True, True)
        if cli_rest:
            raise self._unknown_arguments(cli_rest)
        if config_rest:  # not reached: _check_recipe reports unknown keys first
            raise TrainArgumentError(f"unknown recipe keys: {config_rest}")
        return tuple(outputs)

    # -- help --------------------------------------------------------------------------------------------------

    def _help_entries(self) -> list[argparse.Action]:
        return [
            _display_action("--config", "a YAML recipe (`option: value` lines) whose values are the defaults; "
                            "flags override them", metavar="RECIPE.yaml"),
            next(a for a in self._actions if isinstance(a, argparse._HelpAction)),
            _display_action("--help-all", f"show all {len(self.field_owner)} options and exit"),
        ]  # fmt: skip

    def _format(self, sections: list[tuple[str, list[argparse.Action]]], epilog: str) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, [], [])
        formatter.add_text(self.description)
        for title, actions in sections:
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        formatter.add_text(epilog)
        return formatter.format_help()

    def _short(self, name: str) -> argparse.Action:
        """The `--name` entry alone (no `--name-with-dashes` alias), with its type as the metavar."""
        action = copy.copy(self.field_action[name])
        action.option_strings = [f"--{name}"]
        metavars = {"int": "INT", "float": "FLOAT", "bool": "BOOL", "str": "TEXT"}
        if action.choices is None and _kind(action) in metavars:
            action.metavar = metavars[_kind(action)]
        return action

    def format_help(self) -> str:
        """The short help: the recipe, the CE-GPPO, data and reward options, the most-used TRL ones."""
        script = [f.name for f in dataclasses.fields(CEGPPOScriptArguments) if f.init]
        common = [name for name in COMMON_OPTIONS if name in self.field_action]
        sections = [
            ("recipe and help", self._help_entries()),
            ("CE-GPPO (CEGPPOConfig)", [self._short(n) for n in self.cegppo_fields]),
            ("data and reward (CEGPPOScriptArguments)", [self._short(n) for n in script]),
            ("most-used TRL, transformers and model options (CEGPPOConfig, trl.ModelConfig)",
             [self._short(n) for n in common]),
        ]  # fmt: skip
        shown = len(self.cegppo_fields) + len(script) + len(common)
        epilog = (
            f"These are {shown} of the {len(self.field_owner)} options; `{self.prog} --help-all` lists them all "
            "(TRL's GRPOConfig, transformers' TrainingArguments, trl.ModelConfig). Each option also takes the form "
            "--option-with-dashes. Ctrl-C stops a run and prints the --resume_from_checkpoint flag that continues it "
            "from its last checkpoint."
        )
        return self._format(sections, textwrap.fill(epilog, width=116))

    def format_full_help(self) -> str:
        """Every option, by dataclass: the script's, CE-GPPO's, TRL's and transformers' training options, the model's."""
        groups: dict[str, list[argparse.Action]] = {}
        titles = {
            "CEGPPOScriptArguments": "data and reward (CEGPPOScriptArguments)",
            "cegppo": "CE-GPPO (CEGPPOConfig)",
            "CEGPPOConfig": "training (CEGPPOConfig: TRL's GRPOConfig and transformers' TrainingArguments)",
            "trl.ModelConfig": "model, LoRA and quantization (trl.ModelConfig)",
        }
        cegppo = set(self.cegppo_fields)
        for action in self._actions:
            owner = self.field_owner.get(action.dest)
            if owner is not None:
                groups.setdefault(titles["cegppo" if action.dest in cegppo else owner], []).append(action)
        sections = [("recipe and help", self._help_entries())]
        sections += [(title, groups[title]) for title in titles.values() if title in groups]
        return self._format(sections, f"`{self.prog} --help` lists the main options only.")


def make_parser(prog: str | None = "cegppo-train") -> TrlParser:
    """The parser of `cegppo-train`: a `TrlParser` over `CEGPPOScriptArguments`, `CEGPPOConfig` and `ModelConfig`."""
    return CEGPPOTrainParser(prog=prog)


def _split_config_flag(argv: list[str]) -> list[str]:
    """`--config=PATH` as `--config PATH` (TrlParser reads exactly the latter)."""
    out = []
    for arg in argv:
        out += ["--config", arg.split("=", 1)[1]] if arg.startswith("--config=") else [arg]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Pieces (importable, so tests and other scripts can reuse them)
# ----------------------------------------------------------------------------------------------------------------


def build_reward_funcs(script_args: CEGPPOScriptArguments) -> list:
    """The reward functions named in `script_args.reward_funcs`, in order."""
    from ..rewards import format_reward, make_math_reward

    names = script_args.reward_funcs
    if isinstance(names, str):
        names = [names]
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
    return funcs


_REWARDS_ACCEPTED = (
    f"reward_funcs takes the built-in rewards {', '.join(REWARD_NAMES)} or `module.function`, a function in a module "
    "importable from the current directory or PYTHONPATH (e.g. my_rewards.length_penalty for def length_penalty in "
    "./my_rewards.py)."
)


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


def _instruction(value: str | None) -> str | None:
    return None if value is None or value.strip().lower() in ("", "none", "null") else value


def load_datasets(script_args: CEGPPOScriptArguments, training_args: CEGPPOConfig):
    """(train_dataset, eval_dataset or None) with TRL's conversational `prompt` and a `solution` column."""
    from ..data import load_math_dataset

    if not script_args.dataset_name:
        raise ValueError(
            "dataset_name is required: a Hub id (e.g. Kwai-Klear/KlearReasoner-MathSub-30K), a local file, or "
            "builtin:arithmetic."
        )
    columns = dict(
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
        system_prompt=script_args.system_prompt,
        instruction=_instruction(script_args.instruction),
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


def resolve_model(model_args: ModelConfig, script_args: CEGPPOScriptArguments, training_args: CEGPPOConfig) -> str:
    """`model_name_or_path`, with ``builtin:tiny`` replaced by a local directory built once per node."""
    name = model_args.model_name_or_path
    if not name:
        raise ValueError("model_name_or_path is required: a Hub id, a local directory, or builtin:tiny.")
    if not name.startswith("builtin:"):
        # A local model by its absolute path: a LoRA adapter records it as its base, and cegppo-eval finds it from any
        # directory.
        local = os.path.expanduser(name)
        return os.path.abspath(local) if os.path.isdir(local) else name
    if name != TINY_MODEL:
        raise ValueError(f"Unknown built-in model {name!r}; the only one is {TINY_MODEL!r}.")
    from accelerate import PartialState

    path = os.path.abspath(os.path.join(training_args.output_dir, "tiny-init"))
    state = PartialState()
    from ..tiny_model import materialize_tiny  # the built-in tiny model (cegppo_trl/tiny_model.py)

    with state.local_main_process_first():  # the first process of each node builds it, the others load it
        if state.is_local_main_process:
            materialize_tiny(path, seed=training_args.seed, sft_steps=script_args.tiny_sft_steps)
    return path


def _hub_dataset_name(name: str | None) -> str | None:
    """The data set name for the model card, if it is a Hub id (not a local file or a built-in set)."""
    if not name or name.startswith("builtin:") or os.path.exists(name) or name.count("/") != 1:
        return None
    return name


def save_prompt_and_sampling(path: str, script_args: CEGPPOScriptArguments, training_args: CEGPPOConfig) -> str:
    """Write, next to the model or adapter in `path`, the prompt format and sampling it was trained with: the
    instruction and system prompt in ``cegppo_prompt.json``, temperature / top_p / top_k / max_completion_length in
    ``generation_config.json`` (`cegppo_trl.evaluation.save_eval_settings`). `cegppo-eval path` uses them."""
    from ..evaluation.settings import save_eval_settings

    return save_eval_settings(
        path,
        instruction=_instruction(script_args.instruction),
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


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------


def train(script_args: CEGPPOScriptArguments, training_args: CEGPPOConfig, model_args: ModelConfig):
    """Train with `CEGPPOTrainer`, then save the model (or adapter), `trainer_state.json` and a model card."""
    from trl import get_peft_config, get_quantization_config

    from ..trainer import CEGPPOTrainer

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    reward_funcs = build_reward_funcs(script_args)  # first: a wrong name fails before the model is built
    model = resolve_model(model_args, script_args, training_args)
    train_dataset, eval_dataset = load_datasets(script_args, training_args)
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
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")

    trainer.save_model(training_args.output_dir)
    if trainer.args.should_save:
        save_prompt_and_sampling(training_args.output_dir, script_args, trainer.args)
    trainer.save_state()
    dataset_name = _hub_dataset_name(script_args.dataset_name)
    model_name = training_args.hub_model_id or os.path.basename(os.path.normpath(training_args.output_dir))
    trainer.create_model_card(model_name=model_name.split("/")[-1], dataset_name=dataset_name)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    if hasattr(trainer, "end"):  # transformers >= 5.18
        trainer.end()  # finish the trackers and destroy the process group
    return trainer


def _with_shipped_config(argv: list[str]) -> list[str]:
    """Point `--config recipes/...` at the shipped copy when the path does not exist here (a pip-installed user)."""
    argv = _split_config_flag(argv)
    if "--config" in argv[:-1]:  # TrlParser reads exactly `--config PATH`
        i = argv.index("--config") + 1
        argv[i] = resolve_shipped_path(argv[i])
    return argv


def last_checkpoint(output_dir: str) -> tuple[str | None, str | None]:
    """(the last complete ``checkpoint-N`` in `output_dir`, a later one left incomplete), each None if there is none.

    A checkpoint is complete once its ``trainer_state.json`` is written, the last file the Trainer saves in it."""
    found = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            match = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
            if match and os.path.isdir(os.path.join(output_dir, name)):
                found.append((int(match[1]), os.path.join(output_dir, name)))
    found.sort()
    complete = [path for _, path in found if os.path.isfile(os.path.join(path, "trainer_state.json"))]
    last = complete[-1] if complete else None
    incomplete = found[-1][1] if found and found[-1][1] != last else None
    return last, incomplete


def interrupted_message(argv: Sequence[str], training_args: CEGPPOConfig | None, prog: str = "cegppo-train") -> str:
    """What `cegppo-train` prints on Ctrl-C: the last checkpoint and the command that resumes from it."""
    lines = [f"{prog}: interrupted (Ctrl-C)."]
    if training_args is None:
        return lines[0]
    output_dir = training_args.output_dir
    last, incomplete = last_checkpoint(output_dir)
    if last is None:
        if str(training_args.save_strategy) in ("no", "SaveStrategy.NO"):
            lines.append(
                "This run saves no checkpoints (save_strategy: no), so it cannot be resumed; run the same command to "
                "start over (with --save_strategy steps --save_steps N to be able to resume next time)."
            )
        else:
            lines.append(f"No checkpoint was saved in {output_dir} yet; run the same command to start over.")
        if incomplete:
            lines.append(f"{incomplete} was being written when the run stopped and is incomplete.")
        return "\n".join(lines)
    kept = []
    skip = False
    for arg in argv:  # the same arguments, without an earlier --resume_from_checkpoint
        if skip:
            skip = False
        elif arg in ("--resume_from_checkpoint", "--resume-from-checkpoint"):
            skip = True
        elif not arg.startswith(("--resume_from_checkpoint=", "--resume-from-checkpoint=")):
            kept.append(arg)
    flag = f"--resume_from_checkpoint {shlex.quote(last)}"
    lines.append(f"Last checkpoint saved: {last}")
    if incomplete:
        lines.append(
            f"({incomplete} was being written when the run stopped and is incomplete; do not resume from it.)"
        )
    lines.append(f"To resume from it, run the same command with {flag} added, e.g.:")
    lines.append(f"  {prog} {shlex.join(kept)} {flag}")
    return "\n".join(lines)


def _close_progress_bars() -> None:
    """Close the tqdm bars an interrupted run left open."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except Exception:  # a cosmetic step: never hide the interruption message
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-train` (also run by `examples/train_cegppo.py`).

    Exit status: 0 when the run finishes, 2 for a wrong argument, recipe key or value (a short message naming it and
    the fix), 130 on Ctrl-C (a message naming the last checkpoint and the `--resume_from_checkpoint` flag)."""
    parser = make_parser()
    user_argv = list(sys.argv[1:] if argv is None else argv)
    training_args = None
    try:
        try:
            script_args, training_args, model_args = parser.parse_args_and_config(args=_with_shipped_config(user_argv))
        except (ValueError, FileNotFoundError) as error:  # ours, TrlParser's, a dataclass's check, no such recipe
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 2
        try:
            train(script_args, training_args, model_args)
        except TrainArgumentError as error:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        _close_progress_bars()  # else the training bar is redrawn below the message at exit
        if os.environ.get("RANK", "0") == "0":  # one message, not one per process
            print("\n" + interrupted_message(user_argv, training_args, parser.prog), file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
