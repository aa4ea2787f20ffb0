"""The real-model learning command (experiments/real_model_learning.py, `cegppo-compare` with the SmolLM2 recipe)
shortened, with the study's options on (`--study`: 8 optimizer steps per generation batch shrunk to 2, dynamic
sampling, LoRA, both gradings): one seed, both arms, 2 optimizer steps, 4 held-out problems x 2 samples. It checks
that the command runs end to end on SmolLM2-135M-Instruct and writes its table (markdown and json) and its figure with
finite numbers. Whether the model learns is a measurement (docs/comparison.md), not a threshold here."""

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
    argv = [sys.executable, ROOT / "experiments" / "real_model_learning.py", "--study", "--out", out,
            "--model_name_or_path", smollm2_dir, "--seeds", "0", "--max_steps", "2", "--eval_problems", "4", "--eval_k",
            "2", "--per_device_train_batch_size", "8", "--num_generations", "4", "--steps_per_generation", "2"]  # fmt: skip
    proc = run_command(argv, real_model_env())

    result = json.loads((out / "results.json").read_text())
    assert result["settings"]["training"]["use_peft"] and result["settings"]["shaping"]["eval_problems"] == 4
    assert [r["name"] for r in result["runs"]] == ["grpo-seed0", "cegppo-seed0"]
    for name, row in result["summary"]["per_run"].items():
        assert set(row) >= {"boxed", "lighteval"}, name
    # the held-out figures (training metrics are NaN for a run none of whose 2 steps kept a group: not measured)
    numbers = _numbers([{p: row[p] for p in ("boxed", "lighteval")} for row in result["summary"]["per_run"].values()])
    assert numbers and all(math.isfinite(v) for v in numbers)
    table = (out / "results.md").read_text()
    for row in ("| start |", "| GRPO seed 0 |", "| CE-GPPO (0.5, 1) seed 0 |"):
        assert row in table
    assert "Time per training command" in proc.stdout
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "runs" / "cegppo-seed0" / "adapter_config.json").is_file()  # LoRA, as the recipe says
