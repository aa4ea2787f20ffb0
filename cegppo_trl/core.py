"""Pure tensor functions of CE-GPPO (paper Eq. 8), readable against the paper line by line and tested alone
(`tests/test_core.py`) against an independent implementation. Notation (Su et al., ACL 2026, arXiv 2509.20712, Eq. 8;
the authors' verl loss `gppo_general` agrees):

    r      = pi_theta(y_t | ...) / pi_old(y_t | ...)      importance ratio, here `exp(log_ratio)`
    A      = group-normalised advantage
    sg(.)  = stop-gradient (`.detach()`)

    l_t =  beta1 * (1 - eps_low)  * r / sg(r) * A    if r < 1 - eps_low  and A < 0     ("beta1 set")
           beta2 * (1 + eps_high) * r / sg(r) * A    if r > 1 + eps_high and A > 0     ("beta2 set")
           r * A                                     otherwise

and the per-token *loss* is `-l_t`; comparisons are strict. Why the trainer can add [`gradient_preserving_correction`]
to TRL's loss, and why the old log-probs are clamped: `docs/method.md`. Entropy-ratio clipping (ERC, arXiv
2512.05591; the authors' verl loss `gppo_erc` agrees), an option on top of Eq. 8:

    rho_t  = (H_t(pi_theta) + 1e-8) / (H_t(pi_old) + 1e-8)    H_t: full-vocabulary entropy at position t
    L_t   <- L_t         if low < rho_t < high                 (strict: the open interval)
             sg(L_t)     otherwise                              same value, no gradient; still counted
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


# Bound on |log pi_theta - log pi_old| before any `exp`, as in verl (`clamp(log_prob - old_log_prob, -20, 20)`).
# exp(20) ~ 4.85e8 and exp(-20) ~ 2.06e-9 are far outside any clip range and representable in float32 and bf16.
LOG_RATIO_CLAMP = 20.0

# Added to both entropies of the entropy ratio, as in the authors' ERC code: a token whose old distribution is one-hot
# (entropy 0) gets a large finite ratio instead of a division by zero, and two zero entropies give exactly 1.
ENTROPY_RATIO_EPS = 1e-8

# Two rewards of one group count as equal when they differ by at most this much relative to max(1, |reward|): a few
# float32 ulps, so rewards computed by different arithmetic (0.1 + 0.6 vs 0.7) still compare equal.
EQUAL_REWARD_RTOL = 1e-6


@torch.no_grad()
def clamp_old_log_probs(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, bound: float = LOG_RATIO_CLAMP
):
    """Move `old_per_token_logps` to within `bound` of the current log-probs, so `exp(logps - old)` stays finite
    (unchanged, bit for bit, where `|log_ratio| <= bound`). Returns `(clamped_old, was_clamped)`, both detached."""
    low = per_token_logps.detach() - bound
    high = per_token_logps.detach() + bound
    clamped = torch.clamp(old_per_token_logps, min=low, max=high)
    return clamped, (old_per_token_logps < low) | (old_per_token_logps > high)


@torch.no_grad()
def equal_reward_groups(rewards: torch.Tensor, group_size: int, rtol: float = EQUAL_REWARD_RTOL) -> torch.Tensor:
    """`(N / group_size,)` bool: which groups of `group_size` consecutive rows of `rewards` (`(N,)`, or `(N, K)`: then
    every column) are equal within `rtol * max(1, max |reward|)`, NaN ignored (all NaN: equal). Decided on rewards, not
    advantages: TRL's group mean of eight rewards of 0.7 leaves an advantage of 5.95e-4."""
    grouped = rewards.reshape(-1, group_size, *rewards.shape[1:]).float()
    scorable = ~torch.isnan(grouped)
    high = torch.where(scorable, grouped, torch.full_like(grouped, -math.inf)).amax(dim=1)
    low = torch.where(scorable, grouped, torch.full_like(grouped, math.inf)).amin(dim=1)
    scale = torch.where(scorable, grouped.abs(), torch.zeros_like(grouped)).amax(dim=1).clamp(min=1.0)
    equal = ~(high - low > rtol * scale)  # also True when a column has no scorable entry (-inf - inf is not > x)
    return equal.reshape(equal.size(0), -1).all(dim=1)


@dataclass(frozen=True)
class ClipParams:
    """The scalars of Eq. 8 for one micro-batch (validated in `config.py`): the clip range, the betas, and the
    optional dual-clip cap `delta` of the ratio in the "otherwise" branch, `min(r, delta) A` (the authors' `c = 10`)."""

    epsilon_low: float
    epsilon_high: float
    beta1: float
    beta2: float
    delta: float | None = None


@dataclass
class ClippedSets:
    """Which tokens Eq. 8 clips (bool masks of the beta1 and beta2 sets) and each token's `grad_coef = d l_t / d log
    pi_theta` (`beta (1 -+ eps) A` on the sets, `r A` elsewhere, 0 where dual-clip caps the ratio); all detached."""

    beta1_mask: torch.Tensor
    beta2_mask: torch.Tensor
    grad_coef: torch.Tensor


@dataclass
class CEGPPOTokenLoss(ClippedSets):
    """Output of [`cegppo_per_token_loss`]: the [`ClippedSets`] and `per_token_loss`, `-l_t` (differentiable)."""

    per_token_loss: torch.Tensor


@torch.no_grad()
def clipped_sets(log_ratio: torch.Tensor, advantages: torch.Tensor, params: ClipParams) -> ClippedSets:
    """The two clipped sets of Eq. 8 and each token's gradient weight; arguments as in [`cegppo_per_token_loss`]."""
    p = params
    ratio = torch.exp(log_ratio)
    beta1_mask = (ratio < 1 - p.epsilon_low) & (advantages < 0)  # strict, as in Eq. 8
    beta2_mask = (ratio > 1 + p.epsilon_high) & (advantages > 0)
    unclipped_coef = ratio * advantages
    if p.delta is not None:
        unclipped_coef = torch.where(ratio > p.delta, torch.zeros_like(unclipped_coef), unclipped_coef)
    grad_coef = torch.where(
        beta1_mask,
        p.beta1 * (1 - p.epsilon_low) * advantages,
        torch.where(beta2_mask, p.beta2 * (1 + p.epsilon_high) * advantages, unclipped_coef),
    )
    return ClippedSets(beta1_mask=beta1_mask, beta2_mask=beta2_mask, grad_coef=grad_coef)


def cegppo_per_token_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, params: ClipParams) -> CEGPPOTokenLoss:
    """Per-token CE-GPPO loss `-l_t` (Eq. 8) of `log_ratio = log pi_theta - log pi_old` (`(B, T)`, or `(B, 1)` at
    sequence level; it carries the gradient) and `advantages` (`(B, 1)` or `(B, T)`). `beta1 = beta2 = 1` is GPPO;
    `beta1 = beta2 = 0` has PPO-clip's gradient."""
    p = params
    ratio = torch.exp(log_ratio)
    # r / sg(r): exactly 1 in the forward pass, gradient d log pi_theta. exp(x - sg(x)) avoids dividing two
    # possibly huge or tiny ratios.
    ratio_over_sg_ratio = torch.exp(log_ratio - log_ratio.detach())

    sets = clipped_sets(log_ratio, advantages, p)
    unclipped_ratio = ratio if p.delta is None else torch.clamp(ratio, max=p.delta)
    objective = torch.where(
        sets.beta1_mask,
        p.beta1 * (1 - p.epsilon_low) * ratio_over_sg_ratio * advantages,
        torch.where(
            sets.beta2_mask,
            p.beta2 * (1 + p.epsilon_high) * ratio_over_sg_ratio * advantages,
            unclipped_ratio * advantages,
        ),
    )
    return CEGPPOTokenLoss(
        per_token_loss=-objective, beta1_mask=sets.beta1_mask, beta2_mask=sets.beta2_mask, grad_coef=sets.grad_coef
    )


def gradient_preserving_correction(
    log_ratio: torch.Tensor, advantages: torch.Tensor, params: ClipParams
) -> tuple[torch.Tensor, ClippedSets]:
    """`cegppo_per_token_loss - trl_mirror.ppo_clip_per_token_loss`, per token: what turns TRL's PPO-clip loss into CE-GPPO's.

    Zero (value and gradient) outside the two clipped sets; on them `-beta (1 -+ eps) A r / sg(r) + (1 -+ eps) A`.
    Returns `(correction, clipped_sets)`. Why adding it to TRL's loss gives CE-GPPO's exactly: `docs/method.md`.
    """
    # Computed directly rather than as the difference of the two losses (three differentiable ops per micro-batch);
    # `tests/test_core.py` checks it against that difference (values and gradients).
    p = params
    sets = clipped_sets(log_ratio, advantages, p)
    with torch.no_grad():
        # PPO's (constant) objective on each clipped set, (1 -+ eps) A, and the beta that scales its gradient.
        clipped_objective = torch.where(
            sets.beta1_mask,
            (1 - p.epsilon_low) * advantages,
            torch.where(sets.beta2_mask, (1 + p.epsilon_high) * advantages, torch.zeros_like(advantages)),
        )
        beta = torch.where(sets.beta1_mask, p.beta1, p.beta2).to(log_ratio.dtype)
    correction = clipped_objective * (1 - beta * torch.exp(log_ratio - log_ratio.detach()))
    return correction, sets


@torch.no_grad()
def entropy_ratio(
    entropies: torch.Tensor, old_entropies: torch.Tensor, eps: float = ENTROPY_RATIO_EPS
) -> torch.Tensor:
    """ERC's `rho_t = (H_t(pi_theta) + eps) / (H_t(pi_old) + eps)`, per token (detached), from the `(B, T)`
    full-vocabulary entropies TRL's `_get_per_token_logps_and_entropies` returns under the current and old policy."""
    return (entropies.detach() + eps) / (old_entropies + eps)


@dataclass
class EntropyRatioBand:
    """Where each token's entropy ratio lies against ERC's band `(low, high)`: `keep` (`low < rho < high`, strict as
    the authors'), `below` (`rho <= low`), `above` (`rho >= high`); a NaN ratio is in none (and loses its gradient)."""

    keep: torch.Tensor
    below: torch.Tensor
    above: torch.Tensor


@torch.no_grad()
def entropy_ratio_band(
    entropies: torch.Tensor, old_entropies: torch.Tensor, band: tuple[float, float]
) -> EntropyRatioBand:
    """Split the tokens by [`entropy_ratio`] against `band = (low, high)`; arguments as there."""
    low, high = band
    rho = entropy_ratio(entropies, old_entropies)
    return EntropyRatioBand(keep=(rho > low) & (rho < high), below=rho <= low, above=rho >= high)


def entropy_ratio_clip(per_token_loss: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """ERC's masked gradient `torch.where(keep, L, sg(L))`: every token keeps its loss value (and still counts in the
    token-mean denominator); the tokens outside the band give no gradient."""
    return torch.where(keep, per_token_loss, per_token_loss.detach())
