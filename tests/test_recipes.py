"""Every recipe parses into valid configs (with `--use_cpu true`: see `parse_train_args`), and the paper recipes carry
the paper's numbers."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from shared import RECIPES, ROOT, parse_train_args, recipe_id

from cegppo_trl import CEGPPOConfig
from cegppo_trl.scripts.train import CEGPPOScriptArguments, build_reward_funcs


ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))

DATASET = "Kwai-Klear/KlearReasoner-MathSub-30K"
PROCESSES = 8  # what every GPU recipe's batch arithmetic assumes
# paper recipe -> (beta1, beta2, epsilon_high); its model is the size's DeepSeek-R1-Distill-Qwen
PAPER_RECIPES = {
    "DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_paper.yaml": (0.5, 1.0, 0.2),
    "DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_paper.yaml": (0.0, 0.0, 0.2),
    "DeepSeek-R1-Distill-Qwen-1.5B/dapo/config_paper.yaml": (0.0, 0.0, 0.28),
    "DeepSeek-R1-Distill-Qwen-7B/cegppo/config_paper.yaml": (0.75, 1.0, 0.2),
    "DeepSeek-R1-Distill-Qwen-7B/grpo/config_paper.yaml": (0.0, 0.0, 0.2),
    "DeepSeek-R1-Distill-Qwen-7B/dapo/config_paper.yaml": (0.0, 0.0, 0.28),
}
# The authors' entropy-ratio clipping runs (arXiv 2512.05591; Kwai-Klear/ERC's `gppo_erc` scripts).
ERC_RECIPES = tuple(f"DeepSeek-R1-Distill-Qwen-{size}/erc/config_paper.yaml" for size in ("1.5B", "7B"))
LORA_RECIPE = "DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_lora.yaml"
TINY_RECIPE = "tiny/cegppo/config_cpu.yaml"


def _deprecated_fields() -> set[str]:
    from trl import ModelConfig

    names = set()
    for cls in (CEGPPOScriptArguments, CEGPPOConfig, ModelConfig):
        for f in dataclasses.fields(cls):
            if "deprecated" in str(f.metadata.get("help", "")).lower():
                names.add(f.name)
    return names


def parse(recipe: str | Path):
    return parse_train_args("--config", ROOT / "recipes" / recipe)


def hub_model(recipe: str) -> str:
    return f"deepseek-ai/{recipe.split('/')[0]}"


def test_all_recipes_are_listed():
    found = {recipe_id(p) for p in RECIPES}
    assert found == set(PAPER_RECIPES) | set(ERC_RECIPES) | {LORA_RECIPE, TINY_RECIPE}, (
        "add new recipes to the tables of this test"
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_parses_without_unknown_or_deprecated_keys(recipe):
    keys = set(yaml.safe_load(recipe.read_text()))
    deprecated = keys & _deprecated_fields()
    assert not deprecated, f"{recipe_id(recipe)} uses deprecated options {sorted(deprecated)}"
    # TrlParser raises on keys that belong to none of the three dataclasses.
    script_args, config, model_args = parse(recipe)
    assert isinstance(config, CEGPPOConfig)
    assert model_args.model_name_or_path and script_args.dataset_name
    assert len(build_reward_funcs(script_args)) == len(script_args.reward_funcs)
    # CE-GPPO only acts off-policy: every recipe must take several optimizer steps per generation batch.
    assert config.steps_per_generation * config.num_iterations > config.gradient_accumulation_steps
    # Commands in the header name files that exist.
    for ref in re.findall(r"(?:accelerate_configs|examples|recipes)/[\w./-]+\.(?:yaml|py)", recipe.read_text()):
        assert (ROOT / ref).exists(), f"{recipe_id(recipe)} refers to missing {ref}"
    # The authors sample 256 prompts and train on the first 128 informative groups; every recipe that turns dynamic
    # sampling on does the same (baselines too, so that comparisons stay fair).
    values = yaml.safe_load(recipe.read_text())
    dynamic = values.get("cegppo_exclude_zero_advantage_groups")
    assert values.get("cegppo_oversampling", 1.0) == (2.0 if dynamic else 1.0), recipe_id(recipe)


@pytest.mark.parametrize("recipe", sorted(PAPER_RECIPES))
def test_paper_recipe_matches_the_paper(recipe):
    beta1, beta2, epsilon_high = PAPER_RECIPES[recipe]
    script_args, c, model_args = parse(recipe)
    assert model_args.model_name_or_path == hub_model(recipe)
    assert model_args.dtype == "bfloat16" and c.bf16
    assert not model_args.use_peft
    # Data and reward: KlearReasoner-MathSub-30K, +1 / -1 by math-verify.
    assert script_args.dataset_name == DATASET and script_args.dataset_train_split == "train"
    assert script_args.problem_column == "prompt" and script_args.answer_column == "reward_model.ground_truth"
    assert script_args.reward_funcs == ["math"]
    (reward,) = build_reward_funcs(script_args)
    assert (reward.correct, reward.wrong, reward.unparseable) == (1.0, -1.0, -1.0)
    assert c.reward_weights is None
    # CE-GPPO coefficients (1.5B: 0.5 / 1, 7B: 0.75 / 1; GRPO and DAPO: 0 / 0) and clip ranges.
    assert (c.cegppo_beta1, c.cegppo_beta2) == (beta1, beta2)
    assert c.epsilon == 0.2 and c.epsilon_high == epsilon_high
    assert c.cegppo_entropy_target is None and c.cegppo_sft_coef == 0.0 and c.delta is None
    # Objective: token-level mean, no KL, no entropy bonus, 8 rollouts at temperature 1, 16k completions.
    assert c.loss_type == "dapo" and c.beta == 0.0 and c.entropy_coef == 0.0 and not c.use_adaptive_entropy
    assert c.num_generations == 8 and c.temperature == 1.0 and c.top_p == 1.0
    assert c.max_completion_length == 16 * 1024
    # Optimizer: lr 1e-6 constant after 10 warm-up steps, weight decay 0.1, grad clip 1.0, ~1000 steps.
    assert c.learning_rate == 1e-6 and c.lr_scheduler_type.value == "constant_with_warmup" and c.warmup_steps == 10
    assert c.weight_decay == 0.1 and c.max_grad_norm == 1.0 and c.max_steps == 1000
    # Batch: 16 prompts x 8 rollouts per optimizer step, 8 optimizer steps per generation batch, one pass.
    assert c.per_device_train_batch_size * PROCESSES * c.gradient_accumulation_steps == 16 * 8
    assert c.steps_per_generation == 8 * c.gradient_accumulation_steps and c.num_iterations == 1
    # vLLM generation.
    assert c.use_vllm and c.vllm_mode in ("colocate", "server")
    assert c.vllm_max_model_length is None or c.vllm_max_model_length >= c.max_completion_length


@pytest.mark.parametrize("recipe", sorted(ERC_RECIPES))
def test_erc_recipe_has_the_authors_released_values(recipe):
    """The values of the authors' `gppo_erc` scripts: GPPO (beta1 = beta2 = 1), band [0.95, 1.05], eps 0.2 / 0.2,
    dual clip c = 10, SFT 0.1, token-mean, lr 1e-6, 256 prompts generated for 128 trained, 8 samples, 16 prompts per
    optimizer step on the recipe's 8 processes."""
    script_args, c, model_args = parse(recipe)
    assert model_args.model_name_or_path == hub_model(recipe) and script_args.dataset_name == DATASET
    assert (c.cegppo_beta1, c.cegppo_beta2) == (1.0, 1.0) and c.cegppo_entropy_ratio_clip == [0.95, 1.05]
    assert c.epsilon == 0.2 and c.epsilon_high == 0.2 and c.delta == 10.0 and c.cegppo_sft_coef == 0.1
    assert c.cegppo_sft_reward_threshold == 1.0 and script_args.correct_reward == 1.0
    assert c.loss_type == "dapo" and c.beta == 0.0 and c.learning_rate == 1e-6 and c.num_generations == 8
    assert c.cegppo_exclude_zero_advantage_groups and c.cegppo_oversampling == 2.0
    assert c.per_device_train_batch_size * PROCESSES * c.steps_per_generation == 128 * 8  # 128 prompts per batch
    assert c.per_device_train_batch_size * PROCESSES * c.gradient_accumulation_steps == 16 * 8
    assert c.cegppo_entropy_target is None and c.entropy_coef == 0.0


# algo -> the fields where its paper recipe may differ from CE-GPPO's of the same size (besides where it saves)
DIFFERS_FROM_CEGPPO = {
    "grpo": {"cegppo_beta1", "cegppo_beta2", "epsilon_high"},  # GRPO and DAPO: beta1 = beta2 = 0, DAPO's eps 0.28
    "dapo": {"cegppo_beta1", "cegppo_beta2", "epsilon_high"},
    "erc": {"cegppo_beta1", "cegppo_beta2", "cegppo_entropy_ratio_clip", "delta", "cegppo_sft_coef"},  # the authors'
}


@pytest.mark.parametrize("algo", sorted(DIFFERS_FROM_CEGPPO))
@pytest.mark.parametrize("size", ["1.5B", "7B"])
def test_baselines_and_erc_differ_from_cegppo_only_where_intended(size, algo):
    cegppo, other = (parse(f"DeepSeek-R1-Distill-Qwen-{size}/{name}/config_paper.yaml") for name in ("cegppo", algo))
    allowed = DIFFERS_FROM_CEGPPO[algo] | {"output_dir", "run_name", "logging_dir"}
    for ours, theirs in zip(cegppo, other):
        a, b = dataclasses.asdict(ours), dataclasses.asdict(theirs)
        diff = {k for k in a if a[k] != b[k]} - allowed
        assert not diff, f"{algo} differs from cegppo in {sorted(diff)}"
    assert other[1].output_dir != cegppo[1].output_dir


def test_lora_recipe_fits_one_gpu():
    from trl import get_peft_config

    script_args, c, model_args = parse(LORA_RECIPE)
    assert model_args.model_name_or_path == hub_model(LORA_RECIPE)
    peft_config = get_peft_config(model_args)
    assert peft_config is not None and peft_config.r == model_args.lora_r
    assert (c.cegppo_beta1, c.cegppo_beta2) == (0.5, 1.0)
    assert 5e-6 <= c.learning_rate <= 2e-5
    # One process: 16 prompts x 8 rollouts per optimizer step, 8 optimizer steps per generation batch.
    assert c.per_device_train_batch_size * c.gradient_accumulation_steps == 128
    assert c.steps_per_generation == 8 * c.gradient_accumulation_steps
    assert c.use_vllm and c.vllm_mode == "colocate" and c.vllm_gpu_memory_utilization <= 0.5
    assert c.num_generations == 8 and c.beta == 0.0 and script_args.reward_funcs == ["math"]


def test_tiny_recipe_is_local_and_cpu():
    script_args, c, model_args = parse(TINY_RECIPE)
    assert model_args.model_name_or_path == "builtin:tiny"
    assert script_args.dataset_name.startswith("builtin:")
    assert c.use_cpu and not c.bf16 and not c.use_vllm
    assert c.max_steps <= 8 and c.report_to in ([], "none", ["none"])
    # The prompt is exactly the one the tiny model is trained on.
    from cegppo_trl.data import build_prompt
    from cegppo_trl.tiny_model import format_user_message

    assert build_prompt("What is 2+3?", instruction=script_args.instruction)[-1]["content"] == format_user_message(
        "What is 2+3?"
    )


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_machines == 1 and config.mixed_precision == "bf16"
    if path.name.startswith("zero"):
        assert config.distributed_type.value == "DEEPSPEED"
        assert config.deepspeed_config["zero_stage"] == int(path.stem[-1])
    if path.name == "zero3.yaml":
        assert config.deepspeed_config["zero3_save_16bit_model"] is True
    if path.name == "fsdp2.yaml":
        assert config.distributed_type.value == "FSDP" and config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # save_model writes the full model


def test_accelerate_config_set():
    assert {p.stem for p in ACCELERATE_CONFIGS} >= {"single_gpu", "multi_gpu", "zero2", "zero3", "fsdp2"}
