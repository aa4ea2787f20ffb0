"""The parser of `cegppo-train`: TRL's `TrlParser` over `CEGPPOScriptArguments`, `CEGPPOConfig` and `trl.ModelConfig`,
with messages that name the file, key or flag and the fix.

TrlParser parses as usual (a YAML recipe with ``--config``, command-line values win). Before it, the recipe is read
once more to report every unknown key (with the closest field) and every value of the wrong type (with its line),
from the dataclasses' type hints alone; after it, unknown flags get the closest option. ``--help`` is a short list
(CE-GPPO, data, reward and the most-used TRL options), ``--help-all`` every option by dataclass; both are printed by a
display-only `argparse.ArgumentParser` built from the dataclass fields (public argparse API only).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import re
import shlex
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from trl import GRPOConfig, ModelConfig, TrlParser

from .config import CEGPPOConfig
from .resources import resolve_shipped_path
from .script_args import CEGPPOScriptArguments, TrainArgumentError, check_training_args


__all__ = ["CEGPPOTrainParser", "with_shipped_config"]

USAGE = "%(prog)s [--config RECIPE.yaml] [--option VALUE ...]"
DATACLASSES = {
    CEGPPOScriptArguments: "CEGPPOScriptArguments",
    CEGPPOConfig: "CEGPPOConfig",
    ModelConfig: "trl.ModelConfig",
}
FIELDS_OF = "CEGPPOScriptArguments, CEGPPOConfig (TRL's GRPOConfig + CE-GPPO) or trl.ModelConfig"
# The TRL / transformers / model options the short `--help` lists (all of them: `--help-all`).
COMMON_OPTIONS = (
    "model_name_or_path", "dtype", "output_dir", "max_steps", "num_train_epochs", "learning_rate",
    "lr_scheduler_type", "warmup_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_generations", "steps_per_generation", "num_iterations", "max_completion_length", "temperature", "epsilon",
    "epsilon_high", "delta", "beta", "loss_type", "reward_weights", "use_vllm", "vllm_mode", "bf16", "use_cpu",
    "activation_checkpointing", "logging_steps", "report_to", "save_strategy", "save_steps",
    "resume_from_checkpoint", "eval_strategy", "seed", "use_peft", "lora_r", "lora_alpha",
)  # fmt: skip
_METAVARS = {int: "INT", float: "FLOAT", bool: "BOOL", str: "TEXT"}
_TRUE_FALSE = {"yes", "true", "t", "y", "1", "no", "false", "f", "n", "0"}  # transformers' `string_to_bool`


def with_shipped_config(argv: Sequence[str]) -> list[str]:
    """`--config=PATH` as `--config PATH` (what TrlParser reads), and `--config recipes/...` pointing at the copy
    shipped with the package when the path does not exist here (a pip-installed user)."""
    out: list[str] = []
    for arg in argv:
        out += ["--config", arg.split("=", 1)[1]] if arg.startswith("--config=") else [arg]
    if "--config" in out[:-1]:
        i = out.index("--config") + 1
        out[i] = resolve_shipped_path(out[i])
    return out


def _closest(word: str, names: Iterable[str]) -> list[str]:
    normal = {name.lower().replace("-", "_"): name for name in names}
    return [normal[m] for m in difflib.get_close_matches(word.lower().replace("-", "_"), list(normal), 3, 0.75)]


def _parsed_type(hint: Any) -> tuple[Any, bool]:
    """(the type HfArgumentParser converts a value to, whether null is accepted), from a field's type hint.

    Mirrors `transformers.HfArgumentParser._parse_dataclass_field` (transformers 5.25): `X | None` is X or null, and a
    union with `str` (e.g. `SchedulerType | str`) is parsed as its other member."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint, False
    optional = type(None) in args
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 2 and str in rest:
        rest = [a for a in rest if a is not str]
    return (rest[0] if len(rest) == 1 else None), optional


def _choices(kind: Any) -> list[str]:
    if typing.get_origin(kind) is Literal:
        return [str(c) for c in typing.get_args(kind)]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return [str(e.value) for e in kind]
    return []


def _scalar_words(kind: Any) -> tuple[Any, str]:
    """(check(value) -> bool, what a value must be in words) for one scalar type; check None: anything goes."""
    choices = _choices(kind)
    if choices:
        return (lambda v: str(v) in choices), "one of " + ", ".join(choices)
    if kind is bool:
        return (lambda v: isinstance(v, bool) or (isinstance(v, str) and v.lower() in _TRUE_FALSE)), "true or false"
    if kind in (int, float):
        words = "an integer" if kind is int else "a number (float, e.g. 0.5 or 1.0e-6)"

        def check(value):
            if isinstance(value, str):
                return _converts(kind, value)
            return (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and (kind is float or value == int(value))
            )

        return check, words
    return None, ""


def _converts(kind, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def recipe_value_problem(key: str, value: Any, hint: Any) -> str | None:
    """Why HfArgumentParser (or the dataclass) would reject `value` for the field `key` of type `hint`, or None."""
    kind, optional = _parsed_type(hint)
    if value is None or isinstance(value, dict) or kind is None:
        return None
    listed = typing.get_origin(kind) is list
    if listed:
        if not isinstance(value, list):
            return None  # a single value; argparse converts it on its own
        kind = (typing.get_args(kind) or (str,))[0]
    elif isinstance(value, list):
        return None  # a field that takes several forms (e.g. a string or a list); its dataclass checks it
    check, words = _scalar_words(kind)
    words += " or null" if optional else ""
    for item in value if listed else [value]:
        if check is not None and not check(item):
            shown = f"`{key}` item {item!r}" if listed else f"`{key}: {value!r}`"
            close = _closest(str(item), _choices(kind))
            hint_text = f" Did you mean {' or '.join(close)}?" if close else ""
            expected = (
                f"a list, e.g. [a, b], of {words.removeprefix('a ').removeprefix('an ')} values" if listed else words
            )
            return f"{shown} is not valid: {key} takes {expected}.{hint_text}"
    return None


class CEGPPOTrainParser(TrlParser):
    """`TrlParser` for `cegppo-train`: the same parsing, with errors that name the file, key or flag and the fix
    (`TrainArgumentError`, a ValueError), the checks of `check_training_args`, a short ``--help`` and ``--help-all``."""

    def __init__(self, prog: str | None = "cegppo-train", description: str | None = None):
        super().__init__(tuple(DATACLASSES), prog=prog, usage=USAGE, description=description)
        self.field_owner: dict[str, str] = {}  # field name -> the dataclass it belongs to
        self.field_type: dict[str, Any] = {}
        for cls, name in DATACLASSES.items():
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if f.init and f.name not in self.field_owner:
                    self.field_owner[f.name], self.field_type[f.name] = name, hints[f.name]
        grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
        self.cegppo_fields = [f.name for f in dataclasses.fields(CEGPPOConfig) if f.init and f.name not in grpo_fields]

    def error(self, message: str):
        """argparse's error without the usage dump (it lists every option)."""
        self.exit(2, f"{self.prog}: error: {message}\n{self.help_hint()}\n")

    def help_hint(self) -> str:
        return f"`{self.prog} --help` lists the main options, `{self.prog} --help-all` all {len(self.field_owner)}."

    def parse_args_and_config(self, args=None, return_remaining_strings=False, fail_with_unknown_args=True,
                              separate_remaining_strings=False):  # fmt: skip
        """TrlParser's parsing, after checking the recipe and before `check_training_args`."""
        args = with_shipped_config(list(sys.argv[1:] if args is None else args))
        if "--help-all" in args or "-h" in args or "--help" in args:
            print(self.format_help(full="--help-all" in args))
            self.exit(0)
        if "--config" in args:
            i = args.index("--config")
            if i + 1 >= len(args) or args[i + 1].startswith("--") or args.count("--config") > 1:
                raise TrainArgumentError(
                    "--config needs the path of one YAML recipe, e.g. --config recipes/tiny/cegppo/config_cpu.yaml "
                    "(flags after it override its values)."
                )
            self.check_recipe(args[i + 1], args[:i] + args[i + 2 :], fail_with_unknown_args)
        if return_remaining_strings or not fail_with_unknown_args:
            return super().parse_args_and_config(args, return_remaining_strings, fail_with_unknown_args,
                                                 separate_remaining_strings)  # fmt: skip
        *outputs, _, cli_rest = super().parse_args_and_config(args, True, True, True)
        if cli_rest:
            raise self.unknown_arguments(cli_rest)
        check_training_args(outputs[1])
        return tuple(outputs)

    def check_recipe(self, path: str, cli_args: Sequence[str], report_unknown_keys: bool = True) -> None:
        """Raise `TrainArgumentError` listing every unknown key and every value of the wrong type in the recipe,
        each with its line (argparse would stop at the first wrong value; TrlParser names no line or fix)."""
        config, lines = _read_recipe(path)
        overridden = {a[2:].split("=", 1)[0].replace("-", "_") for a in cli_args if a.startswith("--")}
        problems = []
        for key, value in config.items():
            number = next(
                (n for n, line in enumerate(lines, 1) if re.match(rf"['\"]?{re.escape(str(key))}['\"]?\s*:", line)),
                None,
            )
            where = f"{path}:{number}" if number else path
            if key == "env":  # TrlParser: environment variables to set
                continue
            if key not in self.field_owner:
                close = _closest(str(key), self.field_owner)
                hint = " or ".join(f"`{c}` ({self.field_owner[c]})" for c in close)
                hint = f"did you mean {hint}?" if close else f"it is no field of {FIELDS_OF}."
                problems += [f"{where}: unknown key `{key}`: {hint}"] if report_unknown_keys else []
            elif key not in overridden:  # argparse never converts a default that the command line replaces
                problem = recipe_value_problem(key, value, self.field_type[key])
                problems += [f"{where}: {problem}"] if problem else []
        if problems:
            raise TrainArgumentError(
                "\n".join(problems) + f"\nFix the recipe {path}, or override a value on the command line "
                f"(--option VALUE). {self.help_hint()}"
            )

    def unknown_arguments(self, rest: Sequence[str]) -> TrainArgumentError:
        lines = [f"unknown argument(s) on the command line: {shlex.join(rest)}"]
        for flag in (arg.split("=", 1)[0] for arg in rest if arg.startswith("-")):
            close = _closest(flag, [f"--{name}" for name in self.field_owner])
            lines.append(f"{flag}: did you mean {' or '.join(close)}?" if close else f"{flag}: no such option.")
        return TrainArgumentError("\n".join(lines) + f"\n{self.help_hint()}")

    def format_help(self, full: bool = False) -> str:
        """The short help (CE-GPPO, data, reward and the most-used TRL options) or, `full`, every option by dataclass."""
        script = [name for name, owner in self.field_owner.items() if owner == "CEGPPOScriptArguments"]
        if full:
            sections = {
                "data and reward (CEGPPOScriptArguments)": script,
                "CE-GPPO (CEGPPOConfig)": self.cegppo_fields,
                "training (CEGPPOConfig: TRL's GRPOConfig and transformers' TrainingArguments)": [
                    n for n, o in self.field_owner.items() if o == "CEGPPOConfig" and n not in self.cegppo_fields
                ],
                "model, LoRA and quantization (trl.ModelConfig)": [
                    n for n, o in self.field_owner.items() if o == "trl.ModelConfig"
                ],
            }
            epilog = f"`{self.prog} --help` lists the main options only."
        else:
            common = [name for name in COMMON_OPTIONS if name in self.field_owner]
            sections = {
                "CE-GPPO (CEGPPOConfig)": self.cegppo_fields,
                "data and reward (CEGPPOScriptArguments)": script,
                "most-used TRL, transformers and model options (CEGPPOConfig, trl.ModelConfig)": common,
            }
            shown = sum(len(names) for names in sections.values())
            epilog = (
                f"These are {shown} of the {len(self.field_owner)} options; `{self.prog} --help-all` lists them all "
                "(TRL's GRPOConfig, transformers' TrainingArguments, trl.ModelConfig). Each option also takes the "
                "form --option-with-dashes. Ctrl-C or SIGTERM stops a run at the end of a step and prints the "
                "--resume_from_checkpoint flag that continues it from its last checkpoint."
            )
        return self._display_parser(sections, epilog).format_help()

    def _display_parser(self, sections: dict[str, list[str]], epilog: str) -> argparse.ArgumentParser:
        """A parser that only prints: the recipe and help entries, then one group per section."""
        display = argparse.ArgumentParser(
            prog=self.prog, usage=USAGE, description=self.description, epilog=epilog, add_help=False,
            formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=40, width=119),
        )  # fmt: skip
        group = display.add_argument_group("recipe and help")
        group.add_argument("--config", metavar="RECIPE.yaml", help="a YAML recipe (`option: value` lines) whose "
                           "values are the defaults; flags override them")  # fmt: skip
        group.add_argument("-h", "--help", action="store_true", help="show the main options and exit")
        group.add_argument(
            "--help-all", action="store_true", help=f"show all {len(self.field_owner)} options and exit"
        )
        fields = {
            f.name: f for cls in reversed(list(DATACLASSES)) for f in dataclasses.fields(cls)
        }  # first owner wins
        for title, names in sections.items():
            group = display.add_argument_group(title)
            for name in names:
                kind, _ = _parsed_type(self.field_type[name])
                choices = _choices(kind)
                metavar = "{" + ",".join(choices) + "}" if choices else _METAVARS.get(kind, "VALUE")
                text = fields[name].metadata.get("help", "")
                if fields[name].default is not dataclasses.MISSING:
                    text += f" (default: {fields[name].default})"
                group.add_argument(f"--{name}", metavar=metavar, help=text.replace("%", "%%"))
        return display


def _read_recipe(path: str) -> tuple[dict, list[str]]:
    """The recipe as a mapping and its lines; `TrainArgumentError` names an unreadable file or bad YAML."""
    import yaml

    try:
        with open(path) as file:
            text = file.read()
    except FileNotFoundError:
        raise TrainArgumentError(
            f"--config {path}: no such file. The recipes are recipes/<model>/<method>/config_*.yaml in a clone of the "
            "repository; `cegppo-recipes --list` lists the ones shipped with the package."
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
    return config, text.splitlines()
