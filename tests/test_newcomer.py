"""A newcomer's first hour: every command of the README's shell blocks names the one install it needs, that
install is enough to run it, and with an extra missing the command refuses in one line within seconds.

The fresh environment grows install by install, as the extras nest (base < `plot` < `real`), each installed as the
README says (`pip install torch==2.13.0 -e ".[extra]"`, from this clone, offline: the package index is local); at each
step the commands of that install run at the smallest sizes they accept and the commands of a later or GPU install
must refuse. The `dev` install's commands are CI's own (`.ci/run` runs those lines verbatim), and the `gpu` install
(vLLM's CUDA build) cannot be installed here: its launches are run as `cegppo-train` on this CPU and must refuse.
"""

import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from doc_blocks import readme_commands, shell_commands
from shared import HUB_EVAL_SETS, HUB_MODELS, PLACEHOLDER_MODELS, TINY_RECIPE, run_checked, wheel_env


ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
NESTED = ("", "plot", "real")  # each install holds the one before it (pyproject: real = plot + peft + gguf)
# Flags appended to a command (the last occurrence of a flag wins) for the smallest run it accepts.
SMALL = {
    "cegppo-demo": "--quick --toy-seeds 1 --toy-steps 2 --sft-steps 2 --seeds 1 --steps 1 --prompts-per-step 2 "
    "--num-generations 2 --eval-size 2 --eval-samples 1 --no-progress",
    "cegppo-train": "--tiny_sft_steps 1 --max_steps 1",
    "cegppo-eval": "--max-problems 2 --k 1 --max-new-tokens 4 --output eval.json",
    "cegppo-plot": "",
    "cegppo-recipes": "",
    "cegppo-compare": "--seeds 0 --max_steps 2 --eval_problems 3 --eval_k 2 --tiny_sft_steps 5 --jobs 1 "
    "--per_device_train_batch_size 8 --num_generations 4 --steps_per_generation 2",
    # the SmolLM2 scripts build the model from the package index: the real-model tier runs them shortened
    # (tests/real_model/test_real_model_learning.py); here their own install must import and parse them
    "python": "--help",
}
# What a command checks first (a `python` command: its script's): a missing extra refuses in one line.
NEEDS = {"cegppo-demo": "plot", "cegppo-plot": "plot", "cegppo-compare": "real", "real_model_learning.py": "real"}


def _needs(argv: list[str]) -> str | None:
    name = Path(argv[0]).name
    return NEEDS.get(Path(argv[1]).name if name == "python" else name)


REFUSAL_S = 60  # "within seconds": the imports alone take a few on a loaded 2-core machine


def _commands() -> list[tuple[str, list[str]]]:
    """(install, argv) of the README's commands a user runs, in README order (installs themselves left out)."""
    found = []
    for _, section, install, argv in readme_commands():
        is_install = Path(argv[0]).name in ("pip", "pip3") or argv[1:3] in (["-m", "venv"], ["-m", "pip"])
        if not is_install:
            found.append((install, argv))
    return found


def test_every_readme_command_names_one_install():
    """Each command's block names its install (a `pip install` in the command's chain or a comment above it), that
    install is the base one or one extra, the `dev` install's commands are lines `.ci/run` runs, and every other
    command is run or refused by the test below."""
    ci = shell_commands((ROOT / ".ci" / "run").read_text().replace("||", "&&"))
    for install, argv in _commands():
        assert install is not None, f"the README names no install for `{shlex.join(argv)}`"
        assert install == "" or install in EXTRAS, f"`{shlex.join(argv)}`: install {install!r} is not one extra"
        if install == "dev":
            assert argv in ci, f"`{shlex.join(argv)}` needs the dev install, but .ci/run does not run it"
        else:
            assert install in NESTED or install == "gpu", f"`{shlex.join(argv)}`: no test runs {install!r}"


def _gpu_launch_on_cpu(argv: list[str]) -> list[str] | None:
    """A GPU launch as `cegppo-train` (the same script) with its training options on this CPU; None for SLURM
    (tests/test_slurm.py runs it under stand-ins)."""
    if argv[:2] == ["accelerate", "launch"]:
        script = next(i for i, word in enumerate(argv) if word.endswith(".py"))
        return ["cegppo-train", *argv[script + 1 :], "--use_cpu", "true"]
    return [*argv, "--use_cpu", "true"] if argv[0] == "cegppo-train" else None


def _stand_ins(argv: list[str]) -> list[str]:
    """Hub ids and placeholders become what this test made: the tiny recipe's run and the built-in held-out sums."""
    run = yaml.safe_load((ROOT / TINY_RECIPE).read_text())["output_dir"]
    swap = dict.fromkeys((*HUB_MODELS, *PLACEHOLDER_MODELS, "RUN_DIR"), run)
    swap.update(dict.fromkeys(HUB_EVAL_SETS, "builtin:arithmetic_eval"))
    # the clone's scripts and files (the study's recipe): the commands run from the clone's root, this test elsewhere
    swap.update({w: str(ROOT / w) for w in argv if w.endswith((".py", ".yaml")) and (ROOT / w).is_file()})
    return [swap.get(word, word) for word in argv if not set(word) & set("[]") and word != "..."]


def _refuses(argv: list[str], extra: str, cwd: Path, env: dict) -> None:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=REFUSAL_S * 5)
    seconds, lines = time.perf_counter() - start, proc.stderr.strip().splitlines()
    said = f"`{shlex.join(argv)}` without {extra!r} ({seconds:.0f} s, exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and seconds < REFUSAL_S, said
    assert lines and "which is not installed: pip install 'cegppo-trl[" in lines[-1] and not proc.stdout.strip(), said


@pytest.mark.slow  # a fresh venv and each install the README names: 4 min on 2 cores shared with two other jobs
def test_readme_commands_run_from_their_own_install(tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    run_checked([sys.executable, "-m", "venv", venv], tmp_path)
    env, commands = wheel_env(venv), _commands()
    installs = [extra for extra in NESTED if any(install == extra for install, _ in commands)]
    for step, extra in enumerate(installs):
        target = f"{ROOT}[{extra}]" if extra else str(ROOT)
        run_checked([venv / "bin" / "pip", "install", "-q", "torch==2.13.0", "-e", target], tmp_path, env, 1800)
        for install, argv in commands:
            name = Path(argv[0]).name
            if install == extra:  # its own install: it runs, at the smallest sizes it accepts
                run_checked([name, *_stand_ins(argv[1:]), *SMALL[name].split()], work, env)
            elif step == 0 and install == "gpu" and (launch := _gpu_launch_on_cpu(argv)):
                _refuses(launch, install, work, env)
            elif step == 0 and _needs(argv) == install != extra:
                _refuses([name, *_stand_ins(argv[1:])], install, work, env)  # it must stop before any work


# (console entry point, arguments, the module made missing or None, words of the one line it must print)
REFUSALS = {
    "demo without matplotlib": ("cegppo_trl.demo.run:main", [], "matplotlib", "pip install 'cegppo-trl[plot]'"),
    "demo output under a file": ("cegppo_trl.demo.run:main", ["--output-dir", "{file}/out"], None, "under the file"),
    "plot output under a file": (
        "cegppo_trl.demo.plotting:main",
        ["r", "--out", "{file}/a.png"],
        None,
        "under the file",
    ),
    "recipes into a file": ("cegppo_trl.resources:main", ["{file}"], None, "is a file"),
    "train LoRA without peft": ("cegppo_trl.scripts.train:main", ["--use_peft", "true"], "peft", "cegppo-trl[peft]"),
    "train vLLM without vllm": ("cegppo_trl.scripts.train:main", ["--use_vllm", "true"], "vllm", "cegppo-trl[vllm]"),
    "eval vLLM without vllm": ("cegppo_trl.scripts.eval:main", ["--backend", "vllm"], "vllm", "cegppo-trl[vllm]"),
    "eval adapter without peft": ("cegppo_trl.scripts.eval:main", [], "peft", "cegppo-trl[peft]"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_commands_refuse_in_one_line_before_any_work(
    case, adapter_dir, no_model_loading, tmp_path, capsys, monkeypatch
):
    """Each console command refuses what it cannot do (a missing extra, a path it cannot write) in one line and exit
    status 2 before it loads a model or writes anything."""
    import importlib.util
    import pkgutil

    entry, args, missing, words = REFUSALS[case]
    file = tmp_path / "a-file"
    file.write_text("")
    args = [arg.format(file=file) for arg in args]
    if entry.endswith("train:main"):
        args = ["--config", str(ROOT / TINY_RECIPE), "--output_dir", str(tmp_path / "run"), *args]
    elif entry.endswith("eval:main"):
        args = [str(adapter_dir), "--datasets", "builtin:arithmetic_eval", "--max-problems", "1", *args]
    find_spec = importlib.util.find_spec  # as without the extra (a fresh venv without it: the slow test above)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(pkgutil.resolve_name(entry)(args))
    err = capsys.readouterr().err  # cegppo-eval may first say which settings it read
    assert exit_info.value.code == 2 and words in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "adapter"]  # nothing written
