"""The learning command's own code without the real model: the TRL names its timer wraps exist and are called where it
assumes, and the paired differences and table are computed right."""

import math
import sys

import pytest
from shared import ROOT, load_script, run_checked


@pytest.fixture(scope="module")
def learning():
    return load_script(ROOT / "experiments" / "real_model_learning.py")


def test_timed_trl_methods_exist_and_nest_as_the_timer_assumes(learning):
    """Private TRL 1.16 names the timer wraps: the old-log-prob pass is the call of
    `_get_per_token_logps_and_entropies` made inside `_generate_and_score_completions`, generation `_generate`, the
    reward `_calculate_rewards`."""
    import inspect

    from trl import GRPOTrainer

    from cegppo_trl import CEGPPOTrainer

    for name in learning.TIMED_METHODS:
        assert callable(getattr(CEGPPOTrainer, name)), name
    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for called in ("self._generate(", "self._calculate_rewards(", "self._get_per_token_logps_and_entropies("):
        assert called in scoring, called


def test_paired_difference_and_standard_error(learning):
    mean, se = learning.paired([2, 4, 0, 4], [0, 2, 0, 4], k=4)  # per-problem differences 0.5, 0.5, 0, 0
    assert mean == pytest.approx(0.25)
    assert se == pytest.approx(math.sqrt(1 / 12) / 2)  # stdev([.5, .5, 0, 0]) / sqrt(4)


def test_summary_and_table(learning):
    start = {"num_correct": [0, 1, 0, 2], "k": 2, "num_problems": 4, "accuracy": 3 / 8, "accuracy_se": 0.2,
             "boxed_rate": 0.0, "answered_rate": 0.5, "accuracy_among_answered": 0.75, "entropy": 1.0}  # fmt: skip

    def run(arm, seed, correct):
        end = {**start, "num_correct": correct, "accuracy": sum(correct) / 8}
        return {"name": f"{arm}-seed{seed}", "arm": arm, "seed": seed, "end": end}

    runs = [run("cegppo", 0, [2, 2, 1, 2]), run("grpo", 0, [1, 1, 0, 2]), run("cegppo", 1, [1, 2, 1, 2]),
            run("grpo", 1, [0, 1, 0, 2])]  # fmt: skip
    summary = learning.summarize(start, runs)
    assert summary["per_run"]["cegppo-seed0"]["diff_vs_start"] == pytest.approx(4 / 8)
    assert summary["arms"]["grpo"]["diff_mean"] == pytest.approx((1 / 8 + 0) / 2)
    assert summary["arms"]["grpo"]["diff_spread"] == pytest.approx(math.sqrt(2) / 16)
    assert [v["accuracy_diff"] for v in summary["cegppo_minus_grpo"]] == pytest.approx([3 / 8, 3 / 8])
    table = learning.markdown_table(start, runs, summary)
    assert "| cegppo seed 0 | 87.5 +- 20.0 | +50.0 +-" in table  # 7 of 8 right
    assert "| grpo | +6.2 | 8.8 |" in table


def test_prompts_hold_the_worked_example_and_the_held_out_set_never_trains(learning):
    """Every prompt, training and held-out, is the worked example then the problem; the example is in neither set and
    no held-out problem is a training problem."""
    train, held_out = learning.load_rows("builtin:arithmetic"), learning.load_eval_rows(300)
    problems = {split: {row["prompt"][-1]["content"] for row in rows} for split, rows in (("train", train),
                                                                                              ("eval", held_out))}  # fmt: skip
    assert not problems["train"] & problems["eval"]
    assert learning.EXAMPLE[0]["content"] not in problems["train"] | problems["eval"]
    for rows in (train, held_out):
        assert all(row["prompt"][:-1] == learning.EXAMPLE for row in rows)
    with pytest.raises(SystemExit, match="--eval_problems 301"):
        learning.load_eval_rows(301)


def test_generation_speed_command_prints_its_table(tiny_checkpoint):
    """experiments/generation_speed.py as a user runs it, HF backend only (vLLM's side runs where vLLM is installed:
    docs/real_model.md quotes that run), on the tests' tiny checkpoint instead of SmolLM2."""
    argv = [sys.executable, ROOT / "experiments" / "generation_speed.py", "--model", tiny_checkpoint, "--backends",
            "hf", "--eval_problems", "3"]  # fmt: skip
    proc = run_checked(argv, ROOT, timeout=300)
    assert "| hf | training batch (8 prompts x 8) |" in proc.stdout
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| hf |")]
    assert [int(row[5]) for row in rows] == [64, 12]  # samples: 8 x 8, then 3 problems x 4
    assert all(float(row[4]) > 0 for row in rows)
