"""`cegppo-compare`: train several arms from one start model for several seeds with everything else equal, measure
every model on the same held-out problems, compare them with paired statistics (docs/comparison.md).

    cegppo-compare --model builtin:tiny --arms grpo cegppo 0,1 1,0 --seeds 0 1 2 --out build/compare
    cegppo-compare --config my_comparison.yaml          # a YAML file may carry every flag

Writes ``results.md``, ``results.json`` and ``curves.png`` in --out, with the start model's and each run's folders.
Run it again with the same --out to resume: finished runs and measurements are reused, an interrupted run resumes
from its newest finite checkpoint, and it says which.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from ..comparison.settings import TINY_MODEL, CompareArguments, check_same_settings, preflight


PROG = "cegppo-compare"


def say(text: str) -> None:
    print(f"[{PROG}] {text}", flush=True)


def parse(argv) -> CompareArguments:
    from trl import TrlParser

    parser = TrlParser(CompareArguments, prog=PROG, description=__doc__.split("\n\n")[0])
    (args,) = parser.parse_args_and_config(argv)
    return args


def start_model(args: CompareArguments, out: Path) -> str:
    """The start model's directory: builtin:tiny built and SFT-warm-started once in ``<out>/start-model``."""
    if args.model != TINY_MODEL:
        return args.model
    import torch

    from ..tiny_model import materialize_tiny

    torch.set_num_threads(1)  # two threads spin against the other jobs of a shared machine (NOTES: 10x slower)

    path = out / "start-model"
    say(f"builtin:tiny: building (or reusing) {path}, {args.tiny_sft_steps} SFT steps")
    return materialize_tiny(path, seed=0, sft_steps=args.tiny_sft_steps)


def finished(path: Path, fingerprint: str) -> dict | None:
    """The saved result at `path` if it was made with these settings, else None."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved if saved.get("fingerprint") == fingerprint else None


def run_all(args: CompareArguments, out: Path) -> tuple[dict, list[dict], list[str]]:
    """The start's measurement and every (arm, seed) run, reusing what an earlier call finished; returns (start,
    runs in --arms then --seeds order, failures)."""
    from ..comparison.jobs import job_measure_start, job_train, resume_point

    settings = {name: getattr(args, name) for name in args.__dataclass_fields__}
    fingerprint = args.fingerprint()
    model_dir = start_model(args, out)
    start = finished(out / "start.json", fingerprint)
    results, failures, reused, resumed = {}, [], [], []
    for arm in args.arm_list:
        for seed in args.seeds:
            run_dir = out / "runs" / f"{arm.name}-seed{seed}"
            result = finished(run_dir / "result.json", fingerprint)
            if result is not None:
                results[(arm.name, seed)] = result
                reused.append(result["name"])
            elif run_dir.is_dir() and resume_point(run_dir)[0]:
                resumed.append(f"{arm.name}-seed{seed} from {Path(resume_point(run_dir)[0]).name}")
    say("reused (finished before): " + (", ".join((["start"] if start else []) + reused) or "nothing"))
    if resumed:
        say("resumed from their newest finite checkpoint: " + ", ".join(resumed))
    todo = [(arm, seed) for seed in args.seeds for arm in args.arm_list if (arm.name, seed) not in results]
    if start is None or todo:
        pool = ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"))
        try:
            futures = {}
            if start is None:
                futures[pool.submit(job_measure_start, settings, model_dir)] = "start"
            for arm, seed in todo:
                run_dir = str(out / "runs" / f"{arm.name}-seed{seed}")
                futures[pool.submit(job_train, settings, arm, seed, model_dir, run_dir)] = (arm.name, seed)
            for future in as_completed(futures):
                key = futures[future]
                try:
                    value = future.result()
                except Exception as error:  # one run failing keeps the others (and their results) going
                    failures.append(f"{key}: {type(error).__name__}: {error}")
                    say(f"FAILED {key}: {type(error).__name__}: {error}")
                    continue
                if key == "start":
                    start = value
                    (out / "start.json").write_text(json.dumps(value, indent=1) + "\n")
                    say(f"start measured: {_figures(value, args)}")
                else:
                    results[key] = value
                    say(f"{value['name']} finished: {_figures(value['end'], args)}")
        finally:  # on Ctrl-C: no queued run starts; the running ones stop with their process group
            pool.shutdown(wait=False, cancel_futures=True)
    runs = [results[(arm.name, seed)] for arm in args.arm_list for seed in args.seeds if (arm.name, seed) in results]
    return start, runs, failures


def _figures(m: dict, args: CompareArguments) -> str:
    g = m["grades"][args.protocols[0]]
    return f"avg@{m['k']} {g['avg']:.3f}, pass@{m['k']} {g['pass']:.3f}, held-out entropy {m['entropy']:.3f}"


def write_report(args: CompareArguments, out: Path, start: dict, runs: list[dict], wall: float | None) -> str:
    from ..comparison import report
    from ..comparison.jobs import JOB_THREADS
    from ..figures import machine_description

    machine = machine_description(threads=JOB_THREADS)  # the runs' threads, not this reporting process's
    settings = {**args.shaping(), "arms": args.arms, "seeds": args.seeds, "machine": machine}
    summary = report.summarize(start, runs, args.protocols)
    table = report.markdown(start, runs, summary, settings)
    timing = report.time_report(start, runs, wall) + f" Machine: {settings['machine']}."
    slim = [{k: v for k, v in r.items() if k != "log_history"} for r in runs]
    result = {"settings": settings, "start": start, "summary": summary, "claims": report.claims(summary, args.protocols),
              "runs": slim, "time": timing}  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(table + "\n" + timing + "\n")
    picture = report.figure(start, runs, settings, out / "curves.png")
    print(table + "\n" + timing, flush=True)
    say(f"wrote {out / 'results.md'}, {out / 'results.json'}, {picture}")
    return table


def main(argv=None) -> int:
    wall = time.perf_counter()
    try:
        args = parse(argv)
    except ValueError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    problems = preflight(args)
    if problems:
        print("\n".join(f"{PROG}: {p}" for p in problems), file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    from ..comparison.jobs import load_problems
    from ..data import DatasetFormatError

    try:
        check_same_settings(args, str(out / "comparison.json"))
        train, held_out = load_problems(args)  # a bad data set or size fails before any model loads
    except (ValueError, FileNotFoundError, DatasetFormatError) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.json").write_text(json.dumps({"shaping": args.shaping()}, indent=1) + "\n")
    say(f"{len(args.arm_list)} arms x seeds {args.seeds}, {args.max_steps} steps each; {len(train)} training and "
        f"{len(held_out)} held-out problems (k = {args.eval_k}); {args.jobs} processes; output {out}")  # fmt: skip
    try:
        start, runs, failures = run_all(args, out)
    except KeyboardInterrupt:
        print(f"{PROG}: stopped. Run the same command again to resume: finished runs are kept, and each stopped run "
              "resumes from its newest checkpoint.", file=sys.stderr)  # fmt: skip
        return 130
    if start is not None and runs:
        write_report(args, out, start, runs, time.perf_counter() - wall)
    if failures:
        print(f"{PROG}: {len(failures)} job(s) failed (run the same command again to retry them): "
              + "; ".join(failures), file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
