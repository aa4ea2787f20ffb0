"""Tests for cegppo_trl.rewards: answer extraction, math-verify grading, hostile inputs, threads and processes."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shared import in_threads

from cegppo_trl.rewards import (
    extract_answer,
    format_reward,
    grade_completions,
    grading,
    make_math_reward,
    math_reward,
    prefilter,
    shutdown_grading_workers,
)


# (completion, gold, expected reward of the default math_reward: +1 correct, -1 otherwise, None = gold unusable)
CASES = [
    # equivalent forms verify
    (r"\boxed{72}", "72", 1.0),
    (r"The answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{2\sqrt{2}}", r"$\sqrt{8}$", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1000}", "1,000", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{\frac{3}{4}}", r"\frac34", 1.0),
    (r"\boxed{0.75}", r"\frac34", 1.0),
    (r"\boxed{12}", r"\boxed{12}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{3.0}", "3", 1.0),
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    (r"$\boxed{\sqrt{8}}$", r"2\sqrt{2}", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", 1.0),
    # where the answer is found
    (r"<think>maybe \boxed{5}</think> so the result is \boxed{72}", "72", 1.0),
    (r"First \boxed{5}, then I corrected it: \boxed{72}", "72", 1.0),
    ("The answer is 72.", "72", 1.0),
    ("Answer: 72", "72", 1.0),
    ("... so the final answer is $\\frac{1}{2}$.", "0.5", 1.0),
    ("2 + 3 = 5\n#### 5", "5", 1.0),
    ("23+41 = 64", "64", 1.0),
    ("64", "64", 1.0),
    (r"\boxed 7", "7", 1.0),
    # gold written in other ways
    (r"\boxed{72}", 72, 1.0),
    (r"\boxed{27}", 27.0, 1.0),
    (r"\boxed{\frac12}", 0.5, 1.0),
    (r"\boxed{12}", r"Adding up, the total is $\boxed{12}$.", 1.0),
    (r"\boxed{5}", "2 + 3 = 5\n#### 5", 1.0),
    # wrong answers and traps
    (r"\boxed{73}", "72", -1.0),
    (r"\boxed{-72}", "72", -1.0),
    (r"\boxed{72} was my first guess, but it is \boxed{5}", "72", -1.0),
    (r"<think>the answer is \boxed{72}", "72", -1.0),
    (r"<think>\boxed{72}</think> I am not sure.", "72", -1.0),
    (r"\boxed{72}</think>", "72", -1.0),
    (r"So the answer is \boxed{72", "72", -1.0),
    ("", "72", -1.0),
    (r"\boxed{}", "72", -1.0),
    ("I do not know.", "72", -1.0),
    (r"\boxed{x^2+2x}", "x^2+2x+1", -1.0),
    (r"\boxed{\sqrt{7}}", r"2\sqrt{2}", -1.0),
    (r"\boxed{0.51}", r"\frac{1}{2}", -1.0),
    (r"\boxed{1,001}", "1000", -1.0),
    (r"\boxed{2^{11}}", "1024", -1.0),
    ("The answer is 71.", "72", -1.0),
    (r"\boxed{\frac{2}{3}}", "0.66", -1.0),
    # gold that cannot be used: None, never a score
    (r"\boxed{1}", None, None),
    (r"\boxed{1}", [1, 2], None),
    (r"\boxed{1}", "", None),
    (r"\boxed{1}", r"\frac{", None),
    (r"\boxed{1}", float("nan"), None),
    ("no answer at all", r"\frac{", None),
]


def _conversational(completion: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": completion}]


def test_table_has_enough_cases():
    assert len(CASES) >= 40
    assert {expected for *_, expected in CASES} == {1.0, -1.0, None}


@pytest.mark.parametrize("form", [str, _conversational], ids=["string", "conversational"])
def test_table(form):
    got = math_reward([form(completion) for completion, _, _ in CASES], [gold for _, gold, _ in CASES])
    mismatches = [
        f"{completion!r} vs gold {gold!r}: expected {expected}, got {value}"
        for (completion, gold, expected), value in zip(CASES, got, strict=True)
        if value != expected
    ]
    assert not mismatches, "\n".join(mismatches)


def test_conversational_takes_last_assistant_message():
    completion = [
        {"role": "assistant", "content": r"call the tool: \boxed{1}"},
        {"role": "tool", "content": r"\boxed{99}"},
        {"role": "assistant", "content": [{"type": "text", "text": r"so it is \boxed{72}"}]},
    ]
    assert math_reward([completion], ["72"]) == [1.0]


def test_trl_calling_convention_and_metrics():
    metrics: dict[str, list[float]] = {}
    extra: dict[str, list] = {}
    completions = [_conversational(c) for c in (r"\boxed{72}", r"\boxed{71}", "no idea", r"\boxed{1}")]
    got = math_reward(
        prompts=[[{"role": "user", "content": "q"}]] * 4,
        completions=completions,
        completion_ids=[[1, 2]] * 4,
        trainer_state=None,
        log_extra=lambda column, values: extra.setdefault(column, []).extend(values),
        log_metric=lambda name, value: metrics.setdefault(name, []).append(value),
        solution=["72", "72", "72", None],
        problem=["q"] * 4,
    )
    assert got == [1.0, -1.0, -1.0, None]
    assert metrics["math_reward/unparseable_gold"] == [1.0]
    assert metrics["math_reward/timeouts"] == [0.0]
    assert metrics["math_reward/gold_timeouts"] == [0.0]
    assert metrics["math_reward/accuracy"] == [pytest.approx(1 / 3)]
    assert metrics["math_reward/no_answer_frac"] == [pytest.approx(1 / 3)]
    assert extra["math_reward/status"] == ["correct", "wrong", "no_answer", "bad_gold"]
    assert extra["math_reward/answer"] == ["72", "71", None, "1"]


def test_make_math_reward_values_name_and_pickling():
    reward = make_math_reward(correct=2.0, wrong=-0.5, unparseable=-1.0, timeout_s=2.0, num_workers=1, name="mv")
    from trl.trainer.utils import get_callable_name

    assert get_callable_name(reward) == "mv"
    assert get_callable_name(math_reward) == "math_reward"
    clone = pickle.loads(pickle.dumps(reward))  # TRL's async rollout worker pickles reward functions
    for fn in (reward, clone):
        completions = [r"\boxed{\sqrt{8}}", r"\boxed{3}", "nothing", r"\boxed{1}"]
        assert fn(completions, [r"2\sqrt{2}", "4", "4", None]) == [2.0, -0.5, -1.0, None] and fn.__name__ == "mv"
    default = make_math_reward()
    assert (default.correct, default.wrong, default.unparseable) == (1.0, -1.0, -1.0)
    # One name constructs it (no `MathReward` class beside the factory), and the repr says how to rebuild it.
    import cegppo_trl
    import cegppo_trl.rewards

    assert "MathReward" not in cegppo_trl.rewards.__all__ and not hasattr(cegppo_trl.rewards, "MathReward")
    assert "MathReward" not in cegppo_trl.__all__ and cegppo_trl.make_math_reward is make_math_reward
    assert repr(reward) == (
        "make_math_reward(correct=2.0, wrong=-0.5, unparseable=-1.0, timeout_s=2.0, num_workers=1, name='mv')"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"correct": -1.0, "wrong": 1.0}, "highest"),
        ({"correct": 0.0, "wrong": -1.0, "unparseable": 0.5}, "highest"),
        ({"correct": float("inf")}, "finite"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"num_workers": 0}, "num_workers"),
        ({"name": ""}, "name"),
    ],
)
def test_make_math_reward_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_math_reward(**kwargs)


# A string `solution` would be read one character per completion and silently mis-grade (`\boxed{42}` would score -1
# and `\boxed{4}` +1), and `None` completions used to fail with a bare TypeError: refused, naming the argument and fix.
def test_a_string_solution_is_refused_with_the_argument_named():
    with pytest.raises(TypeError, match=r"^solution must be a list of gold answers.*got the string '42'") as error:
        math_reward(["\\boxed{42}", "\\boxed{4}"], solution="42")
    assert "['42'] * len(completions)" in str(error.value)
    with pytest.raises(TypeError, match="^solution must be a list"):
        make_math_reward(correct=1.0, wrong=0.0)(["\\boxed{1}"], solution=b"1")
    with pytest.raises(TypeError, match="^solutions must be a list"):  # grade_completions names its own argument
        grade_completions(["\\boxed{4}", "\\boxed{2}"], "42")
    with pytest.raises(ValueError, match="one gold answer per completion"):
        math_reward([r"\boxed{1}", r"\boxed{2}"], ["1"])


@pytest.mark.parametrize("completions", [None, "\\boxed{42}", 42])
def test_completions_must_be_a_list(completions):
    with pytest.raises(TypeError, match="^completions must be a list of completions") as error:
        math_reward(completions, solution=["42"])
    assert repr(completions)[:10] in str(error.value) or "the string" in str(error.value)


def test_the_lists_trl_passes_still_grade():
    from datasets import Dataset

    column = Dataset.from_dict({"solution": ["42", "4"]})["solution"]  # a datasets Column, as a user may pass
    assert math_reward(["\\boxed{42}", "\\boxed{4}"], solution=column) == [1.0, 1.0]
    assert math_reward([[{"role": "assistant", "content": "\\boxed{42}"}]], solution=("41",)) == [-1.0]
    with pytest.raises(ValueError, match="needs the gold answers in a `solution` dataset column"):
        math_reward(["\\boxed{42}"])


@pytest.mark.parametrize(
    "completion, expected",
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"a \boxed{1} b \boxed{\{1,2\}} c", r"\{1,2\}"),
        (r"$\boxed{$x$}$", "x"),
        ("<think>\\boxed{1}</think>\\fbox{2}", "2"),
        ("The answer is $0.5$. Let me check.", "0.5"),
        ("**Answer:** 12", "12"),
        ("The answer is **1,000**.", "1,000"),
        ("#### 1,234", "1,234"),
        ("so we get 3.5", "3.5"),
        ("The area is 12 cm", None),
        (r"\boxed{1", None),
        ("<think>unfinished", None),
        (None, None),
        (_conversational(r"\boxed{9}"), "9"),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_format_reward():
    completions = [
        r"<think>x</think> \boxed{3}",
        r"\boxed{3}",
        r"<think>\boxed{3}",
        r"\boxed{3}</think> done",
        r"the answer is 3",
        r"\boxed{}",
        r"\boxed{3",
        _conversational(r"\boxed{x+1}"),
    ]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_fast_path_agrees_with_math_verify():
    """Plain-number pairs are decided in-process; math-verify in a worker must give the same verdict."""
    pairs = [
        ("72", "72"),
        ("72", "73"),
        ("1,000", "1000"),
        ("1,234,567", "1234567"),
        ("3,000", "3"),
        ("0.5", r"\frac{1}{2}"),
        ("3/4", "0.75"),
        (r"-\frac{3}{4}", "-0.75"),
        ("72.0", "72"),
        ("007", "7"),
        ("-5", "5"),
        ("12345678901234567890", "12345678901234567891"),
    ]
    decided = [prefilter.fast_verdict(a, g) for a, g in pairs]
    assert all(d is not None for d in decided)
    pool = grading.pool_for(1)
    verified = [status for status, _ in pool.grade(pairs, timeout_s=10.0)]
    assert decided[:-1] == verified[:-1]
    # math-verify compares floats to 15 digits and calls these equal; exact comparison (ours) is stricter.
    assert decided[-1] == "wrong"


HOSTILE = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"\boxed{10^{10^{10}}}",
    r"\boxed{99999999!}",
    r"\boxed{(10!)!}",
    r"\boxed{\binom{99999999}{49999999}}",
    r"\boxed{x^{99999999}}",
    r"\boxed{\sqrt{2}^{99999999}}",
    "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "\\boxed{" + "(" * 500 + "1" + ")" * 500 + "}",
    "\\boxed{" + "\\sqrt{" * 200 + "2" + "}" * 200 + "}",
    "x" * 1_000_000,
    "The answer is " + "9" * 1_000_000,
    "{" * 100_000 + r"\boxed{" + "{" * 1000,
    r"\boxed{\frac{1}{2}",
    "}}}}{{{{" + r"\boxed{}}}",
    "\x00" * 1000 + "\\boxed{7\x00}",
    "\\boxed{__import__('os').system('touch {marker}')}",
    "The answer is __import__('os').system('touch {marker}')",
    "\\boxed{eval(\"__import__('os').system('touch {marker}')\")}",
    "#### exec(\"open('{marker}', 'w').write('x')\")",
    "\\boxed{" + "+".join(["x"] * 480) + "}",
    "\\boxed{\\left(" * 50,
    "\\boxed{\ud800}",
]


def _hostile_batch(marker: Path, n: int = 64) -> list[str]:
    texts = [h.replace("{marker}", str(marker)) for h in HOSTILE]
    return [texts[i % len(texts)] for i in range(n)]


def test_hostile_batch_is_fast_safe_and_scored(tmp_path):
    marker = tmp_path / "pwned"
    batch = _hostile_batch(marker)
    metrics: dict[str, float] = {}
    start = time.perf_counter()
    got = math_reward(batch, ["7"] * len(batch), log_metric=metrics.__setitem__)
    elapsed = time.perf_counter() - start
    assert elapsed < 30.0, f"64 hostile completions took {elapsed:.1f} s"
    assert len(got) == 64
    expected = [1.0 if text.startswith("\x00") else -1.0 for text in batch]  # "7" survives the NUL bytes
    assert got == expected
    assert not marker.exists(), "a completion was executed as code"


def test_hostile_gold_is_skipped_not_scored():
    golds = [r"9^{9^{9^{9}}}", "\\frac{1}{" * 300 + "2" + "}" * 300, r"99999999!", "__import__('os')"]
    got = math_reward([r"\boxed{1}"] * len(golds), golds)
    assert got[:3] == [None, None, None]
    assert got[3] in (None, -1.0)  # parses as a product of symbols, or not at all: never +1


def test_timeout_is_enforced_and_counted():
    """An answer that passes the pre-filters but is slow in sympy is cut at timeout_s and scores `unparseable`."""
    reward = make_math_reward(unparseable=-2.0, timeout_s=0.5, num_workers=1, name="short_timeout")
    metrics: dict[str, float] = {}
    start = time.perf_counter()
    completions = [r"\boxed{(x+1)^{9000}}", r"\boxed{\sqrt{8}}"]
    got = reward(completions, ["x^2+2x+1", r"2\sqrt{2}"], log_metric=metrics.__setitem__)
    assert time.perf_counter() - start < 10.0
    assert got == [-2.0, 1.0]
    assert metrics["short_timeout/timeouts"] == 1.0


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_worker_timer_stops_a_tower_that_skips_the_prefilter():
    """Sent straight to a real worker, 9^{9^{9}} is cut by the worker's own timer and the worker stays usable."""
    pool = grading.pool_for(1)
    start = time.perf_counter()
    ((status, seconds),) = pool.grade([("9^{9^{9}}", "1")], timeout_s=1.0)
    assert status == "timeout"
    assert seconds <= 1.2
    assert time.perf_counter() - start < 5.0
    assert [s for s, _ in pool.grade([(r"\sqrt{8}", r"2\sqrt{2}")], timeout_s=10.0)] == ["correct"]


_FAKE_WORKER = r"""
import json, os, signal, sys, time
print(json.dumps(["ready", os.getpid()]), flush=True)
for line in sys.stdin:
    task_id, answer, gold, soft = json.loads(line)
    if answer == "hang":  # deaf to every catchable signal, like a C call that never returns
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM, signal.SIGINT})
        time.sleep(600)
    if answer == "crash":
        os._exit(3)
    print(json.dumps([task_id, "correct" if answer == gold else "wrong", 0.0]), flush=True)
"""


def test_pool_kills_hung_workers_and_survives_crashes():
    """The parent's SIGKILL backstop, requeueing and crash handling, with a worker that ignores its timer."""
    pool = grading.GraderPool(1, argv=[sys.executable, "-c", _FAKE_WORKER])
    try:
        pool.grade([("0", "0")], timeout_s=30.0)  # start-up
        (first_pid,) = pool.worker_pids()
        start = time.perf_counter()
        tasks = [("1", "1"), ("hang", "x"), ("2", "2"), ("crash", "x"), ("3", "4"), ("hang", "y"), ("5", "5")]
        results = pool.grade(tasks, timeout_s=1.0)
        elapsed = time.perf_counter() - start
        statuses = [status for status, _ in results]
        assert statuses == ["correct", "timeout", "correct", "error", "wrong", "timeout", "correct"]
        assert 0.9 < results[1][1] < 2.0 and 0.9 < results[5][1] < 2.0
        assert elapsed < 20.0
        assert not _alive(first_pid), "the killed worker was not reaped"
        (last_pid,) = pool.worker_pids()
        assert last_pid != first_pid
    finally:
        pool.close()
    assert not _alive(last_pid)


def test_called_from_worker_threads():
    """TRL may call rewards outside the main thread (async reward loop); the timeout must still hold there."""
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{3}", r"\boxed{9^{9^{9}}}", r"\boxed{(x+1)^2}"]
    outputs = in_threads(lambda: math_reward(completions, ["0.5", "4", "1", "x^2+2x+1"]), n=3, timeout=60)
    assert outputs == [[1.0, -1.0, -1.0, 1.0]] * 3


_RANK_SCRIPT = r"""
import json, os, sys, time
from cegppo_trl.rewards import grading, math_reward
assert not {"torch", "trl", "transformers"} & set(sys.modules)  # the reward alone stays light
rank = int(os.environ["RANK"])
completions = [r"\boxed{\frac{1}{2}}", r"\boxed{2\sqrt{2}}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{%d}" % rank,
               "x" * 100000]
start = time.perf_counter()
values = math_reward(completions, ["0.5", r"\sqrt{8}", "1", str(rank), "1"])
pids = grading.worker_pids()
print(json.dumps({"rank": rank, "values": values, "pids": pids, "workers": grading.default_num_workers(),
                  "seconds": time.perf_counter() - start}))
"""


def test_two_processes_grade_concurrently_and_leave_no_workers(tmp_path):
    """Two ranks (as under torchrun --nproc_per_node 2) each start their own pool and clean it up at exit."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True))
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for rank, report in enumerate(sorted(reports, key=lambda r: r["rank"])):
        assert report["values"] == [1.0, 1.0, -1.0, 1.0, -1.0]
        assert report["workers"] == max(1, min(8, len(os.sched_getaffinity(0)) // 2))
        assert report["pids"], "expected the pool to have workers"
        for pid in report["pids"]:
            assert not _alive(pid), f"rank {rank} left grading worker {pid} running"


def test_shutdown_reaps_workers_and_pool_restarts():
    assert math_reward([r"\boxed{\sqrt{4}}"], ["2"]) == [1.0]
    pids = grading.worker_pids()
    assert pids
    shutdown_grading_workers()
    assert not any(_alive(pid) for pid in pids)
    assert math_reward([r"\boxed{\sqrt{9}}"], ["3"]) == [1.0]


def test_grade_completions_reports_status_and_latency():
    results = grade_completions([r"\boxed{\sqrt{8}}", "none", r"\boxed{2}"], [r"2\sqrt{2}", "1", "3"], timeout_s=5.0)
    assert [r.status for r in results] == ["correct", "no_answer", "wrong"]
    assert [r.answer for r in results] == [r"\sqrt{8}", None, "2"]
    assert all(0 <= r.seconds < 5.0 and math.isfinite(r.seconds) for r in results)


def test_the_pool_owns_what_grading_remembers(monkeypatch):
    """A worker's verdict is kept in its pool's memory: the same pair on a later call needs no worker round trip."""
    answer, gold = r"\sqrt{75}", r"5\sqrt{3}"  # graded by no other test
    pool = grading.pool_for(1)
    assert not pool.memory.gold_is_known(gold)
    first = grade_completions([rf"\boxed{{{answer}}}"], [gold], num_workers=1)
    assert [r.status for r in first] == ["correct"]
    assert pool.memory.gold_is_known(gold) and pool.memory.verdict(answer, gold) == "correct"
    assert not grading.GraderPool(1).memory.gold_is_known(gold), "a new pool starts with an empty memory"
    asked = []
    grade = pool.grade
    monkeypatch.setattr(pool, "grade", lambda tasks, timeout_s: asked.append(tasks) or grade(tasks, timeout_s))
    again = grade_completions([rf"The answer is \boxed{{{answer}}}"], [gold], num_workers=1)
    assert [r.status for r in again] == ["correct"]
    assert asked == []


def test_memory_learns_golds_and_settles_a_slow_gold_at_the_bound():
    memory = grading.GradingMemory()
    memory.learn(("2", "x"), "wrong")
    memory.learn((None, "y"), "gold_ok")
    memory.learn(("1", "z"), "bad_gold")
    memory.learn(("1", "t"), "timeout")  # a timed-out answer says nothing about its gold
    assert (memory.verdict("2", "x"), memory.gold_is_known("y"), memory.gold_is_bad("z")) == ("wrong", True, True)
    assert not memory.gold_is_known("t")
    assert [memory.count_gold_timeout("slow", 3) for _ in range(2)] == [1, 2]
    assert not memory.gold_is_bad("slow")
    assert memory.count_gold_timeout("slow", 3) == 3
    assert memory.gold_is_bad("slow") and "slow" not in memory.gold_timeouts


def test_a_forked_child_leaves_the_parents_workers_alone_and_grades_with_its_own():
    """As in a forked DataLoader worker: the child drops its copies of the parent's pipes and starts its own pool."""
    assert math_reward([r"\boxed{\sqrt{4}}"], ["2"]) == [1.0]
    parent_pids = grading.worker_pids()
    assert parent_pids
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            before = grading.worker_pids()
            values = math_reward([r"\boxed{\sqrt{81}}"], ["9"])
            report = {"before": before, "values": values, "after": grading.worker_pids()}
            shutdown_grading_workers()
            os.write(write_end, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    report = json.loads(data)
    assert report["before"] == [] and report["values"] == [1.0]
    assert report["after"] and set(report["after"]).isdisjoint(parent_pids)
    assert all(_alive(p) for p in parent_pids), "the child killed the parent's workers"
    assert math_reward([r"\boxed{\sqrt{16}}"], ["4"]) == [1.0]
    assert grading.worker_pids() == parent_pids


def test_no_private_names_are_imported_across_the_reward_modules():
    """Each module of the grading engine uses the others through their public names only."""
    import ast

    package = Path(grading.__file__).parent
    imported = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("cegppo_trl")):
                imported += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert imported == []


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("2^{10}", None),
        ("x^{2}+5!", None),
        (r"\binom{10}{3}", None),
        (r"3\!", None),  # a TeX thin space, not a factorial
        ("9^{9^{9}}", "huge exponent"),
        ("2^{(100+1)*100}", "huge exponent"),  # the exponent is evaluated, bounded, before sympy sees it
        ("x^{99999999}", "huge exponent"),
        ("99999999!", "huge factorial"),
        ("(10!)!", "huge factorial"),
        ("1000!", None),
        ("1001!", "huge factorial"),
        (r"\binom{99999999}{3}", "huge binomial"),
        (r"{100000} \choose 2", "huge binomial"),
        ("x" * 1001, "too long"),
        ("(" * 11 + ")" * 11, "nested too deep"),
    ],
)
def test_prefilter_reject_reason(text, reason):
    assert prefilter.reject_reason(text) == reason
