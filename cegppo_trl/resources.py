"""The recipes and accelerate configs shipped with the package, and `cegppo-recipes`, which copies them out.

In a clone they are the repository's `recipes/` and `accelerate_configs/`; a wheel carries the same files as
`cegppo_trl/recipes/` and `cegppo_trl/accelerate_configs/` (see `pyproject.toml`). So the README's commands work from
a clone as written, and a pip-installed user runs `cegppo-recipes` once to get the same two folders in the current
directory (or passes `--config recipes/...` to `cegppo-train`, which falls back to the shipped copy).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path


__all__ = ["KINDS", "list_shipped", "resolve_shipped_path", "shipped_dir", "main"]

KINDS = ("recipes", "accelerate_configs")
_PACKAGE_DIR = Path(__file__).resolve().parent


def shipped_dir(kind: str) -> Path:
    """The folder of shipped `kind` files ("recipes" or "accelerate_configs"): in the wheel, else in the clone."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    for candidate in (_PACKAGE_DIR / kind, _PACKAGE_DIR.parent / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"No shipped {kind}/ folder next to {_PACKAGE_DIR}: the installation is incomplete. Reinstall cegppo-trl."
    )


def list_shipped(kind: str) -> list[str]:
    """Relative paths (`kind/...yaml`) of the shipped files of `kind`."""
    root = shipped_dir(kind)
    return sorted(f"{kind}/{p.relative_to(root).as_posix()}" for p in root.rglob("*.yaml"))


def resolve_shipped_path(path: str) -> str:
    """`path` if it exists; else the shipped file it names (`recipes/tiny/cegppo/config_cpu.yaml` works from any
    directory once the package is installed). A name that is neither says so and lists what is shipped."""
    if Path(path).exists():
        return path
    relative = Path(path).as_posix().lstrip("./")
    for kind in KINDS:
        if relative.startswith(kind + "/"):
            candidate = shipped_dir(kind) / relative[len(kind) + 1 :]
            if candidate.is_file():
                return str(candidate)
    shipped = "\n  ".join(list_shipped("recipes") + list_shipped("accelerate_configs"))
    raise FileNotFoundError(
        f"{path!r} is neither a file nor a shipped recipe or accelerate config. Shipped:\n  {shipped}"
    )


def copy_shipped(dest: str | Path, force: bool = False) -> list[Path]:
    """Copy `recipes/` and `accelerate_configs/` into `dest`; existing files are kept unless `force`."""
    written = []
    for kind in KINDS:
        root = shipped_dir(kind)
        for src in sorted(root.rglob("*.yaml")):
            target = Path(dest) / kind / src.relative_to(root)
            if target.exists() and not force:
                print(f"kept existing {target} (use --force to overwrite)")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
            written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-recipes`."""
    parser = argparse.ArgumentParser(
        prog="cegppo-recipes",
        description="Copy the shipped recipes/ and accelerate_configs/ folders into a directory, or list them.",
    )
    parser.add_argument("dest", nargs="?", default=".", help="directory to copy into (default: the current one)")
    parser.add_argument("--list", action="store_true", help="only list the shipped files")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(list_shipped("recipes") + list_shipped("accelerate_configs")))
        return 0
    written = copy_shipped(args.dest, force=args.force)
    print(f"wrote {len(written)} files under {Path(args.dest).resolve()} (recipes/, accelerate_configs/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
