"""The public surface as a user meets it: names importable from `cegppo_trl`, cheap imports, declared dependencies."""

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from doc_blocks import DOCS
from shared import ROOT, run_checked

import cegppo_trl


PACKAGE = ROOT / "cegppo_trl"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# `from cegppo_trl import a, b` in prose or code, over line breaks and inside parentheses.
_DOC_IMPORT_RE = re.compile(r"from\s+cegppo_trl\s+import\s+\(?\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)")


def doc_names() -> list[str]:
    """Every name README.md and docs/*.md import from the top level (`from cegppo_trl import ...`)."""
    names = set()
    for doc in DOCS:
        for match in _DOC_IMPORT_RE.finditer(doc.read_text()):
            names.update(name.strip() for name in match[1].split(","))
    return sorted(names)


DOC_NAMES = doc_names()


def test_doc_names_are_public_names():
    """Every name the docs import from the top level is in `__all__` (which imports: the test below); the reader finds
    the quick start's imports, so an empty or broken read cannot pass."""
    assert {"CEGPPOConfig", "CEGPPOTrainer", "load_math_dataset"} <= set(DOC_NAMES), DOC_NAMES
    assert _DOC_IMPORT_RE.search("`from cegppo_trl import (\n    A,\n    b_c,\n)`")[1].split(",")[1].strip() == "b_c"
    assert set(DOC_NAMES) <= set(cegppo_trl.__all__), sorted(set(DOC_NAMES) - set(cegppo_trl.__all__))


def test_all_is_exactly_the_public_names():
    assert len(set(cegppo_trl.__all__)) == len(cegppo_trl.__all__)
    for name in cegppo_trl.__all__:
        value = getattr(cegppo_trl, name)
        module = sys.modules[value.__module__]
        assert module.__name__.startswith("cegppo_trl."), name
        assert not name.startswith("_")
    # `from cegppo_trl import *` gives exactly __all__
    namespace = {}
    exec("from cegppo_trl import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(cegppo_trl.__all__)
    assert set(cegppo_trl.__all__) <= set(dir(cegppo_trl))


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'CEGPPOTrainerX'"):
        cegppo_trl.CEGPPOTrainerX  # noqa: B018
    with pytest.raises(ImportError):
        exec("from cegppo_trl import not_a_name", {})


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize(
    "statement",
    [
        "import cegppo_trl",
        "from cegppo_trl import math_reward, format_reward",
        "from cegppo_trl import load_math_dataset",
    ],
)
def test_light_imports_do_not_pull_torch_or_trl(statement):
    """A reward worker or a data script does not pay for torch / TRL (seconds of import time)."""
    loaded = _modules_after(statement)
    assert not loaded & {"torch", "trl", "transformers"}, sorted(loaded & {"torch", "trl", "transformers"})


def test_trainer_import_is_the_real_class():
    from trl import GRPOTrainer

    from cegppo_trl import CEGPPOTrainer
    from cegppo_trl.trainer import CEGPPOTrainer as direct

    assert CEGPPOTrainer is direct and issubclass(CEGPPOTrainer, GRPOTrainer)


# ----------------------------------------------------------------------------------------------------------------
# Dependencies: module-level imports of the library are base dependencies; optional ones are imported lazily.
# ----------------------------------------------------------------------------------------------------------------


def _requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in specs}


def _top_level_imports(path: Path) -> set[str]:
    """Top-level package names imported at module level (not inside functions or `if TYPE_CHECKING`)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_module_level_imports_are_base_dependencies():
    base = _requirement_names(PROJECT["dependencies"]) | {"torch"}  # torch: installed with trl / accelerate
    distributions = packages_distributions()
    stdlib = sys.stdlib_module_names
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _top_level_imports(path) - stdlib - {"cegppo_trl"}:
            dists = {d.lower().replace("_", "-") for d in distributions.get(name, [name])}
            if not dists & base:
                offenders.append(f"{path.relative_to(ROOT)} imports {name} ({sorted(dists)}) at module level")
    assert not offenders, "\n".join(offenders)


def test_declared_dependencies_are_used():
    """Every base dependency is imported somewhere in the library (no stale entries such as pyyaml)."""
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    import_names = {"math-verify": "math_verify"}
    for name in _requirement_names(PROJECT["dependencies"]):
        module = import_names.get(name, name.replace("-", "_"))
        assert f"import {module}" in source or f"from {module}" in source, f"{name} is declared but never imported"


def _extra_packages() -> dict[str, set[str]]:
    """The distributions each extra adds to the base install (`dev` lists `cegppo-trl[...]`, `vllm` may go through
    `trl[vllm]`: those names are base dependencies and left out)."""
    base = _requirement_names(PROJECT["dependencies"]) | {"cegppo-trl"}
    return {extra: _requirement_names(specs) - base for extra, specs in PROJECT["optional-dependencies"].items()}


# Optional packages a library module may use, and the module name each imports as (vllm: also what `trl[vllm]` adds).
_OPTIONAL_MODULES = {"matplotlib": "matplotlib", "peft": "peft", "deepspeed": "deepspeed", "vllm": "vllm"}


def test_extras_are_imported_only_lazily():
    """Every library module imports with all optional packages missing (an import of them raises ImportError, as it
    would for a user without that extra): they are imported only where they are used, inside functions."""
    runtime_extras = {name for extra in ("plot", "peft", "deepspeed", "vllm") for name in _extra_packages()[extra]}
    assert runtime_extras <= set(_OPTIONAL_MODULES), runtime_extras - set(_OPTIONAL_MODULES)
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in PACKAGE.rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"blocked = {sorted(_OPTIONAL_MODULES.values())!r}\n"
        "sys.modules.update(dict.fromkeys(blocked))  # None: `import` raises ImportError, `find_spec` says absent\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m, v in sys.modules.items() if m.split('.')[0] in blocked and v is not None)\n"
        "assert not loaded, loaded\n"
        "print(len(" + repr(modules) + "))\n"
    )
    proc = run_checked([sys.executable, "-c", code], ROOT, timeout=600)
    assert int(proc.stdout.split()[-1]) == len(modules) > 10


def test_extras_are_named_in_the_readme():
    """The README's extras table has a row for every extra, naming what it brings."""
    readme = (ROOT / "README.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([\w-]+)` \|([^|]*)\|", readme, re.M)}
    for extra, packages in _extra_packages().items():
        assert extra in rows, f"the README's extras table has no row for `{extra}`"
        if extra != "dev":  # dev: "the three above but vllm, pytest, ruff, build"
            for package in packages:
                assert package in rows[extra], f"the README's row for `{extra}` does not name {package}"


@pytest.mark.parametrize("package, table", [("cegppo_trl", "_PUBLIC_NAMES"), ("cegppo_trl.evaluation", "_LAZY")])
def test_type_checking_imports_match_the_name_table(package, table):
    """The eager imports static tools read (`if TYPE_CHECKING:`) name the same modules as the lazy table, in the
    package and in `cegppo_trl.evaluation`; every public name resolves."""
    import importlib

    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    eager = {alias.name: node.module for node in block.body for alias in node.names}
    assert eager == getattr(module, table)
    assert all(getattr(module, name) is not None for name in module.__all__)


def test_the_private_names_the_trainer_overrides_are_the_ones_docs_method_lists():
    """Every private method of TRL's or transformers' that `CEGPPOTrainer` (with the guard it composes) overrides is a
    row of docs/method.md's table, and every listed override is one: a new private override, or one dropped, fails."""
    from trl import GRPOTrainer

    from cegppo_trl import CEGPPOTrainer, DivergenceGuardMixin

    inherited = {name for base in GRPOTrainer.__mro__ for name in vars(base)}
    overridden = {
        name
        for cls in (CEGPPOTrainer, DivergenceGuardMixin)
        for name, value in vars(cls).items()
        if name.startswith("_") and not name.startswith("__") and callable(value) and name in inherited
    }
    table = [line for line in (ROOT / "docs" / "method.md").read_text().splitlines() if line.startswith("| `")]
    listed = {
        name
        for row in table
        if "overridden" in row.split("|")[2]
        for name in re.findall(r"`(?:GRPOTrainer|Trainer)\.(_[a-z]\w*)`", row.split("|")[1])
    }
    assert overridden == listed, (overridden, listed)
    assert {"_save_checkpoint", "_load_optimizer_and_scheduler"}.isdisjoint(overridden)
