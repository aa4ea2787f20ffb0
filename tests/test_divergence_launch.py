"""A non-finite value on ONE process stops every process at the same step, before applying it, on 2 gloo processes
(DDP) and under DeepSpeed ZeRO-2 and ZeRO-3 in fp32 (tests/divergence_worker.py: full and LoRA, entropy controller,
dynamic sampling): the engine passes over the non-finite step it applied inside the last backward, so the weights and
every checkpoint stay finite, and the guard counts that step once. Under ZeRO-2 the engine's own skipped steps (its
overflow check, `divergence_worker.overflow_at_next_step` standing in for a bf16 overflow) are counted, logged and
budgeted. Slow: each launch trains a few short runs.
"""

import json

import pytest
from divergence_worker import ENGINE_SCENARIOS, SCENARIOS, check
from launching import launcher, run_launched
from shared import ROOT


TIMEOUT_S = 1800


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "zero2", "zero3"])
def test_a_nan_on_one_process_stops_both_at_the_same_step(backend, tiny_checkpoint, tmp_path):
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed", reason="the `deepspeed` extra is not installed")
    worker = [ROOT / "tests" / "divergence_worker.py", tiny_checkpoint, tmp_path]
    engine = backend == "zero2"  # the engine's own skipped steps: its overflow check's stand-in (ZeRO-1/2 optimizer)
    worker += ["--deepspeed"] if engine else []
    run_launched([*launcher(2, None if backend == "ddp" else f"{backend}.yaml"), *worker], timeout=TIMEOUT_S)
    for name in {**SCENARIOS, **(ENGINE_SCENARIOS if engine else {})}:
        check([json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)], tmp_path, name)
