"""CEGPPOTrainer through real training steps on a tiny local model: learning, checkpoints, LoRA, options, errors."""

import dataclasses
import warnings

import pytest
import torch
from shared import cpu_config
from trl import GRPOConfig
from trl_batches import build_trainer, current_logps, history, loss_ready

from cegppo_trl import CEGPPOConfig


def test_lora_adapter_saves_and_loads(tiny_trainer, tiny_checkpoint, tmp_path):
    from peft import AutoPeftModelForCausalLM, LoraConfig

    base_dir = str(tiny_checkpoint)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = tiny_trainer(base_dir, tmp_path / "lora", max_steps=3, learning_rate=5e-2,
                           trainer_kwargs={"peft_config": peft_config})  # fmt: skip
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in n for n in trainable)
    trainer.train()
    assert any(
        not torch.equal(trainable[n], p.detach()) for n, p in trainer.model.named_parameters() if n in trainable
    )
    assert history(trainer, "cegppo/beta1_token_frac")
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 6, 7, 8]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, trainer.model(ids).logits, atol=1e-5)


def test_sft_term_with_dynamic_sampling_trains_and_evaluates(tiny_trainer, arithmetic_dataset):
    def first_completion_wins(completions, **kwargs):
        # Group of 4: one completion +1, the rest -1, except every other group is all -1 (zero advantage).
        return [1.0 if i % 8 == 0 else -1.0 for i in range(len(completions))]

    trainer = tiny_trainer(reward_funcs=first_completion_wins, max_steps=2, cegppo_sft_coef=0.1,
                           cegppo_exclude_zero_advantage_groups=True, eval_strategy="steps", eval_steps=2,
                           per_device_eval_batch_size=8,
                           trainer_kwargs={"eval_dataset": arithmetic_dataset.select(range(8))})  # fmt: skip
    trainer.train()
    assert history(trainer, "cegppo/sft_nll")
    assert history(trainer, "cegppo/informative_group_frac")[1] == pytest.approx(0.5)
    assert history(trainer, "eval_cegppo/beta1_token_frac") and history(trainer, "eval_loss")


def test_sft_term_adds_token_mean_nll(tiny_trainer, tiny_tokenizer):
    """The SFT term's value is coef * mean(-log pi) over the SFT tokens (one process, one accumulation step)."""
    from shared import make_loss_batch

    trainer = loss_ready(tiny_trainer, cegppo_sft_coef=0.25, steps_per_generation=1, gradient_accumulation_steps=1)
    inputs = make_loss_batch(tiny_tokenizer, seed=3)
    sft_mask = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    inputs["cegppo_sft_mask"] = sft_mask
    inputs["cegppo_num_sft_tokens"] = (inputs["completion_mask"] * sft_mask.unsqueeze(1)).sum()
    with_sft = trainer._compute_loss(trainer.model, inputs).item()
    trainer.args.cegppo_sft_coef = 0.0
    without = trainer._compute_loss(trainer.model, inputs).item()
    logps, _ = current_logps(trainer, inputs)
    mask = inputs["completion_mask"] * sft_mask.unsqueeze(1)
    expected = 0.25 * (-(logps * mask).sum() / mask.sum()).item()
    assert with_sft - without == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    "overrides, warning",
    [
        ({"gradient_accumulation_steps": 1}, r"steps_per_generation.*num_iterations.*8 optimizer steps"),
        ({"cegppo_entropy_ratio_clip": [0.95, 1.05]}, "cegppo_entropy_ratio_clip"),  # entropy ratios of 1: inert
    ],
)
def test_inert_configuration_warns(overrides, warning, tiny_trainer):
    with pytest.warns(UserWarning, match=warning):
        tiny_trainer(steps_per_generation=1, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tiny_trainer(steps_per_generation=1, num_iterations=2)


def test_plain_grpo_config_is_upgraded(tiny_trainer):
    with pytest.warns(UserWarning, match="plain GRPOConfig"):
        trainer = tiny_trainer(config_cls=GRPOConfig, max_steps=1, epsilon=0.25)
    assert isinstance(trainer.args, CEGPPOConfig)
    assert trainer.args.cegppo_beta1 == 0.5 and trainer.args.epsilon == 0.25
    assert trainer.args.steps_per_generation == 4 and trainer.args.generation_batch_size == 32
    trainer.train()
    assert trainer.state.global_step == 1


DYNAMIC_SAMPLING = {"cegppo_exclude_zero_advantage_groups": True}


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"epsilon": 1.0}, "epsilon"),
        ({"epsilon": -0.2}, "epsilon"),
        ({"epsilon_high": float("nan")}, "epsilon_high"),
        ({"loss_type": "cispo"}, r"loss_type.*REINFORCE.*already keeps its gradient"),
        ({"loss_type": "sapo"}, r"loss_type.*soft sigmoid gate.*no hard clip"),
        ({"loss_type": "vespo"}, r"loss_type.*gamma weights.*no clip"),
        ({"loss_type": "no_such_loss"}, r"loss_type.*not a loss type"),
        ({"delta": 1.1}, "delta"),
        ({"cegppo_entropy_target": 0.5, "cegppo_beta1": 2.0}, "cegppo_beta1_max"),
        ({"cegppo_entropy_target": -1.0}, "cegppo_entropy_target"),
        ({"cegppo_low_prob_threshold": 1.5}, "cegppo_low_prob_threshold"),
        # Dynamic sampling: a dropped row keeps an empty loss mask, which these loss types count in their normaliser
        # (docs/method.md); batch-wide reward normalisation would see the dropped groups.
        *(
            (
                {"loss_type": loss_type, **DYNAMIC_SAMPLING},
                rf"`loss_type='{loss_type}'`: .*rows.* Use loss_type='dapo'",
            )
            for loss_type in ("grpo", "dr_grpo", "luspo")
        ),
        *(
            (
                {field: value, **DYNAMIC_SAMPLING},
                rf"cegppo_exclude_zero_advantage_groups=True with `{field}={value!r}`",
            )
            for field, value in (("scale_rewards", "batch"), ("multi_objective_aggregation", "normalize_then_sum"))
        ),
        (
            {"gradient_accumulation_steps": 4, "steps_per_generation": 6, **DYNAMIC_SAMPLING},
            "steps_per_generation=6` is not a multiple of `gradient_accumulation_steps=4",
        ),
    ],
)
def test_bad_config_fails_with_field_name(overrides, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        cpu_config(CEGPPOConfig, tmp_path, **overrides)
    if overrides.get("cegppo_exclude_zero_advantage_groups"):  # fine without dynamic sampling
        cpu_config(CEGPPOConfig, tmp_path, **dict(overrides, cegppo_exclude_zero_advantage_groups=False))


def test_bad_values_set_after_construction_fail_at_trainer_init(
    tiny_model, tiny_tokenizer, arithmetic_dataset, tmp_path
):
    config = cpu_config(CEGPPOConfig, tmp_path)
    config.cegppo_beta1 = float("nan")
    with pytest.raises(ValueError, match="cegppo_beta1"):
        build_trainer(tiny_model, tiny_tokenizer, arithmetic_dataset, config)  # build_trainer's default reward


def test_paper_defaults():
    config = CEGPPOConfig(output_dir="unused", use_cpu=True, bf16=False)
    assert (config.cegppo_beta1, config.cegppo_beta2) == (0.5, 1.0)
    assert config.epsilon == 0.2 and config.epsilon_high is None  # TRL reads None as epsilon_high = epsilon
    assert config.loss_type == "dapo" and config.beta == 0.0 and config.entropy_coef == 0.0
    assert config.cegppo_sft_coef == 0.0 and not config.cegppo_exclude_zero_advantage_groups
    assert config.cegppo_entropy_target is None


def test_betas_in_force_have_one_owner(tiny_trainer, tmp_path):
    from cegppo_trl import ClipParams
    from cegppo_trl.controller import EntropyController

    trainer = tiny_trainer(output_dir=tmp_path / "fixed", cegppo_beta1=0.75, epsilon_high=0.28, delta=10.0)
    assert trainer._controller is None
    assert trainer.clip_params == ClipParams(0.2, 0.28, 0.75, 1.0, 10.0)
    assert not hasattr(trainer, "cegppo_beta1") and not hasattr(trainer, "cegppo_beta2")

    trainer = tiny_trainer(output_dir=tmp_path / "controlled", cegppo_entropy_target=7.0)
    assert isinstance(trainer._controller, EntropyController)
    trainer._controller.update(1.0)  # entropy far below target: beta1 falls, beta2 rises
    params = trainer.clip_params
    assert (params.beta1, params.beta2) == (trainer._controller.beta1, trainer._controller.beta2)
    assert params.beta1 < 0.5 < 1.0 < params.beta2
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.beta1 = 0.0
