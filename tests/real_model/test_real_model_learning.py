"""The real-model learning command (experiments/real_model_learning.py) shortened: one seed, both arms, 2 optimizer
steps, 4 held-out problems x 2 samples. It checks that the command runs end to end on SmolLM2-135M-Instruct and writes
its table (markdown and json) and its figure with finite numbers. Whether the model learns is a measurement
(docs/real_model.md), not a threshold here."""

import json
import math
import sys

import pytest
from real_runs import ROOT, real_model_env, run_command


pytestmark = pytest.mark.real_model


def _numbers(value) -> list[float]:
    if isinstance(value, dict | list):
        return [n for item in (value.values() if isinstance(value, dict) else value) for n in _numbers(item)]
    return [float(value)] if isinstance(value, int | float) and not isinstance(value, bool) else []


def test_learning_command_writes_its_table_and_figure(smollm2_dir, tmp_path):
    out = tmp_path / "learning"
    argv = [sys.executable, ROOT / "experiments" / "real_model_learning.py", "--out", out, "--model", smollm2_dir,
            "--seeds", "0", "--max_steps", "2", "--eval_problems", "4", "--eval_k", "2", "--eval_every", "1",
            "--prompts_per_generation", "2", "--num_generations", "4", "--steps_per_generation", "2"]  # fmt: skip
    proc = run_command(argv, real_model_env())

    result = json.loads((out / "results.json").read_text())
    assert result["start"]["num_problems"] == 4 and result["start"]["k"] == 2
    assert [r["name"] for r in result["runs"]] == ["cegppo-seed0", "grpo-seed0"]
    for run in result["runs"]:
        assert [point["step"] for point in run["curve"]] == [1, 2]  # --eval_every 1, then the end
        assert set(run["time"]) == {"generation", "reward", "old_logprob_pass", "optimizer_step", "other_scoring"}
        assert run["time"]["generation"] > 0 and run["time"]["old_logprob_pass"] > 0  # off-policy: the old pass ran
    summary = result["summary"]
    assert set(summary["arms"]) == {"cegppo", "grpo"} and len(summary["cegppo_minus_grpo"]) == 1
    # every figure finite, except a ratio whose standard error is 0 (4 problems can all be wrong)
    numbers = list(_numbers({k: v for k, v in result.items() if k != "summary"}))
    numbers += _numbers([{key: v for key, v in run.items() if key != "z"} for run in summary["per_run"].values()])
    numbers += _numbers([summary["arms"], summary["cegppo_minus_grpo"]])
    assert numbers and all(math.isfinite(v) for v in numbers)

    table = (out / "results.md").read_text()
    for row in ("| start (built model) |", "| cegppo seed 0 |", "| grpo seed 0 |", "| cegppo |", "| grpo |"):
        assert row in table
    assert "time (process seconds" in table and "time (process seconds" in proc.stdout
    figure = (out / "learning_curves.png").read_bytes()
    assert figure.startswith(b"\x89PNG") and len(figure) > 10_000
