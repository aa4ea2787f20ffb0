"""The installed package is the product: build the sdist and wheel, install the wheel into a fresh virtual
environment outside the checkout, and from a directory that is not the checkout run the README's quick start (with
the doc harness's stand-ins), `cegppo-demo --quick` and `cegppo-train` on the tiny recipe.

The wheel, its environment (no download: see `wheel_venv`) and the two end-to-end runs are the session fixtures of
conftest.py, shared with the other slow tests. `cegppo_trl.__file__` proves the wheel, not the checkout, is imported.
"""

import json
import zipfile

import pytest
from doc_blocks import FAST_CONFIG, readme_quick_start, swap_ids
from shared import ROOT, run_checked, wheel_env


pytestmark = pytest.mark.slow  # builds and installs the wheel


def test_wheel_and_sdist_contents(wheel_dist):
    wheel = next(wheel_dist.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    source_modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cegppo_trl").rglob("*.py")}
    wheel_modules = {n for n in names if n.endswith(".py")}
    assert wheel_modules == source_modules, (
        f"missing from the wheel: {sorted(source_modules - wheel_modules)}; "
        f"not in the source tree: {sorted(wheel_modules - source_modules)}"
    )
    shipped = {
        f"cegppo_trl/{p.relative_to(ROOT).as_posix()}"
        for folder, pattern in (("recipes", "*.yaml"), ("accelerate_configs", "*.yaml"), ("slurm", "*.slurm"))
        for p in (ROOT / folder).rglob(pattern)
    }
    assert any(name.endswith(".slurm") for name in shipped)
    assert shipped <= names, f"recipes / accelerate configs / SLURM scripts missing: {sorted(shipped - names)}"
    data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cegppo_trl").rglob("*.jsonl")}
    assert data and data <= names
    assert not any(n.startswith(("tests/", "benchmarks/", "experiments/")) for n in names)
    assert len(list(wheel_dist.glob("*.tar.gz"))) == 1


def test_installed_package_is_the_wheel(wheel_venv, tmp_path):
    venv = wheel_venv
    env = wheel_env(venv)
    where = run_checked(
        ["python", "-c", "import cegppo_trl; print(cegppo_trl.__file__)"], tmp_path, env
    ).stdout.strip()
    assert where.startswith(str(venv)), f"imported {where}, not the installed wheel"
    # The wheel's own requirements (base, no extras) are met by what the environment finds.
    check = (
        "from importlib.metadata import requires, version\n"
        "from packaging.requirements import Requirement\n"
        "bad = []\n"
        "for spec in requires('cegppo-trl'):\n"
        "    req = Requirement(spec)\n"
        "    if req.marker is None and version(req.name) not in req.specifier:\n"
        "        bad.append(f'{req} (found {version(req.name)})')\n"
        "print(len(requires('cegppo-trl'))); assert not bad, bad\n"
    )
    assert int(run_checked(["python", "-c", check], tmp_path, env).stdout) >= 6
    for command in ("cegppo-demo", "cegppo-train", "cegppo-eval", "cegppo-plot", "cegppo-recipes"):
        assert (venv / "bin" / command).is_file(), f"console script {command} not installed"


def test_quick_start_from_the_wheel(wheel_venv, stand_ins, tmp_path):
    """The README's first python block, with the doc harness's stand-ins, in the wheel's environment."""
    block = readme_quick_start()
    script = tmp_path / "quick_start.py"
    script.write_text(
        "import cegppo_trl\n"
        "_config = cegppo_trl.CEGPPOConfig\n"
        f"cegppo_trl.CEGPPOConfig = lambda *a, **k: _config(*a, **{{**k, **{FAST_CONFIG!r}}})\n"
        + swap_ids(block.body, stand_ins)
        + "\nimport json; print(json.dumps({'steps': trainer.state.global_step, 'file': cegppo_trl.__file__}))\n"
    )
    out = run_checked(["python", script], tmp_path, wheel_env(wheel_venv)).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    assert result["steps"] == FAST_CONFIG["max_steps"] and result["file"].startswith(str(wheel_venv))


def test_quick_demo_from_the_wheel(quick_demo):
    """`cegppo-demo --quick` runs from the wheel (the shared `quick_demo` is the wheel's console script), in a directory
    outside the checkout."""
    assert not (quick_demo.cwd / "recipes").exists() and ROOT not in quick_demo.cwd.parents
    arms = {r["arm"] for r in quick_demo.summary["lm"]["runs"]}
    assert arms == {"cegppo", "grpo"}, quick_demo.summary["lm"]["runs"]
    assert "CE-GPPO (0.5, 1)" in quick_demo.summary["lm"]["table"] and "GRPO" in quick_demo.summary["lm"]["table"]


def test_tiny_recipe_from_the_wheel(wheel_venv, tiny_recipe_run, tmp_path):
    """`cegppo-train --config recipes/...` finds the recipe shipped in the wheel (the shared `tiny_recipe_run` ran in a
    directory with no recipes/ folder); `cegppo-recipes` copies them."""
    state = json.loads((tiny_recipe_run.out / "trainer_state.json").read_text())
    assert state["global_step"] > 0 and any("cegppo/beta1_token_frac" in e for e in state["log_history"])
    assert not (tiny_recipe_run.cwd / "recipes").exists()
    run_checked(["cegppo-recipes", "copied"], tmp_path, wheel_env(wheel_venv))
    assert (tmp_path / "copied" / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml").is_file()
    shipped_script = (ROOT / "slurm" / "train.slurm").read_bytes()
    assert (tmp_path / "copied" / "slurm" / "train.slurm").read_bytes() == shipped_script
    assert (tmp_path / "copied" / "accelerate_configs" / "zero3.yaml").is_file()
