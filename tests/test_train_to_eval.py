"""From training to a number, as a user runs it: docs/evaluation.md's commands in an empty directory, console scripts
in subprocesses, nothing downloaded (HF_HUB_OFFLINE=1).

The paper's five benchmarks run on offline stand-ins of the five Hub sets (same ids, splits and columns, in a datasets
cache) and a stand-in `vllm` module that checks the wiring only."""

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from doc_blocks import code_blocks
from shared import BIN, EVAL_SETTING_NAMES, ROOT, TINY_RECIPE, assert_saved_settings, run_checked, write_problems


DOC = ROOT / "docs" / "evaluation.md"
STANDINS = Path(__file__).resolve().parent / "standins"
RECIPE = yaml.safe_load((ROOT / TINY_RECIPE).read_text())
# The five benchmarks: (Hub id, split, columns of one row) as docs/rewards_and_data.md describes them.
PAPER_SETS = {
    "HuggingFaceH4/aime_2024": ("train", lambda q, a: {"problem": q, "answer": a, "solution": f"so \\boxed{{{a}}}"}),
    "math-ai/aime25": ("test", lambda q, a: {"problem": q, "answer": a}),
    "MathArena/hmmt_feb_2025": ("train", lambda q, a: {"problem_idx": 1, "problem": q, "answer": a}),
    "HuggingFaceH4/MATH-500": ("test", lambda q, a: {"problem": q, "solution": "...", "answer": a, "level": 1}),
    "math-ai/amc23": ("test", lambda q, a: {"question": q, "answer": float(a)}),
}


def doc_blocks(lang: str) -> list[str]:
    return [block.body for block in code_blocks(DOC) if block.lang == lang]


def doc_commands(marker: str) -> list[list[str]]:
    """The commands of the docs' bash block that contains `marker` (continuations joined, comments dropped)."""
    (body,) = [b for b in doc_blocks("bash") if marker in b]
    return [shlex.split(line, comments=True) for line in body.replace("\\\n", " ").splitlines() if shlex.split(line, comments=True)]  # fmt: skip


def env(**extra) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}  # fmt: skip


def run(argv: list[str], cwd: Path, expect: int = 0, **extra_env) -> subprocess.CompletedProcess:
    return run_checked([BIN / argv[0], *argv[1:]], cwd, env(**extra_env), expect=expect)


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """docs/evaluation.md's "From training to a number" block, command by command, in an empty directory."""
    cwd = tmp_path_factory.mktemp("walk")
    commands = doc_commands("cegppo-train --config recipes/tiny")
    assert [c[0] for c in commands] == ["cegppo-train", "cegppo-eval", "cegppo-train", "cegppo-eval"]
    procs = [run(argv, cwd) for argv in commands]
    return cwd, procs


@pytest.mark.slow
def test_saved_models_carry_their_prompt_and_sampling(walk):
    cwd, _ = walk
    full, lora = cwd / "outputs" / "tiny-cegppo", cwd / "outputs" / "tiny-cegppo-lora"
    assert (full / "config.json").is_file()
    assert (lora / "adapter_config.json").is_file() and not (lora / "config.json").exists()
    base = json.loads((lora / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert os.path.isabs(base) and Path(base) == lora / "tiny-init"  # found from any directory
    for path in (full, lora):
        assert_saved_settings(path, RECIPE["instruction"], RECIPE["temperature"], RECIPE["max_completion_length"])


@pytest.mark.slow
def test_cegppo_eval_uses_the_prompt_they_were_trained_with(walk):
    cwd, procs = walk
    (text_block,) = [b for b in doc_blocks("text") if "declares its evaluation settings" in b]
    for proc, name in ((procs[1], "tiny-cegppo"), (procs[3], "tiny-cegppo-lora")):
        assert text_block.strip().replace("outputs/tiny-cegppo", f"outputs/{name}") in proc.stderr
        report = json.loads((cwd / "outputs" / name / "eval.json").read_text())
        assert report["settings"]["from_checkpoint"] == EVAL_SETTING_NAMES and report["pending"] == []
        assert report["settings"]["instruction"] == RECIPE["instruction"]
        assert report["settings"]["max_new_tokens"] == RECIPE["max_completion_length"]
        metrics = report["datasets"]["builtin:arithmetic_eval"]
        assert metrics["num_problems"] == 300 and metrics["k"] == 4
        assert all(p["problem"].endswith(" Put the final answer in \\boxed{}.") for p in metrics["problems"])
        assert proc.stdout.startswith("builtin:arithmetic_eval: avg@4 = ")
    lora_report = json.loads((cwd / "outputs" / "tiny-cegppo-lora" / "eval.json").read_text())
    assert lora_report["source"]["adapter"] == "outputs/tiny-cegppo-lora"
    assert lora_report["source"]["model"] == str(cwd / "outputs" / "tiny-cegppo-lora" / "tiny-init")
    assert "with the LoRA adapter outputs/tiny-cegppo-lora" in procs[3].stderr


@pytest.mark.slow
def test_the_samples_are_the_saved_models_own(walk, tmp_path, one_torch_thread):
    """The command's samples, from another directory, equal `generate` on the saved model (full) and on the base
    with the adapter merged (LoRA), prompted with the recipe's instruction and sampled as in training; the docs' LoRA
    merge gives a full model with the adapter's settings and samples."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cegppo_trl.data import load_math_dataset
    from cegppo_trl.evaluation import generate_completions

    cwd, _ = walk
    full, lora, merged = cwd / "outputs" / "tiny-cegppo", cwd / "outputs" / "tiny-cegppo-lora", tmp_path / "merged"
    (block,) = [b for b in doc_blocks("python") if "merge_and_unload" in b]
    source = block.replace('"outputs/DeepSeek-R1-Distill-Qwen-1.5B-CEGPPO-LoRA-merged"', repr(str(merged)))
    source = source.replace('"outputs/DeepSeek-R1-Distill-Qwen-1.5B-CEGPPO-LoRA"', repr(str(lora)))
    assert "DeepSeek" not in source
    exec(compile(source, f"{DOC}:merge", "exec"), {"__name__": "__doc__"})
    assert (merged / "config.json").is_file() and (merged / "cegppo_prompt.json").is_file()

    data = write_problems(tmp_path / "probs.jsonl", [3, 12, 40, 41, 7, 9])
    prompts = list(load_math_dataset(str(data), instruction=RECIPE["instruction"])["prompt"])
    base = AutoModelForCausalLM.from_pretrained(lora / "tiny-init")
    models = {
        full: AutoModelForCausalLM.from_pretrained(full),
        lora: PeftModel.from_pretrained(base, lora).merge_and_unload(),
    }
    initial = AutoModelForCausalLM.from_pretrained(lora / "tiny-init").state_dict()
    changed = [n for n, p in models[lora].state_dict().items() if not torch.equal(p, initial[n])]
    targets = json.loads((lora / "adapter_config.json").read_text())["target_modules"]
    assert changed and all(any(t in n for t in targets) for n in changed)  # the adapter is really applied
    reports = {}
    for path in (full, lora, merged):
        out = tmp_path / f"{path.name}.json"
        run(["cegppo-eval", str(path), "--datasets", str(data), "--k", "3", "--save-completions", "--output", str(out)], tmp_path)  # fmt: skip
        reports[path] = json.loads(out.read_text())
    sampling = dict(temperature=RECIPE["temperature"], top_p=1.0, max_new_tokens=RECIPE["max_completion_length"])
    for path, model in models.items():
        expected = generate_completions(model, AutoTokenizer.from_pretrained(path), prompts, 3, **sampling)
        assert [p["completions"] for p in reports[path]["datasets"][str(data)]["problems"]] == expected, path.name
    assert reports[merged]["settings"] == reports[lora]["settings"]
    assert reports[merged]["datasets"][str(data)]["problems"] == reports[lora]["datasets"][str(data)]["problems"]


@pytest.mark.slow
def test_a_run_killed_in_a_later_set_keeps_the_finished_ones(walk, tmp_path):
    """The report is rewritten after each set: killing the process (as the OOM killer would) while it works on a
    long second set leaves the first set's complete result, the same as a run of that set alone."""
    cwd, _ = walk
    model = str(cwd / "outputs" / "tiny-cegppo")
    first = write_problems(tmp_path / "first.jsonl", [2, 5, 9, 14])
    out = tmp_path / "report.json"
    argv = [str(BIN / "cegppo-eval"), model, "--datasets", str(first), "builtin:arithmetic", "--k", "8", "--output", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stderr.read()[-3000:]
        time.sleep(1.0)  # well into the 24,000 samples of builtin:arithmetic
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    kept = json.loads(out.read_text())
    assert list(kept["datasets"]) == [str(first)] and kept["pending"] == ["builtin:arithmetic"]
    alone = tmp_path / "alone.json"
    run(["cegppo-eval", model, "--datasets", str(first), "--k", "8", "--output", str(alone)], tmp_path)
    expected = json.loads(alone.read_text())["datasets"][str(first)]
    for key in ("avg@8", "pass@1", "pass@8", "num_problems", "problems"):
        assert kept["datasets"][str(first)][key] == expected[key], key


def build_hub_standins(cache: Path, sets: dict[str, tuple[str, list[dict]]]) -> Path:
    """A datasets cache holding, for each Hub id, one prepared split with the given rows: with HF_HUB_OFFLINE=1 and
    HF_DATASETS_CACHE=`cache`, `datasets.load_dataset(id, split=...)` returns them (and any other split is unknown:
    the end of test_the_paper_benchmarks_command_wiring_only_with_stand_ins). Nothing is downloaded: a cache miss
    fails offline."""
    import shutil

    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    from cegppo_trl.data import write_jsonl

    for repo_id, (split, rows) in sets.items():
        namespace, name = repo_id.split("/")
        name = camelcase_to_snakecase(name)
        source = write_jsonl(rows, cache / "_rows" / f"{name}.jsonl")
        build = cache / "_build"
        Json(cache_dir=str(build), dataset_name=name, config_name="default", data_files={split: source},
             hash="standin").download_and_prepare()  # fmt: skip
        (built,) = (build / name).glob("*/*/standin")
        target = cache / f"{namespace}___{name}" / "default" / "0.0.0" / "standin"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(built), str(target))
        shutil.rmtree(build)
    return cache


@pytest.fixture(scope="module")
def paper_standins(tmp_path_factory) -> Path:
    """The five sets: 5 problems each, with their own columns; the stand-in vLLM answers 2, right for one problem."""
    sets = {
        repo_id: (split, [row(f"What is {a}+1?", str(a + 1)) for a in range(5)])
        for repo_id, (split, row) in PAPER_SETS.items()
    }
    return build_hub_standins(tmp_path_factory.mktemp("hub-cache"), sets)


PAPER_K = [32, 32, 32, 4, 32]  # the paper's samples per problem, in PAPER_SETS' order


@pytest.mark.slow
def test_the_paper_preset_as_the_docs_run_it(tiny_checkpoint, paper_standins, tmp_path):
    """docs/evaluation.md's `--preset paper` command without vLLM, on the tiny model and offline stand-ins of the five
    Hub sets (same ids, splits and columns). Swapped: the tiny model for the 1.5B one and `--max-new-tokens 4` for
    32768 (size only). The five sets with the paper's k each, the authors' protocol and raw-problem prompt, the
    paper's sampling, and a report that says so."""
    (argv,) = [c for c in doc_commands("--preset paper") if "--backend" not in c]
    argv = [argv[0], str(tiny_checkpoint), *argv[2:], "--max-new-tokens", "4", "--save-completions"]
    output = argv[argv.index("--output") + 1]
    proc = run(argv, tmp_path, HF_DATASETS_CACHE=str(paper_standins))
    report = json.loads((tmp_path / output).read_text())
    assert report["protocol"] == "authors" and report["settings"]["instruction"] == ""
    assert report["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_new_tokens": 4, "k": 4,
                                  "seed": 0, "backend": "hf"}  # fmt: skip
    assert list(report["datasets"]) == [f"{repo_id}:{split}" for repo_id, (split, _) in PAPER_SETS.items()]
    for (name, metrics), k in zip(report["datasets"].items(), PAPER_K):
        assert (metrics["k"], metrics["num_problems"], sum(metrics["status_counts"].values())) == (k, 5, 5 * k), name
        assert f"avg@{k}" in metrics and metrics["problems"][1]["problem"] == "What is 1+1?"  # the raw problem
        assert f"{name}: avg@{k} = " in proc.stdout


@pytest.mark.slow
def test_the_paper_benchmarks_command_wiring_only_with_stand_ins(walk, paper_standins, tmp_path):
    """docs/evaluation.md's `--preset paper` commands with vLLM (full model and LoRA adapter) on the tiny runs. Checks
    the wiring only, not vLLM: one engine for the five sets with the docs' engine flags, one generate call per set
    with the paper's sampling and its k per set, the LoRA adapter merged first, every set on its own split."""
    cwd, _ = walk
    commands = [c for c in doc_commands("--preset paper") if "--backend" in c]
    assert len(commands) == 2
    models = {
        "outputs/DeepSeek-R1-Distill-Qwen-1.5B-CEGPPO-LoRA": cwd / "outputs" / "tiny-cegppo-lora",
        "outputs/DeepSeek-R1-Distill-Qwen-1.5B-CEGPPO": cwd / "outputs" / "tiny-cegppo",
    }
    for argv in commands:
        assert argv[0] == "cegppo-eval" and argv[1] in models
        log = tmp_path / f"{Path(argv[1]).name}.jsonl"
        argv = [argv[0], str(models[argv[1]]), *argv[2:]]
        proc = run(argv, tmp_path, HF_DATASETS_CACHE=str(paper_standins), PYTHONPATH=str(STANDINS),
                   CEGPPO_STANDIN_VLLM_LOG=str(log))  # fmt: skip
        events = [json.loads(line) for line in log.read_text().splitlines()]
        engines = [e for e in events if e["event"] == "engine"]
        assert len(engines) == 1 and [e["event"] for e in events[1:]] == ["generate"] * 5
        (engine,) = engines
        flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        assert engine["kwargs"]["max_model_len"] == int(flag["--max-model-len"])
        assert engine["kwargs"]["gpu_memory_utilization"] == float(flag.get("--gpu-memory-utilization", 0.9))
        assert engine["kwargs"]["tensor_parallel_size"] == 1 and "config.json" in engine["files"]
        if "LoRA" in log.name:  # merged into a temporary folder, removed after the run
            assert "adapter_config.json" not in engine["files"] and not Path(engine["kwargs"]["model"]).exists()
        else:
            assert engine["kwargs"]["model"] == argv[1]
        for event, k in zip(events[1:], PAPER_K):
            assert event["params"] == dict(n=k, temperature=0.6, top_p=0.95, top_k=0, max_tokens=32768, seed=0)
            assert len(event["prompts"]) == 5
        report = json.loads((tmp_path / flag["--output"]).read_text())
        assert list(report["datasets"]) == [f"{repo_id}:{split}" for repo_id, (split, _) in PAPER_SETS.items()]
        for (name, metrics), k in zip(report["datasets"].items(), PAPER_K):
            assert metrics["split"] == name.split(":")[1] and metrics["num_problems"] == 5
            assert metrics[f"avg@{k}"] == pytest.approx(1 / 5), name  # "What is 1+1?" is the one answered right
        assert proc.stdout.count(": avg@32 = 20.0%") == 4 and proc.stdout.count(": avg@4 = 20.0%") == 1

    # A set on the wrong split fails before the model loads, with the splits it has.
    argv = ["cegppo-eval", str(models[commands[0][1]]), "--backend", "vllm", "--datasets", "math-ai/aime25:test", "HuggingFaceH4/aime_2024"]  # fmt: skip
    proc = run(argv, tmp_path, expect=2, HF_DATASETS_CACHE=str(paper_standins), PYTHONPATH=str(STANDINS))
    assert "HuggingFaceH4/aime_2024: ValueError: Unknown split \"test\". Should be one of ['train']" in proc.stderr


def test_checkpoints_get_the_prompt_and_sampling_too(tiny_checkpoint, tmp_path):
    """`cegppo-train`'s callback writes them into each checkpoint-N it saves (only where the trainer saves)."""
    import shutil

    from shared import parse_train_args
    from transformers import TrainerControl, TrainerState

    from cegppo_trl.scripts.train import prompt_and_sampling_callback

    script_args, training_args, _ = parse_train_args("--config", ROOT / TINY_RECIPE, "--output_dir", tmp_path)
    shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint-2")
    prompt_and_sampling_callback(script_args).on_save(training_args, TrainerState(global_step=2), TrainerControl())
    assert_saved_settings(tmp_path / "checkpoint-2", RECIPE["instruction"], 1.0, RECIPE["max_completion_length"])
