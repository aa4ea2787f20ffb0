"""A worked example before each problem (`--example_problem`, `--example_answer`: a user and an assistant turn) is
one setting of `cegppo-train` and `cegppo-eval`: it shapes the training prompts, travels with the saved model
(``cegppo_prompt.json``), and `cegppo-eval` (so `cegppo-compare`'s measurement) prompts with it by default."""

import json
import shutil

import pytest
import yaml

from cegppo_trl.data import build_prompt, load_math_dataset
from cegppo_trl.evaluation.datasets import load_eval_datasets
from cegppo_trl.evaluation.settings import EvalSettings
from cegppo_trl.prompt_settings import PROMPT_FILE, save_eval_settings


EXAMPLE = ("What is 12+30?", "12 + 30 = 42. \\boxed{42}")
TEMPLATE = "{problem} Put the final answer in \\boxed{}."


def test_the_example_comes_after_the_system_message_and_before_the_problem():
    messages = build_prompt("What is 1+2?", "Be brief.", TEMPLATE, EXAMPLE)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12+30? Put the final answer in \\boxed{}."},
        {"role": "assistant", "content": EXAMPLE[1]},
        {"role": "user", "content": "What is 1+2? Put the final answer in \\boxed{}."},
    ]
    rows = load_math_dataset("builtin:arithmetic_eval", instruction=None, example=EXAMPLE)
    assert rows[0]["prompt"][:2] == [
        {"role": "user", "content": EXAMPLE[0]},
        {"role": "assistant", "content": EXAMPLE[1]},
    ]


def test_cegppo_train_reads_the_pair_and_refuses_half_of_it(tmp_path):
    from cegppo_trl.scripts.train import load_datasets, make_parser

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"dataset_name": "builtin:arithmetic", "instruction": "none", "use_cpu": True,
                                      "bf16": False, "activation_checkpointing": False, "example_problem": EXAMPLE[0],
                                      "example_answer": EXAMPLE[1]}))  # fmt: skip
    script, training, _ = make_parser().parse_args_and_config(["--config", str(recipe)])
    train, _ = load_datasets(script, training)
    assert train[0]["prompt"][1] == {"role": "assistant", "content": EXAMPLE[1]} and len(train[0]["prompt"]) == 3
    with pytest.raises(ValueError, match="--example_problem and --example_answer go together"):
        make_parser().parse_args_and_config(["--dataset_name", "builtin:arithmetic", "--example_problem", EXAMPLE[0]])


def test_a_saved_model_carries_its_example_to_cegppo_eval(tiny_checkpoint, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    save_eval_settings(model, instruction=None, temperature=1.0, max_new_tokens=8, example=EXAMPLE)
    assert json.loads((model / PROMPT_FILE).read_text())["example"] == list(EXAMPLE)
    settings, _ = EvalSettings(max_problems=2).resolve(str(model))
    assert (settings.example_problem, settings.example_answer) == EXAMPLE
    _, data = load_eval_datasets(["builtin:arithmetic_eval"], settings)
    assert [m["role"] for m in data["builtin:arithmetic_eval"][0]["prompt"]] == ["user", "assistant", "user"]
    # a flag wins over the model's; half a pair is refused
    other, _ = EvalSettings(example_problem="What is 1+1?", example_answer="2").resolve(str(model))
    assert other.example_problem == "What is 1+1?"
    with pytest.raises(ValueError, match="--example-problem"):
        EvalSettings(example_problem="What is 1+1?")
