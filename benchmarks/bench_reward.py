"""Grading throughput and latency of cegppo_trl.math_reward against TRL's trl.rewards.accuracy_reward, on one GRPO
step's mix (90% ordinary answers, 10% slow or hostile ones: `HOSTILE_KINDS`); docs/rewards_and_data.md ("Performance")
describes and quotes it. TRL's items are capped (``--trl-cap``; a capped mix gives bounds, ``>=`` / ``<=``);
math_reward runs in a fresh process per row, so that ``--baseline DIR`` (another checkout's ``cegppo_trl/``, e.g. from
``git archive``) is measured the same way. ``--protocols``: each grading protocol's time per long completion instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import subprocess
import sys
import tempfile
from collections import Counter
from math import gcd
from pathlib import Path


GROUP = 16  # completions per prompt
ROOT = Path(__file__).resolve().parent.parent  # this checkout


def _gold_and_variants(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """A gold answer, equivalent rewritings of it, and wrong answers."""
    kind = rng.choices(["int", "frac", "sqrt", "poly", "pi", "interval"], [55, 12, 10, 10, 7, 6])[0]
    if kind == "int":
        n = rng.choice([rng.randint(0, 99), rng.randint(100, 999), rng.randint(1000, 99999)])
        same = [f"{n:,}" if n >= 1000 else f"{n}.0"]
        return str(n), same, [str(n + d) for d in (1, -1, 10)]
    if kind == "frac":
        b = rng.randint(2, 40)
        a = rng.randint(1, 3 * b)
        g = gcd(a, b)
        a, b = a // g, b // g
        if b == 1:
            b = 7
        same = [f"{a}/{b}", rf"\dfrac{{{a}}}{{{b}}}"]
        return rf"\frac{{{a}}}{{{b}}}", same, [rf"\frac{{{a + 1}}}{{{b}}}", f"{a}/{b + 1}"]
    if kind == "sqrt":
        k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10])
        return rf"{k}\sqrt{{{m}}}", [rf"\sqrt{{{k * k * m}}}"], [rf"{k}\sqrt{{{m + 1}}}", rf"{k + 1}\sqrt{{{m}}}"]
    if kind == "poly":
        a = rng.randint(1, 9)
        return f"x^2+{2 * a}x+{a * a}", [f"(x+{a})^2"], [f"(x+{a + 1})^2", f"x^2+{a}x+{a * a}"]
    if kind == "pi":
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        return rf"\frac{{{a}\pi}}{{{b}}}", [rf"\frac{{{a}}}{{{b}}}\pi"], [rf"\frac{{{a + 1}\pi}}{{{b}}}"]
    a, b = sorted(rng.sample(range(-20, 20), 2))
    return f"[{a}, {b})", [f"[{a},{b})"], [f"({a}, {b})", f"[{a}, {b + 1})"]


_FILLER = [
    "Let me think about this step by step.",
    "First, we simplify the expression.",
    "Substituting the values, we get {n}.",
    "So the intermediate result is {n}.",
    "Checking the boundary cases carefully.",
    "This gives us {n} when we expand.",
    "Wait, let me double-check the arithmetic.",
]


def _reasoning(rng: random.Random) -> str:
    return " ".join(rng.choice(_FILLER).format(n=rng.randint(1, 500)) for _ in range(rng.randint(10, 40)))


def _ordinary(rng: random.Random, n: int) -> list[tuple[str, str]]:
    items = []
    while len(items) < n:
        gold, same, wrong = _gold_and_variants(rng)
        for _ in range(GROUP):
            r = rng.random()
            if r < 0.50:
                answer = gold
            elif r < 0.65:
                answer = rng.choice(same)
            else:
                answer = rng.choice(wrong)
            ending = (
                f" The answer is ${answer}$."
                if r >= 0.90
                else f" Therefore the final answer is $\\boxed{{{answer}}}$."
            )
            items.append((f"<think>{_reasoning(rng)}</think>{_reasoning(rng)[:300]}{ending}", gold))
    return items[:n]


HOSTILE_KINDS = {  # kind -> the i-th distinct completion of that kind (distinct, so no batch deduplication helps)
    "power tower": lambda i: rf"\boxed{{{i % 8 + 2}^{{9^{{9^{{9}}}}}}}}",
    "factorial 99999999!": lambda i: rf"\boxed{{{99999999 - i}!}}",
    "factorial (10!)!": lambda i: rf"\boxed{{({10 + i % 5}!)! + {i}}}",
    "binomial": lambda i: rf"\boxed{{\binom{{{99999999 - i}}}{{49999999}}}}",
    "x^99999999": lambda i: rf"\boxed{{x^{{{99999999 - i}}}}}",
    "frac nested 300": lambda i: "\\boxed{" + "\\frac{1}{" * (300 + i) + "2" + "}" * (300 + i) + "}",
    "parens nested 500": lambda i: "\\boxed{" + "(" * (500 + i) + "1" + ")" * (500 + i) + "}",
    "1 MB of text": lambda i: "a" * (1_000_000 + i),
    "unbalanced braces": lambda i: rf"\boxed{{\frac{{1}}{{{i}" + "{" * 500,
    "NUL bytes": lambda i: "\x00" * 1000 + f"\\boxed{{{i}\x00}}",
    "python code": lambda i: f"\\boxed{{__import__('os').system('echo pwned{i}')}}",
    "sum of 480 terms (slow)": lambda i: "\\boxed{" + "+".join(["x"] * 479 + [str(i)]) + "}",
    "(x+1)^3000 (slow)": lambda i: rf"\boxed{{(x+{i + 1})^{{3000}}}}",
    "frac nested 10 (slow)": lambda i: "\\boxed{" + "\\frac{1}{" * 10 + str(i + 2) + "}" * 10 + "}",
}


def build_mix(n: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """(ordinary items, hostile items, hostile kind of each hostile item); items are (completion, gold)."""
    rng = random.Random(seed)
    n_hostile = n // 10
    ordinary = _ordinary(rng, n - n_hostile)
    kinds = [list(HOSTILE_KINDS)[i % len(HOSTILE_KINDS)] for i in range(n_hostile)]
    hostile = [(HOSTILE_KINDS[k](i), "7") for i, k in enumerate(kinds)]
    return ordinary, hostile, kinds


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pool_pair(completion: str, gold: str) -> tuple[str, str] | None:
    """The ``(answer, gold)`` pair math_reward sends to a grading worker, or ``None`` if it decides in-process
    (no answer, answer == gold, or plain numbers)."""
    from cegppo_trl.rewards import extract_answer, prefilter

    answer = extract_answer(completion)
    if answer is None or answer == gold or prefilter.fast_verdict(answer, gold) is not None:
        return None
    return answer, gold


_OURS_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from cegppo_trl.rewards import grade_completions
import cegppo_trl
with open(sys.argv[2]) as f:
    items = json.load(f)
timeout_s, workers = float(sys.argv[3]), int(sys.argv[4])
grade_completions([r"\boxed{x}"], ["x"], timeout_s=timeout_s, num_workers=workers)  # start-up, untimed
start = time.perf_counter()
results = grade_completions([c for c, _ in items], [g for _, g in items], timeout_s=timeout_s, num_workers=workers)
elapsed = time.perf_counter() - start
print(json.dumps({"package": cegppo_trl.__file__, "seconds": elapsed, "latencies": [r.seconds for r in results],
                  "statuses": [r.status for r in results]}))
"""


def run_ours(items: list[tuple[str, str]], timeout_s: float, workers: int, root: Path = ROOT) -> dict:
    """Grade ``items`` with one ``grade_completions`` call of the package under ``root``, in a fresh process."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(items, f)
        f.flush()
        argv = [sys.executable, "-c", _OURS_CHILD, str(root), f.name, str(timeout_s), str(workers)]
        out = subprocess.run(argv, stdout=subprocess.PIPE, check=True, text=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    if not Path(report["package"]).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"measured {report['package']}, not the package under {root}")
    statuses = report["statuses"]
    return {
        "n": len(items),
        "seconds": report["seconds"],
        "rate": len(items) / report["seconds"],
        "p99": _percentile(report["latencies"], 0.99),
        "max": max(report["latencies"]),
        "timeouts": statuses.count("timeout") + statuses.count("error"),
        "correct": statuses.count("correct"),
        "statuses": statuses,
    }


def run_ours_parts(
    parts: dict[str, list], timeout_s: float, workers: int, roots: list[Path], repeats: int = 1
) -> list[dict]:
    """``{part: measurement}`` per root, the run of median rate out of ``repeats``; the roots run side by side, their
    order reversed from one round to the next (neither always runs on the machine the other one warmed)."""
    runs: list[dict[str, list]] = [{part: [] for part in parts} for _ in roots]
    round_ = 0
    for _ in range(repeats):
        for part, items in parts.items():
            order = list(enumerate(roots))
            for i, root in order[::-1] if round_ % 2 else order:
                runs[i][part].append(run_ours(items, timeout_s, workers, root))
            round_ += 1
    return [{part: sorted(r, key=lambda m: m["rate"])[len(r) // 2] for part, r in by_part.items()} for by_part in runs]


def _row(label: str, ours: dict) -> tuple[str, ...]:
    mix = ours["mix"]
    cells = (f"{ours['ordinary']['rate']:.0f}", f"{mix['rate']:.0f}", f"{mix['p99'] * 1000:.0f} ms")
    return (label, *cells, f"{mix['max']:.2f} s", f"{ours['pool only']['rate']:.0f}")


def _ratio_row(label: str, ours: dict, other: dict) -> tuple[str, ...]:
    ratios = {part: f"{ours[part]['rate'] / other[part]['rate']:.2f}x" for part in ours}
    return (label, ratios["ordinary"], ratios["mix"], "", "", ratios["pool only"])


_TRL_CHILD = r"""
import json, sys, time, logging
logging.disable(logging.WARNING)
from trl.rewards import accuracy_reward
print("ready", flush=True)
for line in sys.stdin:
    completion, gold = json.loads(line)
    start = time.perf_counter()
    value = accuracy_reward([[{"role": "assistant", "content": completion}]], [gold])[0]
    print(json.dumps([value, time.perf_counter() - start]), flush=True)
"""


class _TrlChild:
    proc = None  # started for the first item and after each abandoned one

    def grade(self, completion: str, gold: str, cap: float) -> tuple[float | None, float]:
        """(reward, seconds); (None, cap) when the item did not finish within ``cap`` seconds."""
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _TRL_CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert self.proc.stdout.readline().strip() == "ready"
        self.proc.stdin.write(json.dumps([completion, gold]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], cap)
        if not ready:  # abandoned: a fresh child for the next item
            self.close()
            return None, cap
        return tuple(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def run_trl(ordinary: list[tuple[str, str]], hostile_kinds: list[str], cap: float) -> dict:
    child = _TrlChild()
    graded = [child.grade(completion, gold, cap) for completion, gold in ordinary]
    ordinary_latencies = [seconds for _, seconds in graded]
    kind_seconds = {}
    for kind in dict.fromkeys(hostile_kinds):  # each distinct hostile kind once, then extrapolate
        value, seconds = child.grade(HOSTILE_KINDS[kind](0), "7", cap)
        kind_seconds[kind] = (seconds, value is None)
    child.close()
    hostile_latencies = [kind_seconds[k][0] for k in hostile_kinds]
    ordinary_time = sum(ordinary_latencies)
    mix_time = ordinary_time + sum(hostile_latencies)
    latencies = ordinary_latencies + hostile_latencies
    return {
        "ordinary_rate": len(ordinary) / ordinary_time,
        "mix_rate": len(latencies) / mix_time,
        "p99": _percentile(latencies, 0.99),
        "max": max(latencies),
        "capped": any(kind_seconds[k][1] for k in hostile_kinds),
        "kind_seconds": kind_seconds,
        "correct": sum(value == 1.0 for value, _ in graded),
    }


def long_completion(rng: random.Random, chars: int, right: bool) -> tuple[str, str]:
    """A long completion and its gold: many reasoning steps (numbers, some boxed) inside <think>, a boxed answer."""
    gold = rng.randint(100, 999)
    steps = []
    size = 0
    while size < chars:
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        step = f"Next, ${a} + {b} = {a + b}$, so the partial sum is $\\boxed{{{a + b}}}$? Let me check again. "
        if rng.random() < 0.7:
            step = f"Then {a} times {b} is {a * b}, and dividing by {b} gives back {a}. "
        steps.append(step)
        size += len(step)
    answer = gold if right else gold + 1
    text = "<think>\n" + "".join(steps) + f"\n</think>\n\nThe answer is $\\boxed{{{answer}}}$."
    return text, str(gold)


def time_protocols(n: int, chars: int, timeout_s: float, workers: int | None) -> None:
    """`--protocols`: the wall time per completion and the statuses of each grading protocol."""
    import time

    from cegppo_trl.rewards import PROTOCOLS, grade_with_protocol

    rng = random.Random(0)
    cases = [long_completion(rng, chars, right=i % 2 == 0) for i in range(n)]
    texts, golds = [c[0] for c in cases], [c[1] for c in cases]
    print(f"{n} completions of ~{chars} characters, timeout {timeout_s} s, workers {workers or 'auto'}")
    for name in PROTOCOLS:
        grade_with_protocol(["\\boxed{1}"], ["1"], name, timeout_s=timeout_s, num_workers=workers)  # warm
        start = time.perf_counter()
        results = grade_with_protocol(texts, golds, name, timeout_s=timeout_s, num_workers=workers)
        wall = time.perf_counter() - start
        counts = Counter(r.status for r in results)
        print(f"{name:14s} {1000 * wall / n:8.1f} ms/completion  {dict(sorted(counts.items()))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocols", action="store_true", help="time each grading protocol on long completions")
    parser.add_argument("--chars", type=int, default=100_000, help="--protocols: characters per completion")
    parser.add_argument("--n", type=int, help="completions in the mix (default 2048: one GRPO step; --protocols: 64)")
    parser.add_argument("--timeout", type=float, help="math_reward timeout_s (default 3.0; --protocols: 40.0)")
    parser.add_argument("--workers", type=int, default=None, help="grading processes (default: CPUs / local ranks)")
    parser.add_argument("--trl-cap", type=float, default=15.0, help="seconds before a TRL grading call is abandoned")
    parser.add_argument("--skip-trl", action="store_true", help="only measure cegppo_trl.math_reward")
    parser.add_argument("--baseline", type=Path, help="another checkout (a folder holding cegppo_trl/) to compare")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each math_reward row; the median is shown")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.protocols:
        time_protocols(args.n or 64, args.chars, args.timeout or 40.0, args.workers)
        return
    args.n, args.timeout = args.n or 2048, args.timeout or 3.0
    if args.baseline is not None and not (args.baseline / "cegppo_trl" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline}: no cegppo_trl/__init__.py there; pass the folder that holds it")

    from cegppo_trl.rewards import grading

    ordinary, hostile, kinds = build_mix(args.n, args.seed)
    workers = args.workers or grading.default_num_workers()
    cpus = len(os.sched_getaffinity(0))
    print(
        f"mix: {len(ordinary)} ordinary + {len(hostile)} slow/hostile completions ({len(HOSTILE_KINDS)} kinds); "
        f"{cpus} CPUs, {workers} grading workers, timeout {args.timeout} s, load average "
        f"{os.getloadavg()[0]:.1f} before start"
    )
    pairs = [pool_pair(c, g) for c, g in ordinary]
    print(
        f"ordinary completions decided in-process (no answer, answer == gold, or plain numbers): "
        f"{pairs.count(None) / len(ordinary):.0%}"
    )
    distinct: dict[tuple[str, str], tuple[str, str]] = {}
    for item, pair in zip(ordinary, pairs):  # pairs no shortcut decides, each once (repeats in the batch)
        if pair is not None:
            distinct.setdefault(pair, item)
    parts = {"ordinary": ordinary, "mix": ordinary + hostile, "pool only": list(distinct.values())}
    roots = [ROOT] if args.baseline is None else [ROOT, args.baseline]
    measured = run_ours_parts(parts, args.timeout, workers, roots, args.repeats)
    ours = measured[0]
    rows = [_row("cegppo math_reward", ours)]
    if args.baseline is not None:
        rows.append(_row(f"baseline ({args.baseline})", measured[1]))
        rows.append(_ratio_row("ratio (ours / baseline)", ours, measured[1]))
    trl = None
    if not args.skip_trl:
        trl = run_trl(ordinary, kinds, args.trl_cap)
        bound, upper = (">=", "<=") if trl["capped"] else ("", "")
        cells = f"{upper}{trl['mix_rate']:.1f}", f"{bound}{trl['p99'] * 1000:.0f} ms", f"{bound}{trl['max']:.2f} s"
        rows.append(("trl accuracy_reward", f"{trl['ordinary_rate']:.0f}", *cells, ""))
        ordinary_ratio = f"{ours['ordinary']['rate'] / trl['ordinary_rate']:.1f}x"
        rows.append(
            ("ratio (ours / trl)", ordinary_ratio, f"{bound}{ours['mix']['rate'] / trl['mix_rate']:.0f}x", "", "", "")
        )
    header = ("", "ordinary c/s", "mix c/s", "p99 latency", "max latency", "pool-only c/s")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, *rows]:
        cells = zip(row, widths, strict=True)
        print("  ".join(str(cell).rjust(w) if i else str(cell).ljust(w) for i, (cell, w) in enumerate(cells)))
    print()
    print(
        f"cegppo: ordinary part {ours['ordinary']['n']} in {ours['ordinary']['seconds']:.2f} s; mix "
        f"{ours['mix']['n']} in {ours['mix']['seconds']:.2f} s with {ours['mix']['timeouts']} timeouts; the "
        f"{ours['pool only']['n']} distinct (answer, gold) pairs of the ordinary part that need math-verify alone "
        f"(pool-only column)"
    )
    if args.baseline is not None:
        for part in parts:
            pairs = zip(measured[1][part]["statuses"], ours[part]["statuses"], strict=True)
            differ = Counter(f"{old} -> {new}" for old, new in pairs if old != new)
            shown = f" ({', '.join(f'{n} {change}' for change, n in differ.items())})" if differ else ""
            print(f"statuses that differ from the baseline, {part}: {differ.total()} of {ours[part]['n']}{shown}")
    if trl is not None:
        print(
            f"agreement on the ordinary part: cegppo {ours['ordinary']['correct']} correct, trl {trl['correct']} "
            "correct"
        )
        slow = ", ".join(
            f"{k} {'>' if capped else ''}{s:.2f} s" for k, (s, capped) in trl["kind_seconds"].items() if s > 0.05
        )
        print(f"trl time per hostile kind (measured once each, extrapolated to the mix): {slow}")


if __name__ == "__main__":
    main()
