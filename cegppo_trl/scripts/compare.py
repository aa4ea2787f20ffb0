"""`cegppo-compare`: train each arm of your recipe for each seed with `cegppo-train`, measure every model (the start
model too) with `cegppo-eval`, and compare them with paired statistics (docs/comparison.md).

    cegppo-compare --recipe recipes/tiny/cegppo/config_cpu.yaml --arms grpo cegppo 0,1 --seeds 0 1 2 --out cmp
    cegppo-compare --recipe recipes/DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_lora.yaml --launcher accelerate \\
        --accelerate_config zero2 --num_processes 8 --eval_backend vllm --out cmp-1.5b
    cegppo-compare --recipe my_recipe.yaml --launcher slurm --out /shared/cmp   # --dry_run: print the sbatch lines
    cegppo-compare --report_only --out cmp                                       # the report from the run folders

Writes ``results.md``, ``results.json`` and ``curves.png`` in --out. Run it again with the same --out to resume:
finished runs and measurements are reused, a stopped run resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from pathlib import Path


PROG = "cegppo-compare"


def say(text: str) -> None:
    print(f"[{PROG}] {text}", flush=True)


class Stopped(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _stop_on(signum, frame):
    raise Stopped(signum)


def write_report(out: Path, wall: float | None = None) -> str | None:
    """The table (``results.md``: from the run folders alone, the same bytes wherever they are), ``results.json``
    and ``curves.png``; None when the start or every run is not measured yet."""
    from ..comparison import report

    settings, start, runs = report.load(out)
    if start is None or not runs:
        say("nothing to report yet: the start and at least one run must be measured")
        return None
    protocols = settings["shaping"]["protocols"]
    summary = report.summarize(start, runs, protocols)
    table = report.markdown(settings, start, runs, summary)
    timing = report.time_report(runs) + ("" if wall is None else f" This call: {wall:.0f} s wall.")
    slim = [{k: v for k, v in r.items() if k not in ("log_history", "grades")} for r in runs]
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps({"settings": settings, "summary": summary, "runs": slim,
                                                  "time": timing}, indent=1) + "\n")  # fmt: skip
    picture = report.figure(settings, start, runs, out / "curves.png")
    print(table + "\n" + timing, flush=True)
    say(f"wrote {out / 'results.md'}, {out / 'results.json'}, {picture}")
    return table


def read_recipe(args):
    """(script_args, training_args, model_args) of the recipe with the overrides, parsed as `cegppo-train` parses
    them (the same parser: what a run will see); a ValueError names a bad field."""
    from .train import make_parser  # the parser of the runs: what they will see

    parser = make_parser()

    def error(message):
        raise ValueError(f"--recipe {args.recipe} with {' '.join(args.train_flags) or 'no overrides'}: {message}")

    parser.error = error
    try:
        return parser.parse_args_and_config(["--config", args.recipe, *args.train_flags])
    except ValueError as problem:
        if "not used by the HfArgumentParser" not in str(problem):
            raise
        unknown = str(problem).split(": ", 1)[1].strip("[]").replace("'", "").replace(",", "")
        raise ValueError(f"{unknown}: neither a cegppo-compare flag nor a cegppo-train one (`cegppo-compare --help` "
                         "and `cegppo-train --help` list them).") from None  # fmt: skip


def prepare(args, out: Path):
    """The recipe as the runs will read it, checked, and the comparison's settings (``comparison.json``), before any
    work; a ValueError is the one line to print."""
    from ..comparison.settings import check_model, check_same_settings

    recipe = read_recipe(args)
    script_args, training_args, model_args = recipe
    if problem := check_model(model_args.model_name_or_path):
        raise ValueError(problem)
    shaping = args.shaping(Path(args.recipe).read_text())
    check_same_settings(shaping, out / "comparison.json")
    training = {name: getattr(training_args, name) for name in ("max_steps", "per_device_train_batch_size",
                "num_generations", "steps_per_generation", "learning_rate", "temperature", "max_completion_length")}  # fmt: skip
    training.update(model=model_args.model_name_or_path, use_peft=model_args.use_peft)
    settings = {"shaping": shaping, "arms": [a.name for a in args.arm_list], "seeds": args.seeds,
                "training": training, "recipe": args.recipe}  # fmt: skip
    return recipe, settings


def run(args, out: Path, wall: float) -> int:
    from ..comparison.runs import build_start_model, local_command, plan, run_here, submit
    from .stopping import last_complete_checkpoint

    try:
        recipe, settings = prepare(args, out)
    except (ValueError, FileNotFoundError) as error:
        print(f"{PROG}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.json").write_text(json.dumps(settings, indent=1) + "\n")
    start_model = build_start_model(args, recipe, out)
    runs, tasks = plan(args, recipe, out, start_model)
    for described in runs if not args.dry_run else []:
        folder = out / "runs" / described["name"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "compare_run.json").write_text(json.dumps(described, indent=1) + "\n")
    reused = [t.name for t in tasks if t.done()]
    say("reused (finished before): " + (", ".join(reused) or "nothing"))
    resumed = [f"{t.name} from {Path(c).name}" for t in tasks if t.kind == "train" and not t.done()
               and (c := last_complete_checkpoint(str(t.folder)) if t.folder.is_dir() else None)]  # fmt: skip
    if resumed:
        say("resumed from their newest complete checkpoint: " + ", ".join(resumed))
    say(
        f"{len(args.arm_list)} arms x seeds {args.seeds}; start model {start_model}; launcher {args.launcher}; "
        f"output {out}"
    )
    if args.launcher == "slurm":
        jobs = submit(tasks, args, out, say)
        if not args.dry_run:
            say(f"{len(jobs)} job(s) submitted; a last job writes the report. Run the same command again to resume "
                "what a stop or a time limit cut.")  # fmt: skip
        return 0
    if args.dry_run:  # each command not done, in the order it would run (a measurement after its training)
        print("\n".join(shlex.join(local_command(t, args, recipe)) for t in tasks if not t.done()), flush=True)
        return 0
    failures = run_here(tasks, args, recipe, say)
    write_report(out, time.perf_counter() - wall)
    if failures:
        print(f"{PROG}: {len(failures)} command(s) failed (the finished ones stay; run the same command again to "
              "retry the others): " + "; ".join(failures), file=sys.stderr)  # fmt: skip
        return 1
    return 0


def main(argv=None) -> int:
    wall = time.perf_counter()
    from ..comparison.settings import parse, preflight

    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    problems = preflight(args)
    if problems:  # one line: the first (a missing extra comes first), the fix beside it
        print(f"{PROG}: {problems[0]}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    if args.report_only:
        if not (out / "comparison.json").is_file():
            print(f"{PROG}: --out {out} holds no comparison (no comparison.json); pass the folder a comparison "
                  "wrote.", file=sys.stderr)  # fmt: skip
            return 2
        return 0 if write_report(out) is not None else 1
    previous = signal.signal(signal.SIGTERM, _stop_on)
    try:
        return run(args, out, wall)
    except (KeyboardInterrupt, Stopped) as stop:
        print(f"{PROG}: stopped. Run the same command again to resume: finished runs are kept, and each stopped run "
              "resumes from its newest checkpoint.", file=sys.stderr)  # fmt: skip
        return 128 + getattr(stop, "signum", signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
