"""A non-finite value on ONE process stops every process at the same step, before applying it (issue 35), on 2 gloo
processes (DDP) and under DeepSpeed ZeRO-2 (tests/divergence_worker.py: full and LoRA, entropy controller, dynamic
sampling), and `cegppo-train` on the tiny recipe with the issue's command stops with exit status 3 and keeps its
finite checkpoints. All slow: each launch trains a few short runs.
"""

import json
import math
import sys
from pathlib import Path

import pytest
from launching import launcher, run_launched, subprocess_env
from shared import ROOT, TINY_RECIPE, run_checked

from cegppo_trl.divergence import DIVERGED_EXIT_STATUS, non_finite_tensors


TIMEOUT_S = 1800


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_a_nan_on_one_process_stops_both_at_the_same_step(backend, tiny_checkpoint, tmp_path):
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed", reason="the `deepspeed` extra is not installed")
    worker = [ROOT / "tests" / "divergence_worker.py", tiny_checkpoint, tmp_path]
    run_launched([*launcher(2, None if backend == "ddp" else f"{backend}.yaml"), *worker], timeout=TIMEOUT_S)
    for name in ("stop", "stop-lora", "skip"):
        ranks = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
        expected_step, last_finite = (3, 2) if name.startswith("stop") else (4, 3)
        for record in ranks:
            assert record["error_step"] == expected_step, (name, record)
            assert f"before applying optimizer step {expected_step}" in record["error"]
            assert "process 1: loss nan" in record["error"] and f"last finite step {last_finite}" in record["error"]
            assert record["global_step"] == last_finite and record["finite"]
        assert ranks[0]["weight_sum"] == ranks[1]["weight_sum"]  # one model on both processes
        checkpoints = ranks[0]["checkpoints"]
        assert checkpoints == [f"checkpoint-{n}" for n in range(1, last_finite + 1)], (name, checkpoints)
        for checkpoint in checkpoints:
            counts = non_finite_tensors(str(tmp_path / name / checkpoint))
            assert counts is not None and counts[0] == 0, (name, checkpoint, counts)
        if name == "skip":
            assert all(r["skipped"] == {"cegppo/skipped_steps/non_finite": 1, "cegppo/skipped_steps/unscored": 0}
                       for r in ranks)  # fmt: skip
            controller = ranks[0]["controller"]
            assert controller["num_updates"] == 2  # steps 1 and 3; not the skipped step 2
            assert all(math.isfinite(v) for v in controller.values())
            state = json.loads((tmp_path / name / "checkpoint-3" / "cegppo_controller_state.json").read_text())
            assert state == controller


@pytest.mark.slow
def test_the_issue_command_on_the_tiny_recipe_stops_with_status_3(tmp_path):
    """The issue's reproduction: `--learning_rate 10 --max_grad_norm 0 --save_steps 1 --save_total_limit 2`."""
    out = tmp_path / "run"
    cmd = [Path(sys.executable).parent / "cegppo-train", "--config", TINY_RECIPE,
           "--learning_rate", "10", "--max_grad_norm", "0", "--save_strategy", "steps", "--save_steps", "1",
           "--save_total_limit", "2", "--max_steps", "8", "--output_dir", out]  # fmt: skip
    proc = run_checked(cmd, ROOT, subprocess_env(), TIMEOUT_S, expect=DIVERGED_EXIT_STATUS)
    assert "Traceback" not in proc.stderr and "multinomial" not in proc.stderr, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()[-3:]
    step = int(lines[0].split("before applying optimizer step ")[1].split(":")[0])
    assert lines[0].startswith("cegppo-train: stopped before applying optimizer step") and "non-finite" in lines[0]
    kept = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert kept == [n for n in (step - 2, step - 1) if n >= 1], (kept, step)
    assert lines[1].startswith(f"Newest finite checkpoint: {out / f'checkpoint-{step - 1}'}.") or step == 1
    for n in kept:
        assert non_finite_tensors(str(out / f"checkpoint-{n}"))[0] == 0
