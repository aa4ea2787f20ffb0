"""Evaluation (`cegppo_trl/evaluation/`, `cegppo-eval`): the estimators against brute force, the one declaration and
the one check of the settings, what may be evaluated (full models, LoRA adapters, Hub ids, ID:SPLIT sets), the
command on a tiny local model, the report written set by set, the vLLM backend's wiring (with a stand-in module), the
TRL code the package mirrors, and `AvgAtKCallback` on one process (tests/test_callback_multiprocess.py: two)."""

import copy
import dataclasses
import importlib.util
import itertools
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from math import comb
from pathlib import Path

import pytest
import torch
from avg_at_k_worker import Recorder
from shared import EVAL_SETTING_NAMES, TINY_INSTRUCTION, eval_error, write_problems

from cegppo_trl.evaluation import (
    PROMPT_FILE,
    AvgAtKCallback,
    EvalSettings,
    evaluate_completions,
    evaluate_model,
    format_summary,
    generate_completions,
    load_eval_settings,
    parse_dataset_spec,
    pass_at_k,
    prompt_token_ids,
    save_eval_settings,
    summarize_counts,
)
from cegppo_trl.evaluation.settings import EvalArguments
from cegppo_trl.model_source import resolve_model_source
from cegppo_trl.scripts.eval import main, parse_arguments
from cegppo_trl.trl_mirror import completion_token_mask


ROOT = Path(__file__).resolve().parents[1]
STANDINS = Path(__file__).resolve().parent / "standins"


def brute_force_pass_at_k(outcomes, k):
    """Fraction of the k-subsets of the samples that contain at least one correct sample."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_edge_cases_and_large_n():
    assert pass_at_k(32, 0, 32) == 0.0 and pass_at_k(32, 1, 32) == 1.0
    assert pass_at_k(32, 8, 1) == pytest.approx(8 / 32)  # pass@1 is the plain accuracy
    assert pass_at_k(1000, 3, 500) == pytest.approx(1 - comb(997, 500) / comb(1000, 500))
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_evaluate_completions_grades_and_averages():
    completions = [
        ["so \\boxed{12}", "\\boxed{13}", "12", "no answer here"],  # 2 correct ("12" ends the text)
        ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{2}"],  # 3 correct
        ["\\boxed{7}"] * 4,  # 0 correct
    ]
    solutions = ["12", "\\frac{1}{2}", "8"]
    report = evaluate_completions(completions, solutions, pass_ks=[1, 2, 4])
    assert report["num_correct"] == [2, 3, 0]
    assert report["avg@4"] == pytest.approx(5 / 12)
    assert report["pass@1"] == pytest.approx(5 / 12)
    outcomes = [[True, False, True, False], [True, True, True, False], [False] * 4]
    for k in (2, 4):
        expected = sum(brute_force_pass_at_k(o, k) for o in outcomes) / 3
        assert report[f"pass@{k}"] == pytest.approx(expected)
    assert report["status_counts"]["correct"] == 5 and report["status_counts"]["no_answer"] >= 1
    line = format_summary("toy", report)
    assert line.startswith("toy: avg@4 = 41.7% | pass@1 = 41.7% | pass@2 = ") and "3 problems x 4 samples" in line
    with pytest.raises(ValueError):
        evaluate_completions(completions, solutions, pass_ks=[5])
    with pytest.raises(ValueError):
        evaluate_completions([["a"], ["b", "c"]], ["1", "2"])


def test_summarize_counts_leaves_out_unparseable_golds():
    figures = summarize_counts([2, 0, 4], 4, [1, 4], skipped=[False, True, False])
    assert figures["num_problems"] == 3 and figures["num_skipped"] == 1
    assert figures["avg@4"] == pytest.approx(6 / 8) and figures["pass@4"] == 1.0
    assert figures["pass@1"] == pytest.approx(figures["avg@4"])
    with pytest.raises(ValueError, match="between 0 and k"):
        summarize_counts([5], 4)


@pytest.mark.parametrize(
    "protocol, think",
    [("boxed", "no_answer"), ("authors", "correct"), ("lighteval", "no_answer"), ("lighteval_avg", "correct")],
)
def test_every_sample_gets_a_counted_status(protocol, think):
    """An empty completion, a whitespace one and one that is all think block with no answer are `no_answer`, an empty
    gold and one math-verify cannot parse `bad_gold` (the problem left out and counted in `num_skipped`), under every
    protocol: counted in the report and in the printed line, never a crash or a silent 0. The protocol reaches the
    grader: an answer only inside the think block is `think` (the authors and lighteval's avg@n parse the whole
    completion, lighteval's pass@k removes the think block and boxed reads after </think>)."""
    completions = [
        ["<think>so 12?</think> The answer is \\boxed{12}.", "", "<think>Let me think about this problem and", " "],
        ["\\boxed{3}"] * 4,
    ]  # fmt: skip
    report = evaluate_completions(completions, ["12", ""], protocol=protocol)
    assert report["statuses"] == [["correct", "no_answer", "no_answer", "no_answer"], ["bad_gold"] * 4]
    assert report["status_counts"] == {"correct": 1, "no_answer": 3, "bad_gold": 4}
    assert (report["num_skipped"], report["avg@4"]) == (1, 0.25)
    assert "1 skipped (unparseable gold); samples: 3 no_answer" in format_summary("set", report)
    assert evaluate_completions([["\\boxed{3}"]], ["\\frac{"], protocol=protocol)["num_skipped"] == 1
    assert evaluate_completions([["<think>\\boxed{8}</think>"]], ["8"], protocol=protocol)["statuses"] == [[think]]


def test_every_setting_is_one_field_one_flag_and_one_report_entry():
    """The flags are EvalSettings' fields (plus EvalArguments'), each spelled --name, --name-with-dashes or as the
    messages spell it (`EvalSettings.flag`); a command line sets exactly those fields (the report records every field:
    test_cegppo_eval_writes_json_report)."""
    names = {f.name for f in dataclasses.fields(EvalSettings)}
    given = {
        "instruction": "{problem} Answer in \\boxed{}.", "system_prompt": "Be brief.", "temperature": 0.7,
        "top_p": 0.9, "top_k": 5, "max_new_tokens": 7, "k": 3, "pass_ks": [1, 3], "seed": 4, "timeout_s": 2.0,
        "split": "validation", "problem_column": "question", "answer_column": "final", "max_problems": 9,
        "backend": "vllm", "dtype": "float32", "base_model": "org/base", "batch_size": 8, "device": "cpu",
        "use_kernels": False, "max_model_len": 4096, "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2,
        "merge_dir": "merged", "protocol": "authors", "example_problem": "What is 1+1?", "example_answer": "2",
    }  # fmt: skip
    assert set(given) == names, "this test gives every field a non-default value"
    spellings = (lambda n: f"--{n}", lambda n: "--" + n.replace("_", "-"), EvalSettings.flag)
    for spell in spellings:
        argv = ["m", "--datasets", "x.jsonl"]
        for name, value in given.items():
            argv += [spell(name), *map(str, value if isinstance(value, list) else [value])]
        arguments, settings = parse_arguments(argv)
        assert dataclasses.asdict(settings) == given, spell("top_p")
        assert arguments == EvalArguments(datasets=["x.jsonl"], model_name_or_path="m")
    assert parse_arguments(["m", "--datasets", "x"])[1] == EvalSettings()
    run = ["--datasets", "a", "b", "--output", "r.json", "--save_completions", "--no-progress"]
    assert parse_arguments(["--model_name_or_path", "m", *run])[0] == EvalArguments(
        datasets=["a", "b"], model_name_or_path="m", output="r.json", save_completions=True, progress=False
    )


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("k", 0, "--k"),
        ("top_p", 1.5, "--top-p"),
        ("temperature", -1.0, "--temperature"),
        ("max_new_tokens", 0, "--max-new-tokens"),
        ("batch_size", 0, "--batch-size"),
        ("gpu_memory_utilization", 1.5, "--gpu-memory-utilization"),
        ("tensor_parallel_size", 0, "--tensor-parallel-size"),
        ("top_k", -1, "--top-k"),
    ],
)
def test_bad_settings_fail_once_with_the_flag_named(field, value, flag, capsys, tmp_path):
    with pytest.raises(ValueError, match=f"^{flag} \\({field}\\)") as error:
        EvalSettings(**{field: value}).validate()
    for spelling in (flag, "--" + field):  # the command, either spelling: the same message, before anything loads
        argv = ["model", "--datasets", "builtin:arithmetic_eval", spelling, value, "--output", tmp_path / "r"]
        assert eval_error(argv, capsys) == f"cegppo-eval: error: {error.value}\n"
    if field in ("top_p", "temperature", "max_new_tokens", "top_k"):  # generation checks with the same code
        with pytest.raises(ValueError, match=f"^{flag} \\({field}\\)"):
            generate_completions(None, None, ["p"], 2, **{field: value})


def test_prompt_words_none_and_default():
    from cegppo_trl.data import DEFAULT_INSTRUCTION

    assert EvalSettings(instruction="none").instruction == ""
    assert EvalSettings(instruction="default").instruction == DEFAULT_INSTRUCTION
    assert EvalSettings(system_prompt="none").system_prompt == ""
    assert EvalSettings().instruction is None  # None: not given (the model's, else the paper's)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("HuggingFaceH4/MATH-500", ("HuggingFaceH4/MATH-500", "test", None)),
        ("HuggingFaceH4/aime_2024:train", ("HuggingFaceH4/aime_2024", "train", None)),
        ("math-ai/amc23:test[:10]", ("math-ai/amc23", "test[:10]", None)),
        ("builtin:arithmetic_eval", ("builtin:arithmetic_eval", "test", None)),
        ("HuggingFaceH4/MATH-500:test@4", ("HuggingFaceH4/MATH-500", "test", 4)),
        ("builtin:arithmetic_eval@2", ("builtin:arithmetic_eval", "test", 2)),
    ],
)
def test_dataset_specs(text, expected):
    """`ID`, `ID:SPLIT`, a built-in set, each with an optional `@K` (its own samples per problem; not in the name)."""
    spec = parse_dataset_spec(text)
    assert (spec.source, spec.split, spec.k) == expected
    assert spec.name == text.rsplit("@", 1)[0]


def test_dataset_spec_refuses_a_split_on_a_file(tmp_path):
    data = write_problems(tmp_path / "p.jsonl", [1])
    assert parse_dataset_spec(str(data)).source == str(data)
    for text in (f"{data}:train", "builtin:arithmetic_eval:train"):
        with pytest.raises(ValueError, match="a split applies to Hub data sets"):
            parse_dataset_spec(text)
    with pytest.raises(ValueError, match="empty split"):
        parse_dataset_spec("math-ai/aime25:")
    with pytest.raises(ValueError, match="after '@' must be >= 1"):
        parse_dataset_spec(f"{data}@0")
    odd = write_problems(tmp_path / "p@2", [1])  # a file whose name ends in @2 is that file
    assert (parse_dataset_spec(str(odd)).source, parse_dataset_spec(str(odd)).k) == (str(odd), None)


@pytest.mark.parametrize(
    "name",
    ["missing-dir/model", "./model", "~/no/such/model/here", "out/runs/cegppo/final", "not a hub id"],
)
def test_cegppo_eval_names_a_missing_local_path(name, tmp_path, monkeypatch, capsys):
    """A local path that does not exist is reported as such (huggingface_hub's repo-id check decides what could be a
    Hub id), not as a Hub download error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "missing-dir").mkdir()  # an existing parent: "missing-dir/model" is a path, not a Hub id
    message = eval_error([name, "--datasets", "builtin:arithmetic_eval", "--output", str(tmp_path / "x.json")], capsys)
    assert f"model path {name!r} does not exist" in message and "Hugging Face Hub id" in message
    assert resolve_model_source("org/model-name").path == "org/model-name"  # a valid Hub id passes the check


def test_cegppo_eval_names_a_directory_without_a_model(model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "final")
    (run / "trainer_state.json").write_text("{}")
    message = eval_error([run, "--datasets", "builtin:arithmetic_eval", "--output", tmp_path / "x.json"], capsys)
    assert "holds no saved model (no config.json or adapter_config.json)" in message and str(run / "final") in message


def test_lora_adapter_source(adapter_dir, tiny_checkpoint, tmp_path):
    source = resolve_model_source(str(adapter_dir))
    assert source.path == str(tiny_checkpoint) and source.adapter == str(adapter_dir)
    assert source.tokenizer_dir == str(adapter_dir) and source.settings_dirs[0] == str(adapter_dir)
    moved = Path(shutil.copytree(adapter_dir, tmp_path / "moved"))
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone" / "base")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="base_model_name_or_path in .*adapter_config.json.*--base-model"):
        resolve_model_source(str(moved))
    assert resolve_model_source(str(moved), base_model=str(tiny_checkpoint)).path == str(tiny_checkpoint)
    with pytest.raises(ValueError, match="--base-model applies to LoRA adapter folders"):
        resolve_model_source(str(tiny_checkpoint), base_model=str(tiny_checkpoint))


@pytest.mark.usefixtures("one_torch_thread")
def test_cegppo_eval_writes_json_report(model_dir, tmp_path, capsys):
    data = write_problems(tmp_path / "probs.jsonl", [1, 2, 3])
    out = tmp_path / "reports" / "eval.json"
    argv = [
        str(model_dir), "--datasets", "builtin:arithmetic_eval", str(data), "--max-problems", "4", "--k", "3",
        "--pass-k", "1", "2", "3", "--max-new-tokens", "6", "--batch-size", "5", "--instruction", TINY_INSTRUCTION,
        "--device", "cpu", "--output", str(out), "--save-completions", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == str(model_dir) and report["settings"]["k"] == 3 and report["pending"] == []
    assert set(report["settings"]) == {f.name for f in dataclasses.fields(EvalSettings)} | {"from_checkpoint"}
    assert report["settings"]["temperature"] == 0.6 and report["settings"]["top_p"] == 0.95
    assert report["protocol"] == "boxed" and report["math_verify"]["math-verify"] == version("math-verify")
    assert report["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_new_tokens": 6, "k": 3,
                                  "seed": 0, "backend": "hf"}  # fmt: skip
    assert list(report["datasets"]) == ["builtin:arithmetic_eval", str(data)]
    for name, n in (("builtin:arithmetic_eval", 4), (str(data), 3)):
        metrics = report["datasets"][name]
        assert metrics["num_problems"] == n and len(metrics["problems"]) == n
        counts = [p["num_correct"] for p in metrics["problems"]]
        assert metrics["avg@3"] == pytest.approx(sum(counts) / (3 * n))
        for j in (1, 2, 3):
            assert metrics[f"pass@{j}"] == pytest.approx(sum(pass_at_k(3, c, j) for c in counts) / n)
        assert metrics["status_counts"].get("correct", 0) == sum(counts)
        assert metrics["pass@1"] == pytest.approx(metrics["avg@3"])
        assert all(len(p["completions"]) == 3 and 0 <= p["num_correct"] <= 3 for p in metrics["problems"])
        assert sum(metrics["status_counts"].values()) == 3 * n
    assert report["datasets"][str(data)]["problems"][2]["solution"] == "3"
    assert "Put the final answer" in report["datasets"][str(data)]["problems"][0]["problem"]
    lines = [line for line in capsys.readouterr().out.splitlines() if ": avg@" in line]  # (deepspeed may log too)
    assert len(lines) == 2 and lines[0].startswith("builtin:arithmetic_eval: avg@3 = ")
    assert lines[1].startswith(f"{data}: avg@3 = ") and "(3 problems x 3 samples" in lines[1]

    # Same seed, same samples, whatever the other sets: each set starts from the seed.
    out2 = tmp_path / "eval2.json"
    alone = [str(model_dir), "--datasets", str(data), *argv[4:-4], "--output", str(out2), "--save-completions"]
    assert main([*alone, "--no-progress"]) == 0
    again = json.loads(out2.read_text())["datasets"][str(data)]
    assert [p["completions"] for p in again["problems"]] == [
        p["completions"] for p in report["datasets"][str(data)]["problems"]
    ]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_protocol_brings_its_prompt_and_each_set_its_own_k(model_dir, tmp_path):
    """`--protocol authors` prompts with the raw problem although the model declares an instruction (a flag still
    wins), `lighteval` with its template; `SET@K` sets a set's own samples per problem; the report says it all."""
    from cegppo_trl.rewards.protocols import LIGHTEVAL_MATH_TEMPLATE

    save_eval_settings(model_dir, instruction=TINY_INSTRUCTION, temperature=1.0, max_new_tokens=4)
    data = write_problems(tmp_path / "p.jsonl", [1, 2])
    sets = [f"{data}@1", "builtin:arithmetic_eval@3"]
    report = evaluate_model(str(model_dir), sets, protocol="authors", max_problems=2, save_completions=True,
                            progress=False)  # fmt: skip
    assert report["protocol"] == "authors" and report["settings"]["instruction"] == ""
    assert report["settings"]["from_checkpoint"] == ["temperature", "top_p", "top_k", "max_new_tokens"]
    first, second = (report["datasets"][name] for name in (str(data), "builtin:arithmetic_eval"))
    assert (first["k"], second["k"], "avg@1" in first, "avg@3" in second) == (1, 3, True, True)
    assert [len(p["completions"]) for p in first["problems"] + second["problems"]] == [1, 1, 3, 3]
    assert first["problems"][0]["problem"] == "What is 0+1?"  # the raw problem, the authors' prompt
    assert sum(second["status_counts"].values()) == 2 * 3

    flag = evaluate_model(str(model_dir), [str(data)], protocol="authors", instruction="default", k=1, progress=False)
    assert flag["settings"]["instruction"].startswith("Please reason step by step")
    template = evaluate_model(str(model_dir), [str(data)], protocol="lighteval", k=1, save_completions=True,
                              progress=False)  # fmt: skip
    problem = template["datasets"][str(data)]["problems"][0]["problem"]
    assert problem == LIGHTEVAL_MATH_TEMPLATE.replace("{problem}", "What is 0+1?").strip()  # (the report strips)
    with pytest.raises(ValueError, match="--pass-k"):  # a set's own K is checked against --pass-k, before loading
        evaluate_model(str(model_dir), [f"{data}@2"], pass_ks=[1, 3], k=4, progress=False)


@pytest.mark.usefixtures("no_model_loading")
def test_every_set_is_checked_before_the_model_loads(model_dir, tmp_path, capsys):
    """A missing later set, a split on a file and an unknown built-in set are all reported at once, before any
    model code runs, and nothing is evaluated."""
    good = write_problems(tmp_path / "good.jsonl", [1, 2])
    bad = ["missing.jsonl", "builtin:arithmetic_eval:train", "builtin:nope"]
    out = tmp_path / "report.json"
    message = eval_error([model_dir, "--datasets", good, *bad, "--output", out, "--no-progress"], capsys)
    assert "3 of 4 data sets cannot be used (nothing was evaluated" in message
    assert all(f"  {name}: " in message for name in bad) and f"  {good}: " not in message
    assert not out.exists()


@pytest.mark.usefixtures("one_torch_thread")
def test_each_set_is_written_as_soon_as_it_finishes(model_dir, tmp_path, monkeypatch, capsys):
    """The report on disk holds every finished set (and the pending ones) after each set; when a later set fails
    during generation, the finished set stays in the report and the error says so."""
    from cegppo_trl.evaluation import generation

    first = write_problems(tmp_path / "first.jsonl", [1, 2, 3])
    second = write_problems(tmp_path / "second.jsonl", [4, 5])
    out = tmp_path / "report.json"
    seen_on_disk = []
    report = evaluate_model(
        str(model_dir), [str(first), str(second)], k=2, max_new_tokens=4, output=out, progress=False,
        on_result=lambda name, metrics: seen_on_disk.append(json.loads(out.read_text())),
    )  # fmt: skip
    assert [list(r["datasets"]) for r in seen_on_disk] == [[str(first)], [str(first), str(second)]]
    assert [r["pending"] for r in seen_on_disk] == [[str(second)], []]
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))

    real_generate = generation.generate_completions
    calls = []

    def fail_on_the_second_set(model, tokenizer, prompts, k, **settings):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_generate(model, tokenizer, prompts, k, **settings)

    monkeypatch.setattr(generation, "generate_completions", fail_on_the_second_set)
    out2 = tmp_path / "report2.json"
    argv = [str(model_dir), "--datasets", str(first), str(second), "--k", "2", "--max-new-tokens", "4"]
    message = eval_error([*argv, "--output", str(out2), "--no-progress"], capsys)
    assert "out of memory (simulated)" in message and f"the finished sets ({first}) are in {out2}" in message
    kept = json.loads(out2.read_text())
    assert list(kept["datasets"]) == [str(first)] and kept["pending"] == [str(second)]
    assert kept["datasets"][str(first)]["avg@2"] == report["datasets"][str(first)]["avg@2"]


@pytest.mark.usefixtures("one_torch_thread")
def test_eval_settings_travel_with_the_checkpoint(tiny_checkpoint, model_dir, tmp_path, capsys):
    """`save_eval_settings` writes cegppo_prompt.json + generation_config.json; `cegppo-eval` uses them when no flag
    is given (and says so), explicit flags win, and a model without the file keeps the paper's defaults."""
    from transformers import AutoModelForCausalLM

    from cegppo_trl.data import DEFAULT_INSTRUCTION

    assert load_eval_settings(tiny_checkpoint) is None
    paper = {"instruction": DEFAULT_INSTRUCTION, "system_prompt": "", "temperature": 0.6, "top_p": 0.95, "top_k": 0,
             "max_new_tokens": 32768}  # fmt: skip
    resolved, used = EvalSettings().resolve(tiny_checkpoint)
    assert ({name: getattr(resolved, name) for name in paper}, used) == (paper, [])
    save_eval_settings(model_dir, instruction=TINY_INSTRUCTION, temperature=1.0, top_p=1.0, max_new_tokens=6)
    assert (model_dir / PROMPT_FILE).is_file()
    saved = {"instruction": TINY_INSTRUCTION, "system_prompt": "", "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    assert load_eval_settings(model_dir) == {**saved, "max_new_tokens": 6}
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # the standard place: plain `generate` samples the same
    assert model.generation_config.do_sample and model.generation_config.max_new_tokens == 6
    assert model.generation_config.temperature == 1.0 and model.generation_config.top_k == 0
    resolved, used = EvalSettings(temperature=0.0, instruction="default", k=1).resolve(model_dir)
    expected = {**saved, "instruction": DEFAULT_INSTRUCTION, "temperature": 0.0, "max_new_tokens": 6}
    assert {name: getattr(resolved, name) for name in expected} == expected
    assert used == ["system_prompt", "top_p", "top_k", "max_new_tokens"]

    data = write_problems(tmp_path / "probs.jsonl", [1, 2, 3])
    base = [str(model_dir), "--datasets", str(data), "--k", "2", "--device", "cpu", "--no-progress"]
    assert main([*base, "--save-completions", "--output", str(tmp_path / "auto.json")]) == 0
    assert "declares its evaluation settings" in capsys.readouterr().err
    report = json.loads((tmp_path / "auto.json").read_text())
    assert report["settings"]["from_checkpoint"] == EVAL_SETTING_NAMES
    assert {k: report["settings"][k] for k in saved} == saved and report["settings"]["max_new_tokens"] == 6
    (problem,) = report["datasets"][str(data)]["problems"][:1]
    assert problem["problem"] == "What is 0+1? Put the final answer in \\boxed{}."
    flags = ["--instruction", "default", "--temperature", "0.6", "--top-p", "0.9", "--max-new-tokens", "4"]
    flags += ["--top-k", "3", "--system-prompt", "Be brief."]
    assert main([*base, *flags, "--output", str(tmp_path / "flags.json")]) == 0
    assert "declares" not in capsys.readouterr().err
    settings = json.loads((tmp_path / "flags.json").read_text())["settings"]
    assert settings["from_checkpoint"] == [] and settings["instruction"] == DEFAULT_INSTRUCTION
    assert [settings[k] for k in ("temperature", "top_p", "max_new_tokens", "top_k")] == [0.6, 0.9, 4, 3]
    assert settings["system_prompt"] == "Be brief."


@pytest.fixture
def standin_vllm(monkeypatch):
    spec = importlib.util.spec_from_file_location("vllm", STANDINS / "vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def test_vllm_backend_wiring_only_with_a_stand_in_module(standin_vllm, adapter_dir, tiny_checkpoint, tmp_path):
    """Checks the wiring only, not vLLM: one engine for all sets, built with the engine flags, from the merged
    adapter; prompts go in as TRL's token ids with the adapter's instruction; sampling as resolved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cegppo_trl.data import load_math_dataset

    sets = [write_problems(tmp_path / f"set{i}.jsonl", answers) for i, answers in enumerate(([1, 2, 2], [2, 7]))]
    engine_flags = ["--max-model-len", "512", "--gpu-memory-utilization", "0.55", "--tensor-parallel-size", "2"]
    merged_dir = tmp_path / "merged"
    argv = [str(adapter_dir), "--backend", "vllm", "--datasets", *map(str, sets), "--k", "3", *engine_flags]
    assert main([*argv, "--merge-dir", str(merged_dir), "--output", str(tmp_path / "r.json"), "--no-progress"]) == 0

    (engine,) = standin_vllm.ENGINES  # one engine for both sets
    assert engine.kwargs == {
        "model": str(merged_dir), "seed": 0, "dtype": "auto", "gpu_memory_utilization": 0.55,
        "tensor_parallel_size": 2, "max_model_len": 512,
    }  # fmt: skip
    assert "config.json" in engine.files and "tokenizer.json" in engine.files
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    assert not torch.equal(*(m.model.layers[0].self_attn.q_proj.weight for m in (merged, base)))
    assert len(standin_vllm.CALLS) == 2 and all(call[0] is engine for call in standin_vllm.CALLS)
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    for (_, inputs, params), path in zip(standin_vllm.CALLS, sets):
        prompts = load_math_dataset(str(path), instruction=TINY_INSTRUCTION)["prompt"]
        assert inputs == [{"prompt_token_ids": prompt_token_ids(tokenizer, p)} for p in prompts]
        assert params.kwargs == {"n": 3, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 6, "seed": 0}
    report = json.loads((tmp_path / "r.json").read_text())
    assert [m["avg@3"] for m in report["datasets"].values()] == [pytest.approx(2 / 3), pytest.approx(1 / 2)]

    # Without --merge-dir the merged model goes to a temporary directory, removed after the run.
    standin_vllm.ENGINES.clear()
    assert main([*argv, "--output", str(tmp_path / "r2.json"), "--no-progress"]) == 0
    (engine,) = standin_vllm.ENGINES
    assert "config.json" in engine.files and not Path(engine.kwargs["model"]).exists()


def test_vllm_backend_without_vllm_says_how_to_install(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    data = write_problems(tmp_path / "p.jsonl", [1])
    argv = [model_dir, "--backend", "vllm", "--datasets", data, "--output", tmp_path / "r.json"]
    assert "pip install 'cegppo-trl[vllm]'" in eval_error(argv, capsys)


def test_vllm_extra_is_trls_own_range():
    """`pip install "cegppo-trl[vllm]"` installs TRL's vllm extra, and any vLLM pin it adds lies in TRL's range."""
    import tomllib
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = [Requirement(spec) for spec in project["optional-dependencies"]["vllm"]]
    (trl,) = [Requirement(spec) for spec in project["dependencies"] if spec.startswith("trl")]
    (trl_extra,) = [r for r in extra if r.name == "trl"]
    assert trl_extra.extras == {"vllm"} and trl_extra.specifier == trl.specifier
    trl_vllm = [Requirement(r) for r in requires("trl") if r.startswith("vllm")]
    (trl_range,) = [r.specifier for r in trl_vllm if r.marker.evaluate({"extra": "vllm"})]
    assert str(trl_range) == "<=0.31.0,>=0.22.0"
    pins = [spec.version for r in extra if r.name == "vllm" for spec in r.specifier if spec.operator == "=="]
    assert all(trl_range.contains(version) for version in pins) and {r.name for r in extra} <= {"trl", "vllm"}


@pytest.fixture
def trainer(tiny_trainer):
    """A one-step trainer on the tiny model with a zero reward."""
    return tiny_trainer(reward_funcs=lambda completions, **kw: [0.0] * len(completions), max_steps=1)


def test_prompt_token_ids_mirror_trls_tokenize_prompts(trainer, tiny_tokenizer):
    conversational = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
                      [{"role": "user", "content": "What is 40+2? Put the final answer in \\boxed{}."}]]  # fmt: skip
    for prompts in (conversational, ["What is 2+3?", "7 - 5 ="]):
        trl_ids = trainer._tokenize_prompts(prompts)[0]
        assert [prompt_token_ids(tiny_tokenizer, p) for p in prompts] == [list(ids) for ids in trl_ids]


def test_completion_token_mask_mirrors_trls_completion_mask(trainer, monkeypatch):
    """The held-out entropy counts the tokens TRL 1.16's `_generate_single_turn` keeps: up to the first eos."""
    eos = trainer.eos_token_ids[0]
    new_tokens = torch.tensor([[5, eos, 7, eos], [5, 6, 7, 8], [eos, 6, eos, 8]])
    monkeypatch.setattr(trainer.model, "generate", lambda input_ids, **kw: torch.cat([input_ids, new_tokens], 1))
    trl_ids, _ = trainer._generate_single_turn([[3, 4]] * 3, None, {}, 1)
    mask = completion_token_mask(new_tokens, torch.tensor(trainer.eos_token_ids))
    assert [row[m].tolist() for row, m in zip(new_tokens, mask)] == trl_ids == [[5, eos], [5, 6, 7, 8], [eos]]


def test_grpo_trainers_log_folds_its_buffered_metrics(trainer):
    """Why AvgAtKCallback logs with `transformers.Trainer.log`: TRL 1.16's GRPOTrainer.log merges and clears the
    training metrics it buffers, so an extra log entry in between would take them from the trainer's own entry."""
    trainer._metrics["train"]["reward"].append(0.25)
    trainer.log({"heldout/avg@2": 0.5})
    assert trainer.state.log_history[-1]["reward"] == 0.25 and not trainer._metrics["train"]
    trainer._metrics["train"]["reward"].append(0.25)
    from transformers import Trainer

    Trainer.log(trainer, {"heldout/avg@2": 0.5})
    assert "reward" not in trainer.state.log_history[-1] and trainer._metrics["train"]["reward"] == [0.25]


@pytest.mark.usefixtures("one_torch_thread")
def test_avg_at_k_callback_logs_through_the_trainer(tiny_trainer, tiny_model, tmp_path):
    from cegppo_trl.data import load_math_dataset
    from cegppo_trl.demo.plotting import load_log_history

    held_out = load_math_dataset("builtin:arithmetic_eval", instruction=TINY_INSTRUCTION).select(range(5))
    reference_model = copy.deepcopy(tiny_model)

    trainer = tiny_trainer(tiny_model, tmp_path / "with", max_steps=2)
    callback = AvgAtKCallback(trainer, held_out, k=2, eval_steps=1, max_new_tokens=4, batch_size=4, eval_on_start=True)
    recorder = Recorder(callback)
    trainer.add_callback(callback)
    trainer.add_callback(recorder)
    trainer.train()
    entries = [h for h in trainer.state.log_history if "heldout/avg@2" in h]
    assert [e["step"] for e in entries] == [0, 1, 2]  # on start, then every step; no duplicate at the end
    for e in entries:
        assert 0.0 <= e["heldout/avg@2"] <= e["heldout/pass@2"] <= 1.0
        assert e["heldout/pass@1"] == pytest.approx(e["heldout/avg@2"])
        assert "reward" not in e  # only the figures: the trainer's buffered metrics stay with its own entry
    assert callback.history == entries and callback.last_share == [0, 1, 2, 3, 4]
    assert [log["heldout/avg@2"] for log in recorder.logs if "heldout/avg@2" in log] == [
        e["heldout/avg@2"] for e in entries
    ]  # every callback's on_log (so every report_to integration) receives the figures
    trainer.save_state()
    assert [h["step"] for h in load_log_history(tmp_path / "with") if "heldout/avg@2" in h] == [0, 1, 2]

    # The evaluation changes nothing else: same training log and weights as without it (its own RNG; the trainer's
    # metrics are not taken into its entries).
    reference = tiny_trainer(reference_model, tmp_path / "without", max_steps=2)
    reference.train()

    def own_entries(trainer):  # the trainer's own log entries, without wall-clock figures
        timing = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
        entries = [h for h in trainer.state.log_history if "heldout/avg@2" not in h]
        return [{k: v for k, v in h.items() if k not in timing} for h in entries]

    assert own_entries(trainer) == own_entries(reference)
    assert [h["step"] for h in own_entries(trainer)] == [1, 2, 2] and "reward" in own_entries(trainer)[0]
    for (name, p), q in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    assert trainer.model.training == reference.model.training


def test_avg_at_k_callback_checks_its_arguments(trainer):
    rows = [{"prompt": "What is 1+1?", "solution": "2"}] * 5
    with pytest.raises(TypeError, match="needs the trainer"):
        AvgAtKCallback(rows)
    with pytest.raises(ValueError, match="'prompt' and 'solution'"):
        AvgAtKCallback(trainer, [{"problem": "1+1", "answer": "2"}])
    with pytest.raises(ValueError, match="held-out rows"):
        AvgAtKCallback(trainer)  # no eval_dataset and none on the trainer
    with pytest.raises(ValueError, match="--top-p"):
        AvgAtKCallback(trainer, rows, top_p=2.0)
    callback = AvgAtKCallback(trainer, rows, k=2, batch_size=4)
    assert callback.settings.max_new_tokens == trainer.args.max_completion_length
    assert callback.chunks() == [[0, 1], [2, 3], [4]]  # fixed chunks of <= batch_size sequences


def test_settings_and_the_command_line_do_not_import_torch():
    """The command line is parsed and checked before any model code loads: TRL's parser (transformers'
    HfArgumentParser) imports neither torch nor the model classes."""
    code = (
        "import sys\n"
        "from cegppo_trl.evaluation import EvalSettings, pass_at_k, evaluate_completions, parse_dataset_spec\n"
        "from cegppo_trl.scripts.eval import parse_arguments\n"
        "assert parse_arguments(['m', '--datasets', 'x'])[1] == EvalSettings()\n"
        "parse_dataset_spec('math-ai/aime25:test')\n"
        "print(sorted({'torch', 'transformers.modeling_utils'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
