"""`cegppo-train` on bad input: one line naming the fault and the fix, exit status 2, nothing trained or saved; each
fault also raised where a Python user of the library meets it (`CEGPPOConfig`, `load_math_dataset`,
`CEGPPOTrainer`). TrlParser's own errors answer an unknown key, an unknown flag and a wrong type. Also: the recipe
spellings, the prompt words, rewards from the current directory, `--help`, and the message of a stopped run."""

import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from shared import BIN, ROOT, parse_train_args, run_checked, train_error
from trl_batches import build

from cegppo_trl.data import DatasetFormatError, load_math_dataset, write_jsonl
from cegppo_trl.scripts.stopping import interrupted_message, last_complete_checkpoint
from cegppo_trl.scripts.train import build_reward_funcs, main, make_parser


TINY_RECIPE = ROOT / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml"
CEGPPO_TRAIN = str(BIN / "cegppo-train")


# (flags, words of the one line); parsed before anything is built.
PARSE_FAULTS = {
    "max_train_samples": (["--max_train_samples", "0"], "--max_train_samples 0: it keeps the first N training rows"),
    "placeholder": (["--instruction", "{question} Think."], "the only placeholder is {problem}"),
    "completion_length": (["--max_completion_length", "0"], "the longest completion, in tokens, must be at least 1"),
    "batch_size": (["--per_device_train_batch_size", "0"], "micro-batch must be at least 1"),
    "temperature": (["--temperature", "0"], "the sampling temperature must be > 0"),
    "save_steps_0": (["--save_strategy", "steps", "--save_steps", "0"], "--save_steps 0 with --save_strategy steps"),
    "output_dir_file": (["--output_dir", str(TINY_RECIPE)], f"--output_dir '{TINY_RECIPE}' is a file"),
    "output_dir_under_file": (["--output_dir", f"{TINY_RECIPE}/run"], f"is under the file {TINY_RECIPE}"),
    "jit_checkpoint": (["--enable_jit_checkpoint", "true"], "transformers' SIGTERM handler would replace"),
    "dataset_streaming": (["--dataset_streaming", "true"], "--dataset_streaming True: cegppo-train loads the data"),
    "ignore_bias_buffers": (["--ignore_bias_buffers", "true"], "--ignore_bias_buffers True: it is for DDP"),
    "unknown_flag": (["--learnin_rate", "0.1"], "not used by the HfArgumentParser: ['--learnin_rate', '0.1']"),
    "reward_module": (["--reward_funcs", "no_such_module_xyz.f"], "No module named 'no_such_module_xyz'"),
    "reward_word": (["--reward_funcs", "math,format"], "separate several with spaces"),
}


@pytest.mark.parametrize("fault", PARSE_FAULTS)
def test_a_bad_argument_is_one_line_and_exit_2_before_anything_is_built(fault, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags, words = PARSE_FAULTS[fault]
    assert main(["--config", str(TINY_RECIPE), "--output_dir", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert words in train_error(err) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_trlparser_answers_an_unknown_recipe_key_and_a_wrong_type_and_a_missing_recipe(tmp_path, capsys):
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    (tmp_path / "key.yaml").write_text(yaml.safe_dump({**recipe, "learnin_rate": 0.1}))
    assert main(["--config", str(tmp_path / "key.yaml")]) == 2
    assert "Unknown arguments from config file: ['--learnin_rate', '0.1']" in train_error(capsys.readouterr().err)
    assert main(["--config", "recipes/tiny/cegppo/config_cpu.yml"]) == 2  # the shipped recipes listed after it
    assert "'recipes/tiny/cegppo/config_cpu.yml' is neither a file nor a shipped recipe" in capsys.readouterr().err
    assert main(["--max_steps", "2", "--config"]) == 2
    assert "--config needs the path of a YAML recipe" in train_error(capsys.readouterr().err)
    (tmp_path / "type.yaml").write_text(yaml.safe_dump({**recipe, "learning_rate": "abc"}))
    with pytest.raises(SystemExit) as exit_info:  # argparse: its usage line (short) and the error, status 2
        main(["--config", str(tmp_path / "type.yaml")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --learning_rate/--learning-rate: invalid float value: 'abc'" in err
    assert len(err.strip().splitlines()) == 2, err


DATA_FAULTS = {
    "missing_column": ([{"question_text": "1+1?", "answer": "2"}] * 40, "no problem column found"),
    "empty_answer": ([{"problem": "1+1?", "answer": ""}] * 40, "answer is empty in rows [0, 1, 2,"),
    "no_rows": ([], "has no rows"),
}


@pytest.mark.parametrize("fault", DATA_FAULTS)
def test_a_bad_data_set_is_one_line_and_exit_2(fault, tmp_path, capsys):
    rows, words = DATA_FAULTS[fault]
    data = write_jsonl(rows, tmp_path / "data.jsonl")
    assert main(["--config", str(TINY_RECIPE), "--dataset_name", data, "--output_dir", str(tmp_path / "o")]) == 2
    assert words in train_error(capsys.readouterr().err)
    with pytest.raises(DatasetFormatError, match=words.replace("[", r"\[")):  # the Python user's error
        load_math_dataset(data)


def test_the_console_command_answers_a_bad_data_set_in_one_line(tmp_path):
    """As a user meets it: the console script, status 2, one line on stderr (was a traceback and status 1)."""
    data = write_jsonl([{"question_text": "1+1?", "answer": "2"}], tmp_path / "data.jsonl")
    argv = [CEGPPO_TRAIN, "--config", str(TINY_RECIPE), "--dataset_name", data, "--output_dir", str(tmp_path / "o")]
    proc = run_checked(argv, tmp_path, {**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600, expect=2)
    assert proc.stderr.strip().splitlines() == [train_error(proc.stderr)] and "no problem column found" in proc.stderr


def test_a_data_set_smaller_than_a_generation_batch_is_refused(
    tmp_path, tiny_checkpoint, capsys, tiny_model, tiny_tokenizer
):
    """It trained 0 steps, exited 0 and saved the untrained model. The tiny recipe's generation batch: 8 prompts."""
    argv = ["--config", str(TINY_RECIPE), "--model_name_or_path", str(tiny_checkpoint), "--max_train_samples", "7"]
    assert main([*argv, "--output_dir", str(tmp_path / "o")]) == 2
    assert "has 7 prompts, fewer than the 8 of one generation batch" in train_error(capsys.readouterr().err)
    assert not (tmp_path / "o" / "model.safetensors").exists()
    data = load_math_dataset("builtin:arithmetic").select(range(1))
    with pytest.raises(ValueError, match="has 1 prompts, fewer than the 8 of one generation batch"):
        build(tiny_model, tiny_tokenizer, data, tmp_path / "p")  # conftest's cpu_config: 8 prompts a generation batch


def test_a_reward_that_returns_none_for_every_completion_stops_the_run(tmp_path, tiny_checkpoint, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "none_reward.py").write_text(
        "def nothing(completions, **kwargs):\n    return [None] * len(completions)\n"
    )
    out = tmp_path / "out"
    argv = ["--config", str(TINY_RECIPE), "--model_name_or_path", str(tiny_checkpoint), "--output_dir", str(out)]
    assert main([*argv, "--reward_funcs", "none_reward.nothing"]) == 3  # the stops' distinct status
    line = train_error(capsys.readouterr().err)
    assert "every reward function (nothing) returned None for all 32 completions of a batch" in line
    assert "no finite checkpoint was saved" in line  # the recipe saves none
    assert not (out / "model.safetensors").exists()  # not saved as a success


def test_a_truncated_weights_file_is_named(tmp_path, model_dir, capsys):
    from cegppo_trl.model_source import UnreadableWeightsError

    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    argv = ["--config", str(TINY_RECIPE), "--model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "o")]
    assert main(argv) == 2
    assert f"cannot read the weights in {weights}" in train_error(capsys.readouterr().err)
    with pytest.raises(UnreadableWeightsError, match="truncated or damaged"):  # the Python user's error
        build(str(model_dir), None, load_math_dataset("builtin:arithmetic"), tmp_path / "p")


def test_config_refuses_what_would_save_nothing_and_warns_about_checkpoints_inside_a_generation_batch(tmp_path):
    from cegppo_trl import CEGPPOConfig

    with pytest.raises(ValueError, match="would save no checkpoint"):
        CEGPPOConfig(str(tmp_path), save_strategy="steps", save_steps=0, use_cpu=True)
    spg = dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=4, use_cpu=True)
    with pytest.warns(UserWarning, match="save_steps 3 is not a multiple of the 4 optimizer steps per generation"):
        CEGPPOConfig(str(tmp_path / "a"), save_strategy="steps", save_steps=3, **spg)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="save_steps")
        CEGPPOConfig(str(tmp_path / "b"), save_strategy="steps", save_steps=8, **spg)


def test_the_trainer_refuses_an_output_dir_under_a_file_before_the_model_loads(tmp_path):
    """The Python user's side of `--output_dir`'s check (the config no longer probes the file system)."""
    from cegppo_trl import CEGPPOConfig, CEGPPOTrainer

    (tmp_path / "file").write_text("")
    args = CEGPPOConfig(str(tmp_path / "file" / "run"), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=f"--output_dir '{tmp_path / 'file' / 'run'}' is under the file"):
        CEGPPOTrainer("no/such-model-is-loaded", reward_funcs=[], args=args)


def _sources(*roots: Path) -> str:
    return "".join(path.read_text() for root in roots for path in ([root] if root.is_file() else root.rglob("*.py")))


def test_every_flag_is_read_or_refused():
    """Each of the ~230 flags of `cegppo-train` is read by this command or the package (the script's and the model's
    as `.name`), or by the TRL / transformers code that trains with it (the config's, also as `"name"`), or refused in
    one line (`UNUSED_SCRIPT_FLAGS`, checked above)."""
    import dataclasses
    import inspect
    import re

    import transformers
    import trl

    from cegppo_trl.scripts.train import UNUSED_SCRIPT_FLAGS

    script, config, model = make_parser().dataclass_types
    trl_root, hf_root = Path(trl.__file__).parent, Path(transformers.__file__).parent
    command = _sources(ROOT / "cegppo_trl") + inspect.getsource(trl.get_peft_config)
    command += inspect.getsource(trl.get_quantization_config)
    training = command + _sources(trl_root / "trainer", trl_root / "models", hf_root / "integrations")
    training += _sources(
        *(hf_root / f for f in ("trainer.py", "training_args.py", "trainer_callback.py", "modelcard.py"))
    )
    training += _sources(*(hf_root / f for f in ("trainer_pt_utils.py", "trainer_utils.py", "trainer_optimizer.py")))

    def unread(cls, text: str, read: str = "[.\"']") -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.init and not re.search(rf"{read}{f.name}\b", text)}

    assert unread(script, command, read="\\.") | unread(model, command, read="\\.") == set(UNUSED_SCRIPT_FLAGS)
    assert unread(config, training) == set()


def test_config_spellings_and_the_prompt_words(tmp_path, monkeypatch):
    from cegppo_trl.data import DEFAULT_INSTRUCTION

    for spelling in (["--config", str(TINY_RECIPE)], [f"--config={TINY_RECIPE}"]):
        _, config, _ = parse_train_args(*spelling, "--max_steps", "3")
        assert config.max_steps == 3 and config.learning_rate == 1.0e-3  # the recipe read, the flag wins
    monkeypatch.chdir(tmp_path)  # no recipes/ here: the copy shipped with the package
    script_args, _, _ = parse_train_args("--config", "recipes/tiny/cegppo/config_cpu.yaml", "--system_prompt", "none")
    assert script_args.system_prompt is None and script_args.dataset_name == "builtin:arithmetic"
    words = {"none": None, "default": DEFAULT_INSTRUCTION, "Q: {problem}": "Q: {problem}"}
    for word, meaning in words.items():  # as cegppo-eval reads them
        assert parse_train_args("--config", str(TINY_RECIPE), "--instruction", word)[0].instruction == meaning


def test_rewards_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "cli_msg_rewards.py").write_text("def short(completions, **kwargs):\n    return [0.0]\n")
    script_args = parse_train_args("--config", TINY_RECIPE)[0]
    script_args.reward_funcs = ["math", "cli_msg_rewards.short"]
    funcs = build_reward_funcs(script_args)
    assert funcs[1].__name__ == "short" and funcs[1](["x"]) == [0.0]


def test_help_describes_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Train a causal language model with CE-GPPO" in text and "--cegppo_beta1" in text


def test_interrupted_message_names_the_last_complete_checkpoint(tmp_path):
    out = tmp_path / "out"
    args = SimpleNamespace(output_dir=str(out), save_strategy="steps")
    argv = ["--config", "r.yaml", "--resume_from_checkpoint", "old/checkpoint-1", "--max_steps", "9"]
    message = interrupted_message(argv, args, "cegppo-train", "Ctrl-C")
    assert f"No checkpoint was saved in {out} yet; run the same command to start over." in message
    for step, complete in ((2, True), (10, True), (12, False)):  # 12: interrupted while saving
        (out / f"checkpoint-{step}").mkdir(parents=True)
        if complete:
            (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(out)) == str(out / "checkpoint-10")
    message = interrupted_message(argv, args, "cegppo-train", "SIGTERM")
    assert message.startswith("cegppo-train: interrupted (SIGTERM).")
    assert f"{out / 'checkpoint-12'} was being written when the run stopped and is incomplete" in message
    flag = f"--resume_from_checkpoint {out / 'checkpoint-10'}"
    assert message.endswith(f"  cegppo-train --config r.yaml --max_steps 9 {flag}")  # the old flag replaced
    no_save = interrupted_message([], SimpleNamespace(output_dir=str(tmp_path / "x"), save_strategy="no"), "p", "s")
    assert "saves no checkpoints (save_strategy: no)" in no_save
