"""Grading time of each protocol (cegppo_trl.rewards.protocols) on long, reasoning-model-like completions.

The authors' protocol parses the whole completion, think block included, so its cost grows with the completion; a
32k-token R1-style completion is ~100k characters. Each row grades ``--n`` distinct completions of ``--chars``
characters (a think block of arithmetic steps with intermediate ``\\boxed{}`` values, then a final boxed answer;
half right, half wrong) through ``grade_with_protocol`` in the grading pool, after a warm-up call that starts the
workers, and reports the wall time per completion and the statuses.

Usage: python benchmarks/bench_protocols.py [--n 64] [--chars 100000] [--workers N] [--timeout 40]
"""

from __future__ import annotations

import argparse
import collections
import random
import time


def completion(rng: random.Random, chars: int, right: bool) -> tuple[str, str]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--chars", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=40.0)
    args = parser.parse_args()

    from cegppo_trl.rewards import PROTOCOLS, grade_with_protocol

    rng = random.Random(0)
    cases = [completion(rng, args.chars, right=i % 2 == 0) for i in range(args.n)]
    texts, golds = [c[0] for c in cases], [c[1] for c in cases]
    print(
        f"{args.n} completions of ~{args.chars} characters, timeout {args.timeout} s, workers {args.workers or 'auto'}"
    )
    for name in PROTOCOLS:
        grade_with_protocol(["\\boxed{1}"], ["1"], name, timeout_s=args.timeout, num_workers=args.workers)  # warm
        start = time.perf_counter()
        results = grade_with_protocol(texts, golds, name, timeout_s=args.timeout, num_workers=args.workers)
        wall = time.perf_counter() - start
        counts = collections.Counter(r.status for r in results)
        print(f"{name:14s} {1000 * wall / args.n:8.1f} ms/completion  {dict(sorted(counts.items()))}")


if __name__ == "__main__":
    main()
