"""The docs are tests: every code block of README.md and docs/*.md runs, or is checked, as a user would use it.

* ```python blocks run as written, one namespace per document (a later block may use an earlier block's names).
  What cannot run offline is swapped by this harness, never by editing the docs: Hub model and data-set ids become
  local stand-ins (the `stand_ins` fixture: the tiny model, the built-in data), and `CEGPPOConfig` gets the small CPU
  settings of `FAST_CONFIG` on top of what the block passes (steps, batch and lengths shrink; every CE-GPPO field is
  kept).
* ```bash blocks are split into commands (`shell_commands`) and each command is checked by its kind (`classify`, one
  test per kind, each saying how: console commands run on local stand-ins, scripts answer `--help`, launches and
  recipes parse, ...; `cegppo-demo` and `cegppo-plot` run from their own install in tests/test_newcomer.py). A command of a kind the harness does not know fails the test. Commands that need a training or
  demo run are `slow`.
* A block meant only to be read carries `<!-- doc-test: skip (reason) -->` on the line above its fence.
"""

import ast
import contextlib
import functools
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from doc_blocks import (
    DOCS,
    FAST_CONFIG,
    code_blocks,
    readme_quick_start,
    readme_test_lines,
    shell_commands,
    swap_ids,
)
from launching import subprocess_env
from shared import DEMO_OUTPUT, HUB_MODELS, TINY_RECIPE, assert_trls_vllm_serve_settings, parse_train_args, run_checked


ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

TIMEOUT_S = 900


ALL_BLOCKS = [b for doc in DOCS for b in code_blocks(doc)]
PYTHON_DOCS = sorted({b.doc for b in ALL_BLOCKS if b.lang == "python" and b.skip_reason is None})
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell") and b.skip_reason is None]


def program(argv: list[str]) -> str:
    """The command's program, without a `.venv/bin/` (or any directory) prefix."""
    return Path(argv[0]).name


def classify(argv: list[str]) -> str:
    prog = program(argv)
    if prog in ("pip", "pip3") or argv[1:3] in (["-m", "venv"], ["-m", "pip"]):
        return "install"
    if argv[1:3] == ["-m", "pytest"]:
        return "pytest"
    if prog == "ruff":
        return "lint"
    if prog in ("cegppo-demo", "cegppo-eval", "cegppo-train", "cegppo-plot", "cegppo-recipes", "cegppo-compare"):
        return prog
    if prog.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
        return "train-script" if argv[1] == "examples/train_cegppo.py" else "script"
    if prog == "accelerate" and argv[1:2] == ["launch"]:
        return "accelerate"
    # `trl vllm-serve` (deprecated in TRL 1.16) is no kind: the docs show `vllm serve` as TRL recommends.
    if prog == "vllm" and argv[1:2] == ["serve"]:
        return "vllm"
    if prog == "sbatch":
        return "sbatch"
    return "unknown"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_checked(argv, cwd, subprocess_env(), TIMEOUT_S)


def test_every_block_is_known():
    """Every fenced block is python, a shell block, or marked as text / skipped with a reason."""
    assert PYTHON_DOCS, "no python block found: the harness is not reading the docs"
    for block in ALL_BLOCKS:
        if block.skip_reason is None:
            assert block.lang in ("python", "bash", "sh", "shell", "text", "yaml", "json"), (
                f"{block.where}: fence language {block.lang!r}; use python/bash for code or text for output"
            )


def test_no_machine_specific_paths():
    pattern = re.compile(r"(/work/|/root/|/home/\w+|/tmp/\w|/Users/\w+|C:\\)")
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{doc.relative_to(ROOT)}:{number} names a machine path: {line.strip()}"


def test_named_tests_exist():
    """A doc that names `tests/x.py::test_y` as the proof of a claim names a test that is there (tests get merged)."""
    for doc in DOCS:
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", doc.read_text()):
            assert (ROOT / path).exists() and re.search(rf"^(def|class) {name}\b", (ROOT / path).read_text(), re.M), (
                f"{doc.relative_to(ROOT)} names {path}::{name}, which does not exist"
            )


@pytest.mark.parametrize("doc", PYTHON_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(doc, stand_ins, tmp_path, monkeypatch):
    import cegppo_trl

    real_config = cegppo_trl.CEGPPOConfig
    built = []

    def fast_config(*args, **kwargs):
        config = real_config(*args, **{**kwargs, **FAST_CONFIG})
        built.append((kwargs, config))
        return config

    monkeypatch.setattr(cegppo_trl, "CEGPPOConfig", fast_config)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc__"}
    for block in code_blocks(doc):
        if block.lang != "python" or block.skip_reason is not None:
            continue
        source = swap_ids(block.body, stand_ins)
        ast.parse(source)  # a syntax error is reported against the block, not the harness
        exec(compile(source, block.where, "exec"), namespace)
    # The CE-GPPO fields a block set reach the trainer unchanged (the harness only shrinks sizes).
    for kwargs, config in built:
        for name, value in kwargs.items():
            if name not in FAST_CONFIG and name != "output_dir":
                assert getattr(config, name) == value, f"{doc.name}: {name} was {getattr(config, name)!r}"
    trainers = [v for v in namespace.values() if type(v).__name__ == "CEGPPOTrainer"]
    for trainer in trainers:
        assert trainer.state.global_step == FAST_CONFIG["max_steps"], f"{doc.name}: the trainer did not train"


SHELL_COMMANDS = [(block, argv) for block in SHELL_BLOCKS for argv in shell_commands(block.body)]


def commands(*kinds: str, is_slow=lambda argv: False) -> list:
    """The docs' commands of `kinds` as parameters, those for which `is_slow(argv)` holds marked `slow` (they need a
    training or demo run)."""
    return [
        pytest.param((b, a), id=f"{b.where}:{program(a)}", marks=[pytest.mark.slow] * is_slow(a))
        for b, a in SHELL_COMMANDS
        if classify(a) in kinds
    ]


def test_every_command_has_a_kind():
    assert SHELL_COMMANDS
    unknown = [f"{b.where}: {shlex.join(a)}" for b, a in SHELL_COMMANDS if classify(a) == "unknown"]
    assert not unknown, "commands the doc harness does not know how to check:\n" + "\n".join(unknown)


def _ci_steps() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]


def test_readme_first_screen_has_the_commands_then_the_quick_start():
    """Before the README's first section: a one-sentence description, the install + demo command, the test command
    and the slow-tier command beside it, then the Python quick start (the README's first python block); the
    real-model and vLLM tier commands, which `.ci/run` runs."""
    readme = (ROOT / "README.md").read_text()
    first_screen = readme[: readme.index("\n## ")]
    fast, slow = readme_test_lines()
    quick_start = readme_quick_start()
    assert quick_start.skip_reason is None and quick_start.body in first_screen
    assert "from cegppo_trl import" in quick_start.body and "trainer.train()" in quick_start.body
    for text in ("cegppo-demo", fast, slow):
        assert text in first_screen, f"the README's first screen lacks {text!r}"
    intro = first_screen[first_screen.index("\n") : first_screen.index("```")]  # between the title and the commands
    assert "drop-in replacement for TRL's `GRPOTrainer`" in intro, intro
    assert first_screen.index("cegppo-demo") < first_screen.index("from cegppo_trl import")
    assert first_screen.index(slow) < first_screen.index("from cegppo_trl import")
    for command in ("python3 .ci/real_model_tier.py", "python3 .ci/vllm_tier.py"):
        assert f"\n{command}\n" in first_screen, f"the README's first screen lacks {command!r}"
        assert command in _ci_steps() and (ROOT / command.split()[1]).is_file(), f".ci/run does not run {command!r}"


def test_readme_test_command_is_ci():
    """`.ci/run` runs the README's test command (lint, then the fast tier) verbatim, then the slow tier as the README
    names it: together, every test."""
    fast, slow = readme_test_lines()
    words = shlex.split(fast)
    assert words[words.index("pytest") + 1 :] == ["tests", "-q", "-m", "not slow and not real_model and not vllm"], (
        fast
    )
    assert shlex.split(slow)[2:] == ["pytest", "tests", "-q", "-m", "slow"], slow
    lint = fast.index("ruff check"), fast.index("ruff format --check")
    assert max(lint) < fast.index("pytest"), "the README's test command lints before the tests"
    steps = _ci_steps()  # each tier passes over "no test selected" (test below)
    fast_at, slow_at = (steps.index(f"{command} || no_test_is_ok") for command in (fast, slow))
    assert fast_at < slow_at, f".ci/run does not run the slow tier ({slow}) after the README's command"


def test_ci_accepts_a_tier_that_selects_no_test():
    """pytest exits 5 when a marker selects no test; `.ci/run` passes over that and fails on any other status."""
    steps = _ci_steps()
    handler = next(line for line in steps if line.startswith("no_test_is_ok()"))
    for status, expected in ((0, 0), (5, 0), (1, 1), (2, 2)):
        script = f"set -euo pipefail\n{handler}\n(exit {status}) || no_test_is_ok\necho reached"
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        assert proc.returncode == expected and ("reached" in proc.stdout) == (expected == 0), (status, proc)


@pytest.mark.parametrize("item", commands("install"))
def test_install_commands_name_real_extras(item):
    _, argv = item
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    for word in argv:
        for group in re.findall(r"\[([\w,-]+)\]", word):
            for extra in group.split(","):
                assert extra in extras, f"`{shlex.join(argv)}` asks for extra {extra!r}; pyproject has {extras}"
        if word.startswith("torch"):
            assert word == "torch==2.13.0", "the docs pin the CPU torch build as torch==2.13.0"


@pytest.mark.parametrize("item", commands("lint"))
def test_lint_commands_pass_with_the_pinned_ruff(item):
    """Each lint command of the docs passes on the checkout, run by the ruff version the dev extra pins."""
    _, argv = item
    assert argv[1] in ("check", "format"), argv
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    pinned = next(spec.split("==")[1] for spec in dev if spec.startswith("ruff=="))
    assert _run([str(BIN / "ruff"), "--version"], cwd=ROOT).stdout.split()[1] == pinned
    _run([str(BIN / "ruff"), *argv[1:]], cwd=ROOT)


@pytest.mark.parametrize("item", commands("pytest"))
def test_pytest_commands_name_real_paths(item):
    _, argv = item
    words = argv[3:]
    paths = [w for i, w in enumerate(words) if not w.startswith("-") and (i == 0 or words[i - 1] not in ("-m", "-k"))]
    assert paths, f"`{shlex.join(argv)}` names no test path"
    for word in paths:
        assert (ROOT / word.split("::")[0]).exists(), f"`{shlex.join(argv)}`: {word} does not exist"
    for i, word in enumerate(words[:-1]):
        if word == "-m":  # a marker expression names registered markers only
            markers = PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]
            registered = {m.split(":")[0].strip() for m in markers}
            used = set(re.findall(r"\w+", words[i + 1])) - {"not", "and", "or"}
            assert used <= registered, f"`{shlex.join(argv)}` selects unregistered markers {used - registered}"


@functools.cache
def _help_text(script: str) -> str:
    """`python <script> --help`, run in this process (torch and TRL are imported already: a fresh interpreter spent
    seconds importing them again), once per script for the whole session (the docs name some scripts many times)."""
    out = io.StringIO()
    saved_path, saved_argv = list(sys.path), sys.argv
    sys.argv = [script, "--help"]
    sys.path.insert(0, str((ROOT / script).parent))  # as `python script` puts its folder first
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings(), pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(ROOT / script), run_name="__main__")
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
    assert exit_info.value.code in (0, None), f"python {script} --help exited {exit_info.value.code}"
    return out.getvalue()


@pytest.mark.parametrize("item", commands("script"))
def test_scripts_answer_help(item):
    _, argv = item
    assert (ROOT / argv[1]).is_file(), f"{argv[1]} does not exist"
    text = _help_text(argv[1])
    assert "usage" in text.lower()
    # the flags the doc passes are flags the script knows
    for word in argv[2:]:
        if word.startswith("--"):
            assert word.split("=")[0] in text, f"{argv[1]} has no flag {word}"


def _console(name: str, args: list[str], cwd: Path, monkeypatch, capsys) -> str:
    """The console command `name` (pyproject's entry point) as its script calls it, in this process, in `cwd`: the
    docs' commands check our code; the console scripts' own start is tested where it matters (test_signals.py,
    test_train_cli_messages.py). Returns its stdout."""
    import pkgutil

    entry = PYPROJECT["project"]["scripts"][name]
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [name, *args])
    status = pkgutil.resolve_name(entry)()
    out = capsys.readouterr()
    assert status in (0, None), f"`{shlex.join([name, *args])}` failed ({status})\n{out.out[-3000:]}{out.err[-6000:]}"
    return out.out


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def _is_cpu_recipe(argv: list[str]) -> bool:
    return "--config" in argv and "recipes/tiny/" in argv[argv.index("--config") + 1]


@pytest.mark.parametrize("item", commands("cegppo-train", "train-script", is_slow=_is_cpu_recipe))
def test_train_commands(item, request):
    """The tiny recipe's command is the shared `tiny_recipe_run` (the only CPU training command of the docs); GPU
    recipes parse."""
    _, argv = item
    if _is_cpu_recipe(argv):
        assert argv[1:] == ["--config", TINY_RECIPE] and program(argv) == "cegppo-train", f"run {argv} here"
        assert (request.getfixturevalue("tiny_recipe_run").out / "trainer_state.json").is_file()
    else:
        _parse_training_args(argv[1:] if program(argv) == "cegppo-train" else argv[2:])


def _parse_training_args(train_args: list[str]):
    script_args, _, model_args = parse_train_args(*train_args)
    assert model_args.model_name_or_path and script_args.dataset_name


@pytest.mark.parametrize("item", commands("accelerate"))
def test_accelerate_launches(item):
    """Every `accelerate launch`: its accelerate config loads and its recipe validates. Which configs and recipes
    they launch: tests/test_recipe_walk.py::test_doc_launch_lines_use_a_walked_config_and_recipe."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    _, argv = item
    script_at = next(i for i, word in enumerate(argv) if word.endswith(".py"))
    launch_args = launch_command_parser().parse_args([*argv[2:script_at], argv[script_at]])
    assert (ROOT / argv[script_at]).is_file()
    config = load_config_from_file(str(ROOT / launch_args.config_file))
    assert config.distributed_type is not None
    _parse_training_args(argv[script_at + 1 :])
    assert launch_args.mixed_precision == "no" or not _is_cpu_recipe(argv), "CPU launches need --mixed_precision no"


@pytest.mark.parametrize("item", commands("vllm"))
def test_vllm_serve_commands_are_trls(item):
    """vLLM's own server as TRL 1.16 starts it (`trl vllm-serve` is deprecated): dev mode and TRL's settings."""
    block, argv = item
    assert argv[2] in HUB_MODELS, argv
    assert re.search(r"VLLM_SERVER_DEV_MODE=1 (\S+ )*vllm serve " + re.escape(argv[2]), block.body), block.where
    assert_trls_vllm_serve_settings(argv)


@pytest.mark.parametrize("item", commands("sbatch"))
def test_sbatch_commands(item):
    """A shipped SLURM script; for train.slurm its recipe validates with the options after `--` (as the script's own
    parse does; tests/test_slurm.py runs the script) and its accelerate config is shipped."""
    _, argv = item
    script_at = next(i for i, word in enumerate(argv) if word.startswith("slurm/"))
    assert (ROOT / argv[script_at]).is_file(), argv[script_at]
    args = argv[script_at + 1 :]
    if argv[script_at] == "slurm/train.slurm":
        ours, train = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
        config = ours[ours.index("--accelerate-config") + 1] if "--accelerate-config" in ours else "zero3"
        assert (ROOT / "accelerate_configs" / f"{config}.yaml").is_file(), config
        _parse_training_args(["--config", ours[ours.index("--recipe") + 1], *train])
    else:
        assert argv[script_at] == "slurm/evaluate.slurm" and args and not args[0].startswith("-"), argv


def _on_demo(argv: list[str]) -> bool:
    return any(word.startswith(DEMO_OUTPUT + "/") for word in argv)


@pytest.mark.parametrize("item", commands("cegppo-eval", is_slow=_on_demo))
def test_eval_commands(item, stand_ins, tmp_path, request, monkeypatch, capsys):
    """Hub ids and placeholders become the tiny checkpoint; `cegppo-demo-output/...` is the shared quick demo's output.
    A command the demo printed is checked to be one (tests/test_demo_eval.py runs each printed command and checks that
    it reproduces the demo's held-out figure); any other command on the demo's output runs here and must reproduce
    the figure too."""
    _, argv = item
    cmd = [stand_ins.get(word, word) for word in argv[1:]]
    on_demo = _on_demo(cmd)
    cwd = request.getfixturevalue("quick_demo").cwd if on_demo else tmp_path
    if on_demo:
        summary = json.loads((cwd / DEMO_OUTPUT / "results.json").read_text())
        printed = [shlex.split(command)[1:] for command in summary["eval_commands"].values()]
        if cmd in printed:
            assert (cwd / cmd[0] / "config.json").is_file(), cmd
            return
        # the quick demo may draw fewer samples per problem than the full one the docs describe
        cmd = _set_flag(cmd, "--k", str(summary["sizes"]["eval_samples"]))
    else:
        for flag, value in (("--max-problems", "3"), ("--k", "2"), ("--max-new-tokens", "8")):
            cmd = _set_flag(cmd, flag, value)
    cmd = _set_flag(cmd, "--output", str(tmp_path / "eval.json"))
    assert "avg@" in _console("cegppo-eval", cmd, cwd, monkeypatch, capsys)
    if on_demo:
        # e.g. cegppo-demo-output/lm/runs/cegppo-seed0: the comparison's own cegppo-eval report of that model
        model = Path(cmd[0])
        report = cwd / (model.parent.parent / "start" if model.name == "start-model" else model) / "eval-boxed.json"
        (figures,) = json.loads(report.read_text())["datasets"].values()
        (metrics,) = json.loads((tmp_path / "eval.json").read_text())["datasets"].values()
        k = cmd[cmd.index("--k") + 1]
        assert metrics[f"avg@{k}"] == figures[f"avg@{k}"], (cmd, metrics, figures)


@pytest.mark.parametrize("item", commands("cegppo-recipes"))
def test_recipes_commands(item, tmp_path):
    _, argv = item
    _run([str(BIN / "cegppo-recipes"), *argv[1:]], cwd=tmp_path)
    if "--list" not in argv:
        assert (tmp_path / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml").is_file()
        assert (tmp_path / "accelerate_configs" / "zero3.yaml").is_file()


#: `cegppo-compare` commands of the docs run with these sizes (the docs' other flags kept: the recipe, the arms, the
#: gradings); the full runs are measurements (docs/comparison.md). --max_steps and --tiny_sft_steps are cegppo-train's.
COMPARE_SIZES = {"--seeds": "0", "--max_steps": "2", "--eval_problems": "3", "--eval_k": "2", "--tiny_sft_steps": "5",
                 "--per_device_train_batch_size": "8", "--num_generations": "4", "--steps_per_generation": "2",
                 "--jobs": "1"}  # fmt: skip


@pytest.mark.parametrize("item", commands("cegppo-compare", is_slow=lambda argv: True))
def test_compare_commands(item, tmp_path, monkeypatch, capsys):
    """Each documented comparison at the smallest sizes: it writes its table; its flags are the command's."""
    _, argv = item
    args = list(argv[1:])
    for flag, value in {**COMPARE_SIZES, "--out": str(tmp_path / "cmp")}.items():
        if flag in args:  # the flag and every value after it (--seeds 0 1 2)
            at = args.index(flag)
            end = next((i for i in range(at + 1, len(args)) if args[i].startswith("--")), len(args))
            del args[at:end]
        args += [flag, value]
    _console("cegppo-compare", args, ROOT, monkeypatch, capsys)
    assert (tmp_path / "cmp" / "results.md").is_file()
