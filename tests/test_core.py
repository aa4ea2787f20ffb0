"""The pure loss functions against an independent, scalar implementation of Eq. 8 (Su et al., ACL 2026)."""

import itertools
import math

import pytest
import torch
from oracles import cegppo_token_mean_loss, eq8_scalar

from cegppo_trl.core import (
    LOG_RATIO_CLAMP,
    ClipParams,
    cegppo_per_token_loss,
    clamp_old_log_probs,
    equal_reward_groups,
    gradient_preserving_correction,
)
from cegppo_trl.trl_mirror import ppo_clip_per_token_loss


def random_tokens(seed, shape, scale, adv_shape):
    """Float64 log-ratios ~ N(0, scale^2) (requiring grad) and advantages ~ N(0, 1), from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    log_ratio = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(True)
    return log_ratio, torch.randn(adv_shape, generator=gen, dtype=torch.float64)


def check_against_scalar(log_ratio, adv, params, atol=1e-12):
    log_ratio = log_ratio.clone().requires_grad_(True)
    out = cegppo_per_token_loss(log_ratio, adv, params)
    (grad,) = torch.autograd.grad(out.per_token_loss.sum(), log_ratio)
    ratio = torch.exp(log_ratio.detach())
    adv_b = adv.expand_as(ratio)
    for idx in itertools.product(*(range(n) for n in ratio.shape)):
        r, a = ratio[idx].item(), adv_b[idx].item()
        value, dvalue = eq8_scalar(r, a, params)
        assert out.per_token_loss[idx].item() == pytest.approx(-value, abs=atol, rel=1e-9), (idx, r, a)
        assert grad[idx].item() == pytest.approx(-dvalue, abs=atol, rel=1e-9), (idx, r, a)
        assert out.grad_coef[idx].item() == pytest.approx(dvalue, abs=atol, rel=1e-9), (idx, r, a)
        assert bool(out.beta1_mask[idx]) == (r < 1 - params.epsilon_low and a < 0)
        assert bool(out.beta2_mask[idx]) == (r > 1 + params.epsilon_high and a > 0)
    return out


@pytest.mark.parametrize("beta1,beta2", [(0.5, 1.0), (0.75, 1.0), (0.0, 0.0), (1.0, 1.0), (2.0, 0.3)])
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28)])
def test_random_tokens_match_eq8(beta1, beta2, eps_low, eps_high):
    log_ratio, adv = random_tokens(0, (6, 9), 0.4, (6, 1))
    out = check_against_scalar(log_ratio, adv, ClipParams(eps_low, eps_high, beta1, beta2))
    assert out.beta1_mask.any() and out.beta2_mask.any()  # both branches exercised


def test_per_token_advantages_and_dual_clip():
    log_ratio, adv = random_tokens(1, (5, 7), 1.5, (5, 7))  # some ratios exceed delta = 3
    assert (torch.exp(log_ratio) > 3).any()
    check_against_scalar(log_ratio, adv, ClipParams(0.2, 0.2, 0.5, 1.0, delta=3.0))


def _exact_log(target: float) -> float:
    """A float64 x with exp(x) == target exactly, so the edge case is truly on the edge."""
    x = torch.tensor(math.log(target), dtype=torch.float64)
    for _ in range(8):
        r = torch.exp(x).item()
        if r == target:
            return x.item()
        x = torch.nextafter(x, torch.tensor(math.inf if r < target else -math.inf, dtype=torch.float64))
    raise AssertionError("no exact log found")


def test_clip_edges_are_strict():
    eps = 0.2
    lo, hi = 1 - eps, 1 + eps
    log_ratio = torch.tensor([[_exact_log(lo), _exact_log(hi), _exact_log(lo), _exact_log(hi)]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    out = check_against_scalar(log_ratio, adv, ClipParams(eps, eps, 0.5, 1.0))
    # On the edges nothing is clipped: "otherwise" branch, l = r A with gradient r A.
    assert not out.beta1_mask.any() and not out.beta2_mask.any()
    assert torch.allclose(out.per_token_loss, -torch.exp(log_ratio) * adv)


def test_zero_advantage_gives_zero_loss_and_gradient():
    log_ratio = torch.tensor([[-1.0, 0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    out = cegppo_per_token_loss(log_ratio, torch.zeros(1, 1, dtype=torch.float64), ClipParams(0.2, 0.2, 0.5, 1.0))
    (grad,) = torch.autograd.grad(out.per_token_loss.sum(), log_ratio)
    assert torch.equal(out.per_token_loss, torch.zeros_like(out.per_token_loss))
    assert torch.equal(grad, torch.zeros_like(grad))
    assert not out.beta1_mask.any() and not out.beta2_mask.any()


@pytest.mark.parametrize("delta", [None, 4.0])
def test_reductions_gppo_and_ppo(delta):
    """beta = 1: GPPO (PPO's forward value, gradient kept); beta = 0: PPO-clip's gradient exactly."""
    log_ratio, adv = random_tokens(2, (4, 11), 0.8, (4, 1))
    ppo = ppo_clip_per_token_loss(log_ratio, adv, ClipParams(0.2, 0.2, 0.0, 0.0, delta))
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), log_ratio)

    gppo = cegppo_per_token_loss(log_ratio, adv, ClipParams(0.2, 0.2, 1.0, 1.0, delta))
    assert torch.allclose(gppo.per_token_loss, ppo, atol=1e-12)  # same forward value
    (gppo_grad,) = torch.autograd.grad(gppo.per_token_loss.sum(), log_ratio)
    clipped = gppo.beta1_mask | gppo.beta2_mask
    assert clipped.any()
    assert torch.allclose(gppo_grad[~clipped], ppo_grad[~clipped])
    assert (ppo_grad[clipped] == 0).all() and (gppo_grad[clipped] != 0).all()

    zero = cegppo_per_token_loss(log_ratio, adv, ClipParams(0.2, 0.2, 0.0, 0.0, delta))
    (zero_grad,) = torch.autograd.grad(zero.per_token_loss.sum(), log_ratio)
    assert torch.allclose(zero_grad, ppo_grad, atol=1e-12)


@pytest.mark.parametrize(
    "beta1, beta2, eps_low, eps_high, delta",
    [(0.5, 1.0, 0.2, 0.2, None), (0.0, 0.0, 0.2, 0.28, None), (1.0, 1.0, 0.1, 0.3, 3.0), (0.75, 0.25, 0.2, 0.2, 1.5)],
)
def test_correction_is_cegppo_minus_ppo_and_zero_outside_clipped_sets(beta1, beta2, eps_low, eps_high, delta):
    log_ratio, adv = random_tokens(3, (6, 10), 0.5, (6, 1))
    adv[0] = 0.0
    params = ClipParams(eps_low, eps_high, beta1, beta2, delta)
    correction, sets = gradient_preserving_correction(log_ratio, adv, params)
    cegppo = cegppo_per_token_loss(log_ratio, adv, params)
    ppo = ppo_clip_per_token_loss(log_ratio, adv, params)
    assert torch.equal(sets.beta1_mask, cegppo.beta1_mask) and torch.equal(sets.beta2_mask, cegppo.beta2_mask)
    assert torch.equal(sets.grad_coef, cegppo.grad_coef)
    clipped = cegppo.beta1_mask | cegppo.beta2_mask
    assert clipped.any() and (~clipped).any()
    assert torch.allclose(ppo + correction, cegppo.per_token_loss, atol=1e-12)
    assert (correction[~clipped] == 0).all()
    g_sum = torch.autograd.grad((ppo + correction).sum(), log_ratio, retain_graph=True)[0]
    g_ref = torch.autograd.grad(cegppo.per_token_loss.sum(), log_ratio, retain_graph=True)[0]
    assert torch.allclose(g_sum, g_ref, atol=1e-12)
    (g_correction,) = torch.autograd.grad(correction.sum(), log_ratio)
    assert (g_correction[~clipped] == 0).all()


def test_token_mean_with_masks_and_ragged_lengths():
    lengths = [1, 4, 7, 0, 5]
    mask = torch.zeros(5, 7, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    log_ratio, adv = random_tokens(4, (5, 7), 0.5, (5, 1))
    # Padding positions hold garbage that must not leak into value or gradient.
    garbage = torch.where(mask.bool(), torch.zeros_like(mask), torch.full_like(mask, 50.0))
    loss = cegppo_token_mean_loss(log_ratio + garbage, adv, mask, ClipParams(0.2, 0.2, 0.5, 1.0))
    (grad,) = torch.autograd.grad(loss, log_ratio)

    total, expected_grad = 0.0, torch.zeros_like(grad)
    ratio = torch.exp(log_ratio.detach())
    for i, n in enumerate(lengths):
        for t in range(n):
            value, dvalue = eq8_scalar(ratio[i, t].item(), adv[i, 0].item(), ClipParams(0.2, 0.2, 0.5, 1.0))
            total += value
            expected_grad[i, t] = -dvalue / sum(lengths)
    assert loss.item() == pytest.approx(-total / sum(lengths), rel=1e-10)
    assert torch.allclose(grad, expected_grad, atol=1e-12)
    assert (grad[~mask.bool()] == 0).all()


def test_sequence_level_ratio_broadcasts():
    """(B, 1) sequence-level ratios (GSPO-style) use the same branches per sequence."""
    log_ratio = torch.tensor([[math.log(0.7)], [math.log(1.3)], [0.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0], [1.0], [1.0]], dtype=torch.float64)
    out = check_against_scalar(log_ratio, adv, ClipParams(0.2, 0.2, 0.5, 1.0))
    assert out.beta1_mask.squeeze(1).tolist() == [True, False, False]
    assert out.beta2_mask.squeeze(1).tolist() == [False, True, False]


def test_float32_and_bfloat16_inputs_keep_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        log_ratio = torch.randn(2, 3).to(dtype)
        adv = torch.randn(2, 1).to(dtype)
        params = ClipParams(0.2, 0.2, 0.5, 1.0)
        out = cegppo_per_token_loss(log_ratio, adv, params)
        assert out.per_token_loss.dtype == dtype
        assert torch.isfinite(out.per_token_loss).all()
        correction, _ = gradient_preserving_correction(log_ratio, adv, params)
        assert correction.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_clamp_of_old_log_probs_is_exact_within_the_bound(dtype):
    gen = torch.Generator().manual_seed(5)
    logps = (-5 * torch.rand(4, 6, generator=gen)).to(dtype)
    old = logps.float() - (torch.rand(4, 6, generator=gen) * 38 - 19)  # |log-ratio| < 19
    old = old.to(dtype)
    extreme = torch.tensor([100.0, -100.0, 1e4, -1e4, 20.5, -1e30])
    old[0, :6] = (logps[0].float() - extreme).to(dtype)
    clamped, was_clamped = clamp_old_log_probs(logps, old)
    assert torch.equal(clamped[1:], old[1:]) and not was_clamped[1:].any()  # bit for bit inside the bound
    assert was_clamped[0].all()
    log_ratio = (logps - clamped).float()
    assert (log_ratio.abs() <= LOG_RATIO_CLAMP * 1.01).all()
    assert torch.isfinite(torch.exp(logps - clamped)).all()
    assert torch.sign(log_ratio[0]).tolist() == torch.sign(extreme).tolist()


def test_equal_reward_groups_uses_rewards_with_a_tolerance():
    g = 8
    rewards = torch.tensor([0.7] * g + [0.1] * g + [1.0] * (g - 1) + [0.0] + [0.3] * (g - 1) + [0.1 + 0.2])
    # TRL's group advantage of eight equal float rewards is not exactly zero: the test must not rely on it.
    grouped = rewards[:g]
    advantage = (grouped - grouped.mean()) / (grouped.std() + 1e-4)
    assert (advantage != 0).any()
    assert equal_reward_groups(rewards, g).tolist() == [True, True, False, True]
    nan = float("nan")
    with_nan = torch.tensor([1.0, nan, 1.0, 1.0, nan, nan, nan, nan])
    assert equal_reward_groups(with_nan, 4).tolist() == [True, True]  # unscorable rows are ignored
    per_func = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    assert equal_reward_groups(per_func, 4).tolist() == [False]  # the second function varies
    assert equal_reward_groups(torch.tensor([1.0, 1.0 + 1e-3]), 2).tolist() == [False]
