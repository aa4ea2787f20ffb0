"""The code blocks of the docs, as the doc harness (tests/test_docs.py) and the wheel and floor tests read them: each
fenced block with its language, line and `<!-- doc-test: skip (reason) -->` mark; the README's test commands; the
stand-in swap and the small CPU settings the harness runs the Python blocks with."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from shared import ROOT, cpu_config


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_RE = re.compile(r"<!--\s*doc-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE_RE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.S | re.M)

# What the harness sets on every `CEGPPOConfig` a block builds: conftest's small CPU config (the one builder of the
# tests), 2 steps of 8 completions.
FAST_CONFIG = cpu_config(dict, None, max_steps=2, per_device_train_batch_size=4, steps_per_generation=2)
del FAST_CONFIG["output_dir"]


@dataclass
class Block:
    doc: Path
    lang: str
    body: str
    line: int
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def code_blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    blocks = []
    for match in FENCE_RE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        previous = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP_RE.search(previous)
        blocks.append(Block(doc, match["lang"], match["body"], line, skip["reason"].strip() if skip else None))
    return blocks


def swap_ids(source: str, stand_ins: dict[str, str]) -> str:
    for name, value in stand_ins.items():
        source = source.replace(f'"{name}"', repr(value)).replace(f"'{name}'", repr(value))
    return source


def shell_commands(body: str) -> list[list[str]]:
    """Commands of a shell block: continuations joined, comments dropped, `&&` chains split, env prefixes dropped."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";"):
                while current and re.fullmatch(r"[A-Z_]+=\S*", current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def readme_quick_start() -> Block:
    """The README's first python block: the quick start (tests/test_quick_start.py, test_wheel.py)."""
    return next(b for b in code_blocks(ROOT / "README.md") if b.lang == "python")


def readme_test_lines() -> tuple[str, str]:
    """(the README's test command, its slow-tier command): the lines of a README shell block that run pytest."""
    lines = [line.strip() for b in code_blocks(ROOT / "README.md") if b.lang == "bash" for line in b.body.splitlines()]
    tests = [line for line in lines if "-m pytest" in line and not line.startswith("#")]
    fast = [line for line in tests if "ruff check" in line]
    slow = [line for line in tests if shlex.split(line)[-2:] == ["-m", "slow"]]
    assert len(fast) == 1 and len(slow) == 1, f"expected one test command and one slow-tier command, got {tests}"
    return fast[0], slow[0]


# `pip install ... -e ".[extra]"` (or `-e .`: the base install) and `pip install "WHEEL[extra]"`, in a command or in a
# comment naming the install of the commands below it.
INSTALL_RE = re.compile(
    r"pip install [^#\n]*?(?:-e \"?\.(?:\[(?P<extra>[\w,-]+)\])?(?![\w/\[])|\)\[(?P<wheel>[\w,-]+)\])"
)


def readme_commands() -> list[tuple[Block, str, str | None, list[str]]]:
    """(block, section, install, argv) of every command of the README's shell blocks: `install` is the extra that the
    last install before it in its block names ("" for the base install, None when none is named), `section` the
    heading above the block."""
    readme = ROOT / "README.md"
    text, found = readme.read_text(), []
    for block in code_blocks(readme):
        if block.lang != "bash" or block.skip_reason is not None:
            continue
        section = re.findall(r"^## (.+)$", text[: text.index(block.body)], re.M)[-1:] or [""]
        install = None
        for line in block.body.replace("\\\n", " ").splitlines():
            if match := INSTALL_RE.search(line):
                install = match["extra"] or match["wheel"] or ""
            if not line.lstrip().startswith("#"):
                found += [(block, section[0], install, argv) for argv in shell_commands(line)]
    return found
