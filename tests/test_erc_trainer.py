"""Entropy-ratio clipping through the real trainer: its gradient equals the float64 oracle of `tests/oracles.py` (which
shares no code with cegppo_trl) in-process, and its update on one and two launched processes (DDP over gloo) through
`trainer.train()` equals the oracle's replay of the micro-batches `training_worker.py` recorded (two SGD steps); the
old entropies are the old policy's; the metrics count the tokens outside the band; a wrong band fails the checks.
"""

import copy
import functools
import math

import pytest
import torch
from oracles import completion_log_probs_and_entropies, gppo_erc_per_token_loss
from shared import make_loss_batch
from trl_batches import TRL_OPTIONS, launched_runs, loss_and_grad, loss_ready, update_error

from cegppo_trl.config import SUPPORTED_LOSS_TYPES
from cegppo_trl.core import ClipParams


BAND = (0.95, 1.05)
WRONG_BANDS = ((0.9, 1.1), (0.99, 1.01))
TEMPERATURE = 0.7


@pytest.fixture
def erc_trainer(tiny_trainer):
    """`loss_ready` with the band on, at `TEMPERATURE`, on-policy (one step per generation) unless told otherwise."""
    erc = dict(temperature=TEMPERATURE, cegppo_entropy_ratio_clip=list(BAND))
    return functools.partial(loss_ready, tiny_trainer, steps_per_generation=1, gradient_accumulation_steps=1, **erc)


def _off_policy_batch(oracle_model, tokenizer, seed, entropy_factor=None):
    """A hand-built batch with old log-probs = current + noise and old entropies = current x exp(N(0, 0.1^2)) (or x
    `entropy_factor`), computed with the float64 oracle model (the trainer sees them as float32)."""
    batch = make_loss_batch(tokenizer, seed=seed)
    with torch.no_grad():
        logps, entropies = completion_log_probs_and_entropies(oracle_model, batch, TEMPERATURE)
    gen = torch.Generator().manual_seed(100 + seed)
    batch["old_per_token_logps"] = (logps + 0.5 * torch.randn(logps.shape, generator=gen, dtype=logps.dtype)).float()
    factor = torch.exp(0.1 * torch.randn(logps.shape, generator=gen, dtype=logps.dtype))
    batch["cegppo_old_entropies"] = (entropies * (factor if entropy_factor is None else entropy_factor)).float()
    return batch


def _oracle_terms(model, batch, params, band):
    """The oracle's per-token loss of `batch` (zero off the loss mask), and the log-probs and entropies it used."""
    logps, entropies = completion_log_probs_and_entropies(model, batch, TEMPERATURE)
    loss = gppo_erc_per_token_loss(
        logps, batch["old_per_token_logps"], batch["advantages"].unsqueeze(1), entropies,
        batch["cegppo_old_entropies"], params, band,
    )  # fmt: skip
    return loss * batch["completion_mask"].double(), logps, entropies


def _oracle_grad(model, batch, params, band):
    model.zero_grad()
    loss, _, entropies = _oracle_terms(model, batch, params, band)
    loss = loss.sum() / batch["num_items_in_batch"]
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), entropies.detach()


def _outside_band(entropies, batch) -> tuple[int, int, int]:
    """The loss tokens with an entropy ratio below / above the band, and all loss tokens."""
    rho = (entropies + 1e-8) / (batch["cegppo_old_entropies"].double() + 1e-8)
    mask = batch["completion_mask"].bool()
    return (rho[mask] <= BAND[0]).sum().item(), (rho[mask] >= BAND[1]).sum().item(), mask.sum().item()


@pytest.fixture
def oracle_model(tiny_model):
    return copy.deepcopy(tiny_model).double()


def test_trainer_gradient_equals_the_oracle_on_one_process(erc_trainer, oracle_model, tiny_tokenizer):
    params = ClipParams(0.2, 0.2, 0.5, 1.0, delta=1.5)
    trainer = erc_trainer(delta=1.5)
    batch = _off_policy_batch(oracle_model, tiny_tokenizer, seed=2)
    loss, grad = loss_and_grad(trainer, batch)
    grad = grad.double()
    ref_loss, ref_grad, entropies = _oracle_grad(oracle_model, batch, params, BAND)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert ((grad - ref_grad).norm() / ref_grad.norm()).item() < 1e-5
    # The check can fail: a wrong band, or no ERC, gives another gradient.
    for band in (*WRONG_BANDS, None):
        wrong_grad = _oracle_grad(oracle_model, batch, params, band)[1]
        assert ((grad - wrong_grad).norm() / ref_grad.norm()).item() > 1e-2, band
    # The metrics: the tokens below / above the band, over the loss tokens.
    below, above, tokens = _outside_band(entropies, batch)
    assert below > 0 and above > 0
    trainer._device_metrics.flush("train", trainer._metrics["train"])
    assert trainer._metrics["train"]["cegppo/erc_low_frac"] == [pytest.approx(below / tokens, rel=1e-6)]
    assert trainer._metrics["train"]["cegppo/erc_high_frac"] == [pytest.approx(above / tokens, rel=1e-6)]


VARIANTS = {**TRL_OPTIONS, "sft": {"cegppo_sft_coef": 0.1}}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_every_token_outside_the_band_keeps_the_loss_and_gives_no_policy_gradient(
    loss_type, variant, erc_trainer, tiny_model, oracle_model, tiny_tokenizer, tmp_path
):
    """Old entropies twice the current ones (rho = 0.5 everywhere): the loss value is ERC-off's, the policy term gives
    no gradient; only the SFT term (not masked, as in the authors' code) is left."""
    overrides = dict(loss_type=loss_type, gradient_accumulation_steps=2, steps_per_generation=4, **VARIANTS[variant])
    erc = erc_trainer(copy.deepcopy(tiny_model), tmp_path / "on", **overrides)
    off = erc_trainer(copy.deepcopy(tiny_model), tmp_path / "off", **overrides, cegppo_entropy_ratio_clip=None)
    batch = _off_policy_batch(oracle_model, tiny_tokenizer, seed=3, entropy_factor=2.0)
    if variant == "sft":
        batch["cegppo_sft_mask"] = (batch["advantages"] > 0).float()
        batch["cegppo_num_sft_tokens"] = (batch["completion_mask"] * batch["cegppo_sft_mask"].unsqueeze(1)).sum()
    (on_loss, grad), (off_loss, off_grad) = (loss_and_grad(trainer, batch) for trainer in (erc, off))
    grad, off_grad = grad.double(), off_grad.double()
    assert float(on_loss) == pytest.approx(float(off_loss), rel=1e-6, abs=1e-9)
    assert off_grad.norm() > 0  # the batch has a policy gradient to remove
    if variant != "sft":  # zero up to float rounding (TRL's term + the correction, minus Eq. 8 computed in one piece)
        assert (grad.norm() / off_grad.norm()).item() < 1e-6
    else:  # the SFT term's gradient alone: no policy gradient at all with zero advantages
        sft_only = erc_trainer(copy.deepcopy(tiny_model), tmp_path / "sft", **overrides)
        sft_grad = loss_and_grad(sft_only, dict(batch, advantages=torch.zeros_like(batch["advantages"])))[1].double()
        assert sft_grad.norm() > 0 and ((grad - sft_grad).norm() / sft_grad.norm()).item() < 1e-5


@pytest.mark.parametrize("erc", [True, False])
@pytest.mark.parametrize("path", ["trl_old_pass", "select_first"])
def test_old_entropies_are_the_current_policys_from_the_old_log_prob_pass(
    path, erc, tiny_trainer, tiny_checkpoint, arithmetic_dataset
):
    """Drift test of what the trainer assumes of TRL 1.16's `_generate_and_score_completions`: its old-log-prob pass
    is its first forward, before the reference pass (`beta > 0`). With the policy moved away from the reference model,
    the batch's old entropies are the policy's (not the reference's), next to its old log-probs; on both paths: TRL's
    own old pass, and the old pass run after dynamic sampling selected the training rows (over-generation). Without
    ERC no entropies are kept."""
    from transformers import AutoModelForCausalLM

    extra = (
        {} if path == "trl_old_pass" else {"cegppo_exclude_zero_advantage_groups": True, "cegppo_oversampling": 2.0}
    )
    band = list(BAND) if erc else None
    trainer = tiny_trainer(
        str(tiny_checkpoint), beta=0.1, temperature=TEMPERATURE, cegppo_entropy_ratio_clip=band, **extra
    )
    args = trainer.args
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    policy = copy.deepcopy(trainer.model).double()
    trainer.model.train()
    prompts = round(args.generation_batch_size * args.cegppo_oversampling) // args.num_generations
    rows = [arithmetic_dataset[i] for i in range(prompts) for _ in range(args.num_generations)]
    output = trainer._generate_and_score_completions(rows)
    assert output["old_per_token_logps"] is not None and output["ref_per_token_logps"] is not None
    if not erc:
        assert "cegppo_old_entropies" not in output
        return
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).double()
    with torch.no_grad():
        policy_logps, policy_entropies = completion_log_probs_and_entropies(policy, output, TEMPERATURE)
        _, reference_entropies = completion_log_probs_and_entropies(reference, output, TEMPERATURE)
    mask = output["completion_mask"].bool()
    old_entropies = output["cegppo_old_entropies"].double()
    assert mask.any() and old_entropies.shape == mask.shape
    assert torch.allclose(old_entropies[mask], policy_entropies[mask], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(old_entropies[mask], reference_entropies[mask], rtol=1e-3, atol=1e-3)
    assert torch.allclose(output["old_per_token_logps"].double()[mask], policy_logps[mask], rtol=1e-4, atol=1e-5)


SCENARIOS = {
    # GA 2, steps_per_generation 4, 4 rows per micro-batch: each process generates 4 prompts x 4 completions.
    "cegppo": {"config": {"cegppo_beta1": 0.5, "cegppo_beta2": 1.0, "delta": 1.5}, "kinds": ["varied"] * 4},
    # The authors' options: GPPO, dual clip 10, SFT 0.1, dynamic sampling over a 2x over-generated batch.
    "authors": {
        "config": {
            "cegppo_beta1": 1.0, "cegppo_beta2": 1.0, "delta": 10.0, "cegppo_sft_coef": 0.1,
            "cegppo_exclude_zero_advantage_groups": True, "cegppo_oversampling": 2.0,
        },
        "kinds": ["varied", "flat", "varied", "varied", "flat", "varied", "flat", "flat"],
    },
}  # fmt: skip
GA, SPG, LR = 2, 4, 1.0


def _scenarios(world: int) -> list[dict]:
    """Each scenario on `world` processes, each process's share of prompts the same mix."""
    common = dict(temperature=TEMPERATURE, learning_rate=LR, cegppo_entropy_ratio_clip=list(BAND))
    return [
        {"name": n, "config": {**common, **s["config"]}, "kinds": s["kinds"] * world} for n, s in SCENARIOS.items()
    ]


def _replay(model_dir, ranks, config, band):
    """The two SGD steps of the run, in float64 through the oracle: each step's loss is the sum over the processes'
    micro-batches of dapo's token sums / (generation batch tokens x GA / steps_per_generation) (DDP's average over
    processes included), plus the SFT term likewise over its tokens. Returns the final parameters."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).double()
    params = ClipParams(0.2, 0.2, config["cegppo_beta1"], config["cegppo_beta2"], config.get("delta"))
    sft = config.get("cegppo_sft_coef", 0.0)
    for step in range(2):
        model.zero_grad()
        total = 0.0
        for rank in ranks:
            for x in rank["recorded"][step * GA : (step + 1) * GA]:
                loss, logps, _ = _oracle_terms(model, x, params, band)
                total = total + loss.sum() / (x["num_items_in_batch"].clamp(min=1) * GA / SPG)
                if sft:
                    sft_mask = x["completion_mask"].double() * x["cegppo_sft_mask"].double().unsqueeze(1)
                    nll = -(logps * sft_mask).sum() / (x["cegppo_num_sft_tokens"].clamp(min=1) * GA / SPG)
                    total = total + sft * nll
        total.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return dict(model.named_parameters())


def _expected_fractions(model, ranks, micro_batches):
    """Per micro-batch (all processes together): the loss tokens below / above the band at the parameters the run had,
    from the oracle's entropies (`model`: the initial one, for the first step only)."""
    out = []
    for m in micro_batches:
        below = above = tokens = 0
        for rank in ranks:
            with torch.no_grad():
                _, entropies = completion_log_probs_and_entropies(model, rank["recorded"][m], TEMPERATURE)
            counts = _outside_band(entropies, rank["recorded"][m])
            below, above, tokens = below + counts[0], above + counts[1], tokens + counts[2]
        out.append((below / tokens, above / tokens) if tokens else (math.nan, math.nan))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_trainer_update_equals_the_oracle_on_launched_processes(world, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    initial_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).double()
    initial = {n: p.detach().clone() for n, p in initial_model.named_parameters()}
    scenarios = _scenarios(world)
    runs = launched_runs(world, scenarios, tiny_checkpoint, tmp_path)
    for scenario in scenarios:
        name, config = scenario["name"], scenario["config"]
        ranks = runs[name]
        assert all(r["world"] == world and len(r["recorded"]) == 2 * GA for r in ranks), name
        # The old entropies are the old policy's (the initial model's, one generation batch), from the old pass.
        for rank in ranks:
            (generated,) = rank["generated"]
            with torch.no_grad():
                _, entropies = completion_log_probs_and_entropies(initial_model, generated, TEMPERATURE)
            mask = generated["completion_mask"].bool()
            assert mask.any(), name
            assert torch.allclose(
                generated["cegppo_old_entropies"].double()[mask], entropies[mask], rtol=1e-4, atol=1e-5
            ), name
        # The update equals the oracle's; a wrong band's, or no ERC's, does not.
        error = update_error(ranks[0]["final"], initial, _replay(tiny_checkpoint, ranks, config, BAND))
        assert error < 1e-4, f"{name} on {world} process(es): the update differs from the oracle's by {error:.2e}"
        for band in (*WRONG_BANDS, None):
            wrong = update_error(ranks[0]["final"], initial, _replay(tiny_checkpoint, ranks, config, band))
            assert wrong > 100 * max(error, 1e-6), (name, band, wrong, error)
        # The first step's metrics (at the initial parameters), micro-batch by micro-batch, all processes together.
        expected = _expected_fractions(initial_model, ranks, range(GA))
        logged = ranks[0]["logged"][0]
        assert logged["cegppo/erc_low_frac"] == pytest.approx([b for b, _ in expected], rel=1e-6, nan_ok=True), name
        assert logged["cegppo/erc_high_frac"] == pytest.approx([a for _, a in expected], rel=1e-6, nan_ok=True), name
        assert any(b > 0 for b, _ in expected) and any(a > 0 for _, a in expected), name
        assert len(ranks[0]["logged"]) == 2 and "cegppo/erc_low_frac" in ranks[0]["logged"][1], name
