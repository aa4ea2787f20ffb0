"""The recipes, accelerate configs and SLURM scripts shipped with the package, and `cegppo-recipes`, which copies them
out.

In a clone they are the repository's `recipes/`, `accelerate_configs/` and `slurm/`; a wheel carries the same files
under `cegppo_trl/` (`pyproject.toml`). `cegppo-train --config recipes/...` falls back to the shipped copy.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path


__all__ = ["KINDS", "list_shipped", "resolve_shipped_path", "shipped_dir", "main"]

KINDS = ("recipes", "accelerate_configs", "slurm")
_PATTERNS = {"recipes": "*.yaml", "accelerate_configs": "*.yaml", "slurm": "*.slurm"}
_PACKAGE_DIR = Path(__file__).resolve().parent


def shipped_dir(kind: str) -> Path:
    """The folder of shipped `kind` files (one of `KINDS`): in the wheel, else in the clone."""
    for candidate in (_PACKAGE_DIR / kind, _PACKAGE_DIR.parent / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"No shipped {kind}/ folder next to {_PACKAGE_DIR}: the installation is incomplete. Reinstall cegppo-trl."
    )


def list_shipped() -> list[str]:
    """Relative paths (`kind/...`) of every shipped file, recipes first."""
    return [
        path
        for kind in KINDS
        for path in sorted(
            f"{kind}/{p.relative_to(shipped_dir(kind)).as_posix()}" for p in shipped_dir(kind).rglob(_PATTERNS[kind])
        )
    ]


def resolve_shipped_path(path: str) -> str:
    """`path` if it exists; else the shipped file it names (`recipes/tiny/cegppo/config_cpu.yaml` works from any
    directory once the package is installed). A name that is neither says so and lists what is shipped."""
    if Path(path).exists():
        return path
    kind, _, rest = Path(path).as_posix().lstrip("./").partition("/")
    if kind in KINDS and (shipped_dir(kind) / rest).is_file():
        return str(shipped_dir(kind) / rest)
    shipped = "\n  ".join(list_shipped())
    raise FileNotFoundError(
        f"{path!r} is neither a file nor a shipped recipe or accelerate config. Shipped:\n  {shipped}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-recipes`: copy `recipes/`, `accelerate_configs/` and `slurm/` into a directory, or
    list them."""
    parser = argparse.ArgumentParser(
        prog="cegppo-recipes",
        description="Copy the shipped recipes/, accelerate_configs/ and slurm/ folders into a directory, or list them.",
    )
    parser.add_argument("dest", nargs="?", default=".", help="directory to copy into (default: the current one)")
    parser.add_argument("--list", action="store_true", help="only list the shipped files")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(list_shipped()))
        return 0
    from .run_checks import first_problem

    if problem := first_problem(writable=[(args.dest, "DEST", True)]):
        parser.exit(2, f"cegppo-recipes: error: {problem}\n")
    written = 0
    for relative in list_shipped():
        kind, _, rest = relative.partition("/")
        target = Path(args.dest) / relative
        if target.exists() and not args.force:
            print(f"kept existing {target} (use --force to overwrite)")
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shipped_dir(kind) / rest, target)  # with its mode: the SLURM scripts stay executable
        written += 1
    print(f"wrote {written} files under {Path(args.dest).resolve()} (recipes/, accelerate_configs/, slurm/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
