"""The installed package is the product: build the sdist and wheel, install the wheel into a fresh virtual
environment outside the checkout, and from a directory that is not the checkout run the README's quick start (with
the doc harness's stand-ins), `cegppo-demo --quick` and `cegppo-train` on the tiny recipe.

The fresh environment gets the wheel with `pip install --no-deps --no-index`; its third-party dependencies come from
the environment running the tests, through a `.pth` line (no download, and the checkout's own editable install is
not visible there: `.pth` files of that environment are not processed). A check then proves the wheel's declared base
requirements are met by what it finds, and `cegppo_trl.__file__` proves the wheel, not the checkout, is imported.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from test_docs import FAST_CONFIG, _swap_ids, code_blocks


ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900


def _run(argv, cwd, env=None):
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{argv} failed\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # A clean copy of the source: setuptools' build/ folder would otherwise carry modules deleted since a last build.
    src = tmp_path_factory.mktemp("src") / "cegppo-trl"
    junk = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, src, ignore=junk)
    # --no-isolation: build with this environment's setuptools (the dev extra), no download.
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", str(out), str(src)], src)
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("wheel-venv") / "venv"
    _run([sys.executable, "-m", "venv", str(env_dir)], cwd=env_dir.parent)
    python = env_dir / "bin" / "python"
    site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env_dir).stdout.strip()
    )
    (site / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next(dist.glob("*.whl"))
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], env_dir)
    return env_dir


def _env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def test_wheel_and_sdist_contents(dist):
    wheel = next(dist.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    source_modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cegppo_trl").rglob("*.py")}
    wheel_modules = {n for n in names if n.endswith(".py")}
    assert wheel_modules == source_modules, (
        f"missing from the wheel: {sorted(source_modules - wheel_modules)}; "
        f"not in the source tree: {sorted(wheel_modules - source_modules)}"
    )
    shipped = {
        f"cegppo_trl/{p.relative_to(ROOT).as_posix()}"
        for folder in ("recipes", "accelerate_configs")
        for p in (ROOT / folder).rglob("*.yaml")
    }
    assert shipped <= names, f"recipes / accelerate configs missing: {sorted(shipped - names)}"
    data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cegppo_trl").rglob("*.jsonl")}
    assert data and data <= names
    assert not any(n.startswith(("tests/", "benchmarks/", "experiments/")) for n in names)
    assert len(list(dist.glob("*.tar.gz"))) == 1


def test_installed_package_is_the_wheel(venv, tmp_path):
    env = _env(venv)
    where = _run(["python", "-c", "import cegppo_trl; print(cegppo_trl.__file__)"], tmp_path, env).stdout.strip()
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
    assert int(_run(["python", "-c", check], tmp_path, env).stdout) >= 6
    for command in ("cegppo-demo", "cegppo-train", "cegppo-eval", "cegppo-plot", "cegppo-recipes"):
        assert (venv / "bin" / command).is_file(), f"console script {command} not installed"


def test_quick_start_from_the_wheel(venv, stand_ins, tmp_path):
    """The README's first python block, with the doc harness's stand-ins, in the wheel's environment."""
    block = next(b for b in code_blocks(ROOT / "README.md") if b.lang == "python")
    script = tmp_path / "quick_start.py"
    script.write_text(
        "import cegppo_trl\n"
        "_config = cegppo_trl.CEGPPOConfig\n"
        f"cegppo_trl.CEGPPOConfig = lambda *a, **k: _config(*a, **{{**k, **{FAST_CONFIG!r}}})\n"
        + _swap_ids(block.body, stand_ins)
        + "\nimport json; print(json.dumps({'steps': trainer.state.global_step, 'file': cegppo_trl.__file__}))\n"
    )
    out = _run(["python", str(script)], tmp_path, _env(venv)).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    assert result["steps"] == FAST_CONFIG["max_steps"] and result["file"].startswith(str(venv))


def test_quick_demo_from_the_wheel(venv, tmp_path):
    _run(["cegppo-demo", "--quick", "--no-progress", "--output-dir", "demo"], tmp_path, _env(venv))
    summary = json.loads((tmp_path / "demo" / "results.json").read_text())
    labels = [r["label"] for r in summary["runs"]]
    assert len(labels) == 2 and labels[0].startswith("CE-GPPO") and labels[1].startswith("GRPO"), labels


def test_tiny_recipe_from_the_wheel(venv, tmp_path):
    """`cegppo-train --config recipes/...` finds the recipe shipped in the wheel; `cegppo-recipes` copies them."""
    env = _env(venv)
    assert not (tmp_path / "recipes").exists()
    _run(["cegppo-train", "--config", "recipes/tiny/cegppo/config_cpu.yaml", "--output_dir", "run"], tmp_path, env)
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] > 0 and any("cegppo/beta1_token_frac" in e for e in state["log_history"])
    _run(["cegppo-recipes", "copied"], tmp_path, env)
    assert (tmp_path / "copied" / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml").is_file()
    assert (tmp_path / "copied" / "accelerate_configs" / "zero3.yaml").is_file()
