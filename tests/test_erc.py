"""Entropy-ratio clipping (ERC; Su et al., arXiv 2512.05591, the authors' verl loss `gppo_erc`): the masked-gradient
rule of `cegppo_trl.core` against the float64 oracle of `tests/oracles.py` on every token class, and the setting's
validation and parsing. The trainer's gradient against the same oracle on one and two processes:
`tests/test_erc_trainer.py`."""

import pytest
import torch
from oracles import expected_erc_gradient, full_vocab_entropy, gppo_erc_per_token_loss
from shared import cpu_config

from cegppo_trl import CEGPPOConfig
from cegppo_trl.core import (
    ClipParams,
    cegppo_per_token_loss,
    entropy_ratio,
    entropy_ratio_band,
    entropy_ratio_clip,
)


BAND = (0.95, 1.05)  # the authors' released scripts
PARAMS = ClipParams(epsilon_low=0.2, epsilon_high=0.28, beta1=0.5, beta2=0.75, delta=3.0)
# (ratio r, advantage A) of each CE-GPPO branch, and the entropy ratios rho that put a token below, inside, above the
# band and exactly on its edges (the open interval excludes them).
BRANCHES = {
    "beta1 set": (0.7, -1.3),
    "beta2 set": (1.5, 0.9),
    "unclipped, A > 0": (1.1, 0.6),
    "unclipped, A < 0": (0.9, -0.4),
    "unclipped, A > 0, r < 1 - eps": (0.6, 0.8),
    "unclipped, A < 0, r > 1 + eps": (1.6, -0.7),
    "dual clip (r > delta, A < 0)": (4.0, -1.1),
    "zero advantage": (1.4, 0.0),
}
RHOS = {
    "below": 0.9,
    "low edge": BAND[0],
    "inside, near low": 0.951,
    "inside": 1.0,
    "inside, near high": 1.049,
    "high edge": BAND[1],
    "above": 1.2,
}


def _token_grid(dtype=torch.float64):
    """One token per (branch, rho) pair: log pi, old log pi, A, H, H_old."""
    rows = [(r, a, rho) for r, a in BRANCHES.values() for rho in RHOS.values()]
    ratio, adv, rho = (torch.tensor(col, dtype=dtype) for col in zip(*rows))
    old_log_probs = torch.linspace(-3.0, -0.2, len(rows), dtype=dtype)
    log_probs = (old_log_probs + torch.log(ratio)).requires_grad_(True)
    # H_old + 1e-8 == 1 and H + 1e-8 == rho, exactly in float64: the edge tokens sit exactly on the edges.
    old_entropies = torch.full_like(rho, 1.0) - 1e-8
    entropies = rho - 1e-8
    return log_probs, old_log_probs, adv, entropies, old_entropies


def _core_loss(log_probs, old_log_probs, adv, entropies, old_entropies, band):
    loss = cegppo_per_token_loss(log_probs - old_log_probs, adv, PARAMS).per_token_loss
    return entropy_ratio_clip(loss, entropy_ratio_band(entropies, old_entropies, band).keep)


def _grad(loss, log_probs):
    (grad,) = torch.autograd.grad(loss.sum(), log_probs)
    return grad


def test_every_token_class_gets_the_oracles_gradient_and_keeps_its_value():
    log_probs, old, adv, h, h_old = _token_grid()
    ours = _core_loss(log_probs, old, adv, h, h_old, BAND)
    oracle = gppo_erc_per_token_loss(log_probs, old, adv, h, h_old, PARAMS, BAND)
    expected = expected_erc_gradient(log_probs.detach() - old, adv, (h + 1e-8) / (h_old + 1e-8), PARAMS, BAND)
    ours_grad = _grad(ours, log_probs)
    assert torch.allclose(ours_grad, expected, rtol=1e-12, atol=1e-12)
    assert torch.allclose(_grad(oracle, log_probs), expected, rtol=1e-12, atol=1e-12)
    # The value is Eq. 8's everywhere, inside and outside the band (outside tokens still count in the token mean).
    without = cegppo_per_token_loss(log_probs - old, adv, PARAMS).per_token_loss
    assert torch.equal(ours.detach(), without.detach())
    # Every class really occurs: inside the band the gradient is each branch's, outside it is 0, the edges are out.
    grid = expected.view(len(BRANCHES), len(RHOS))
    columns = list(RHOS)
    for name in ("below", "low edge", "high edge", "above"):
        assert torch.all(grid[:, columns.index(name)] == 0), name
    inside = grid[:, columns.index("inside")]
    for name in ("inside, near low", "inside, near high"):
        assert torch.allclose(inside, grid[:, columns.index(name)], rtol=1e-12), name
    nonzero = {name for name, g in zip(BRANCHES, inside.tolist()) if g != 0}
    assert nonzero == set(BRANCHES) - {"dual clip (r > delta, A < 0)", "zero advantage"}
    # ERC off (no band) is Eq. 8.
    no_band = gppo_erc_per_token_loss(log_probs, old, adv, h, h_old, PARAMS, None)
    assert torch.allclose(_grad(without, log_probs), _grad(no_band, log_probs), rtol=1e-12, atol=1e-12)
    # The checks can fail: the oracle's gradient with a shifted band differs from the rule with the right one.
    for wrong_band in ((0.9, 1.1), (0.95, 1.04), (0.96, 1.05), (0.0, 1e9)):
        wrong = _grad(gppo_erc_per_token_loss(log_probs, old, adv, h, h_old, PARAMS, wrong_band), log_probs)
        assert not torch.allclose(ours_grad, wrong, rtol=1e-6, atol=1e-9), wrong_band


def test_sequence_level_loss_broadcasts_over_the_token_mask():
    """With importance_sampling_level="sequence" the policy loss is (B, 1); the band mask is (B, T): each token of a
    row keeps or loses its share of the row's gradient."""
    log_ratio = torch.tensor([[0.3], [-0.1]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    loss = cegppo_per_token_loss(log_ratio, adv, PARAMS).per_token_loss
    keep = torch.tensor([[True, False, True], [False, False, False]])
    clipped = entropy_ratio_clip(loss, keep)
    assert clipped.shape == (2, 3)
    (grad,) = torch.autograd.grad(clipped.sum(), log_ratio, retain_graph=True)
    (full,) = torch.autograd.grad(loss.expand(2, 3).sum(), log_ratio)
    assert torch.allclose(grad, full * torch.tensor([[2 / 3], [0.0]], dtype=torch.float64))


def test_entropy_ratio_is_the_authors_with_its_epsilon():
    h = torch.tensor([0.0, 0.0, 2.0, 1e-9, float("nan")])
    h_old = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    rho = entropy_ratio(h, h_old)
    assert rho[0] == 1.0  # two one-hot distributions: no change
    assert rho[1] == pytest.approx(1e-8) and rho[2] == pytest.approx(2.0)
    assert torch.isfinite(rho[3]) and rho[3] == pytest.approx(1.1, rel=1e-3)
    band = entropy_ratio_band(h, h_old, BAND)
    assert band.keep.tolist() == [True, False, False, False, False]  # NaN: not kept (the authors' `&` of `>` `<`)
    assert band.below.tolist() == [False, True, False, False, False]
    assert band.above.tolist() == [False, False, True, True, False]
    assert not (band.keep & (band.below | band.above)).any()


def test_full_vocab_entropy_oracle_divides_by_the_temperature():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    p = torch.softmax(logits.double() / 0.7, dim=-1)
    assert full_vocab_entropy(logits, 0.7).item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-12)
    assert full_vocab_entropy(logits, 0.7) != full_vocab_entropy(logits, 1.0)


@pytest.mark.parametrize(
    "band",
    [[1.0, 1.05], [0.95, 1.0], [0.0, 1.05], [-0.5, 2.0], [0.95], [0.9, 1.1, 1.2], [float("nan"), 1.05],
     [0.95, float("inf")], ["0.95", "1.05"], [True, 2], 1.05],
)  # fmt: skip
def test_a_bad_band_is_refused_in_one_line_naming_the_field_and_the_fix(band, tmp_path):
    with pytest.raises(ValueError) as err:
        cpu_config(CEGPPOConfig, tmp_path, cegppo_entropy_ratio_clip=band)
    message = str(err.value)
    assert message.startswith("`cegppo_entropy_ratio_clip` must be two numbers [low, high] with 0 < low < 1 < high")
    assert "[0.95, 1.05]" in message and "None to disable" in message and "\n" not in message


@pytest.mark.parametrize("band", [[0.95, 1.05], (0.8, 1.2), [0.5, 3]])
def test_a_good_band_is_accepted(band, tmp_path):
    assert cpu_config(CEGPPOConfig, tmp_path, cegppo_entropy_ratio_clip=band).cegppo_entropy_ratio_clip == band
    assert cpu_config(CEGPPOConfig, tmp_path).cegppo_entropy_ratio_clip is None  # off by default


def test_band_parses_from_the_command_line_and_from_yaml(tmp_path):
    from cegppo_trl.scripts.train import make_parser

    recipe = tmp_path / "erc.yaml"
    recipe.write_text(
        "model_name_or_path: builtin:tiny\ndataset_name: builtin:arithmetic\noutput_dir: out\nuse_cpu: true\n"
        "bf16: false\ncegppo_entropy_ratio_clip: [0.95, 1.05]\n"
    )
    _, config, _ = make_parser().parse_args_and_config(args=["--config", str(recipe)])
    assert config.cegppo_entropy_ratio_clip == [0.95, 1.05]
    _, config, _ = make_parser().parse_args_and_config(
        args=["--config", str(recipe), "--cegppo_entropy_ratio_clip", "0.8", "1.2"]
    )
    assert config.cegppo_entropy_ratio_clip == [0.8, 1.2]
    with pytest.raises(ValueError, match="cegppo_entropy_ratio_clip"):
        make_parser().parse_args_and_config(
            args=["--config", str(recipe), "--cegppo_entropy_ratio_clip", "1.2", "0.8"]
        )
