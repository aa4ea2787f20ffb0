"""Edge cases of the loss path, each on a hand-built batch through a tiny trainer's `_compute_loss`:
dynamic sampling as physical removal, TRL's `policy_loss` metric, finite loss and gradient at any log-ratio."""

import functools
import math

import pytest
import torch
from shared import make_loss_batch
from trl_batches import (
    add_off_policy,
    batch_with_dropped_rows,
    current_logps,
    logged,
    loss_and_grad,
    loss_ready,
    select_rows,
    tiny_moe,
)

import cegppo_trl.trainer as trainer_module
from cegppo_trl.config import SUPPORTED_LOSS_TYPES
from cegppo_trl.core import LOG_RATIO_CLAMP, ClipParams, cegppo_per_token_loss
from cegppo_trl.trl_mirror import ppo_clip_per_token_loss


@pytest.fixture
def build(tiny_trainer):
    return functools.partial(loss_ready, tiny_trainer)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_excluded_groups_equal_physical_removal_for_every_term(
    loss_type, level, build, tiny_checkpoint, tiny_tokenizer, tmp_path
):
    """KL (beta > 0), entropy bonus, SFT term and policy term, with gradient accumulation: the option's loss, gradient
    and metrics on the micro-batch with dropped rows masked equal those of the micro-batch without them."""
    model_dir = str(tiny_checkpoint)  # beta > 0: TRL loads the reference by name
    common = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.1,
        entropy_coef=0.05,
        cegppo_sft_coef=0.1,
        cegppo_exclude_zero_advantage_groups=True,
    )
    on, ref = build(model_dir, tmp_path / "on", **common), build(model_dir, tmp_path / "ref", **common)
    kept = [0, 1, 2, 3, 6]
    full, inputs = batch_with_dropped_rows(on, tiny_tokenizer, seed=11, kept=kept)
    before = {k: v.clone() for k, v in full.items() if isinstance(v, torch.Tensor)}
    loss, grad = loss_and_grad(on, full)
    removed_loss, removed_grad = loss_and_grad(ref, select_rows(inputs, kept))
    assert torch.allclose(loss, removed_loss, rtol=1e-6, atol=1e-8), (loss.item(), removed_loss.item())
    assert torch.allclose(grad, removed_grad, rtol=1e-5, atol=1e-8)
    for key in (
        "kl",
        "entropy",
        "cegppo/policy_loss",
        "cegppo/sft_nll",
        "clip_ratio/region_mean",
        "cegppo/beta1_token_frac",
    ):
        assert logged(on)[key][-1] == pytest.approx(logged(ref)[key][-1], rel=1e-5), key
    for key, value in before.items():  # the buffered batch is reused across num_iterations: never modified
        assert torch.equal(full[key], value), key


def test_moe_aux_loss_is_refused_with_dynamic_sampling(build, tiny_tokenizer):
    """The router's load-balancing loss would count the tokens of dropped rows (docs/method.md)."""
    with pytest.raises(ValueError, match="cegppo_exclude_zero_advantage_groups=True with a MoE router aux loss"):
        build(tiny_moe(tiny_tokenizer), cegppo_exclude_zero_advantage_groups=True)


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_micro_batch_with_every_group_excluded_has_zero_loss_and_gradient(loss_type, build, tiny_tokenizer):
    on = build(loss_type=loss_type, entropy_coef=0.05, cegppo_sft_coef=0.1, cegppo_exclude_zero_advantage_groups=True)
    inputs, _ = batch_with_dropped_rows(on, tiny_tokenizer, seed=13, kept=[])
    inputs["num_items_in_batch"] = torch.tensor(40.0)  # other micro-batches of the generation batch had kept rows
    inputs["cegppo_num_sft_tokens"] = torch.tensor(10.0)
    loss, grad = loss_and_grad(on, inputs)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    # No loss token on any process: CE-GPPO's own metrics of this micro-batch are NaN, which TRL's `log` skips.
    for name in ("cegppo/beta1_token_frac", "cegppo/quadrant/neg_low/token_frac", "cegppo/sft_nll"):
        assert math.isnan(logged(on)[name][-1]), name


def test_generation_keeps_informative_groups_on_rewards_not_advantages(build, arithmetic_dataset):
    """Groups of 8: [0.7 x8] (float residue in TRL's advantage), [1, 0, 0, 1, ...] (informative), [1 x8] (correct).
    The informative group leads the training batch; the others follow as dropped rows (empty loss mask)."""
    informative = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]

    def rewards(completions, **kwargs):
        return ([0.7] * 8 + informative + [1.0] * 8)[: len(completions)]

    trainer = build(
        reward_funcs=rewards,
        per_device_train_batch_size=24,
        num_generations=8,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        cegppo_exclude_zero_advantage_groups=True,
        cegppo_sft_coef=0.1,
        cegppo_sft_reward_threshold=1.0,
    )
    inputs = [arithmetic_dataset[i] for i in range(3) for _ in range(8)]
    original = trainer_module.GRPOTrainer._generate_and_score_completions(trainer, inputs)
    assert (original["advantages"][:8] != 0).any()  # the residue that `advantage != 0` mistook for signal
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(inputs)
    assert batch["cegppo_keep"].tolist() == [1.0] * 8 + [0.0] * 16
    assert torch.equal(batch["prompt_ids"][:8], original["prompt_ids"][8:16])  # generation order, informative first
    assert batch["advantages"][:8].tolist() == pytest.approx(original["advantages"][8:16].tolist())
    mask = batch["completion_mask"].float()
    assert mask[8:].sum() == 0 and mask[:8].sum() > 0
    assert batch["num_items_in_batch"].item() == mask[:8].sum().item()
    # The all-correct group gets no SFT term: it is not part of the update at all.
    assert batch["cegppo_sft_mask"].tolist() == informative + [0.0] * 16
    assert batch["cegppo_num_sft_tokens"].item() == (mask[0] + mask[3]).sum().item()
    assert logged(trainer)["cegppo/informative_group_frac"][-1] == pytest.approx(1 / 3)


def test_multimodal_batch_is_refused_with_the_field_name(build, arithmetic_dataset, monkeypatch):
    trainer = build(cegppo_exclude_zero_advantage_groups=True)
    original = trainer_module.GRPOTrainer._generate_and_score_completions
    with_pixels = {"pixel_values": torch.zeros(1)}
    monkeypatch.setattr(
        trainer_module.GRPOTrainer, "_generate_and_score_completions", lambda *args: original(*args) | with_pixels
    )
    with pytest.raises(ValueError, match="cegppo_exclude_zero_advantage_groups.*pixel_values"):
        trainer._generate_and_score_completions([arithmetic_dataset[i] for i in range(8)])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
@pytest.mark.parametrize("extra", [{"entropy_coef": 0.05}, {"use_adaptive_entropy": True, "entropy_target": 10.0}])
def test_logged_policy_loss_is_the_cegppo_policy_term(loss_type, extra, build, tiny_tokenizer):
    """`cegppo/policy_loss` is CE-GPPO's policy term; TRL's own `policy_loss` (entropy bonus on) stays its PPO-clip."""
    trainer = build(loss_type=loss_type, **extra)
    inputs = add_off_policy(trainer, make_loss_batch(tiny_tokenizer, seed=21), scale=0.6)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum() * 3
    trainer._compute_loss(trainer.model, inputs)

    with torch.no_grad():
        logps, _ = current_logps(trainer, inputs)
        mask = inputs["completion_mask"].float()
        log_ratio, advantages = logps - inputs["old_per_token_logps"], inputs["advantages"].unsqueeze(1)
        per_token = cegppo_per_token_loss(log_ratio, advantages, ClipParams(0.2, 0.2, 0.5, 1.0))
        assert per_token.beta1_mask.any() or per_token.beta2_mask.any()

        def as_trl_logs(loss):
            loss = loss * mask
            if loss_type == "grpo":  # TRL logs it before dividing by gradient accumulation
                return ((loss.sum(-1) / mask.sum(-1)).mean()).item()
            if loss_type == "luspo":
                return loss.sum(-1).mean().item()
            # dapo: the normalised value, num_items / processes * accumulation / steps_per_generation
            return (loss.sum() / (inputs["num_items_in_batch"] * 2 / 4)).item()

        expected = as_trl_logs(per_token.per_token_loss)
        trl_expected = as_trl_logs(ppo_clip_per_token_loss(log_ratio, advantages, ClipParams(0.2, 0.2, 0.5, 1.0)))
    assert logged(trainer)["cegppo/policy_loss"][-1] == pytest.approx(expected, rel=1e-5)
    assert logged(trainer)["policy_loss"][-1] == pytest.approx(trl_expected, rel=1e-5)
    assert expected != pytest.approx(trl_expected, rel=1e-3)  # the clipped tokens make them differ


def _extreme_batch(trainer, tokenizer, dtype, seed=31):
    inputs = add_off_policy(trainer, make_loss_batch(tokenizer, seed=seed), seed=seed)
    logps = current_logps(trainer, inputs)[0].detach()
    old = inputs["old_per_token_logps"].clone()
    # log_ratio = logps - old: +100, -100, +1e4, -1e4 on tokens of positive- and negative-advantage rows.
    for row, col, log_ratio in [(0, 0, 100.0), (0, 2, -100.0), (1, 0, 1e4), (2, 0, -1e4), (3, 0, 100.0)]:
        old[row, col] = logps[row, col] - log_ratio
    inputs["old_per_token_logps"] = old.to(dtype)
    inputs["advantages"] = inputs["advantages"].to(dtype)
    inputs["advantages"][:4] = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=dtype)
    return inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_loss_and_gradient_are_finite_at_any_log_ratio(loss_type, dtype, build, tiny_model, tiny_tokenizer):
    trainer = build(tiny_model.to(dtype), loss_type=loss_type)
    inputs = _extreme_batch(trainer, tiny_tokenizer, dtype)
    for level in ("token", "sequence"):
        for delta in (None, 4.0):
            trainer.importance_sampling_level, trainer.args.delta = level, delta
            loss, grad = loss_and_grad(trainer, inputs)
            assert torch.isfinite(loss), (level, delta, loss)
            assert torch.isfinite(grad).all(), (level, delta, (~torch.isfinite(grad)).sum().item())
            assert logged(trainer)["cegppo/log_ratio_clamped_frac"][-1] > 0


@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_clamp_changes_nothing_within_the_bound(loss_type, build, tiny_tokenizer, monkeypatch):
    """Bit-identical loss and gradient to the trainer without the clamp when every |log-ratio| <= 20."""
    trainer = build(loss_type=loss_type, delta=4.0)
    inputs = add_off_policy(trainer, make_loss_batch(tiny_tokenizer, seed=41), scale=3.0)
    logps = current_logps(trainer, inputs)[0].detach()
    log_ratio = logps - inputs["old_per_token_logps"]
    assert log_ratio.abs().max() <= LOG_RATIO_CLAMP and log_ratio.abs().max() > 5
    for level in ("token", "sequence"):
        trainer.importance_sampling_level = level
        clamped_loss, clamped_grad = loss_and_grad(trainer, inputs)
        assert logged(trainer)["cegppo/log_ratio_clamped_frac"][-1] == 0.0
        with monkeypatch.context() as patch:
            patch.setattr(
                trainer_module, "clamp_old_log_probs", lambda logps, old: (old, torch.zeros_like(old).bool())
            )
            loss, grad = loss_and_grad(trainer, inputs)
        assert torch.equal(clamped_loss, loss) and torch.equal(clamped_grad, grad), level
