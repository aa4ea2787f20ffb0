"""`cegppo_trl.metrics`: every `cegppo/` token metric equals its definition counted token by token (float64, in
Python), the shares' NaN / 0 rules, and how recorded values, on the device or the host, reach TRL's metric lists. Pure: no trainer, no process group."""

import math
from collections import defaultdict

import pytest
import torch

from cegppo_trl.metrics import (
    ERC_RATIOS,
    SFT_RATIOS,
    TOKEN_METRICS,
    TOKEN_RATIOS,
    DeviceMetrics,
    Ratios,
    StepSums,
    erc_sums,
    fill_metrics,
    sft_sums,
    step_sums,
    token_set_sums,
)


THRESHOLD = 0.2


def _micro_batch(seed: int, with_weight: bool):
    gen = torch.Generator().manual_seed(seed)
    shape = (6, 9)
    mask = (torch.rand(shape, generator=gen) < 0.8).float()
    mask[5] = 0  # a row without loss tokens
    beta1 = torch.rand(shape, generator=gen) < 0.25
    beta2 = ~beta1 & (torch.rand(shape, generator=gen) < 0.3)
    grad_coef = torch.randn(shape, generator=gen)
    advantages = torch.tensor([[1.0], [-0.5], [0.0], [2.0], [-1.0], [1.0]])
    logps = -4 * torch.rand(shape, generator=gen)
    clamped = torch.rand(shape, generator=gen) < 0.1
    weight = torch.rand(shape, generator=gen) if with_weight else None
    return mask, grad_coef, weight, beta1, beta2, advantages, logps, clamped


def _by_definition(mask, grad_coef, weight, beta1, beta2, advantages, logps, clamped) -> dict[str, float]:
    """Each metric counted token by token."""
    rows, cols = mask.shape
    tokens = [(i, j) for i in range(rows) for j in range(cols) if mask[i, j] > 0]

    def w(i, j):
        return abs(float(grad_coef[i, j])) * (1.0 if weight is None else float(weight[i, j]))

    def quadrant(i, j):
        a, low = float(advantages[i, 0]), float(logps[i, j]) < math.log(THRESHOLD)
        if a == 0:
            return None
        return ("pos" if a > 0 else "neg") + ("_low" if low else "_high")

    def frac(num, den):
        return num / den if den > 0 else 0.0

    total_tokens, total_weight = len(tokens), sum(w(i, j) for i, j in tokens)
    expected = {}
    for name, members in (("beta1", beta1), ("beta2", beta2)):
        inside = [(i, j) for i, j in tokens if members[i, j]]
        expected[f"cegppo/{name}_token_frac"] = frac(len(inside), total_tokens)
        expected[f"cegppo/{name}_grad_share"] = frac(sum(w(i, j) for i, j in inside), total_weight)
    for q in ("pos_high", "pos_low", "neg_high", "neg_low"):
        inside = [(i, j) for i, j in tokens if quadrant(i, j) == q]
        clipped = [(i, j) for i, j in inside if beta1[i, j] or beta2[i, j]]
        expected[f"cegppo/quadrant/{q}/token_frac"] = frac(len(inside), total_tokens)
        expected[f"cegppo/quadrant/{q}/grad_share"] = frac(sum(w(i, j) for i, j in inside), total_weight)
        expected[f"cegppo/quadrant/{q}/clip_frac"] = frac(len(clipped), len(inside))
        expected[f"cegppo/quadrant/{q}/restored_grad_share"] = frac(sum(w(i, j) for i, j in clipped), total_weight)
    expected["cegppo/log_ratio_clamped_frac"] = frac(sum(bool(clamped[i, j]) for i, j in tokens), total_tokens)
    return expected


@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_token_metric_is_its_definition(seed, with_weight):
    batch = _micro_batch(seed, with_weight)
    sums = token_set_sums(*batch[:-1], THRESHOLD, batch[-1])
    shares = dict(zip(TOKEN_RATIOS.names, TOKEN_RATIOS.shares(sums.double().tolist())))
    expected = _by_definition(*batch)
    assert set(shares) == set(expected) == set(TOKEN_METRICS)
    for name, value in expected.items():
        assert shares[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert expected["cegppo/beta1_token_frac"] > 0 and expected["cegppo/quadrant/neg_low/clip_frac"] > 0


def test_no_old_log_probs_means_nothing_clamped_and_a_micro_batch_without_tokens_is_nan():
    mask, grad_coef, weight, beta1, beta2, advantages, logps, _ = _micro_batch(2, False)
    sums = token_set_sums(mask, grad_coef, weight, beta1, beta2, advantages, logps, THRESHOLD, None)
    shares = dict(zip(TOKEN_RATIOS.names, TOKEN_RATIOS.shares(sums.tolist())))
    assert shares["cegppo/log_ratio_clamped_frac"] == 0.0
    empty = token_set_sums(mask * 0, grad_coef, weight, beta1, beta2, advantages, logps, THRESHOLD, None)
    assert all(math.isnan(v) for v in TOKEN_RATIOS.shares(empty.tolist()))


def test_sft_sums_and_pairs():
    logps = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    sft_mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    nll, frac = SFT_RATIOS.shares(sft_sums(logps, sft_mask, mask).tolist())
    assert (nll, frac) == (pytest.approx(1.5), pytest.approx(2 / 3))
    assert Ratios.of_pairs(("a", "b")) == Ratios(("a", "b"), (0, 2), (1, 3), 4)


def test_erc_sums_count_loss_tokens_outside_the_band():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    below = torch.tensor([[True, False, False], [True, True, False]])  # the masked one does not count
    above = torch.tensor([[False, False, True], [False, False, True]])
    assert ERC_RATIOS.shares(erc_sums(below, above, mask).tolist()) == [pytest.approx(0.5), pytest.approx(0.25)]
    assert all(math.isnan(v) for v in ERC_RATIOS.shares(erc_sums(below, above, mask * 0).tolist()))


def test_device_metrics_reach_trl_lists_in_one_transfer_beside_host_values():
    def reduce(tensor, reduction):
        return tensor * 2 if reduction == "sum" else tensor  # as if two processes had recorded the same sums

    recorded = DeviceMetrics(reduce)
    recorded.record_sums("train", Ratios.of_pairs(("x",)), torch.tensor([1.0, 4.0, 4.0, 4.0]))
    recorded.record_mean("train", ("cegppo/policy_loss",), torch.tensor([0.5]))
    recorded.record("train", ("cegppo/beta1", "cegppo/beta2"), (0.7, 1.25))  # host floats: no transfer
    trl_metrics = defaultdict(list, {"policy_loss": [1.0, 2.0]})
    recorded.flush("train", trl_metrics)
    assert trl_metrics["x"] == [0.25]
    assert trl_metrics["policy_loss"] == [1.0, 2.0]  # TRL's entry is TRL's
    assert trl_metrics["cegppo/policy_loss"] == [0.5]
    assert trl_metrics["cegppo/beta1"] == [pytest.approx(0.7)] and trl_metrics["cegppo/beta2"] == [1.25]
    recorded.flush("train", trl_metrics)  # nothing pending: nothing added
    assert trl_metrics["x"] == [0.25]


def test_step_sums_total_at_the_boundary_and_fill():
    sums = StepSums(lambda tensor, reduction: tensor)
    entropies, mask = torch.ones(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert sums.add(step_sums(entropies, mask, torch.tensor([1.0, 0.0])), boundary=False) is None
    totals = sums.add(step_sums(entropies, mask, torch.tensor([1.0, 1.0])), boundary=True)
    assert totals.tolist() == [6.0, 6.0, 3.0, 4.0]
    fill = fill_metrics(totals, torch.tensor([5.0, 2.0]))
    assert fill.tolist() == [0.75, 5.0, 2.0]
    assert math.isnan(fill_metrics(totals, None)[1])
