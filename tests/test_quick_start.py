"""The README's quick start trains the model it names with the paper recipe's values: its effective `CEGPPOConfig`,
data, reward and model are compared with recipes/DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_paper.yaml field by
field, and every difference must be in `ALLOWED` with its reason (the README states them too). `cegppo-eval`'s
defaults fit the same models. Nothing is downloaded: the block is read with `ast`, and the data set is a local file
in KlearReasoner-MathSub-30K's layout."""

import ast
import dataclasses
import re
import warnings

import pytest
from doc_blocks import readme_quick_start
from shared import BIN, ROOT, parse_train_args, run_checked

from cegppo_trl import CEGPPOConfig, load_math_dataset


RECIPE = ROOT / "recipes" / "DeepSeek-R1-Distill-Qwen-1.5B" / "cegppo" / "config_paper.yaml"
ALLOWED = {  # CEGPPOConfig field -> why the quick start differs from the recipe
    "output_dir": "where the run is saved",
    "logging_steps": "bookkeeping: the quick start keeps TRL's default (every 10 steps)",
    "save_total_limit": "bookkeeping: the quick start keeps every checkpoint (TRL's default)",
    "use_vllm": "the quick start generates with transformers, so it needs only the base install; the recipe's vLLM "
    "lines are faster and need the vllm extra",
    "vllm_enable_sleep_mode": "vLLM setting (the quick start does not use vLLM)",
    "vllm_gpu_memory_utilization": "vLLM setting (the quick start does not use vLLM)",
    "vllm_max_model_length": "vLLM setting (the quick start does not use vLLM)",
}
# Not CEGPPOConfig fields: the recipe's model options (trl.ModelConfig). The quick start passes the model by name, so
# TRL loads it with dtype "auto" (the checkpoint's bfloat16, the recipe's dtype) and transformers' default attention
# (sdpa, the recipe's attn_implementation).
MODEL_OPTIONS = {"dtype": "bfloat16", "attn_implementation": "sdpa"}


def quick_start_calls() -> dict[str, ast.Call]:
    """The calls of the quick start, by function name."""
    calls = {}
    for node in ast.walk(ast.parse(readme_quick_start().body)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls[node.func.id] = node
    assert {"load_math_dataset", "CEGPPOConfig", "CEGPPOTrainer"} <= set(calls), sorted(calls)
    return calls


def keywords(call: ast.Call) -> dict:
    return {k.arg: (k.value.id if isinstance(k.value, ast.Name) else ast.literal_eval(k.value)) for k in call.keywords}


def effective(config) -> dict:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(CEGPPOConfig)}
    # TRL reads epsilon_high None as epsilon.
    values["epsilon_high"] = config.epsilon if config.epsilon_high is None else config.epsilon_high
    return values


@pytest.fixture(scope="module")
def recipe():
    return parse_train_args("--config", RECIPE)  # + `--use_cpu true`, as the quick start's config below


def test_quick_start_config_is_the_paper_recipe(recipe):
    _, training_args, _ = recipe
    given = keywords(quick_start_calls()["CEGPPOConfig"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quick = CEGPPOConfig(**given, use_cpu=True)
    ours, theirs = effective(quick), effective(training_args)
    differences = {name for name in ours if ours[name] != theirs[name]}
    assert differences == set(ALLOWED), {n: (ours[n], theirs[n]) for n in differences ^ set(ALLOWED)}
    # The values the issue was about, stated in the block itself.
    assert given["max_completion_length"] == theirs["max_completion_length"] == 16384
    assert given["steps_per_generation"] == 8 * given["gradient_accumulation_steps"]
    assert (ours["cegppo_beta1"], ours["cegppo_beta2"], ours["loss_type"], ours["beta"]) == (0.5, 1.0, "dapo", 0.0)


def test_quick_start_data_model_and_reward_are_the_recipes(recipe, tmp_path):
    from cegppo_trl import math_reward
    from cegppo_trl.data import write_jsonl
    from cegppo_trl.scripts.train import build_reward_funcs

    script_args, _, model_args = recipe
    calls = quick_start_calls()
    data_call = calls["load_math_dataset"]
    assert ast.literal_eval(data_call.args[0]) == script_args.dataset_name
    data_kwargs = keywords(data_call)
    assert data_kwargs == {"instruction": None} and script_args.instruction is None

    # On a local file in the data set's own layout (verl), the quick start's call (columns found automatically) and
    # the recipe's explicit columns give the same rows.
    rows = [
        {"data_source": "math", "prompt": [{"content": f"Compute {a} * 3.", "role": "user"}], "ability": "math",
         "reward_model": {"ground_truth": str(3 * a), "style": "rule"}, "__index_level_0__": a}
        for a in range(5)
    ]  # fmt: skip
    stand_in = write_jsonl(rows, tmp_path / "train_math_30K.json")
    ours = load_math_dataset(str(stand_in), **data_kwargs)
    theirs = load_math_dataset(
        str(stand_in),
        problem_column=script_args.problem_column,
        answer_column=script_args.answer_column,
        instruction=script_args.instruction,
    )
    assert ours.to_list() == theirs.to_list() and ours[0]["prompt"][0]["content"] == "Compute 0 * 3."

    trainer_kwargs = keywords(calls["CEGPPOTrainer"])
    assert trainer_kwargs["model"] == model_args.model_name_or_path
    assert {name: getattr(model_args, name) for name in MODEL_OPTIONS} == MODEL_OPTIONS
    assert trainer_kwargs["reward_funcs"] == "math_reward"
    (recipe_reward,) = build_reward_funcs(script_args)
    assert repr(recipe_reward) == repr(math_reward.__globals__["_DEFAULT_MATH_REWARD"])  # +1 / -1, same grading


def test_readme_states_every_difference():
    readme = (ROOT / "README.md").read_text()
    block = readme_quick_start().body
    after = " ".join(readme[readme.index(block) + len(block) :][:1500].split())
    assert "tests/test_quick_start.py" in after
    stated = set(re.findall(r"`([a-z_]+)\*?(?::[^`]*)?`", after))
    for field in ALLOWED:
        assert field in stated or field.startswith("vllm_") and "vllm_" in stated, f"the README does not state {field}"


def test_cegppo_eval_defaults_fit_the_readmes_models():
    """R1-Distill models reason for thousands of tokens: cegppo-eval's default length covers what the recipes train
    with (16384 paper, 4096 LoRA) and is the paper's evaluation length; --help says so."""
    import yaml

    from cegppo_trl.evaluation import DEFAULT_MAX_NEW_TOKENS, EvalSettings

    lengths = [
        yaml.safe_load(path.read_text())["max_completion_length"]
        for path in (ROOT / "recipes").glob("DeepSeek-R1-Distill-Qwen-*/*/*.yaml")
    ]
    assert lengths and DEFAULT_MAX_NEW_TOKENS == 32768 >= max(lengths)
    assert EvalSettings().resolve()[0].max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    help_text = run_checked([BIN / "cegppo-eval", "--help"], ROOT).stdout
    assert "32768" in " ".join(help_text.split()) and "DeepSeek-R1-Distill" in " ".join(help_text.split())
