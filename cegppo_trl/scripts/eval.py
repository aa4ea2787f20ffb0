"""`cegppo-eval`: avg@k and pass@k of a model on math data sets, graded with the paper's math-verify reward.

Examples::

    cegppo-eval outputs/tiny-cegppo --datasets builtin:arithmetic_eval --k 4
    cegppo-eval outputs/DeepSeek-R1-Distill-Qwen-1.5B-CEGPPO --backend vllm --k 32 \\
        --datasets HuggingFaceH4/MATH-500:test math-ai/aime25:test HuggingFaceH4/aime_2024:train

`MODEL` is a saved model directory, a LoRA adapter folder (``cegppo-train --use_peft true``), a Trainer checkpoint or
a Hub id. A model saved by ``cegppo-train`` or ``cegppo-demo`` brings the prompt it was trained with and its sampling;
flags override them. Every data set is loaded and checked before the model loads; each set's figures are printed and
written to ``--output`` as soon as the set finishes.

The arguments are two dataclasses, `EvalArguments` and `EvalSettings` (`cegppo_trl.evaluation.settings`), parsed by
TRL's `TrlParser` as ``cegppo-train`` parses its own: every flag is written ``--name`` or ``--name-with-dashes``, a
YAML file passed with ``--config`` gives values (flags win), and bad values are one line naming the flag (exit status
2) before anything loads. The one addition is the positional `MODEL` (a plain argparse positional on the parser; the
same as ``--model_name_or_path``), which `HfArgumentParser` has no dataclass field for.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Sequence


DESCRIPTION = """\
avg@k and pass@k of a model, LoRA adapter or checkpoint on math data sets, graded with math-verify (+1 correct / -1
otherwise, as in CE-GPPO). The paper reports avg@32 (MATH500: avg@4) at temperature 0.6, top_p 0.95 and up to 32768
new tokens for DeepSeek-R1-Distill-Qwen-1.5B / 7B. A model saved by cegppo-train or cegppo-demo declares the
instruction, system prompt and sampling it was trained with (cegppo_prompt.json, generation_config.json); they are
the defaults of the prompt and sampling flags. Every flag is written --name or --name-with-dashes; a YAML file given
with --config sets values (one `name: value` per line), flags override it.

examples:
  cegppo-eval outputs/tiny-cegppo --datasets builtin:arithmetic_eval --k 4
  cegppo-eval outputs/R1-Distill-1.5B-CEGPPO --backend vllm --k 32 --temperature 0.6 --top_p 0.95 \\
      --datasets HuggingFaceH4/MATH-500:test math-ai/aime25:test --output eval.json"""
USAGE = "%(prog)s MODEL --datasets SET [SET ...] [--config EVAL.yaml] [--option VALUE ...]"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (the examples); each option's help says its default."""


def build_parser():
    """TRL's parser over `EvalArguments` and `EvalSettings`, plus the positional MODEL and the help of ``--config``
    (which `TrlParser.parse_args_and_config` reads itself); argparse's own errors (a value of the wrong type) are one
    line too."""
    from trl import TrlParser

    from ..evaluation.settings import EvalArguments, EvalSettings

    class EvalParser(TrlParser):
        def error(self, message: str):  # argparse's documented hook: one line, without the usage
            _fail(f"{message} (`cegppo-eval --help` lists the options).")

    parser = EvalParser(
        (EvalArguments, EvalSettings),
        prog="cegppo-eval",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
        help="model directory, LoRA adapter folder, checkpoint-N folder or Hub id (or --model_name_or_path)",
    )  # fmt: skip
    parser.add_argument(
        "--config", default=argparse.SUPPRESS, metavar="EVAL.yaml", help="YAML file of `name: value` lines"
    )
    return parser


def _fail(message: str) -> None:
    sys.stderr.write(f"cegppo-eval: error: {message}\n")
    raise SystemExit(2)


def _field_of_alias() -> dict[str, str]:
    """{every spelling of every field, without the dashes in front: the field}, e.g. max_completion_length ->
    max_new_tokens."""
    from ..evaluation.settings import EvalArguments, EvalSettings

    return {
        spelling: f.name
        for cls in (EvalArguments, EvalSettings)
        for f in dataclasses.fields(cls)
        for spelling in (f.name, f.name.replace("_", "-"), *(alias[2:] for alias in f.metadata.get("aliases", ())))
    }


def _unknown_flags(words: Sequence[str]) -> str:
    """The unknown words, each unknown flag with the closest known one."""
    known = list(_field_of_alias())
    shown = []
    for word in words:
        close = difflib.get_close_matches(word[2:], known, n=1, cutoff=0.75) if word.startswith("--") else []
        shown.append(f"{word} (did you mean --{close[0]}?)" if close else word)
    return " ".join(shown)


def parse_arguments(argv: Sequence[str] | None = None):
    """(`EvalArguments`, `EvalSettings`) of a command line; a bad one exits with status 2 and one line naming the
    flag (or the ``--config`` key) and the fix, before any model code loads."""
    import yaml

    parser = build_parser()
    try:
        *parsed, in_config, unknown = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except OSError as error:  # TrlParser opens the --config file
        _fail(f"--config {error.filename}: {error.strerror}; pass the path of an existing YAML file.")
    except (ValueError, yaml.YAMLError) as error:  # a dataclass's __post_init__ check, a --config that is no mapping
        _fail(" ".join(str(error).split()))
    if in_config:  # TrlParser returns them as ["--key", "value", ...]; its YAML keys are field names, not aliases
        named = _field_of_alias()
        keys = ", ".join(
            key + (f" (cegppo-eval's key: {named[key]})" if named.get(key, key) != key else "")
            for key in (key.removeprefix("--") for key in in_config[::2])
        )
        _fail(f"--config: unknown keys {keys}; `cegppo-eval --help` lists the options.")
    if unknown:
        _fail(f"unknown arguments {_unknown_flags(unknown)}; `cegppo-eval --help` lists the options.")
    arguments, settings, *extra = parsed
    model = getattr(extra[0], "model", None) if extra else None
    if extra and hasattr(extra[0], "config"):  # `--config=PATH`: TrlParser reads only `--config PATH`
        _fail("write --config PATH, with a space (TrlParser does not read --config=PATH).")
    if model is not None and arguments.model_name_or_path not in (None, model):
        _fail(f"two models: MODEL {model!r} and --model_name_or_path {arguments.model_name_or_path!r}; give one.")
    if model is None and arguments.model_name_or_path is None:
        _fail("no model: pass MODEL first (a saved model directory, LoRA adapter folder, checkpoint or Hub id).")
    arguments.model_name_or_path = model or arguments.model_name_or_path
    return arguments, settings


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-eval`."""
    arguments, settings = parse_arguments(argv)

    def log(message: str) -> None:
        print(f"cegppo-eval: {message}", file=sys.stderr, flush=True)

    finished: list[str] = []

    def on_result(name: str, metrics: dict) -> None:
        from ..evaluation.metrics import format_summary

        finished.append(name)
        print(format_summary(name, metrics), flush=True)

    from ..evaluation.run import evaluate_model

    try:
        report = evaluate_model(
            arguments.model_name_or_path,
            arguments.datasets,
            settings,
            output=arguments.output,
            save_completions=arguments.save_completions,
            progress=arguments.progress,
            log=log,
            on_result=on_result,
        )
    except (ValueError, RuntimeError, OSError) as error:
        kept = (
            f"\ncegppo-eval: the finished sets ({', '.join(finished)}) are in {arguments.output}." if finished else ""
        )
        _fail(f"{error}{kept}")
    log(f"report: {arguments.output} ({len(report['datasets'])} data sets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
