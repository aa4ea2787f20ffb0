"""CE-GPPO adds no device-to-host transfer per micro-batch, and at most one per optimizer step: on a
GPU, `item()` / `tolist()` / `bool()` / `cpu()` / `float()` / `int()` of a tensor wait for every queued kernel. The
one at a step's boundary is the step check (`divergence.StepGuard`), which also carries the entropy
controller's measurement; CE-GPPO's metrics wait on the device until `log` moves them to the host in one transfer.
"""

import contextlib

import pytest
import torch
from trl import GRPOTrainer
from trl_batches import batch_with_dropped_rows, loss_ready


HOST_TRANSFERS = ("item", "tolist", "__bool__", "cpu", "__float__", "__int__")
# TRL's own options (given to both trainers) and CE-GPPO's extras (CE-GPPO only).
CASES = {
    "paper": ({}, {}),
    "sft + controller": ({}, dict(cegppo_sft_coef=0.1, cegppo_entropy_target=1.0)),
    "entropy bonus": (dict(entropy_coef=0.05), {}),
    "dynamic sampling, everything on": (
        dict(entropy_coef=0.05),
        dict(cegppo_exclude_zero_advantage_groups=True, cegppo_sft_coef=0.1, cegppo_entropy_target=1.0),
    ),
}


@contextlib.contextmanager
def counting_host_transfers():
    """Count the calls of `HOST_TRANSFERS` on any tensor while the block runs."""
    counts = {"calls": 0}

    def counted(original):
        def wrapper(self, *args, **kwargs):
            counts["calls"] += 1
            return original(self, *args, **kwargs)

        return wrapper

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_TRANSFERS:
            patch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
        yield counts


def _transfers(trainer, inputs, sync_gradients: bool) -> tuple[int, int]:
    """Host transfers of one micro-batch's loss and backward, and at a step's boundary of the gradient norm the
    Trainer takes before `optimizer.step()` (`_get_grad_norm`: the divergence guard's step check)."""
    trainer.accelerator.gradient_state._set_sync_gradients(sync_gradients)
    with counting_host_transfers() as loss_counts:
        trainer._compute_loss(trainer.model, dict(inputs)).backward()
    with counting_host_transfers() as norm_counts:
        if sync_gradients:
            trainer._get_grad_norm(trainer.model)
    return loss_counts["calls"], norm_counts["calls"]


@pytest.mark.parametrize("case", CASES)
def test_no_host_transfer_per_micro_batch_and_at_most_one_per_step(case, tiny_trainer, tiny_tokenizer, tmp_path):
    trl_options, cegppo_options = CASES[case]
    grpo = loss_ready(tiny_trainer, output_dir=tmp_path / "g", cls=GRPOTrainer, **trl_options)
    cegppo = loss_ready(tiny_trainer, output_dir=tmp_path / "c", **trl_options, **cegppo_options)
    dynamic_sampling = cegppo_options.get("cegppo_exclude_zero_advantage_groups")
    inputs, _ = batch_with_dropped_rows(
        cegppo, tiny_tokenizer, seed=5, kept=[0, 1, 2, 3] if dynamic_sampling else None
    )
    # At the boundary: the step check's one transfer (loss, gradient norm and the controller's sums together).
    for sync_gradients, allowed in ((False, 0), (True, 1)):
        trl_count = sum(_transfers(grpo, inputs, sync_gradients))
        cegppo_loss_count, cegppo_norm_count = _transfers(cegppo, inputs, sync_gradients)
        assert trl_count > 0  # the counter sees TRL's own transfers (its metrics), so it would see CE-GPPO's
        cegppo_count = cegppo_loss_count + cegppo_norm_count
        assert cegppo_count - trl_count <= allowed, (case, sync_gradients, cegppo_count, trl_count)
    # The boundary's one transfer is exactly one, and it updates the controller when there is one.
    assert cegppo_norm_count == 1
    assert cegppo._controller is None or cegppo._controller.num_updates == 1
    # `log` moves every recorded CE-GPPO metric to the host at once.
    with counting_host_transfers() as counts:
        cegppo._device_metrics.flush("train", cegppo._metrics["train"])
    assert counts["calls"] == 1
    assert cegppo._metrics["train"]["cegppo/beta1_token_frac"]
