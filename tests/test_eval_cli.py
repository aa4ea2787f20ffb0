"""`cegppo-eval`'s command line (issues 20 and 22): one argument system with `cegppo-train` (TRL's `TrlParser` over
dataclasses, and ``--config`` YAML), and bad input answered up front in one line naming the flag and the fix, exit
status 2."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
from shared import BIN, eval_error, run_checked, write_problems

from cegppo_trl.evaluation import EvalSettings, generation
from cegppo_trl.evaluation.settings import EvalArguments
from cegppo_trl.scripts.eval import main, parse_arguments


# A value of each flag `cegppo-eval` shares with `cegppo-train`, valid in both (`cegppo-train`'s name: value).
SHARED = {
    "model_name_or_path": "org/model",
    "dataset_name": "problems.jsonl",
    "dataset_test_split": "validation",
    "problem_column": "question",
    "answer_column": "final",
    "instruction": "{problem} Answer in \\boxed{}.",
    "system_prompt": "Be brief.",
    "example_problem": "What is 1+1?",
    "example_answer": "2",
    "temperature": "0.7",
    "top_p": "0.9",
    "top_k": "5",
    "max_completion_length": "64",
    "seed": "3",
    "reward_timeout_s": "2.0",
    "dtype": "float32",
}


# Every option name (underscore spelling) cegppo-eval reads -> the field of EvalArguments / EvalSettings it sets.
EVAL_FIELDS = {
    name: f.name
    for cls in (EvalArguments, EvalSettings)
    for f in dataclasses.fields(cls)
    for name in (f.name, *(a[2:] for a in f.metadata.get("aliases", ()) if "-" not in a[2:]))
}


def _spell(name: str, dashed: bool) -> str:
    return "--" + (name.replace("_", "-") if dashed else name)


@pytest.mark.parametrize("dashed", [False, True], ids=["--problem_column", "--problem-column"])
def test_shared_flags_have_one_name_and_both_spellings_in_both_commands(dashed, tmp_path):
    """Both commands read the flags they share under cegppo-train's names, written either way, and parse them to
    the same values (cegppo-train: the parser of the command, `make_parser`)."""
    from cegppo_trl.scripts.train import make_parser

    argv = [word for name, value in SHARED.items() for word in (_spell(name, dashed), value)]
    cpu = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    trained = make_parser().parse_args_and_config(args=[*argv, *cpu])
    train_names = {f.name for parsed in trained for f in dataclasses.fields(parsed)}
    assert set(EVAL_FIELDS) & train_names == set(SHARED), "SHARED lists every flag the two commands share"

    arguments, settings = parse_arguments(argv)
    for name in SHARED:
        field = EVAL_FIELDS[name]
        got = getattr(arguments, field) if hasattr(arguments, field) else getattr(settings, field)
        expected = next(getattr(parsed, name) for parsed in trained if hasattr(parsed, name))
        assert got == ([expected] if field == "datasets" else expected), name


@pytest.mark.parametrize("spelling", ["--config PATH", "--config=PATH"])
def test_config_yaml_gives_values_and_flags_win(spelling, tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text(
        "model_name_or_path: outputs/tiny\ndatasets: [builtin:arithmetic_eval, problems.jsonl]\nk: 8\n"
        "max_new_tokens: 512\ntemperature: 0.6\n"
    )
    given = spelling.replace("PATH", str(config)).split(" ")
    arguments, settings = parse_arguments([*given, "--k", "4", "--top-p", "0.9"])
    assert arguments.model_name_or_path == "outputs/tiny"
    assert arguments.datasets == ["builtin:arithmetic_eval", "problems.jsonl"]
    assert (settings.k, settings.max_new_tokens, settings.temperature, settings.top_p) == (4, 512, 0.6, 0.9)


def test_the_paper_preset_gives_defaults_that_config_and_flags_override(tmp_path):
    """`--preset paper`: the paper's five Hub sets with their k (@32, MATH500 @4), the authors' protocol and the
    paper's sampling, as defaults: a --config key wins over the preset, a flag over both."""
    from cegppo_trl.evaluation.datasets import PRESETS

    arguments, settings = parse_arguments(["m", "--preset", "paper"])
    assert arguments.datasets == [
        "HuggingFaceH4/aime_2024:train@32", "math-ai/aime25:test@32", "MathArena/hmmt_feb_2025:train@32",
        "HuggingFaceH4/MATH-500:test@4", "math-ai/amc23:test@32",
    ]  # fmt: skip
    expected = {"protocol": "authors", "temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_new_tokens": 32768}
    assert {name: getattr(settings, name) for name in expected} == expected
    assert PRESETS["paper"] == {"datasets": arguments.datasets, **expected}
    config = tmp_path / "eval.yaml"
    config.write_text("max_new_tokens: 16384\nprotocol: lighteval\n")
    arguments, settings = parse_arguments(["m", "--preset=paper", "--config", str(config), "--protocol", "boxed",
                                           "--datasets", "local.jsonl@2"])  # fmt: skip
    assert (settings.max_new_tokens, settings.protocol, settings.temperature) == (16384, "boxed", 0.6)
    assert arguments.datasets == ["local.jsonl@2"]


def test_compare_and_a_bad_protocol_as_a_user_runs_them(tmp_path, monkeypatch, capsys):
    """`cegppo-eval --compare A B` prints the sets side by side (exit 0); a different protocol, math-verify minor
    version, sampling or prompt is a warning, a patch version, the seed and the backend are not (the seed and backend:
    a note). An unknown protocol and a report that is not one are one line, exit status 2 (the console script)."""
    sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_new_tokens": 8, "k": 4, "seed": 0, "backend": "hf"}
    a = {"protocol": "authors", "math_verify": {"math-verify": "0.9.0", "latex2sympy2_extended": "1.11.0"},
         "sampling": sampling, "settings": {"instruction": "", "system_prompt": ""},
         "datasets": {"aime": {"k": 4, "avg@4": 0.25}, "math": {"k": 4, "avg@4": 0.5}}}  # fmt: skip
    b = copy.deepcopy(a)
    b["math_verify"]["math-verify"] = "0.9.1"
    b["sampling"]["seed"] = 1
    b["datasets"] = {"aime": {"k": 32, "avg@32": 0.3}}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "bad.json").write_text("{")

    def compare(b):  # the command's function, in this process (so coverage sees compare.py)
        (tmp_path / "b.json").write_text(json.dumps(b))
        assert main(["--compare", "a.json", "b.json"]) == 0
        return capsys.readouterr().out.splitlines()

    monkeypatch.chdir(tmp_path)

    lines = compare(b)
    assert [line.split()[1:] for line in lines if line.startswith("aime")] == [["avg@4", "25.0%", "avg@32", "30.0%"]]
    assert [line.split()[1:] for line in lines if line.startswith("math ")] == [["avg@4", "50.0%", "-"]]
    assert not [line for line in lines if line.startswith("warning")]
    assert [line for line in lines if line.startswith("note")] == [
        "note: seed 0 (A) and 1 (B): other samples, same law"
    ]
    b.update(protocol="boxed", math_verify={"math-verify": "0.8.0", "latex2sympy2_extended": "1.10.2"})
    b["sampling"]["temperature"] = 1.0
    b["settings"]["instruction"] = "default"
    warnings = [line for line in compare(b) if line.startswith("warning")]
    assert len(warnings) == 5 and all(line.endswith("the figures are not comparable.") for line in warnings)
    assert "warning: graded by different protocols: A authors, B boxed; the figures are not comparable." in warnings
    for words in ("math-verify 0.9.0 (A) and 0.8.0 (B)", "latex2sympy2_extended", "temperature 0.6 (A) and 1.0 (B)",
                  "instruction '' (A) and 'default' (B)"):  # fmt: skip
        assert any(words in line for line in warnings), words
    del b["protocol"]  # a report written before the protocol was recorded
    assert any("A authors, B not recorded" in line for line in compare(b))
    for argv, words in (
        (["--compare", "a.json", "bad.json"], "--compare bad.json: not a JSON report"),
        (["m", "--datasets", "builtin:arithmetic_eval", "--protocol", "author"], "invalid choice: 'author'"),
    ):
        proc = run_checked([BIN / "cegppo-eval", *argv], tmp_path, expect=2)
        assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr


def _one_line_error(err: str, *words: str) -> str:
    """The command's last line is its one error line (progress lines may come before), holding `words`."""
    errors = [line for line in err.splitlines() if line.startswith("cegppo-eval: error: ")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err, err
    assert all(word in errors[0] for word in words), (words, err)
    return errors[0]


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--temperature", "0"], ["--temperature (temperature) 0 is greedy", "pass --k 1 or a temperature > 0"]),
        (["--max_completion_length", "0"], ["--max-new-tokens (max_new_tokens) must be an integer >= 1"]),
        (["--k", "2", "--pass-k", "3"], ["--pass-k (pass_ks) needs values between 1 and --k = 2"]),
        (["--k", "abc"], ["argument --k", "invalid int value: 'abc'", "cegppo-eval --help"]),
        (["--instruction", "{question} Think."], ["--instruction", "{question}", "{problem}"]),
        (["--tempreature", "0.6"], ["'--tempreature', '0.6'"]),
        (["--protocol", "autors"], ["argument --protocol", "invalid choice: 'autors'", "boxed"]),
        (["--preset", "papers"], ["argument --preset", "invalid choice: 'papers'", "paper"]),
        (["--compare", "a.json", "b.json"], ["--compare takes two reports and nothing else"]),
        (["--model_name_or_path", "other"], ["two models", "give one"]),
        (["--backend", "trt"], ["argument --backend", "invalid choice: 'trt'"]),
        (["--use_kernels", "maybe"], ["argument --use_kernels", "true/false"]),
        (None, ["no model: pass MODEL first"]),
    ],
)
def test_bad_command_lines_are_one_line_naming_the_flag(flags, words, tmp_path, capsys):
    given = ["--datasets", "builtin:arithmetic_eval"]
    argv = given if flags is None else ["model", *given, *flags, "--output", tmp_path / "r.json"]
    _one_line_error(eval_error(argv, capsys), *words)


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize(
    "text, words",
    [
        ("datasets: [builtin:arithmetic_eval]\nbogus_key: 1\n", ["config file", "'--bogus_key', '1'"]),
        ("datasets: [builtin:arithmetic_eval]\nk: 1.5\n", ["--k (k) must be an integer >= 1, got 1.5"]),
        ("datasets: [builtin:arithmetic_eval]\nk: many\n", ["argument --k", "invalid int value: 'many'"]),
        (None, ["--config", "No such file or directory", "existing YAML file"]),
    ],
)
def test_bad_config_files_are_one_line(text, words, tmp_path, capsys):
    config = tmp_path / "eval.yaml"
    if text is not None:
        config.write_text(text)
    _one_line_error(eval_error(["model", "--config", config, "--output", tmp_path / "r.json"], capsys), *words)


@pytest.mark.usefixtures("no_model_loading")
@pytest.mark.parametrize("where", ["read-only folder", "a file as its folder", "a directory"])
def test_an_unwritable_output_fails_before_anything_loads(where, model_dir, tmp_path, capsys):
    """Today's failure: all generation and grading done, then every result lost at the write. The path is checked
    first (a temporary file in its folder), as root too (/proc takes no new files, whoever asks)."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    output = {
        "read-only folder": Path("/proc/cegppo-eval-report.json"),
        "a file as its folder": blocker / "reports" / "eval.json",
        "a directory": tmp_path,
    }[where]
    err = eval_error([model_dir, "--datasets", "builtin:arithmetic_eval", "--output", output, "--no-progress"], capsys)
    _one_line_error(err, f"--output '{output}'", "--output")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".cegppo-eval")] == []  # the probe is gone


@pytest.mark.parametrize("weights", ["model.safetensors", "adapter_model.safetensors"])
def test_a_truncated_safetensors_file_is_named(weights, model_dir, tmp_path, monkeypatch, capsys, request):
    """A full model's or a LoRA adapter's weights cut in half (an interrupted copy): one line naming the file, and
    nothing generated."""

    def no_generation(*args, **kwargs):
        raise AssertionError("generated with unreadable weights")

    monkeypatch.setattr(generation, "generate_completions", no_generation)
    model = request.getfixturevalue("adapter_dir") if weights.startswith("adapter") else model_dir
    data = (model / weights).read_bytes()
    (model / weights).write_bytes(data[: len(data) // 2])
    out = tmp_path / "report.json"
    err = eval_error([model, "--datasets", "builtin:arithmetic_eval", "--output", out, "--no-progress"], capsys)
    _one_line_error(err, f"cannot read the weights in {model / weights}", "Copy or download the model again")
    assert not out.exists()


@pytest.mark.usefixtures("one_torch_thread")
def test_an_offline_gpu_machine_gets_one_line_with_the_fix(
    offline_kernel_loader, model_dir, tmp_path, monkeypatch, capsys
):
    """conftest's offline Hub kernel loader: one line with the fixes, and the fixes it names then load the model (the
    same stand-in as tests/test_hub_kernels.py's for cegppo-train)."""
    import transformers
    from packaging.version import Version

    calls = offline_kernel_loader
    data = write_problems(tmp_path / "p.jsonl", [2])
    argv = [str(model_dir), "--datasets", str(data), "--k", "1", "--temperature", "0", "--max-new-tokens", "2"]
    argv += ["--device", "cpu", "--no-progress"]
    # transformers turns Hub kernels on by default from 5.25; at the floor (5.23) only a run that asks meets the case.
    ask = [] if Version(transformers.__version__) >= Version("5.25") else ["--use_kernels", "true"]
    err = eval_error([*argv, *ask, "--output", tmp_path / "r.json"], capsys)
    assert calls
    _one_line_error(err, "'kernels-community/rotary'", "USE_HUB_KERNELS=0", "--use_kernels false")

    calls.clear()
    assert main([*argv, "--use_kernels", "false", "--output", str(tmp_path / "flag.json")]) == 0
    monkeypatch.setenv("USE_HUB_KERNELS", "0")
    assert main([*argv, "--output", str(tmp_path / "env.json")]) == 0
    assert calls == []
    assert json.loads((tmp_path / "flag.json").read_text())["settings"]["use_kernels"] is False
