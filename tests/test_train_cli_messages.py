"""`cegppo-train`'s messages name the fault and the fix: a wrong value or an unknown key in a YAML recipe, an unknown
flag, a `reward_funcs` entry that does not import, Ctrl-C (the last checkpoint and the resume flag), and `--help`
(a description, `--config`, a short list with `--help-all` for all). Each runs the command as a user would: the
console script in a subprocess, or `main([...])`."""

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from cegppo_trl.scripts.train import (
    TrainArgumentError,
    build_reward_funcs,
    interrupted_message,
    last_checkpoint,
    main,
    make_parser,
)


ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml"
CEGPPO_TRAIN = str(Path(sys.executable).parent / "cegppo-train")


def _sigint_default() -> None:
    """In the child: SIGINT at its default, even when the suite runs as a background job (which ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _recipe(tmp_path: Path, name: str = "recipe.yaml", **changes) -> Path:
    """The tiny recipe with `changes` (a key set to None is removed), written to `tmp_path / name`."""
    config = yaml.safe_load(TINY_RECIPE.read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _line_of(path: Path, key: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(f"{key}:"))


# ----------------------------------------------------------------------------------------------------------------
# A wrong value in a recipe: one short message naming the file, the key, the value and the expected type
# ----------------------------------------------------------------------------------------------------------------


def test_wrong_type_in_recipe_is_a_short_message_naming_file_key_value_and_type(tmp_path):
    recipe = _recipe(tmp_path, learning_rate="abc", max_steps="ten")
    proc = subprocess.run(
        [CEGPPO_TRAIN, "--config", str(recipe)], capture_output=True, text=True, env=_env(), timeout=300
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    lines = output.strip().splitlines()
    assert len(lines) <= 4, output  # was a 228-line usage dump, then the first error only
    assert "usage:" not in output and "--bnb_4bit_quant_storage" not in output and "Traceback" not in output
    assert f"{recipe}:{_line_of(recipe, 'learning_rate')}: `learning_rate: 'abc'`" in output
    assert "learning_rate takes a number (float" in output
    assert f"{recipe}:{_line_of(recipe, 'max_steps')}: `max_steps: 'ten'`" in output
    assert "max_steps takes an integer" in output
    assert f"Fix the recipe {recipe}" in output


def test_wrong_choice_list_item_and_bool_in_recipe(tmp_path, capsys):
    recipe = _recipe(tmp_path, lr_scheduler_type="cosin", reward_weights=[1.0, "high"], bf16="maybe")
    assert main(["--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "`lr_scheduler_type: 'cosin'` is not valid: lr_scheduler_type takes one of linear, cosine," in err
    assert "Did you mean cosine?" in err
    assert "`reward_weights` item 'high' is not valid: reward_weights takes a list" in err
    assert "`bf16: 'maybe'` is not valid: bf16 takes true or false" in err


def test_a_wrong_recipe_value_overridden_on_the_command_line_still_parses(tmp_path):
    """The check follows argparse: a recipe value that the command line replaces is never converted (CLI wins)."""
    recipe = _recipe(tmp_path, learning_rate="abc")
    _, config, _ = make_parser().parse_args_and_config(args=["--config", str(recipe), "--learning_rate", "0.25"])
    assert config.learning_rate == 0.25
    _, config, _ = make_parser().parse_args_and_config(args=[f"--config={TINY_RECIPE}", "--max_steps", "3"])
    assert config.max_steps == 3 and config.learning_rate == 1.0e-3  # `--config=PATH` reads the recipe too


# ----------------------------------------------------------------------------------------------------------------
# An unknown key in a recipe, an unknown flag: "did you mean"
# ----------------------------------------------------------------------------------------------------------------


def test_unknown_recipe_key_names_file_and_suggests_the_field(tmp_path, capsys):
    recipe = _recipe(tmp_path, learning_rate=None, learnin_rate=1e-3, cegppo_beta_1=0.5, zzz_qqq=1)
    assert main(["--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "fail_with_unknown_args" not in err  # TRL's advice for developers
    line = _line_of(recipe, "learnin_rate")
    assert f"{recipe}:{line}: unknown key `learnin_rate`: did you mean `learning_rate` (CEGPPOConfig)?" in err
    assert "unknown key `cegppo_beta_1`: did you mean `cegppo_beta1` (CEGPPOConfig)" in err
    assert "unknown key `zzz_qqq`: it is no field of CEGPPOScriptArguments, CEGPPOConfig" in err
    # A library caller still gets a ValueError (TrlParser's contract), now naming the fix.
    with pytest.raises(ValueError, match="did you mean `learning_rate`"):
        make_parser().parse_args_and_config(args=["--config", str(recipe)])


def test_unknown_flag_suggests_the_option(capsys):
    assert main(["--config", str(TINY_RECIPE), "--learnin_rate", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "unknown argument(s) on the command line: --learnin_rate 0.1" in err
    assert "--learnin_rate: did you mean --learning_rate?" in err


def test_missing_recipe_names_the_path(capsys):
    assert main(["--config", "recipes/tiny/cegppo/config_cpu.yml"]) == 2
    err = capsys.readouterr().err
    assert "'recipes/tiny/cegppo/config_cpu.yml' is neither a file nor a shipped recipe" in err
    assert "recipes/tiny/cegppo/config_cpu.yaml" in err  # the shipped recipes are listed
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------------
# reward_funcs: say where the name came from, what was not found and what is accepted
# ----------------------------------------------------------------------------------------------------------------


def test_reward_funcs_module_not_found_names_field_module_and_what_is_accepted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code = main(["--config", str(TINY_RECIPE), "--reward_funcs", "mymod.f", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "ModuleNotFoundError" not in err
    assert "reward_funcs: 'mymod.f': no module named 'mymod'" in err
    assert f"in the current directory ({tmp_path})" in err and "PYTHONPATH" in err
    assert "built-in rewards math, format or `module.function`" in err
    assert not (out / "tiny-init").exists()  # reported before the model is built


def test_reward_funcs_from_the_current_directory_and_its_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "cli_msg_rewards.py").write_text("def short(completions, **kwargs):\n    return [0.0]\n")
    (tmp_path / "cli_msg_broken.py").write_text("import cli_msg_missing_dependency_xyz\n")
    args = make_parser().parse_args_and_config(args=["--config", str(TINY_RECIPE)])[0]

    args.reward_funcs = ["math", "cli_msg_rewards.short"]
    funcs = build_reward_funcs(args)
    assert funcs[1].__name__ == "short" and funcs[1](["x"]) == [0.0]
    args.reward_funcs = ["cli_msg_rewards.long"]
    with pytest.raises(TrainArgumentError, match=r"module 'cli_msg_rewards' \(.*cli_msg_rewards.py\) has no function"):
        build_reward_funcs(args)
    args.reward_funcs = ["cli_msg_broken.f"]
    with pytest.raises(
        TrainArgumentError, match="it imports 'cli_msg_missing_dependency_xyz', which is not installed"
    ):
        build_reward_funcs(args)
    args.reward_funcs = ["math,format"]
    with pytest.raises(TrainArgumentError, match="Separate several rewards with spaces: --reward_funcs math format"):
        build_reward_funcs(args)


# ----------------------------------------------------------------------------------------------------------------
# --help: what the command does, --config, a short list; --help-all: everything
# ----------------------------------------------------------------------------------------------------------------


def _help(capsys, flag: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([flag])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_describes_the_command_lists_config_and_is_short(capsys):
    text = _help(capsys, "--help")
    lines = text.splitlines()
    assert len(lines) < 300, len(lines)  # was 1,397 lines
    assert lines[0] == "usage: cegppo-train [--config RECIPE.yaml] [--option VALUE ...]"
    head = "\n".join(lines[:40])
    assert "Train a causal language model with CE-GPPO" in head
    assert "cegppo-train --config recipes/tiny/cegppo/config_cpu.yaml" in head  # an example with a recipe
    assert "cegppo-recipes --list" in head and "recipes/<model>/<method>/config_*.yaml" in head
    assert re.search(r"^  --config RECIPE\.yaml +a YAML recipe", text, re.M)
    assert re.search(r"^  --help-all +show all \d+ options", text, re.M)
    # CE-GPPO's and the script's own options, and the most-used TRL ones
    parser = make_parser()
    for name in [*parser.cegppo_fields, "reward_funcs", "dataset_name", "tiny_sft_steps", "learning_rate", "use_peft"]:
        assert re.search(rf"^  --{name}\b", text, re.M), name
    assert "--bnb_4bit_quant_storage" not in text  # a rarely used one: only in --help-all
    assert "--help-all` lists them all" in " ".join(text.split())


def test_help_all_lists_every_option_and_config(capsys):
    text = _help(capsys, "--help-all")
    assert "Train a causal language model with CE-GPPO" in text
    assert re.search(r"^  --config RECIPE\.yaml", text, re.M)
    parser = make_parser()
    missing = [name for name in parser.field_owner if not re.search(rf"^  --{name}\b", text, re.M)]
    assert not missing, missing
    assert len(parser.field_owner) > 200
    for title in ("data and reward (CEGPPOScriptArguments)", "CE-GPPO (CEGPPOConfig)", "(trl.ModelConfig)"):
        assert title in text


# ----------------------------------------------------------------------------------------------------------------
# Ctrl-C: the last checkpoint and the flag that resumes from it
# ----------------------------------------------------------------------------------------------------------------


def _checkpoint(path: Path, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return path


def test_interrupted_message_names_the_last_complete_checkpoint(tmp_path):
    out = tmp_path / "out"
    args = SimpleNamespace(output_dir=str(out), save_strategy="steps")
    argv = ["--config", "r.yaml", "--resume_from_checkpoint", "old/checkpoint-1", "--max_steps", "9"]

    message = interrupted_message(argv, args)
    assert f"No checkpoint was saved in {out} yet; run the same command to start over." in message
    _checkpoint(out / "checkpoint-2")
    _checkpoint(out / "checkpoint-10")
    _checkpoint(out / "checkpoint-12", complete=False)  # interrupted while saving
    assert last_checkpoint(str(out)) == (str(out / "checkpoint-10"), str(out / "checkpoint-12"))
    message = interrupted_message(argv, args)
    assert f"Last checkpoint saved: {out / 'checkpoint-10'}" in message
    assert f"{out / 'checkpoint-12'} was being written when the run stopped and is incomplete" in message
    flag = f"--resume_from_checkpoint {out / 'checkpoint-10'}"
    assert f"run the same command with {flag} added" in message
    assert f"cegppo-train --config r.yaml --max_steps 9 {flag}" in message  # the old flag replaced
    no_save = interrupted_message([], SimpleNamespace(output_dir=str(tmp_path / "none"), save_strategy="no"))
    assert "saves no checkpoints (save_strategy: no)" in no_save and "--save_strategy steps --save_steps" in no_save


def test_ctrl_c_exits_130_naming_the_last_checkpoint_and_the_resume_flag(tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole process group (the grading workers too) once a checkpoint exists."""
    out = tmp_path / "run"
    argv = [
        "--config", str(TINY_RECIPE), "--output_dir", str(out), "--tiny_sft_steps", "0", "--max_steps", "100000",
        "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1000",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [CEGPPO_TRAIN, *argv], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=_sigint_default,  # a background job's ignored SIGINT would never arrive
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-1" / "trainer_state.json").is_file():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    match = re.search(r"Last checkpoint saved: (\S+)", stderr)
    assert match, stderr[-3000:]
    last = Path(match[1])
    assert (last / "trainer_state.json").is_file() and last.parent == out
    numbers = [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    assert last.name == f"checkpoint-{max(numbers)}"
    flag = f"--resume_from_checkpoint {last}"
    assert f"run the same command with {flag} added" in stderr
    command = next(line.strip() for line in stderr.splitlines() if line.strip().startswith("cegppo-train "))
    assert shlex.split(command) == ["cegppo-train", *argv, "--resume_from_checkpoint", str(last)]
    _, config, _ = make_parser().parse_args_and_config(args=shlex.split(command)[1:])  # the printed command parses
    assert config.resume_from_checkpoint == str(last) and config.output_dir == str(out)
    assert stderr.strip().splitlines()[-1].strip() == command  # the message closes the output


def test_parser_field_tables_cover_the_three_dataclasses():
    """The names the messages suggest and the help lists are every init field of the three dataclasses."""
    from trl import ModelConfig

    from cegppo_trl import CEGPPOConfig
    from cegppo_trl.scripts.train import CEGPPOScriptArguments

    parser = make_parser()
    expected = {f.name for cls in (CEGPPOScriptArguments, CEGPPOConfig, ModelConfig) for f in dataclasses.fields(cls)}
    expected -= {f.name for cls in (CEGPPOConfig,) for f in dataclasses.fields(cls) if not f.init}
    assert set(parser.field_owner) == expected
    assert parser.field_owner["cegppo_beta1"] == "CEGPPOConfig" and parser.field_owner["lora_r"] == "trl.ModelConfig"


# ----------------------------------------------------------------------------------------------------------------
# Bad values, refused where the arguments are parsed: one line naming the flag and the fix, exit 2, no model built
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--max_train_samples", "0", "it keeps the first N training rows and must be at least 1"),
        ("--instruction", "{question} Please reason step by step.", "only placeholder is {problem}"),
        ("--max_completion_length", "0", "the longest completion, in tokens, must be at least 1"),
        ("--per_device_train_batch_size", "0", "completions per process and micro-batch must be at least 1"),
        ("--temperature", "0", "the sampling temperature must be > 0"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag_before_the_model_builds(flag, value, words, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--config", str(TINY_RECIPE), flag, value, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cegppo-train: error: {flag} "), err
    assert words in err and "Traceback" not in err
    assert not out.exists()  # nothing built


def test_instruction_words_mean_what_they_mean_in_cegppo_eval():
    from cegppo_trl.data import DEFAULT_INSTRUCTION

    def parsed(word):
        return make_parser().parse_args_and_config(args=["--config", str(TINY_RECIPE), "--instruction", word])[0]

    assert parsed("default").instruction == DEFAULT_INSTRUCTION
    assert parsed("none").instruction is None
    assert parsed("Q: {problem}").instruction == "Q: {problem}"


def test_a_reward_that_returns_none_for_every_row_fails_instead_of_training_on_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "cli_msg_none_reward.py").write_text(
        "def nothing(completions, **kwargs):\n    return [None] * len(completions)\n"
    )
    out = tmp_path / "out"
    argv = ["--config", str(TINY_RECIPE), "--tiny_sft_steps", "0", "--output_dir", str(out)]
    assert main([*argv, "--reward_funcs", "cli_msg_none_reward.nothing"]) == 2
    err = capsys.readouterr().err
    assert "reward_funcs: every reward function (nothing) returned None for all 32 completions of a batch" in err
    assert "Traceback" not in err and not (out / "model.safetensors").exists()  # not saved as a success


def test_a_truncated_weights_file_is_named(tmp_path, tiny_model, tiny_tokenizer, capsys):
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()  # the save's own progress bar
    argv = ["--config", str(TINY_RECIPE), "--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"cannot read the weights in {weights}" in err and "truncated or damaged" in err
