"""Test oracles: the paper's objective written out directly, for tests to compare the trainer's loss against."""

import torch

from cegppo_trl.core import ClipParams, cegppo_per_token_loss


def cegppo_token_mean_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: ClipParams
) -> torch.Tensor:
    """The paper's full objective as a loss: `-J = -sum_{i,t} l_t / sum_i |y_i|` over the tokens where `mask` is 1.

    What `CEGPPOTrainer` computes with `loss_type="dapo"` for one generation batch on one process (TRL additionally
    splits the denominator over processes and gradient-accumulation steps).
    """
    per_token = cegppo_per_token_loss(log_ratio, advantages, params)
    return (per_token.per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------------------------------------------
# Entropy-ratio clipping (ERC, arXiv 2512.05591; the authors' verl loss `gppo_erc`), written out from its definition
# in float64, sharing no code with cegppo_trl (not even Eq. 8: it is restated below).
# ----------------------------------------------------------------------------------------------------------------


def full_vocab_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`H = -sum_v p_v log p_v` of `p = softmax(logits / temperature)` over the last dimension, in float64."""
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def gppo_erc_per_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    entropies: torch.Tensor,
    old_entropies: torch.Tensor,
    params: ClipParams,
    band: tuple[float, float] | None,
) -> torch.Tensor:
    """Per-token loss `-l_t` of Eq. 8 (with the dual-clip cap `min(r, delta)` on the unclipped branch), then ERC:
    tokens with `rho = (H + 1e-8) / (H_old + 1e-8)` outside the open interval `band` keep the value, lose the gradient.
    `band=None`: Eq. 8 alone. Float64; `log_probs` carries the gradient."""
    log_probs, old_log_probs, advantages = log_probs.double(), old_log_probs.double(), advantages.double()
    p = params
    r = torch.exp(log_probs - old_log_probs)
    r_over_sg_r = torch.exp(log_probs - log_probs.detach())  # 1 in value, d log pi in gradient
    in_beta1_set = (r.detach() < 1 - p.epsilon_low) & (advantages < 0)
    in_beta2_set = (r.detach() > 1 + p.epsilon_high) & (advantages > 0)
    capped_r = r if p.delta is None else torch.minimum(r, torch.full_like(r, p.delta))
    objective = torch.where(
        in_beta1_set,
        p.beta1 * (1 - p.epsilon_low) * r_over_sg_r * advantages,
        torch.where(in_beta2_set, p.beta2 * (1 + p.epsilon_high) * r_over_sg_r * advantages, capped_r * advantages),
    )
    loss = -objective
    if band is None:
        return loss
    rho = (entropies.double() + 1e-8) / (old_entropies.double() + 1e-8)
    inside = (rho > band[0]) & (rho < band[1])
    return torch.where(inside, loss, loss.detach())


def eq8_scalar(r: float, a: float, p: ClipParams) -> tuple[float, float]:
    """Eq. 8 for one token, written from the paper: returns (l_t, d l_t / d log pi_theta)."""
    if r < 1 - p.epsilon_low and a < 0:  # r / sg(r) is 1 in value, d log pi in gradient
        return (p.beta1 * (1 - p.epsilon_low) * a,) * 2
    if r > 1 + p.epsilon_high and a > 0:
        return (p.beta2 * (1 + p.epsilon_high) * a,) * 2
    if p.delta is not None and r > p.delta:
        return p.delta * a, 0.0  # dual-clip: capped ratio, no gradient
    return r * a, r * a  # d(r a) / d log pi = r a


def expected_erc_gradient(
    log_ratio: torch.Tensor, advantages: torch.Tensor, rho: torch.Tensor, params: ClipParams, band
) -> torch.Tensor:
    """`d(-l_t) / d log pi_theta` token by token, by the case analysis of the definitions (no autograd): outside the
    band 0; inside, Eq. 8's (`eq8_scalar`)."""
    tokens = zip(*(x.flatten().tolist() for x in (log_ratio.double().exp(), advantages.double(), rho.double())))
    grad = [0.0 if band and not band[0] < q < band[1] else -eq8_scalar(r, a, params)[1] for r, a, q in tokens]
    return torch.tensor(grad, dtype=torch.float64).view(log_ratio.shape)


def completion_log_probs_and_entropies(model, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`log pi(y_t)` and the full-vocabulary entropy at every completion position of `batch` (TRL's layout: left-padded
    `prompt_ids`, right-padded `completion_ids` and their masks), from the model's plain logits, in float64. Pass a
    float64 copy of the model that no trainer has patched."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    completion_length = batch["completion_ids"].size(1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.double()
    logits = logits[:, -completion_length - 1 : -1]  # position t predicts token t + 1
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    token_log_probs = log_p.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return token_log_probs, full_vocab_entropy(logits, temperature)
