"""The real-model tier's fixtures: SmolLM2-135M-Instruct built from the package index (`build_smollm2.py`, cached in
build/real-model), and the `cegppo-train` runs that several tests read (`real_runs.train`), each made once per session."""

from pathlib import Path

import pytest
from build_smollm2 import BuildError, build
from real_runs import TrainRun, train


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built model directory (built here if missing or not matching its recorded hashes)."""
    try:
        return build()
    except BuildError as error:
        pytest.fail(f"build_smollm2: {error}", pytrace=False)


@pytest.fixture(scope="session")
def full_run(smollm2_dir, tmp_path_factory) -> TrainRun:
    """Full-parameter training on one process (the console command)."""
    return train(smollm2_dir, tmp_path_factory.mktemp("real-model") / "full-1", processes=1, lora=False)


@pytest.fixture(scope="session")
def lora_run(smollm2_dir, tmp_path_factory) -> TrainRun:
    """LoRA training on two gloo processes."""
    return train(smollm2_dir, tmp_path_factory.mktemp("real-model") / "lora-2", processes=2, lora=True)
