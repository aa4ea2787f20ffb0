"""A non-finite value on ONE process stops every process at the same step, before applying it (issue 35), on 2 gloo
processes (DDP) and under DeepSpeed ZeRO-2 (tests/divergence_worker.py: full and LoRA, entropy controller, dynamic
sampling), and `cegppo-train` on the tiny recipe with the issue's command stops with exit status 3 and keeps its
finite checkpoints. All slow: each launch trains a few short runs.
"""

import json
import sys
from pathlib import Path

import pytest
from divergence_worker import SCENARIOS, check
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
    for name in SCENARIOS:
        check([json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)], tmp_path, name)


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
