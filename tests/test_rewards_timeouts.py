"""Slow golds are not bad golds: a gold whose parse hits the soft timeout is retried on later calls (bounded).

The grading worker is made slow on purpose through the real pool: ``GraderPool(size, argv=...)`` starts a small
wrapper that replaces ``math_verify.parse`` by one that sleeps (far past any soft timeout) on the first parses of
chosen gold strings, then runs the real worker program (``cegppo_trl/rewards/worker.py``) unchanged.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from cegppo_trl import rewards
from cegppo_trl.rewards import grade_completions, grading, make_math_reward, worker


WORKER_FILE = Path(worker.__file__).resolve()

_SLOW_GOLD_WORKER = r"""
import runpy, sys, time
import math_verify

slow = {"\\boxed{" + gold + "}": int(sys.argv[2]) for gold in sys.argv[3:]}  # gold text -> slow parses left
real_parse = math_verify.parse

def parse(pred, *args, **kwargs):
    if slow.get(pred, 0) > 0:
        slow[pred] -= 1
        time.sleep(120)  # the worker's soft timer interrupts this, as it would a slow sympy call
    return real_parse(pred, *args, **kwargs)

math_verify.parse = parse  # the worker calls math_verify.parse
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
runpy.run_path(sys.argv[1], run_name="__cegppo_grader__")["_worker_main"]()
"""


@pytest.fixture
def slow_gold_pool(monkeypatch):
    """``make(slow_parses, *golds)``: route grading to one worker whose first parses of ``golds`` are slow."""
    pools = []

    def make(slow_parses: int, *golds: str) -> grading.GraderPool:
        argv = [sys.executable, "-c", _SLOW_GOLD_WORKER, str(WORKER_FILE), str(slow_parses), *golds]
        pool = grading.GraderPool(1, argv=argv)
        pools.append(pool)
        monkeypatch.setattr(rewards.reward, "pool_for", lambda num_workers: pool)  # grade_completions' lookup
        pool.grade([("1", "1")], timeout_s=60.0)  # start-up and warm-up, outside the timed calls
        return pool

    yield make
    for pool in pools:
        pool.close()


def _call(reward, completions, golds):
    metrics: dict[str, float] = {}
    extra: dict[str, list] = {}
    values = reward(completions, golds, log_metric=metrics.__setitem__, log_extra=extra.__setitem__)
    return values, metrics, extra[f"{reward.__name__}/status"]


def test_slow_gold_is_retried_on_the_next_call_not_cached_as_bad(slow_gold_pool):
    # Unique golds (no other test grades them), so no earlier verdict is cached in this process.
    slow_a, slow_b = r"7\sqrt{3}", r"11\sqrt{5}"
    pool = slow_gold_pool(1, slow_a, slow_b)  # the first parse of each is slow, later ones are not
    (pid,) = pool.worker_pids()
    reward = make_math_reward(timeout_s=2.0, num_workers=1, name="slow_gold")
    completions = [r"\boxed{\sqrt{147}}", r"\boxed{11\sqrt{5}}", r"\boxed{3}", r"\boxed{\sqrt{8}}"]
    golds = [slow_a, slow_b, "3", r"2\sqrt{2}"]

    start = time.perf_counter()
    values, metrics, statuses = _call(reward, completions, golds)
    assert time.perf_counter() - start < 10.0
    # Row 1 equals its gold as a string (decided locally), but its gold could not be checked in time: no score.
    assert values == [None, None, 1.0, 1.0]
    assert statuses == ["gold_timeout", "gold_timeout", "correct", "correct"]
    assert metrics["slow_gold/gold_timeouts"] == 2.0
    assert metrics["slow_gold/unparseable_gold"] == 0.0
    assert metrics["slow_gold/timeouts"] == 0.0
    assert metrics["slow_gold/accuracy"] == 1.0  # over the completions with a usable gold

    values, metrics, statuses = _call(reward, completions, golds)
    assert values == [1.0, 1.0, 1.0, 1.0]
    assert metrics["slow_gold/gold_timeouts"] == 0.0
    assert metrics["slow_gold/unparseable_gold"] == 0.0
    assert pool.worker_pids() == [pid], "the soft timeout should end the slow parse without killing the worker"


def test_gold_that_keeps_timing_out_is_retried_a_bounded_number_of_times(slow_gold_pool):
    gold = r"13\sqrt{7}"
    pool = slow_gold_pool(1000, gold)  # always slow
    reward = make_math_reward(timeout_s=1.2, num_workers=1, name="always_slow")
    completions = [r"\boxed{\sqrt{1183}}", r"\boxed{4}"]
    bound = rewards.MAX_GOLD_TIMEOUTS
    assert bound >= 2
    for _ in range(bound):
        values, metrics, statuses = _call(reward, completions, [gold, "4"])
        assert values == [None, 1.0]
        assert statuses == ["gold_timeout", "correct"]
        assert metrics["always_slow/gold_timeouts"] == 1.0
        assert metrics["always_slow/unparseable_gold"] == 0.0
    # Settled: from now on the gold is unparseable, without asking the (slow) worker again.
    grade = pool.grade
    asked = []
    pool.grade = lambda tasks, timeout_s: asked.append(tasks) or grade(tasks, timeout_s)
    values, metrics, statuses = _call(reward, completions, [gold, "4"])
    assert values == [None, 1.0]
    assert statuses == ["bad_gold", "correct"]
    assert metrics["always_slow/unparseable_gold"] == 1.0
    assert metrics["always_slow/gold_timeouts"] == 0.0
    assert asked == []


def test_gold_timeout_status_in_grade_completions(slow_gold_pool):
    gold = r"\frac{17\pi}{19}"
    slow_gold_pool(1, gold)
    first = grade_completions([r"\boxed{\frac{17}{19}\pi}"], [gold], timeout_s=2.0, num_workers=1)
    assert [r.status for r in first] == ["gold_timeout"]
    assert first[0].answer == r"\frac{17}{19}\pi"
    again = grade_completions([r"\boxed{\frac{17}{19}\pi}"], [gold], timeout_s=2.0, num_workers=1)
    assert [r.status for r in again] == ["correct"]


def test_lru_forgets_least_recently_used():
    cache = grading.LRU(2)
    cache["a"] = 1
    cache["b"] = 2
    assert cache.get("a") == 1  # "a" is now the most recent
    cache["c"] = 3
    assert "b" not in cache
    assert (cache.get("a"), cache.get("c"), len(cache)) == (1, 3, 2)
    assert cache.pop("a") == 1 and cache.get("a", "missing") == "missing"
