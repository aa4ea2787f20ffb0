"""Stress loop for clean stops (issue 20 "Signals"): SIGTERM and SIGINT at many moments of the tiny recipe.

Each run starts `cegppo-train` on the tiny recipe (saving every step) and stops it with the signal at a random moment:
during a step (a random delay after checkpoint-1, -2 or -3), while grading, or in the middle of a checkpoint write
(tests/signal_runs.py says how). Each must exit with its status (130 / 143) without a traceback, leave no process,
name its last complete checkpoint with the resume command, and that checkpoint must load. Prints one line per run
and a summary; exits 1 if any run failed.

    python benchmarks/stop_signals.py --runs 20          # 20 SIGTERM + 20 SIGINT
"""

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from signal_runs import MOMENTS, check_stop, loads, start_run, stop_run  # noqa: E402


def one_run(root: Path, index: int, signal_name: str, moment: str, after: int, delay: float, model_dir) -> float:
    cwd = root / f"{index:03d}-{signal_name}-{moment}"
    cwd.mkdir()
    out = cwd / "run"
    proc, argv = start_run(cwd, out, model_dir, signal_name, moment, after)
    result = stop_run(proc, cwd, out, signal_name, moment, after, delay=delay)
    loads(check_stop(result, out, signal_name, argv))
    return result["seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per signal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    failures, seconds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = None  # the first run builds builtin:tiny; the others reuse it
        for index in range(2 * args.runs):
            signal_name = ("SIGTERM", "SIGINT")[index % 2]
            moment, delay = rng.choice(MOMENTS), rng.uniform(0.0, 1.5)
            after = rng.randint(2 if moment == "grading" else 1, 3)  # grading #1 is before checkpoint-1
            started = time.monotonic()
            try:
                seconds.append(one_run(root, index, signal_name, moment, after, delay, model_dir))
                status = f"ok, exited {seconds[-1]:.1f} s after the signal"
            except AssertionError as error:
                failures.append(index)
                status = f"FAILED: {str(error)[-500:]}"
            print(f"run {index + 1:2d} {signal_name:7s} {moment:10s} after={after} delay={delay:.2f}: {status} "
                  f"({time.monotonic() - started:.0f} s in all)", flush=True)  # fmt: skip
            if model_dir is None and (root / f"{index:03d}-{signal_name}-{moment}" / "run" / "tiny-init").is_dir():
                model_dir = root / f"{index:03d}-{signal_name}-{moment}" / "run" / "tiny-init"
    total = 2 * args.runs
    print(f"RESULT clean stops: {total - len(failures)}/{total}; signal to exit: max {max(seconds, default=0):.1f} s, "
          f"median {sorted(seconds)[len(seconds) // 2] if seconds else 0:.1f} s")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
