"""Every version floor pyproject.toml declares is true: the floor tier, `python3 .ci/floor_tier.py` (TRL's
`tests_min_versions`), installs every dependency of the dev install at its declared floor and runs the fast tier there,
so CI runs each fast test twice: at today's versions and at the floors."""

import shlex
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version

import pytest
from doc_blocks import code_blocks, readme_test_lines
from launching import MAX_STEPS, assert_trained_full_model, check_logs
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from shared import ROOT, TINY_RECIPE, load_script, run_checked


FLOOR_TIER = ROOT / ".ci" / "floor_tier.py"
README_FLOOR_COMMAND = "python3 .ci/floor_tier.py"


def _floor_tier(*args: str, expect: int = 0):
    return run_checked([sys.executable, FLOOR_TIER, *args], ROOT, timeout=120, expect=expect)


def _floor_pins() -> dict[str, str]:
    """What `--print` gives: the constraints the tier installs."""
    return dict(line.split("==") for line in _floor_tier("--print").stdout.splitlines())


def _declared_requirements() -> tuple[list[Requirement], set[str]]:
    """The base requirements and those of the dev extra, with the extras `cegppo-trl[...]` names followed; and the
    extras followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pending, followed, found = [*project["dependencies"], *extras["dev"]], {"dev"}, []
    while pending:
        requirement = Requirement(pending.pop())
        if requirement.name != project["name"]:
            found.append(requirement)
        for extra in requirement.extras - followed if requirement.name == project["name"] else ():
            followed.add(extra)
            pending += extras[extra]
    return found, followed


def test_floor_pins_are_the_declared_floors():
    """Each pin is the requirement's `>=` / `==` version, inside the requirement's own range, for every base and dev
    requirement; left out: the GPU-only vllm extra, and the extras that bundle others for one kind of command (real
    adds gguf, which the real-model tier installs itself; gpu adds vllm)."""
    pins = _floor_pins()
    requirements, followed = _declared_requirements()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) - followed == {"vllm", "real", "gpu"}, followed
    assert set(pins) == {canonicalize_name(r.name) for r in requirements}
    for requirement in requirements:
        floors = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
        assert len(floors) == 1, f"{requirement} declares no floor"
        pin = pins[canonicalize_name(requirement.name)]
        assert pin == floors[0] and Version(pin) in requirement.specifier, (requirement, pin)
    # The floors found true (and the ones this tier raised), as the derivation reads them.
    assert Version(pins["transformers"]) >= Version("5.23") and Version(pins["peft"]) >= Version("0.18")
    assert Version(pins["accelerate"]) >= Version("1.10.1") and Version(pins["datasets"]) >= Version("4.7")
    assert Version(pins["tokenizers"]) >= Version("0.23.1") and Version(pins["deepspeed"]) >= Version("0.18.6")


def test_python_floor_is_what_trl_and_transformers_need():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == ">=3.11"
    assert pyproject["tool"]["ruff"]["target-version"] == "py311"


def test_floor_check_names_every_version_off_its_floor():
    """`--check` (the tier's step between the install and the tests) on this interpreter: it fails exactly when a
    package is not at its floor, naming each one. In the main environment it names transformers and the others that
    are newer; in the floor tier's it passes."""
    pins = {**_floor_pins(), "torch": "2.13.0"}  # the CPU pin
    off = []
    for name, floor in pins.items():
        try:
            found = Version(Version(version(name)).public)
        except PackageNotFoundError:
            found = None
        if found != Version(floor):
            off.append(name)
    proc = _floor_tier("--check", expect=1 if off else 0)
    named = {entry.split("==")[0] for entry in proc.stdout.removeprefix("floor check: ").strip().split("; ")}
    if off:
        assert named == set(off), proc.stdout
    else:
        assert "at their floor" in proc.stdout, proc.stdout


def test_a_requirement_without_a_floor_is_refused(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = ["trl>=1.16,<1.17", "torchvision<1"]\n'
        '[project.optional-dependencies]\ndev = ["x[plot]"]\nplot = ["matplotlib==3.9.0"]\n'
    )
    floor_tier = load_script(FLOOR_TIER)
    with pytest.raises(SystemExit, match="'torchvision<1' needs exactly one floor"):
        floor_tier.floor_pins(pyproject)
    pyproject.write_text(pyproject.read_text().replace('"torchvision<1"', '"Tokenizers>=0.23.1"'))
    assert floor_tier.floor_pins(pyproject) == {"trl": "1.16", "tokenizers": "0.23.1", "matplotlib": "3.9.0"}


def test_ci_runs_the_readme_floor_tier_with_the_readme_fast_tier():
    """The README's first command block names the floor tier; `.ci/run` runs exactly that line after the README's
    test command; the tier installs the README's extra with its torch pin and runs the README's fast tier."""
    first_block = next(b for b in code_blocks(ROOT / "README.md") if b.lang == "bash")
    assert README_FLOOR_COMMAND in first_block.body.splitlines()
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    fast, slow = readme_test_lines()
    fast_at = next(i for i, line in enumerate(steps) if line.startswith(fast))
    assert steps.index(README_FLOOR_COMMAND) > fast_at
    floor_tier = load_script(FLOOR_TIER)
    words = shlex.split(fast)
    assert words[words.index("pytest") - 1 :] == floor_tier.FAST_TIER, fast
    install = next(shlex.split(part) for part in fast.split(" && ") if "pip install" in part)
    assert floor_tier.TORCH in install and f".[{floor_tier.EXTRA}]" in install, install
    assert "--venv" in _floor_tier("--help").stdout


def test_cegppo_train_trains_the_tiny_recipe(tmp_path, monkeypatch):
    """In the fast tier, so that the floor tier proves the recipe trains at the floors (SFT warm start included; in the
    floor tier with transformers 5.23, the first with the recipes' `activation_checkpointing`): the console function
    in this process, with 20 of the recipe's 40 SFT warm-start steps (enough for the format reward to tell completions
    apart; the slow tier runs the recipe as written, from the wheel)."""
    from cegppo_trl.scripts.train import main

    monkeypatch.chdir(ROOT)
    argv = ["--config", TINY_RECIPE, "--tiny_sft_steps", "20", "--output_dir", str(tmp_path / "run")]
    assert main(argv) == 0
    steps = check_logs(tmp_path / "run", world_size=1)
    assert len(steps) == MAX_STEPS
    assert_trained_full_model(tmp_path / "run", tmp_path / "run" / "tiny-init")
