"""`cegppo-eval`: avg@k and pass@k of a model on math data sets, graded with the paper's math-verify reward.

Examples::

    cegppo-eval outputs/tiny-cegppo --datasets builtin:arithmetic_eval --k 4
    cegppo-eval outputs/DeepSeek-R1-Distill-Qwen-1.5B-CEGPPO --backend vllm --preset paper --output eval.json
    cegppo-eval --compare eval.json other.json

`MODEL` is a saved model directory, a LoRA adapter folder (``cegppo-train --use_peft true``), a Trainer checkpoint or
a Hub id. A model saved by ``cegppo-train`` or ``cegppo-demo`` brings the prompt it was trained with and its sampling;
flags override them. Every data set is loaded and checked before the model loads; each set's figures are printed and
written to ``--output`` as soon as the set finishes.

The arguments are two dataclasses, `EvalArguments` and `EvalSettings` (`cegppo_trl.evaluation.settings`), parsed by
TRL's `TrlParser` as ``cegppo-train`` parses its own: every flag is written ``--name`` or ``--name-with-dashes``, a
YAML file passed with ``--config PATH`` or ``--config=PATH`` gives values (flags win), and bad values are one line
naming the flag (exit status 2) before anything loads. Three additions to the dataclasses' flags: the positional
`MODEL` (the same as ``--model_name_or_path``), ``--preset NAME`` (a built-in set of values under ``--config``:
`cegppo_trl.evaluation.datasets.PRESETS`) and ``--compare A.json B.json`` (two reports side by side, with a warning
for each difference that makes them not comparable).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence


DESCRIPTION = """\
avg@k and pass@k of a model, LoRA adapter or checkpoint on math data sets. --protocol says how a completion is graded
and prompted: boxed (the default: the last \\boxed{} after </think>, graded by math-verify as the training reward
does; the model's own instruction, else the DeepSeek-R1 one), authors (the CE-GPPO authors' grader and raw-problem
prompt: the one to compare with the paper's table), lighteval or lighteval_avg (lighteval 0.13's math metrics). The
paper reports avg@32 (MATH500: avg@4) at temperature 0.6, top_p 0.95 and up to 32768 new tokens; --preset paper runs
exactly that on its five Hub sets. A model saved by cegppo-train or cegppo-demo declares the instruction, system
prompt and sampling it was trained with (cegppo_prompt.json, generation_config.json); they are the defaults of the
prompt and sampling flags. Every flag is written --name or --name-with-dashes; a YAML file given with --config sets
values (one `name: value` per line), flags override it. The report names the protocol, the math-verify version and
the sampling; --compare A.json B.json shows two reports side by side and warns where they are not comparable.

examples:
  cegppo-eval outputs/tiny-cegppo --datasets builtin:arithmetic_eval --k 4
  cegppo-eval outputs/R1-Distill-1.5B-CEGPPO --backend vllm --preset paper --output eval.json
  cegppo-eval outputs/R1-Distill-1.5B-CEGPPO --protocol authors --k 32 --temperature 0.6 --top_p 0.95 \\
      --datasets math-ai/aime25:test HuggingFaceH4/MATH-500:test@4 --output eval.json
  cegppo-eval --compare eval.json other.json"""
USAGE = (
    "%(prog)s MODEL (--datasets SET[@K] [SET ...] | --preset paper) [--config EVAL.yaml] [--option VALUE ...]\n"
    "       %(prog)s --compare A.json B.json"
)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks (the examples); each option's help says its default."""


def _split_equals(argv: Sequence[str], flag: str) -> list[str]:
    """`argv` with ``FLAG=VALUE`` written as ``FLAG VALUE`` (TrlParser finds ``--config`` only as its own word)."""
    return [part for word in argv for part in (word.split("=", 1) if word.startswith(flag + "=") else [word])]


def build_parser():
    """TRL's parser over `EvalArguments` and `EvalSettings`, plus the positional MODEL and the help of ``--config``
    (which `TrlParser.parse_args_and_config` reads itself), ``--preset`` and ``--compare``; argparse's own errors (a
    value of the wrong type) are one line too."""
    from trl import TrlParser

    from ..evaluation.datasets import PRESETS
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
    parser.add_argument(
        "--preset", choices=tuple(PRESETS), default=argparse.SUPPRESS,
        help="built-in values, under --config and flags. paper: the paper's five sets with its k per set "
        "(AIME24, AIME25, HMMT25, AMC23 @32; MATH500 @4), --protocol authors, temperature 0.6, top_p 0.95, top_k 0, "
        "32768 new tokens",
    )  # fmt: skip
    parser.add_argument(
        "--compare", nargs=2, default=argparse.SUPPRESS, metavar=("A.json", "B.json"),
        help="instead of evaluating: two reports side by side, with a warning for each difference in protocol, "
        "math-verify version, sampling or prompt (nothing else on the command line)",
    )  # fmt: skip
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
    """The unknown words, then for each unknown flag the closest known one."""
    from ..data import did_you_mean

    known = [*_field_of_alias(), "config", "preset", "compare"]
    flags = [word[2:] for word in words if word.startswith("--")]
    return " ".join(words) + "." + "".join(did_you_mean(f, known, cutoff=0.75, show="--{}".format) for f in flags)


def _apply_preset(parser, argv: Sequence[str]) -> None:
    """``--preset NAME``: its values become the parser's defaults (TrlParser's own `set_defaults_with_config`, as for
    ``--config``, which is applied after it and so wins; flags win over both). An unknown NAME is left to argparse."""
    from ..evaluation.datasets import PRESETS

    for word, value in zip(argv, argv[1:]):
        if word == "--preset" and value in PRESETS:
            parser.set_defaults_with_config(**PRESETS[value])


def parse_arguments(argv: Sequence[str] | None = None):
    """(`EvalArguments`, `EvalSettings`) of a command line; a bad one exits with status 2 and one line naming the
    flag (or the ``--config`` key) and the fix, before any model code loads."""
    import yaml

    argv = _split_equals(_split_equals(sys.argv[1:] if argv is None else argv, "--config"), "--preset")
    parser = build_parser()
    _apply_preset(parser, argv)
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
        _fail(f"unknown arguments {_unknown_flags(unknown)} `cegppo-eval --help` lists the options.")
    arguments, settings, *extra = parsed  # extra: argparse's namespace of MODEL and --preset, if given
    model = getattr(extra[0], "model", None) if extra else None
    if model is not None and arguments.model_name_or_path not in (None, model):
        _fail(f"two models: MODEL {model!r} and --model_name_or_path {arguments.model_name_or_path!r}; give one.")
    if model is None and arguments.model_name_or_path is None:
        _fail("no model: pass MODEL first (a saved model directory, LoRA adapter folder, checkpoint or Hub id).")
    arguments.model_name_or_path = model or arguments.model_name_or_path
    return arguments, settings


def compare(paths: Sequence[str]) -> int:
    """``cegppo-eval --compare A.json B.json``: the lines of `compare_reports` on stdout."""
    from ..evaluation.compare import compare_reports, load_report

    try:
        reports = [load_report(path) for path in paths]
    except (OSError, ValueError) as error:
        _fail(str(error))
    print("\n".join(compare_reports(*reports, names=tuple(paths))), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-eval`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compare" in argv:
        if argv[:1] != ["--compare"] or len(argv) != 3:
            _fail("--compare takes two reports and nothing else: cegppo-eval --compare A.json B.json.")
        return compare(argv[1:])
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
