"""Exactness through the real trainer, and drift detection against TRL's own GRPOTrainer: `CEGPPOTrainer` adds to
TRL's loss a correction built from a mirror of TRL 1.16's ratio, masks and aggregation (`trl_mirror`); the first test
rebuilds TRL's PPO-clip loss from that mirror for every supported loss type and option, so it fails if TRL changes."""

import copy

import pytest
import torch
from oracles import cegppo_token_mean_loss
from shared import make_loss_batch
from trl import GRPOTrainer
from trl_batches import (
    TRL_OPTIONS,
    add_off_policy,
    current_logps,
    logged,
    loss_and_grad,
    loss_ready,
    noisy,
    ready_for_loss,
    tiny_moe,
)

from cegppo_trl import trl_mirror
from cegppo_trl.config import SUPPORTED_LOSS_TYPES
from cegppo_trl.core import ClipParams
from cegppo_trl.trl_mirror import ppo_clip_per_token_loss


VARIANTS = {**TRL_OPTIONS, "vllm_is": {}, "tool_mask": {}}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_mirror_of_trl_policy_loss_matches_grpo_trainer(loss_type, variant, tiny_trainer, tiny_tokenizer):
    trainer = loss_ready(tiny_trainer, loss_type=loss_type, **VARIANTS[variant])
    inputs = add_off_policy(trainer, make_loss_batch(tiny_tokenizer, seed=1))
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum() * 3  # as if the generation batch were larger
    if variant == "tool_mask":  # multi-turn tool output tokens are excluded from the loss
        mask = inputs["completion_mask"]
        inputs["tool_mask"] = (torch.arange(mask.size(1)) % 3 != 1).long().expand_as(mask).clone()
    if variant == "vllm_is":
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        gen = torch.Generator().manual_seed(5)
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(inputs["completion_ids"].shape, generator=gen)

    trl_loss, trl_grad = loss_and_grad(trainer, inputs, lambda m, x: GRPOTrainer._compute_loss(trainer, m, x))

    def mirrored(model, x):
        logps, entropies = current_logps(trainer, x)
        terms = trl_mirror.policy_term_inputs(trainer, x, logps, entropies)
        per_token = ppo_clip_per_token_loss(terms.log_ratio, terms.advantages, trainer.clip_params)
        if terms.token_weight is not None:
            per_token = per_token * terms.token_weight
        return trl_mirror.aggregate(trainer, per_token, terms.mask, x, "train" if trainer.model.training else "eval")

    mirror_loss, mirror_grad = loss_and_grad(trainer, inputs, mirrored)
    assert torch.allclose(trl_loss, mirror_loss, rtol=1e-5, atol=1e-7), (trl_loss, mirror_loss)
    assert torch.allclose(trl_grad, mirror_grad, rtol=1e-4, atol=1e-7)
    # The variant really changed something: its multipliers exist where expected.
    terms = trl_mirror.policy_term_inputs(trainer, inputs, *current_logps(trainer, inputs))
    assert (terms.token_weight is not None) == (variant in ("off_policy_mask", "entropy_mask", "vllm_is"))


def test_dapo_loss_is_the_papers_token_mean_objective(tiny_trainer, tiny_tokenizer):
    """One process, one accumulation step: the trainer's loss and gradient equal -J of Eq. 8 computed directly."""
    trainer = loss_ready(tiny_trainer, steps_per_generation=1, gradient_accumulation_steps=1, cegppo_beta1=0.5)
    inputs = add_off_policy(trainer, make_loss_batch(tiny_tokenizer, seed=2))
    loss, grad = loss_and_grad(trainer, inputs)

    def paper(model, x):
        log_ratio, advantages = current_logps(trainer, x)[0] - x["old_per_token_logps"], x["advantages"].unsqueeze(1)
        return cegppo_token_mean_loss(log_ratio, advantages, x["completion_mask"], ClipParams(0.2, 0.2, 0.5, 1.0))

    ref_loss, ref_grad = loss_and_grad(trainer, inputs, paper)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert logged(trainer)["cegppo/beta1_token_frac"][-1] > 0
    assert logged(trainer)["cegppo/beta2_token_frac"][-1] > 0


@pytest.fixture
def pair(tiny_trainer, tiny_model, tmp_path):
    """`pair(loss_type, beta1, beta2, **overrides)`: TRL's GRPOTrainer and a CEGPPOTrainer with those betas, each on
    its own copy of `model` (default: the tiny model), ready for `_compute_loss`."""

    def make(loss_type, beta1, beta2, model=None, output_dir=tmp_path, **overrides):
        model = tiny_model if model is None else model
        common = dict(loss_type=loss_type, gradient_accumulation_steps=2, steps_per_generation=4, **overrides)
        grpo = tiny_trainer(copy.deepcopy(model), output_dir / "g", cls=GRPOTrainer, **common)
        ceg = tiny_trainer(copy.deepcopy(model), output_dir / "c", cegppo_beta1=beta1, cegppo_beta2=beta2, **common)
        return ready_for_loss(grpo, ceg)

    return make


@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_beta_zero_has_grpo_gradient_beta_one_is_gppo_and_on_policy_is_grpo(loss_type, pair, tiny_tokenizer, tmp_path):
    grpo, ceg0 = pair(loss_type, 0.0, 0.0)
    inputs = add_off_policy(grpo, make_loss_batch(tiny_tokenizer, seed=3))
    grpo_loss, grpo_grad = loss_and_grad(grpo, inputs)
    _, ceg0_grad = loss_and_grad(ceg0, inputs)
    assert torch.allclose(ceg0_grad, grpo_grad, rtol=1e-5, atol=1e-8)

    _, ceg1 = pair(loss_type, 1.0, 1.0, output_dir=tmp_path / "1")
    gppo_loss, gppo_grad = loss_and_grad(ceg1, inputs)
    assert torch.allclose(gppo_loss, grpo_loss, rtol=1e-5, atol=1e-7)  # GPPO keeps PPO's forward value
    assert not torch.allclose(gppo_grad, grpo_grad, rtol=1e-3, atol=1e-6)  # ... and the clipped tokens' gradient
    assert logged(ceg1)["cegppo/beta1_grad_share"][-1] > 0

    _, ceg = pair(loss_type, 0.5, 1.0, output_dir=tmp_path / "paper")
    inputs = make_loss_batch(tiny_tokenizer, seed=4)  # no old_per_token_logps: TRL uses logps.detach(), r == 1
    grpo_loss, grpo_grad = loss_and_grad(grpo, inputs)
    ceg_loss, ceg_grad = loss_and_grad(ceg, inputs)
    assert torch.equal(ceg_loss, grpo_loss)
    assert torch.equal(ceg_grad, grpo_grad)
    assert logged(ceg)["cegppo/beta1_token_frac"][-1] == 0.0


@pytest.mark.parametrize("term", ["kl", "entropy_bonus", "adaptive_entropy_bonus", "moe_aux_loss"])
def test_trl_terms_are_kept(term, pair, tiny_checkpoint, tiny_tokenizer):
    """TRL's KL term, entropy bonus (static or adaptive) and MoE aux loss are added unchanged: GPPO's loss still equals
    GRPO's, and so does TRL's metric of the term."""
    overrides, metric, seed = {
        "kl": (dict(model=str(tiny_checkpoint), beta=0.1), "kl", 6),  # beta > 0: TRL loads the reference by name
        "entropy_bonus": (dict(entropy_coef=0.05), "entropy_coef", 8),
        "adaptive_entropy_bonus": (
            dict(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=10.0),
            "entropy_coef",
            8,
        ),
        "moe_aux_loss": (dict(model=tiny_moe(tiny_tokenizer)), "aux_loss", 9),
    }[term]
    grpo, ceg = pair("dapo", 1.0, 1.0, **overrides)
    assert grpo.aux_loss_enabled == ceg.aux_loss_enabled == (term == "moe_aux_loss")
    inputs = add_off_policy(grpo, make_loss_batch(tiny_tokenizer, seed=seed))
    if term == "kl":
        inputs["ref_per_token_logps"] = noisy(inputs["old_per_token_logps"], seed=7)
    grpo_loss, _ = loss_and_grad(grpo, inputs)
    ceg_loss, _ = loss_and_grad(ceg, inputs)
    assert torch.allclose(ceg_loss, grpo_loss, rtol=1e-5, atol=1e-7)
    assert ceg._metrics["train"][metric] == grpo._metrics["train"][metric]
    assert term != "kl" or grpo._metrics["train"]["kl"][-1] > 0
