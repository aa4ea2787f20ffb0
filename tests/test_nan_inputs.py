"""A NaN ratio belongs to neither clipped set (`r < 1 - eps` and `r > 1 + eps` are both False for NaN), so CE-GPPO's
correction is zero there; what stops a NaN from training silently is the loss. For a NaN in each of the three places
a ratio is built from (the old log-probs, vLLM's importance-sampling ratio, the current log-probs), inside and
outside the loss mask: CE-GPPO's loss is NaN exactly where TRL 1.16's `GRPOTrainer._compute_loss` gives NaN on the
same micro-batch (finite: equal), and in training the divergence guard stops before that step is applied
(docs/launch.md, "A NaN in a ratio").
"""

import math

import pytest
import torch
from shared import make_loss_batch
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl_batches import add_off_policy, loss_ready

from cegppo_trl import CEGPPOTrainer
from cegppo_trl.divergence import NonFiniteStepError


PLACES = ("old_logps", "vllm_is_ratio", "current_logps")
# (row, token): row 0 is complete, so (0, 2) is inside the loss mask; the shortest row has padding at its end.
INSIDE = (0, 2)


def _padding_position(mask: torch.Tensor) -> tuple[int, int]:
    row = int(mask.sum(1).argmin())
    return row, mask.size(1) - 1


def _nan_current_logps(monkeypatch, position):
    """TRL's forward (which CE-GPPO's calls through `super()`) returns a NaN log-prob at `position`."""
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def with_nan(self, *args, **kwargs):
        logps, entropies, aux = original(self, *args, **kwargs)
        logps = logps.clone()
        logps[position] = math.nan
        return logps, entropies, aux

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", with_nan)


def _with_nan(trainer, inputs, place, position, monkeypatch):
    inputs = dict(inputs)
    if place == "old_logps":
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"].clone()
        inputs["old_per_token_logps"][position] = math.nan
    elif place == "vllm_is_ratio":
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        ratio = 0.5 + torch.rand(inputs["completion_ids"].shape, generator=torch.Generator().manual_seed(3))
        ratio[position] = math.nan
        inputs["importance_sampling_ratio"] = ratio
    else:
        _nan_current_logps(monkeypatch, position)
    return inputs


@pytest.mark.parametrize("inside", [True, False], ids=["in-mask", "padding"])
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_nan_gives_cegppo_the_loss_trl_gives_on_the_same_batch(
    loss_type, place, inside, tiny_trainer, tiny_tokenizer, monkeypatch
):
    trainer = loss_ready(tiny_trainer, loss_type=loss_type)
    batch = add_off_policy(trainer, make_loss_batch(tiny_tokenizer, seed=1))
    position = INSIDE if inside else _padding_position(batch["completion_mask"])
    inputs = _with_nan(trainer, batch, place, position, monkeypatch)
    with torch.no_grad():
        trl_loss = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))
        ours = trainer._compute_loss(trainer.model, dict(inputs))
    assert torch.isnan(trl_loss) == torch.isnan(ours), (place, inside, trl_loss, ours)
    # TRL's masked sums multiply a NaN by the mask's 0 (NaN), so a NaN anywhere in the batch makes its loss NaN.
    assert torch.isnan(ours), (place, inside, ours)


class _NanAtStep(CEGPPOTrainer):
    """Puts a NaN into `place` of every micro-batch of optimizer step `nan_step` (1-based)."""

    place: str = "old_logps"
    nan_step: int = 2
    monkeypatch = None

    def _compute_loss(self, model, inputs):
        if not (self.model.training and self.state.global_step + 1 == self.nan_step):
            return super()._compute_loss(model, inputs)
        inputs = _with_nan(self, inputs, self.place, INSIDE, self.monkeypatch)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm = False  # the stand-in's vLLM flag lives for this micro-batch only
            self.monkeypatch.undo()


@pytest.mark.parametrize("place", PLACES)
def test_training_stops_before_a_step_with_a_nan_and_never_applies_it(place, tiny_trainer, monkeypatch):
    trainer = tiny_trainer(cls=_NanAtStep, max_steps=3, gradient_accumulation_steps=2, steps_per_generation=4)
    trainer.place, trainer.monkeypatch = place, monkeypatch
    after_first = {}

    class AfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                after_first.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})

    trainer.add_callback(AfterFirstStep())
    with pytest.raises(NonFiniteStepError, match=r"stopped before applying optimizer step 2: a non-finite value"):
        trainer.train()
    assert trainer.state.global_step == 1
    now = dict(trainer.model.named_parameters())
    assert after_first and all(torch.equal(after_first[n], now[n].detach()) for n in after_first), "step 2 applied"
