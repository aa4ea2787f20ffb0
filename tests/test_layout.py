"""The package's layout, from every import read with `ast` (also those inside functions): the demo package
(`cegppo_trl.demo`) is imported by nothing outside it, there is no import cycle, and the command-line scripts sit
on top."""

import ast
import os
from pathlib import Path

import pytest

import cegppo_trl


PACKAGE = Path(cegppo_trl.__file__).resolve().parent
DEMO = "cegppo_trl.demo"
LAUNCH_SCRIPT = PACKAGE / "scripts" / "train.py"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module the code of module `name` imports (``from a import b`` counts as ``a`` and
    ``a.b``)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def imports_of(path: Path) -> set[str]:
    return imported_modules(path.read_text(), _module_name(path), path.name == "__init__.py")


def _is_demo(module: str) -> bool:
    return module == DEMO or module.startswith(DEMO + ".")


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "demo")


def test_the_walk_sees_every_kind_of_import():
    code = (
        "import cegppo_trl.demo.run\nfrom ..demo import tiny\nfrom . import helper\n"
        "def f():\n    from ..demo.toy import run_toy\n    from cegppo_trl import demo\n"
    )
    modules = imported_modules(code, "cegppo_trl.scripts.train")
    assert {"cegppo_trl.demo.run", "cegppo_trl.demo.tiny", "cegppo_trl.scripts.helper"} <= modules
    assert {"cegppo_trl.demo.toy", "cegppo_trl.demo.toy.run_toy", "cegppo_trl.demo"} <= modules
    assert imported_modules("from .demo import run", "cegppo_trl", is_package=True) >= {"cegppo_trl.demo.run"}
    assert not any(_is_demo(m) for m in imported_modules("from .demonstration import x", "cegppo_trl.data"))


def test_library_modules_are_found():
    names = {_module_name(p) for p in LIBRARY}
    assert {"cegppo_trl", "cegppo_trl.core", "cegppo_trl.trainer", "cegppo_trl.data", "cegppo_trl.evaluation"} <= names
    assert {"cegppo_trl.rewards.reward", "cegppo_trl.scripts.train", "cegppo_trl.tiny_model"} <= names
    assert not any(_is_demo(n) for n in names)


def test_the_cli_scripts_are_library_modules():
    """Every console script outside the demo's own (`cegppo-demo`, `cegppo-plot`) lives in the library, so the test
    below covers it: the launch script and the evaluation, recipe-copying and training commands."""
    import tomllib

    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    library = {_module_name(p) for p in LIBRARY}
    outside = {name: target for name, target in scripts.items() if not _is_demo(target.partition(":")[0])}
    assert {"cegppo-train", "cegppo-eval", "cegppo-recipes"} <= set(outside)
    for name, target in outside.items():
        module = target.partition(":")[0]
        assert module in library or module.rpartition(".")[0] in library, (name, target)
    assert LAUNCH_SCRIPT in LIBRARY


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: _module_name(p))
def test_library_does_not_import_the_demo(path):
    demo_imports = sorted(m for m in imports_of(path) if _is_demo(m))
    assert not demo_imports, f"{_module_name(path)} imports {demo_imports}"


def test_builtin_tiny_comes_from_the_library():
    assert "cegppo_trl.tiny_model.materialize_tiny_in_job" in imports_of(LAUNCH_SCRIPT)
    assert not (PACKAGE / "demo" / "tiny.py").exists(), "the tiny model lives in cegppo_trl/tiny_model.py"


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imported_package_modules(name: str) -> set[str]:
    """The package's modules that module `name` imports (an imported attribute counts as its module); a package
    importing its own parent is left out: Python imports the parents of a module first anyway."""
    found = set()
    for imported in imports_of(MODULES[name]):
        while imported and imported not in MODULES:
            imported = imported.rpartition(".")[0]
        if imported and not (name + ".").startswith(imported + "."):
            found.add(imported)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle of `graph` once, as the path that closes it (depth-first search)."""
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_the_cycle_walk_can_fail():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle_in_the_package():
    """Every import counts, also those inside functions (the old cycle training_run -> tiny_model -> evaluation ->
    evaluation.generation -> training_run was one function's)."""
    graph = {name: _imported_package_modules(name) for name in MODULES}
    assert graph["cegppo_trl.scripts.train"] >= {"cegppo_trl.scripts.stopping", "cegppo_trl.data"}
    assert not import_cycles(graph), import_cycles(graph)


def test_nothing_below_the_scripts_imports_a_script():
    below = [name for name in MODULES if not name.startswith("cegppo_trl.scripts")]
    upward = {n: sorted(m for m in _imported_package_modules(n) if m.startswith("cegppo_trl.scripts")) for n in below}
    assert not {n: m for n, m in upward.items() if m}, upward


def test_the_config_is_on_the_ground_floor():
    """`config.py` imports no module of the package but the vLLM version helper, which imports none; the TRL mirror
    imports no module of the package; dynamic sampling builds on it, not the other way round."""
    assert _imported_package_modules("cegppo_trl.config") == {"cegppo_trl.vllm_support"}
    assert _imported_package_modules("cegppo_trl.vllm_support") == set()
    assert _imported_package_modules("cegppo_trl.trl_mirror") == set()


def test_the_trainer_keeps_one_record_per_trl_call_and_no_flag_resetting_try():
    """What TRL passes only between its own methods lives in a `_Generation` and a `_LossCall`, each set and cleared
    by a `with _While(...)` around the TRL call it records."""
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CEGPPOTrainer")
    class_state = [t.target.id for t in trainer.body if isinstance(t, ast.AnnAssign)]
    assert class_state == ["_generation", "_loss_call"]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Try) and n.finalbody]
    written = {t.attr for n in ast.walk(trainer) if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}  # fmt: skip
    assert not {"_generation", "_loss_call"} & written  # only `_While.__enter__` / `__exit__` set them


def test_lazy_public_names_are_library_names():
    assert not any(_is_demo(f"cegppo_trl.{module}") for module in cegppo_trl._PUBLIC_NAMES.values())


def test_builtin_data_folder_shadows_no_module():
    from cegppo_trl.data import BUILTIN_DATASETS

    folders = {path.parent for path in BUILTIN_DATASETS.values()}
    assert folders == {PACKAGE / "builtin_data"}
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    }
    assert not {folder.name for folder in folders} & modules


def test_the_writable_path_check_runs_once_per_path(tmp_path, monkeypatch):
    """`cegppo-train` checks --output_dir before builtin:tiny writes, `CEGPPOTrainer` again: one probe file."""
    from cegppo_trl import run_checks

    probes = []
    monkeypatch.setattr(run_checks.tempfile, "TemporaryFile", lambda dir: probes.append(dir) or open(os.devnull, "w"))
    for _ in range(2):
        run_checks.check_writable_path(tmp_path / "out", "--output_dir", folder=True)
    assert probes == [str(tmp_path)]
