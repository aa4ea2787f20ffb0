"""The grading pool of cegppo_trl.rewards (``grading.GraderPool``) against ``pebble.ProcessPool``, on the same batches.

Both grade raw ``(answer, gold)`` pairs with math-verify, a per-task timeout, the same 3 GiB address-space limit and
warm-up; each row (start-up, ordinary, hostile, 2 ranks, no ``__main__`` guard, DataLoader worker) runs in a fresh
process. Needs ``pip install pebble`` (and torch for the DataLoader row). docs/rewards_and_data.md ("Own pool or
pebble") describes the rows and quotes the table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

ORDINARY_CHECK = [
    (r"\sqrt{8}", r"2\sqrt{2}", "correct"),
    ("(x+1)^2", "x^2+2x+1", "correct"),
    (r"\frac{3}{4}\pi", r"\frac{3\pi}{4}", "correct"),
    (r"\sqrt{7}", r"2\sqrt{2}", "wrong"),
    ("[1, 2)", "(1,2)", "wrong"),
    (r"\{1,2\}", r"\{2,1\}", "correct"),
]
CHECK_PAIRS, CHECK_STATUSES = [(a, g) for a, g, _ in ORDINARY_CHECK], [expected for *_, expected in ORDINARY_CHECK]
HOSTILE = [
    (r"9^{9^{9^{9^9}}}", "1"),
    ("99999999!", "7"),
    (r"\binom{99999999}{49999999}", "7"),
    (r"10^{10^{10}}", "7"),
    (r"2^{2^{2^{2^{2^{2}}}}}", "7"),
    ("(x+1)^{9000}", "x^2+2x+1"),
    ("+".join(["x"] * 480), "7"),
    ("\\frac{1}{" * 20 + "2" + "}" * 20, "7"),
]


def _stat(pid) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, parent pid, ...); [] if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _children() -> list[int]:
    """Pids of the live (non-zombie) direct children of this process."""
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (s := _stat(e)) and int(s[1]) == me and s[0] != "Z"]


class OwnPool:
    """cegppo_trl.rewards' pool, through its per-process registry (so its fork hook applies, as in training)."""

    name = "own"

    def __init__(self, workers: int, context: str | None = None) -> None:
        from cegppo_trl.rewards import grading

        self.grading, self.workers = grading, workers

    def grade(self, pairs, timeout_s: float) -> list[str]:
        return [status for status, _ in self.grading.pool_for(self.workers).grade(pairs, timeout_s)]

    def close(self) -> None:
        self.grading.shutdown_grading_workers()


_PEBBLE_STATE: dict = {}


def _pebble_load() -> None:
    """Import math-verify and warm sympy up (in the parent too, so that forked workers inherit it: pebble's best)."""
    if _PEBBLE_STATE:
        return
    from cegppo_trl.rewards.worker import WARM_UP, math_verify, parse_boxed

    _PEBBLE_STATE["parse_latex"], _PEBBLE_STATE["verify"] = parse_boxed, math_verify().verify
    for answer, gold in WARM_UP:
        _pebble_grade(answer, gold)


def _pebble_init() -> None:  # runs in each pebble worker (also in a replacement after a timeout kill)
    import resource

    from cegppo_trl.rewards.worker import ADDRESS_SPACE_LIMIT

    with open("/proc/self/statm") as f:
        inherited = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = inherited + ADDRESS_SPACE_LIMIT  # the same 3 GiB as our workers, above what fork inherited
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _pebble_load()  # a no-op under fork (inherited from the parent); the real start-up under forkserver/spawn


def _pebble_grade(answer: str, gold: str) -> str:  # the same work as the grade() of rewards/worker.py
    parse_latex, verify = _PEBBLE_STATE["parse_latex"], _PEBBLE_STATE["verify"]
    gold_parsed = parse_latex(gold)
    if not gold_parsed:
        return "bad_gold"
    answer_parsed = parse_latex(answer)
    if not answer_parsed:
        return "unparseable"
    return "correct" if verify(gold_parsed, answer_parsed, timeout_seconds=None) else "wrong"


class PebblePool:
    """``pebble.ProcessPool.schedule(fn, timeout=...)``, as in the CE-GPPO authors' verl fork.

    The calling process imports math-verify and warms sympy up before the pool forks its workers, so a worker that
    pebble replaces after a timeout starts instantly (fork); under forkserver/spawn each worker does it itself.
    """

    name = "pebble"

    def __init__(self, workers: int, context: str | None = None) -> None:
        import multiprocessing

        import pebble

        self.pebble = pebble
        _pebble_load()
        extra = {"context": multiprocessing.get_context(context)} if context else {}
        self.pool = pebble.ProcessPool(max_workers=workers, initializer=_pebble_init, **extra)

    def grade(self, pairs, timeout_s: float) -> list[str]:
        futures = [self.pool.schedule(_pebble_grade, args=pair, timeout=timeout_s) for pair in pairs]
        out = []
        for future in futures:
            try:
                out.append(future.result())
            except concurrent.futures.TimeoutError:
                out.append("timeout")
            except Exception:  # noqa: BLE001 - ProcessExpired (worker died), MemoryError, ...
                out.append("error")
        return out

    def close(self) -> None:
        self.pool.stop()
        self.pool.join()


POOLS = {"own": OwnPool, "pebble": PebblePool}


def case_startup(kind: str, workers: int, timeout_s: float) -> dict:
    start = time.perf_counter()
    pool = POOLS[kind](workers)
    ok = pool.grade([("(x+1)^2", "x^2+2x+1")], max(timeout_s, 60.0)) == ["correct"]
    seconds = time.perf_counter() - start
    pool.close()
    return {"ok": ok, "cell": f"{seconds:.1f} s"}


def _timed(kind: str, workers: int, timeout_s: float, pairs) -> tuple[list[str], float, bool]:
    """A started pool (untimed) grades `pairs`, timed, then `ORDINARY_CHECK`: (statuses, seconds, check passed)."""
    pool = POOLS[kind](workers)
    pool.grade([(f"{i}", f"{i}") for i in range(2 * workers)], 60.0)  # start-up, untimed
    start = time.perf_counter()
    statuses = pool.grade(pairs, timeout_s)
    seconds = time.perf_counter() - start
    ok = pool.grade(CHECK_PAIRS, timeout_s) == CHECK_STATUSES
    pool.close()
    return statuses, seconds, ok


def case_ordinary(kind: str, workers: int, timeout_s: float) -> dict:
    from bench_reward import build_mix, pool_pair

    pairs = [pool_pair(completion, gold) for completion, gold in build_mix(2048)[0]]  # one GRPO step's ordinary part
    pairs = list(dict.fromkeys(pair for pair in pairs if pair is not None))  # those that need math-verify, once each
    statuses, seconds, ok = _timed(kind, workers, timeout_s, pairs)
    slow = sum(s in ("timeout", "error") for s in statuses)
    return {"ok": ok and slow == 0, "cell": f"{len(pairs) / seconds:.0f} pairs/s ({len(pairs)}; {slow} t/o)"}


def case_hostile(kind: str, workers: int, timeout_s: float) -> dict:
    statuses, seconds, ok = _timed(kind, workers, timeout_s, HOSTILE)
    bound = len(HOSTILE) * (timeout_s + 10.0)  # hang detection: every item cut, each followed by a slow restart
    cut = sum(s in ("timeout", "error") for s in statuses)
    return {
        "ok": ok and seconds < bound and "correct" not in statuses,
        "cell": f"{seconds:.1f} s, {cut}/{len(HOSTILE)} cut, after: {'ok' if ok else 'WRONG'}",
    }


def case_rank(kind: str, workers: int, timeout_s: float) -> dict:
    """One rank of a 2-process launch: its own pool, ordinary and hostile pairs; reports its worker pids."""
    from cegppo_trl.rewards import grading

    workers = grading.default_num_workers()  # CPUs / LOCAL_WORLD_SIZE, as math_reward does
    start = time.perf_counter()
    pool = POOLS[kind](workers)
    statuses = pool.grade([*HOSTILE[:2], *CHECK_PAIRS], timeout_s)
    pids = _children()
    seconds = time.perf_counter() - start
    pool.close()
    ok = statuses[2:] == CHECK_STATUSES and "correct" not in statuses[:2]
    return {"ok": ok, "rank": int(os.environ.get("RANK", "0")), "pids": pids, "seconds": seconds}


CASES = {"startup": case_startup, "ordinary": case_ordinary, "hostile": case_hostile, "rank": case_rank}


_LAST_ERROR = [""]  # the last exception line on the stderr of the last failed child, for the table


def _run(argv: list[str], limit_s: float, env: dict | None = None) -> tuple[int | None, str, float]:
    """(returncode or None if killed at limit_s, stdout, seconds), killing the whole process group on timeout."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        code = None
    errors = [line for line in err.splitlines() if line[:1].isalpha() and "Error" in line.split(":")[0]]
    _LAST_ERROR[0] = errors[-1][:60] if errors else ""
    if code not in (0, None) and os.environ.get("BENCH_VERBOSE"):
        print(err[-2000:], file=sys.stderr)
    return code, out, time.perf_counter() - start


def _last_json(out: str) -> dict | None:
    for line in reversed(out.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def run_case(case: str, kind: str, args) -> str:
    argv = [sys.executable, __file__, "--case", case, "--pool", kind, "--workers", str(args.workers)]
    code, out, seconds = _run([*argv, "--timeout", str(args.timeout)], 240)
    report = _last_json(out)
    if code is None:
        return f"FAIL: hung, killed at {seconds:.0f} s"
    if code != 0 or report is None:
        return f"FAIL: exit {code}"
    return report["cell"] if report["ok"] else f"FAIL: {report['cell']}"


def run_ranks(kind: str, args) -> str:
    """Two ranks under torchrun (``accelerate launch --multi_gpu`` runs torchrun's launcher the same way)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv = [*torchrun, __file__, "--case", "rank", "--pool", kind, "--timeout", str(args.timeout)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code, out, seconds = _run(argv, 240, env)
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if code is None:
        return f"FAIL: hung, killed at {seconds:.0f} s"
    if code != 0 or len(reports) != 2:
        return f"FAIL: exit {code}, {len(reports)} reports"
    left = [pid for r in reports for pid in r["pids"] if _stat(pid)[:1] not in ([], ["Z"])]  # alive
    ok = all(r["ok"] for r in reports) and not left
    cell = f"{seconds:.1f} s, {sum(len(r['pids']) for r in reports)} workers, {len(left)} left"
    return cell if ok else f"FAIL: {cell}"


_NO_GUARD = """
from bench_grader_pool import POOLS, CHECK_PAIRS
pool = POOLS[{kind!r}](1, context={context!r})
print(json.dumps([pool.grade(CHECK_PAIRS, {timeout})]))
pool.close()
"""
_DATALOADER = """
import torch
from torch.utils.data import DataLoader, Dataset
from bench_grader_pool import POOLS, CHECK_PAIRS as PAIRS
pool = POOLS[{kind!r}](1)
first = pool.grade(PAIRS, {timeout})  # used in the trainer process first: its workers exist before the fork

class Graded(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return json.dumps(pool.grade(PAIRS, {timeout}))

loader = DataLoader(Graded(), batch_size=None, num_workers=1, multiprocessing_context="fork")
inside = [json.loads(item) for item in loader]
after = pool.grade(PAIRS, {timeout})  # and still usable in the parent afterwards
pool.close()
print(json.dumps([first, *inside, after]))
"""


def run_script(template: str, kind: str, args, limit_s: float, gradings: int, **fields) -> str:
    """`template` filled in, as a script file of its own (this folder and the repository importable), run with
    `python`: ok when it printed, as its last JSON line, `gradings` lists of `CHECK_STATUSES`."""
    body = template.format(kind=kind, timeout=args.timeout, **fields)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train_script.py"
        script.write_text(f"import json, sys\nsys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]\n{body}")
        code, out, seconds = _run([sys.executable, str(script)], limit_s)
    if code is None:
        return f"FAIL: hung, killed at {seconds:.0f} s"
    report = _last_json(out) if code == 0 else None
    if report != [CHECK_STATUSES] * gradings:
        got = [status for statuses in report or [] for status in statuses]
        counts = ", ".join(f"{got.count(s)} {s}" for s in sorted(set(got)))
        return f"FAIL: exit {code}; {counts or _LAST_ERROR[0]}"
    return f"ok, {seconds:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=3.0, help="per-task timeout, seconds")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per pool")
    parser.add_argument("--skip-ranks", action="store_true")
    parser.add_argument("--skip-dataloader", action="store_true")
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--pool", choices=sorted(POOLS), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.case:  # child mode
        print(json.dumps(CASES[args.case](args.pool, args.workers, args.timeout)), flush=True)
        return

    import pebble

    print(
        f"own GraderPool vs pebble {pebble.__version__} ProcessPool; {len(os.sched_getaffinity(0))} CPUs, "
        f"{args.workers} workers, timeout {args.timeout} s, Python {sys.version.split()[0]}, load average "
        f"{os.getloadavg()[0]:.1f} before start"
    )
    rows = [
        ("start-up to first result", lambda k: run_case("startup", k, args)),
        ("ordinary step (distinct pairs)", lambda k: run_case("ordinary", k, args)),
        (f"hostile batch ({len(HOSTILE)}, no pre-filter)", lambda k: run_case("hostile", k, args)),
    ]
    if not args.skip_ranks:
        rows.append(("2 ranks (torchrun/accelerate)", lambda k: run_ranks(k, args)))
    rows.append(("no __main__ guard (fork)", lambda k: run_script(_NO_GUARD, k, args, 90, 1, context=None)))
    rows.append(
        ("no __main__ guard (forkserver)", lambda k: run_script(_NO_GUARD, k, args, 90, 1, context="forkserver"))
    )
    if not args.skip_dataloader:
        rows.append(("forked DataLoader worker", lambda k: run_script(_DATALOADER, k, args, 120, 4)))

    table = [("", "own pool", "pebble")]
    for label, run in rows:
        table.append((label, run("own"), run("pebble")))
        print(f"  measured: {label}", file=sys.stderr, flush=True)
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    print()
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
