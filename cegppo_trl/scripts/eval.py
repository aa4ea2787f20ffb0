"""`cegppo-eval`: avg@k and pass@k of a model on math data sets (docs/evaluation.md).

The arguments are `EvalArguments` and `EvalSettings` (`cegppo_trl.evaluation.settings`), parsed by TRL's `TrlParser`
as ``cegppo-train`` parses its own (``--name`` or ``--name-with-dashes``, ``--config PATH`` or ``--config=PATH``),
plus the positional MODEL, ``--preset NAME`` (`cegppo_trl.evaluation.datasets.PRESETS`, under ``--config``) and
``--compare A.json B.json``. A bad input is one line and exit status 2, before any model loads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


DESCRIPTION = """\
avg@k and pass@k of a model, LoRA adapter or checkpoint on math data sets. --protocol says how a completion is graded
and prompted: boxed (the default: as the training reward grades), authors (the CE-GPPO authors' grader and prompt:
comparable with the paper's table), lighteval or lighteval_avg. A model saved by cegppo-train or cegppo-demo declares
the prompt and sampling it was trained with (cegppo_prompt.json, generation_config.json): the defaults of those
flags. A YAML file given with --config sets values, flags override it; --preset paper runs the paper's evaluation.

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


def _fail(message: str) -> None:
    sys.stderr.write(f"cegppo-eval: error: {message}\n")
    raise SystemExit(2)


def build_parser():
    """TRL's parser over `EvalArguments` and `EvalSettings`, plus MODEL, ``--preset``, ``--compare`` and the help of
    ``--config`` (which `TrlParser.parse_args_and_config` reads itself); argparse's errors are one line."""
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
        help="model directory, LoRA adapter folder, checkpoint-N folder or Hub id (or --model_name_or_path)",
    )  # fmt: skip
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="EVAL.yaml", help="YAML file of name: value")
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


def parse_arguments(argv: Sequence[str] | None = None):
    """(`EvalArguments`, `EvalSettings`) of a command line; a bad one exits with status 2 and one line, before any
    model code loads."""
    import yaml

    from ..evaluation.datasets import PRESETS

    split = ("--config=", "--preset=")  # TrlParser finds --config only as its own word; --preset is read first
    argv = [
        part
        for word in (sys.argv[1:] if argv is None else argv)
        for part in (word.split("=", 1) if word.startswith(split) else [word])
    ]
    parser = build_parser()
    for word, value in zip(argv, argv[1:]):
        if word == "--preset" and value in PRESETS:  # defaults, as --config's are set (which then win)
            parser.set_defaults_with_config(**PRESETS[value])
    try:
        arguments, settings, *extra = parser.parse_args_and_config(argv)
    except OSError as error:  # TrlParser opens the --config file
        _fail(f"--config {error.filename}: {error.strerror}; pass the path of an existing YAML file.")
    except (ValueError, yaml.YAMLError) as error:  # unknown flags or keys, a dataclass's __post_init__ check
        _fail(" ".join(str(error).split()))
    model = getattr(extra[0], "model", None) if extra else None  # extra: the namespace of MODEL and --preset
    if model is not None and arguments.model_name_or_path not in (None, model):
        _fail(f"two models: MODEL {model!r} and --model_name_or_path {arguments.model_name_or_path!r}; give one.")
    arguments.model_name_or_path = model or arguments.model_name_or_path
    if arguments.model_name_or_path is None:
        _fail("no model: pass MODEL first (a saved model directory, LoRA adapter folder, checkpoint or Hub id).")
    return arguments, settings


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-eval`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compare" in argv:
        from ..evaluation.compare import compare_reports, load_report

        if argv[:1] != ["--compare"] or len(argv) != 3:
            _fail("--compare takes two reports and nothing else: cegppo-eval --compare A.json B.json.")
        try:
            reports = [load_report(path) for path in argv[1:]]
        except (OSError, ValueError) as error:
            _fail(str(error))
        print("\n".join(compare_reports(*reports, names=tuple(argv[1:]))), flush=True)
        return 0
    arguments, settings = parse_arguments(argv)
    from ..evaluation.metrics import format_summary
    from ..evaluation.run import evaluate_model

    def log(message: str) -> None:
        print(f"cegppo-eval: {message}", file=sys.stderr, flush=True)

    finished: list[str] = []

    def on_result(name: str, metrics: dict) -> None:
        finished.append(name)
        print(format_summary(name, metrics), flush=True)

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
