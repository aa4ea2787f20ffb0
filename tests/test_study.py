"""The committed study stays reproducible: the README's and docs/comparison.md's Part A command (`cegppo-compare`
on experiments/study/part_a_tiny.yaml) carries the settings of the committed results (docs/study/tiny), Part B's
preset (experiments/real_model_learning.py --study) those of docs/study/smollm2, and the
study's claims (experiments/study_claims.py) read from those results give the verdict table the README shows."""

import json
import shlex

import pytest
import yaml
from doc_blocks import code_blocks
from shared import ROOT, load_script

from cegppo_trl.comparison.settings import parse
from cegppo_trl.scripts.compare import read_recipe


COMMITTED = json.loads((ROOT / "docs" / "study" / "tiny" / "results.json").read_text())


def _part_a_command(doc):
    lines = [b.body.replace("\\\n", " ") for b in code_blocks(doc) if "part_a_tiny.yaml" in b.body]
    return next(line for body in lines for line in body.splitlines() if "cegppo-compare " in line)


@pytest.mark.parametrize("doc", ["README.md", "docs/comparison.md"])
def test_the_part_a_command_carries_the_committed_settings(doc, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = parse(shlex.split(_part_a_command(ROOT / doc), comments=True)[1:])
    script, training, model = read_recipe(args)
    made = {
        "model": model.model_name_or_path, "tiny_sft_steps": script.tiny_sft_steps, "train_dataset": script.dataset_name,
        "eval_dataset": args.eval_datasets[0], "eval_problems": args.eval_problems, "max_steps": training.max_steps,
        "steps_per_generation": training.steps_per_generation, "num_generations": training.num_generations,
        "prompts_per_step": training.per_device_train_batch_size // training.num_generations,
        "dynamic_sampling": training.cegppo_exclude_zero_advantage_groups, "oversampling": training.cegppo_oversampling,
        "use_peft": model.use_peft, "learning_rate": training.learning_rate, "warmup_steps": training.warmup_steps,
        "max_grad_norm": training.max_grad_norm, "temperature": training.temperature,
        "max_completion_length": training.max_completion_length, "rewards": script.reward_funcs, "eval_k": args.eval_k,
        "protocols": args.protocols, "arms": args.arms, "seeds": args.seeds,
    }  # fmt: skip
    assert made == {key: COMMITTED["settings"][key] for key in made}
    # the committed run took builtin:tiny's own prompt (instruction None) and measured at the training temperature
    assert (
        script.instruction == "{problem} Put the final answer in \\boxed{}."
        and COMMITTED["settings"]["instruction"] is None
    )
    assert COMMITTED["settings"]["eval_temperature"] is None and training.lr_scheduler_type == "constant_with_warmup"
    assert training.gradient_accumulation_steps == 1 and training.beta == 0.0 and training.loss_type == "dapo"


def test_the_study_claims_give_the_readme_verdicts():
    claims = load_script(ROOT / "experiments" / "study_claims.py")
    found = claims.claims(COMMITTED["summary"], COMMITTED["settings"]["protocols"])
    assert [(c["claim"], c["verdict"]) for c in found] == [(c["claim"], c["verdict"]) for c in COMMITTED["claims"]]
    readme = (ROOT / "README.md").read_text()
    for row in claims.claim_rows(found)[2:]:
        assert row in readme, row
    table = (ROOT / "docs" / "study" / "tiny" / "results.md").read_text().split("Over seeds")[1].split("\n\nTime (")[0]
    assert table.strip() in readme  # the arms over seeds, each minus GRPO


def test_the_part_b_preset_carries_the_committed_settings(tmp_path):
    """`experiments/real_model_learning.py --study` (the README's Part B command) writes a recipe and cegppo-compare
    flags with the committed SmolLM2 results' settings (docs/study/smollm2), the worked example included."""
    learning = load_script(ROOT / "experiments" / "real_model_learning.py")
    recipe, flags = learning.settings(["--study", "--out", str(tmp_path)])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    args = parse(["--recipe", str(path), *flags])
    script, training, model = read_recipe(args)
    committed = json.loads((ROOT / "docs" / "study" / "smollm2" / "results.json").read_text())["settings"]
    made = {
        "train_dataset": script.dataset_name, "eval_dataset": args.eval_datasets[0], "eval_problems": args.eval_problems,
        "instruction": script.instruction or "none", "max_steps": training.max_steps,
        "steps_per_generation": training.steps_per_generation, "num_generations": training.num_generations,
        "prompts_per_step": training.per_device_train_batch_size // training.num_generations,
        "dynamic_sampling": training.cegppo_exclude_zero_advantage_groups, "oversampling": training.cegppo_oversampling,
        "use_peft": model.use_peft, "lora_r": model.lora_r, "learning_rate": training.learning_rate,
        "warmup_steps": training.warmup_steps, "max_grad_norm": training.max_grad_norm,
        "temperature": training.temperature, "max_completion_length": training.max_completion_length,
        "rewards": script.reward_funcs, "eval_k": args.eval_k, "protocols": args.protocols, "arms": args.arms,
        "seeds": args.seeds, "example_problem": script.example_problem, "example_answer": script.example_answer,
    }  # fmt: skip
    assert made == {key: committed[key] for key in made}
