"""The grading protocols (cegppo_trl.rewards.protocols) against the anchors themselves.

tests/data/protocol_cases.jsonl holds real-looking completions with the verdicts of the anchors, computed by
`.ci/lighteval_anchors.py` in side venvs: the CE-GPPO authors' procedure run by math-verify 0.7.0 / 0.8.0 / 0.9.0,
and lighteval 0.13.0's own `pass_at_k_math` / `avg_at_n_math` metric objects. The verdicts that depend on
math-verify are keyed by its minor version, so the floor tier (0.8) and the default venv (0.9) each check theirs.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from shared import in_threads

from cegppo_trl.data import DEFAULT_INSTRUCTION, build_prompt, resolve_instruction
from cegppo_trl.rewards import grade_completions, grade_with_protocol, make_math_reward
from cegppo_trl.rewards.protocols import (
    LIGHTEVAL_MATH_TEMPLATE,
    PROTOCOLS,
    authors,
    lighteval,
    lighteval_avg,
    remove_reasoning_tags,
    resolve_protocol,
)


DATA = Path(__file__).parent / "data"
CASES = [json.loads(line) for line in (DATA / "protocol_cases.jsonl").read_text().splitlines() if line.strip()]
META = json.loads((DATA / "protocol_anchors.json").read_text())
MATH_VERIFY = ".".join(importlib.metadata.version("math-verify").split(".")[:2])

# Where math-verify (which the protocols use) and lighteval 0.13's own copy of the extraction code (latex2sympy2_extended
# 1.0.6) disagree: math-verify 0.9 reads "25%" as 25/100 and adds a rule that makes "X%" equal "X"; lighteval does not.
LIGHTEVAL_DIFFERENCES = {"0.8": set(), "0.9": {"pct_box_vs_plain_gold", "pct_9_vs_9"}}

# Today's `boxed` grading against each anchor (case ids), the counts docs/rewards_and_data.md reports.
BOXED_VS_AUTHORS = 9
BOXED_VS_LIGHTEVAL = {"0.8": 16, "0.9": 17}


def _anchored_version() -> str:
    if MATH_VERIFY not in CASES[0]["authors"]:
        pytest.fail(
            f"math-verify {MATH_VERIFY} has no anchor verdicts in tests/data/protocol_cases.jsonl; add its version to "
            "MATH_VERIFY_VERSIONS in .ci/lighteval_anchors.py and run it."
        )
    return MATH_VERIFY


def test_the_case_file_covers_what_issue_28_lists():
    ids = {c["id"] for c in CASES}
    assert len(ids) == len(CASES) == META["cases"] >= 60
    for needed in ("think_intermediate_wrong_box", "two_boxes_set", "pct_9_vs_9", "units_cm", "dfrac_vs_frac",
                   "interval_closed_open", "text_answer", "truncated_mid_think", "think_only_closed", "empty",
                   "bad_gold_unclosed"):  # fmt: skip
        assert needed in ids


@pytest.mark.parametrize(
    "grade, anchor",
    [
        (authors, lambda c, version: c["authors"][version] == 1),  # on every case
        (lighteval, lambda c, version: c["lighteval"]["pass_at_k"] == 1),  # except the listed cases
        (lighteval_avg, lambda c, version: c["lighteval"]["avg_at_n"] == 1),
    ],
    ids=["authors", "lighteval_pass_at_k", "lighteval_avg_at_n"],
)
def test_each_protocol_agrees_with_its_anchor(grade, anchor):
    version = _anchored_version()
    listed = set() if grade is authors else LIGHTEVAL_DIFFERENCES[version]
    assert {c["id"] for c in CASES if (grade(c["completion"], c["gold"]) == "correct") != anchor(c, version)} == listed


def test_lighteval_avg_at_n_keeps_the_think_block_and_pass_at_k_removes_it():
    """lighteval 0.13's AvgAtN reads ModelResponse[i], which drops the post-processed text (anchored, not assumed)."""
    split = {c["id"] for c in CASES if c["lighteval"]["pass_at_k"] != c["lighteval"]["avg_at_n"]}
    assert split == {"think_only_closed", "think_only_closed_box", "truncated_unclosed_final_box"}
    for case in CASES:
        if case["id"] in split:
            assert lighteval(case["completion"], case["gold"]) == "no_answer"
            assert lighteval_avg(case["completion"], case["gold"]) == "correct"


def test_boxed_grades_as_recorded_and_its_differences_are_counted():
    version = _anchored_version()
    statuses = [g.status for g in grade_completions([c["completion"] for c in CASES], [c["gold"] for c in CASES])]
    assert statuses == [c["boxed"][version] for c in CASES]
    vs_authors = sum((s == "correct") != (c["authors"][version] == 1) for s, c in zip(statuses, CASES))
    vs_lighteval = sum((s == "correct") != (c["lighteval"]["pass_at_k"] == 1) for s, c in zip(statuses, CASES))
    assert (vs_authors, vs_lighteval) == (BOXED_VS_AUTHORS, BOXED_VS_LIGHTEVAL[version])


def test_percentages_follow_the_installed_math_verify():
    """math-verify 0.9 makes "9%" equal "9"; 0.8 (the floor) and the authors' 0.7.0 do not."""
    case = next(c for c in CASES if c["id"] == "pct_9_vs_9")
    assert case["authors"] == {"0.7": -1, "0.8": -1, "0.9": 1}
    assert authors(case["completion"], case["gold"]) == ("correct" if MATH_VERIFY == "0.9" else "wrong")


def test_the_pool_gives_the_in_process_verdicts_of_every_protocol():
    completions, golds = [c["completion"] for c in CASES], [c["gold"] for c in CASES]
    for name, grade in (("authors", authors), ("lighteval", lighteval), ("lighteval_avg", lighteval_avg)):
        pooled = [g.status for g in grade_with_protocol(completions, golds, name)]
        assert pooled == [grade(c, g) for c, g in zip(completions, golds)], name


def test_protocols_run_from_a_thread_because_the_workers_hold_math_verify_timeouts():
    """math-verify's signal.alarm raises outside the main thread; the grading workers run it in theirs."""
    ((result,),) = in_threads(lambda: grade_with_protocol(["so \\boxed{4}"], ["4"], "authors"))
    assert result.status == "correct"


@pytest.mark.parametrize("grade", [authors, lighteval, lighteval_avg])
def test_in_process_grading_from_a_thread_is_refused_not_a_silent_wrong(grade):
    (error,) = in_threads(lambda: grade("so \\boxed{4}", "4"), timeout=60)
    assert isinstance(error, RuntimeError) and "grade_with_protocol" in str(error)


def test_the_pool_hard_timeout_bounds_a_protocol():
    slow = "The answer is $\\boxed{9^{9^{9^{9^{9}}}}}$, i.e. $9^{9^{9^{9^{9}}}}+1-1$"
    (result,) = grade_with_protocol([slow], ["1"], "authors", timeout_s=1.0, num_workers=1)
    assert result.status == "timeout" and result.seconds < 5
    assert [g.status for g in grade_with_protocol(["\\boxed{1}"], ["1"], "authors", num_workers=1)] == ["correct"]


@pytest.mark.parametrize("name", ["authors", "lighteval", "lighteval_avg", "boxed"])
def test_bad_input_is_a_counted_status_never_a_crash(name):
    completions = ["", None, "\\boxed{1}", "\\boxed{1}", [{"role": "assistant", "content": "\\boxed{2}"}]]
    golds = ["1", "1", None, "???", "2"]  # "???": math-verify matches it only as a string
    statuses = [g.status for g in grade_with_protocol(completions, golds, name, num_workers=1)]
    assert statuses == ["no_answer", "no_answer", "bad_gold", "bad_gold", "correct"]


def test_a_think_block_without_an_answer():
    text = "<think>\nWe get 7 after checking twice.\n</think>"
    assert (authors(text, "7"), lighteval(text, "7"), lighteval_avg(text, "7")) == ("correct", "no_answer", "correct")
    assert grade_completions([text], ["7"])[0].status == "no_answer"


def test_remove_reasoning_tags_is_lighteval_s():
    assert remove_reasoning_tags("<think>a</think> b <think>c</think>d") == " b d"
    assert remove_reasoning_tags("a</think> b") == "a</think> b"  # start tag in the prompt: nothing removed
    assert remove_reasoning_tags("<think> a") == "<think> a"


def test_unknown_protocol_and_batch_shape_are_refused_with_one_line():
    with pytest.raises(ValueError, match=r"unknown grading protocol 'author'; choose one of authors, lighteval"):
        resolve_protocol("author")
    with pytest.raises(ValueError, match="unknown grading protocol"):
        make_math_reward(protocol="Authors")
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        grade_with_protocol(["a", "b"], ["1"], "authors")
    with pytest.raises(TypeError, match="golds must be a list"):
        grade_with_protocol(["a"], "1", "authors")


def test_instruction_rules():
    assert resolve_instruction(PROTOCOLS["authors"].instruction) is None
    assert resolve_instruction(PROTOCOLS["boxed"].instruction) == DEFAULT_INSTRUCTION
    assert LIGHTEVAL_MATH_TEMPLATE == META["lighteval_math_template"]  # recorded from lighteval 0.13 itself
    for name in ("lighteval", "lighteval_avg"):
        (message,) = build_prompt("What is 1+1?", instruction=resolve_instruction(PROTOCOLS[name].instruction))
        assert message["content"] == META["lighteval_math_template"].replace("{problem}", "What is 1+1?")
    assert build_prompt("What is 1+1?", instruction=None) == [{"role": "user", "content": "What is 1+1?"}]


def test_the_authors_training_reward():
    reward = make_math_reward(protocol="authors", name="math_authors")
    logged = {}
    got = reward(["<think>so 7</think>", "\\boxed{8}", ""], solution=["7", "7", "7"], log_metric=logged.__setitem__)
    assert got == [1.0, -1.0, -1.0]  # the authors grade the think block too
    assert logged["math_authors/accuracy"] == pytest.approx(1 / 3)
    assert logged["math_authors/no_answer_frac"] == pytest.approx(1 / 3)
    assert "protocol='authors'" in repr(reward)
    assert make_math_reward()(["<think>so 7</think>"], solution=["7"]) == [-1.0]  # the default grades after it


def test_cegppo_train_names_the_authors_reward():
    from types import SimpleNamespace

    from cegppo_trl.scripts.train import build_reward_funcs

    args = SimpleNamespace(reward_funcs=["math", "math_authors"], correct_reward=1.0, wrong_reward=-1.0,
                           unparseable_reward=None, reward_timeout_s=3.0)  # fmt: skip
    default, authors_reward = build_reward_funcs(args)
    assert (default.__name__, default.protocol) == ("math_reward", "boxed")
    assert (authors_reward.__name__, authors_reward.protocol) == ("math_authors", "authors")
    assert authors_reward.timeout_s == 3.0
    assert authors_reward(["<think>so 7</think>"], solution=["7"]) == [1.0]
