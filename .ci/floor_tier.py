"""The floor tier (TRL's `tests_min_versions`): the fast tier again, in a fresh virtual environment where every
dependency that pyproject.toml declares for the dev install (the base ones and the dev extra's, which brings the plot,
peft and deepspeed extras) is installed at its declared floor, torch at the CPU pin. A floor that fails here is raised
in pyproject.toml, never left to users.

The pins are derived from pyproject.toml by `floor_pins` below (no second list kept by hand); tests/test_floors.py fails
if they drift from pyproject's specifiers, and the tier checks what pip installed against them before any test runs.

    python3 .ci/floor_tier.py            # the whole tier: venv, install at the floors, check, the fast tier
    python3 .ci/floor_tier.py --print    # the pins, one `name==version` a line (a pip constraints file)
    python .ci/floor_tier.py --check     # does this interpreter have exactly the floors installed?

Standard library only: it runs with the system python3 before any virtual environment exists.
"""

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# Under build/: ignored by git, ruff and the wheel tests' copy of the source, like setuptools' own build output.
VENV = ROOT / "build" / "floors-venv"
TORCH = "torch==2.13.0"  # the CPU pin of the README's commands
EXTRA = "dev"  # what the README's test command installs
FAST_TIER = [
    "-m",
    "pytest",
    "tests",
    "-q",
    "-m",
    "not slow and not real_model and not vllm",
]  # the README's fast tier (tests/test_floors.py checks)
# `name[extras] specifiers ; marker`, as pyproject.toml writes its requirements.
_REQUIREMENT_RE = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?(?P<specs>[^;]*)$"
)


def canonical(name: str) -> str:
    """PEP 503's normalised distribution name (`math_verify` and `Math-Verify` are `math-verify`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def floor_pins(pyproject: Path = ROOT / "pyproject.toml", extra: str = EXTRA) -> dict[str, str]:
    """{distribution: floor} for the base dependencies and those of `extra`, following `cegppo-trl[...]` into the
    extras it names. The floor is a requirement's `>=` (or `==`) version; a requirement without one is an error."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    pending, followed, pins = [*project["dependencies"], *extras[extra]], {extra}, {}
    while pending:
        spec = pending.pop(0)
        match = _REQUIREMENT_RE.match(spec)
        if match is None:
            sys.exit(f"pyproject.toml: cannot read the requirement {spec!r} (markers are not supported here)")
        name = canonical(match["name"])
        if name == canonical(project["name"]):  # `cegppo-trl[plot,peft]`: the extras it names
            for named in (e.strip() for e in match["extras"].split(",")):
                if named not in followed:
                    followed.add(named)
                    pending += extras[named]
            continue
        floors = re.findall(r"(?:>=|==)\s*([^,\s]+)", match["specs"])
        if len(floors) != 1:
            sys.exit(f"pyproject.toml: {spec!r} needs exactly one floor (`>=X` or `==X`); the floor tier installs it")
        if pins.setdefault(name, floors[0]) != floors[0]:
            sys.exit(f"pyproject.toml: {name} is declared with two floors, {pins[name]} and {floors[0]}")
    return pins


def check_installed(pins: dict[str, str]) -> list[str]:
    """The pins this interpreter does not have installed at exactly their floor (torch: at the CPU pin)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version  # in every floor environment: transformers needs it

    wrong = []
    for name, floor in {**pins, "torch": TORCH.split("==")[1]}.items():
        try:
            found = version(name)
        except PackageNotFoundError:
            found = "not installed"
        if found == "not installed" or Version(Version(found).public) != Version(floor):
            wrong.append(f"{name}=={floor} (installed: {found})")
    return wrong


def run_tier(venv: Path) -> int:
    """A fresh `venv`, the dev install at the floors, the check, then the fast tier; pytest's exit status."""
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="floors-") as constraints:
        constraints.write("".join(f"{name}=={floor}\n" for name, floor in floor_pins().items()))
        constraints.flush()
        install = [python, "-m", "pip", "install", "-q", TORCH, "-c", constraints.name, "-e", f".[{EXTRA}]"]
        subprocess.run(install, cwd=ROOT, check=True)
    subprocess.run([python, __file__, "--check"], cwd=ROOT, check=True)
    print(f"floor tier: {shlex.join([python, *FAST_TIER])}", flush=True)
    return subprocess.run([python, *FAST_TIER], cwd=ROOT).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python3 .ci/floor_tier.py")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the floor pins derived from pyproject.toml")
    mode.add_argument("--check", action="store_true", help="exit 1 unless this interpreter has exactly the floors")
    parser.add_argument(
        "--venv", type=Path, default=VENV, help="where to build the environment (default: build/floors-venv)"
    )
    args = parser.parse_args()
    if args.print:
        print("".join(f"{name}=={floor}\n" for name, floor in floor_pins().items()), end="")
        return 0
    if args.check:
        wrong = check_installed(floor_pins())
        print("floor check: " + ("; ".join(wrong) if wrong else f"all {len(floor_pins()) + 1} at their floor"))
        return 1 if wrong else 0
    return run_tier(args.venv.resolve())


if __name__ == "__main__":
    sys.exit(main())
