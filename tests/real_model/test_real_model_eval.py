"""`cegppo-eval` (HF backend) on SmolLM2-135M-Instruct trained by the tier's runs: the full model and the LoRA
adapter, each prompted as it was trained (its `cegppo_prompt.json`, `generation_config.json`), and graded on what the
model really writes.

Only sizes are shrunk: 8 problems of `builtin:arithmetic_eval`. The greedy run is compared with the test's own
`generate` on the chat-templated prompts (one prompt per call on both sides, `--batch_size 1`, so no padding differs).
"""

import json
import sys
from pathlib import Path

import pytest
from real_runs import real_model_env, run_command


pytestmark = pytest.mark.real_model

PROBLEMS = 8
DATASET = "builtin:arithmetic_eval"
MAX_NEW_TOKENS = 48  # the trained model's max_completion_length, from its generation_config.json


def _evaluate(model: Path, report: Path, *flags: str) -> dict:
    cegppo_eval = Path(sys.executable).parent / "cegppo-eval"  # the console command of this environment
    argv = [cegppo_eval, model, "--datasets", DATASET, "--max_problems", str(PROBLEMS), "--save_completions",
            "--output", report, "--no-progress", *flags]  # fmt: skip
    run_command(argv, real_model_env())
    return json.loads(report.read_text())


def _expected_status(text: str, gold: str) -> str | None:
    """The status a completion must get, from its text: no_answer when no answer can be found in it; correct / wrong
    when the answer found is a plain integer; None (not checked) otherwise."""
    from cegppo_trl.rewards.extract import extract_answer

    answer = extract_answer(text)
    if answer is None:
        return "no_answer"
    plain = answer.strip().strip("$").replace(",", "")
    if not plain.lstrip("-").isdigit():
        return None
    return "correct" if int(plain) == int(gold) else "wrong"


def check_grading(report: dict, k: int) -> int:
    """Each saved completion's status matches its text; returns the number graded correct."""
    problems = report["datasets"][DATASET]["problems"]
    assert len(problems) == PROBLEMS
    correct = checked = 0
    for problem in problems:
        assert len(problem["completions"]) == k == len(problem["statuses"])
        for text, status in zip(problem["completions"], problem["statuses"]):
            assert "<|im_end|>" not in text and "<|im_start|>" not in text, text  # cut at EOS, specials removed
            expected = _expected_status(text, problem["solution"])
            if expected is not None:
                assert status == expected, (text, problem["solution"], status)
                checked += 1
            correct += status == "correct"
        assert problem["num_correct"] == problem["statuses"].count("correct")
    assert checked >= PROBLEMS * k // 2, f"only {checked} of {PROBLEMS * k} completions had a plain answer to check"
    return correct


def _greedy_reference(model, tokenizer, problems: list[str], instruction: str) -> list[str]:
    import torch

    texts = []
    for problem in problems:
        messages = [{"role": "user", "content": instruction.replace("{problem}", problem)}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        assert "<|im_start|>assistant\n" in tokenizer.decode(ids["input_ids"][0])
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        texts.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return texts


def test_eval_full_model_greedy_is_what_the_model_writes(full_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cegppo_trl.data import BUILTIN_DATASETS

    report = _evaluate(full_run.out, tmp_path / "greedy.json", "--temperature", "0", "--k", "1", "--batch_size", "1")
    settings = report["settings"]
    # The prompt and length came from the checkpoint; the temperature from the flag.
    assert {"instruction", "max_new_tokens"} <= set(settings["from_checkpoint"]), settings
    assert settings["max_new_tokens"] == MAX_NEW_TOKENS and settings["temperature"] == 0
    problems = report["datasets"][DATASET]["problems"]
    source = [json.loads(line) for line in BUILTIN_DATASETS[DATASET].read_text().splitlines()[:PROBLEMS]]  # raw rows
    assert [p["solution"] for p in problems] == [row["answer"] for row in source]
    model = AutoModelForCausalLM.from_pretrained(full_run.out)
    tokenizer = AutoTokenizer.from_pretrained(full_run.out)
    reference = _greedy_reference(model, tokenizer, [row["problem"] for row in source], settings["instruction"])
    assert [p["completions"][0] for p in problems] == reference
    correct = check_grading(report, k=1)
    # A measured count, not a bound: how many sums 4 steps leave right varies between machines (1 of 8 here).
    print(f"full model, greedy: {correct} of {PROBLEMS} correct")


def test_eval_lora_adapter(lora_run, smollm2_dir, tmp_path):
    report = _evaluate(lora_run.out, tmp_path / "lora.json", "--k", "2")
    assert Path(report["source"]["adapter"]).resolve() == lora_run.out.resolve()
    assert Path(report["source"]["model"]).resolve() == smollm2_dir.resolve()  # the base the adapter records
    settings = report["settings"]
    # Everything the adapter declares is used: its prompt and its training sampling.
    assert {"instruction", "temperature", "max_new_tokens"} <= set(settings["from_checkpoint"]), settings
    assert (settings["temperature"], settings["max_new_tokens"]) == (1.0, MAX_NEW_TOKENS)
    correct = check_grading(report, k=2)
    print(f"LoRA adapter, sampled at temperature 1: {correct} of {2 * PROBLEMS} correct")
