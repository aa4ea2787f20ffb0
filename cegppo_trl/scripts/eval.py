"""`cegppo-eval`: avg@k and pass@k of a model on math data sets, graded with the paper's math-verify reward.

Examples::

    cegppo-eval outputs/tiny-cegppo --datasets builtin:arithmetic_eval --k 4
    cegppo-eval outputs/DeepSeek-R1-Distill-Qwen-1.5B-CEGPPO --backend vllm --k 32 \\
        --datasets HuggingFaceH4/MATH-500:test math-ai/aime25:test HuggingFaceH4/aime_2024:train

`MODEL` is a saved model directory, a LoRA adapter folder (``cegppo-train --use_peft true``), a Trainer checkpoint or
a Hub id. A model saved by ``cegppo-train`` or ``cegppo-demo`` brings the prompt it was trained with and its sampling;
flags override them. Every data set is loaded and checked before the model loads; each set's figures are printed and
written to ``--output`` as soon as the set finishes. Every flag but the run options below is a field of
`cegppo_trl.evaluation.EvalSettings`; docs/evaluation.md walks through them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from ..evaluation.settings import PROMPT_FILE, EvalSettings

    parser = argparse.ArgumentParser(
        prog="cegppo-eval",
        description="avg@k and pass@k of a model, LoRA adapter or checkpoint on math data sets, graded with "
        "math-verify (+1 correct / -1 otherwise, as in CE-GPPO). The paper reports avg@32 (MATH500: avg@4) at "
        "temperature 0.6, top_p 0.95 and up to 32768 new tokens for DeepSeek-R1-Distill-Qwen-1.5B / 7B. A model "
        f"saved by cegppo-train or cegppo-demo has a {PROMPT_FILE}: its instruction, system prompt and sampling "
        "(generation_config.json) are the defaults of the prompt and sampling flags.",
    )
    parser.add_argument("model", help="model directory, LoRA adapter folder, checkpoint-N folder or Hub id")
    parser.add_argument(
        "--datasets",
        nargs="+",
        required=True,
        metavar="SET",
        help="data sets: local .jsonl/.json/.parquet/.csv files, builtin:arithmetic_eval, Hub ids, or ID:SPLIT "
        "(e.g. HuggingFaceH4/aime_2024:train); all are checked before the model loads",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--output", default="eval_report.json", help="JSON report, rewritten after every set "
                     "(default eval_report.json)")  # fmt: skip
    run.add_argument("--save-completions", action="store_true", help="store the completions in the report")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    EvalSettings.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-eval`."""
    from ..evaluation.settings import EvalSettings

    parser = build_parser()
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"cegppo-eval: {message}", file=sys.stderr, flush=True)

    finished: list[str] = []

    def on_result(name: str, metrics: dict) -> None:
        from ..evaluation.metrics import format_summary

        finished.append(name)
        print(format_summary(name, metrics), flush=True)

    try:
        settings = EvalSettings.from_namespace(args).validate()
    except ValueError as error:
        parser.error(str(error))
    from ..evaluation.run import evaluate_model

    try:
        report = evaluate_model(
            args.model,
            args.datasets,
            settings,
            output=args.output,
            save_completions=args.save_completions,
            progress=not args.no_progress,
            log=log,
            on_result=on_result,
        )
    except (ValueError, RuntimeError, OSError) as error:
        kept = f"\ncegppo-eval: the finished sets ({', '.join(finished)}) are in {args.output}." if finished else ""
        parser.exit(2, f"cegppo-eval: error: {error}{kept}\n")
    log(f"report: {args.output} ({len(report['datasets'])} data sets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
