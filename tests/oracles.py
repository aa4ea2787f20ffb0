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
