"""Entropy mechanics of CE-GPPO: the toy's first-order formula and beta direction, the entropy-target controller
(alone and inside CEGPPOTrainer, with checkpoint / resume), and the quadrant metrics of an off-policy run."""

import dataclasses
import json
import math

import pytest
import torch
from launching import controller_state
from shared import cpu_config
from trl_batches import history

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer, EntropyController
from cegppo_trl.demo.toy import (
    TOY_PRESETS,
    ToyConfig,
    entropy_change_first_order,
    entropy_sensitivity,
    first_order_check,
    run_toy,
    single_step_entropy_change,
)


def test_first_order_formula_matches_one_small_step():
    """One SGD step of the real CE-GPPO loss on one token vs `dH = -eta F A s_a`, in all three branches."""
    small = first_order_check(lr=1e-4, trials=32)
    assert small["max_rel_error"] < 2e-3, small["max_rel_error"]
    assert {r["branch"] for r in small["rows"]} == {"beta1", "beta2", "unclipped_pos", "unclipped_neg"}
    assert all(abs(r["predicted"]) > 0 for r in small["rows"])
    # The residual is second order: ten times the step, ten times the relative error (a wrong sign or a wrong
    # weight would give an O(1) error at every step size).
    large = first_order_check(lr=1e-3, trials=32)
    assert 5 < large["max_rel_error"] / small["max_rel_error"] < 20


@pytest.mark.parametrize(
    "advantage, ratio, beta1, beta2, weight",
    [
        (-1.3, 0.7, 0.5, 1.0, 0.5 * 0.8),  # beta1 set: F = beta1 (1 - eps_low)
        (0.9, 1.4, 0.5, 1.0, 1.0 * 1.2),  # beta2 set: F = beta2 (1 + eps_high)
        (0.9, 0.7, 0.5, 1.0, 0.7),  # A > 0, r < 1 - eps: unclipped, F = r
        (-1.3, 1.4, 0.5, 1.0, 1.4),  # A < 0, r > 1 + eps: unclipped, F = r
        (-1.0, 0.7, 0.0, 1.0, 0.0),  # beta1 = 0: the clipped token gets no gradient at all
    ],
)
def test_single_step_weight_and_sign(advantage, ratio, beta1, beta2, weight):
    logits = torch.tensor([3.0, 0.5, -0.2, 0.1, -1.0, 0.0], dtype=torch.float64)
    for action in (0, 4):  # the common and a rare action
        measured, predicted, used = single_step_entropy_change(logits, action, advantage, ratio, 1e-4, beta1, beta2)
        assert used == pytest.approx(weight, rel=1e-12)
        assert measured == pytest.approx(predicted, rel=2e-3)
        assert weight != 0 or measured == predicted == used == 0.0
    # The softmax entropy dynamics: a positive-advantage rare action raises entropy, a negative-advantage rare action lowers it.
    assert (measured > 0) == (advantage > 0)


def test_entropy_sensitivity_matches_core_formula():
    probs = torch.softmax(torch.tensor([1.5, -0.3, 0.2, 2.2, -2.0], dtype=torch.float64), -1)
    s = entropy_sensitivity(probs)
    for a in range(5):
        assert -1e-3 * 0.7 * s[a].item() == pytest.approx(entropy_change_first_order(probs, a, 0.7, 1.0, 1e-3))
    assert abs(float((probs * s).sum())) < 1e-12  # E_a[s_a] = 0: on-policy, zero-mean advantages leave H unchanged


def test_toy_entropy_decomposition_tracks_the_actual_change():
    """The per-set first-order contributions add up to the measured entropy change (small steps)."""
    config = ToyConfig(lr=0.5, steps=6)
    run = run_toy(1.0, 1.0, seed=0, config=config)
    predicted = [a + b + c for a, b, c in zip(run.dH_beta1, run.dH_beta2, run.dH_unclipped)]
    measured = [h1 - h0 for h0, h1 in zip(run.entropy, run.entropy[1:])]
    for p, m in zip(predicted, measured):
        assert p == pytest.approx(m, rel=0.05, abs=1e-4)


@pytest.fixture(scope="module")
def toy_grid():
    config = dataclasses.replace(TOY_PRESETS["sequence"], steps=60)
    grid = {}
    for betas in ((0.0, 0.0), (0.0, 1.0), (1.0, 0.5), (1.0, 1.0), (0.5, 1.0)):
        runs = [run_toy(*betas, seed=seed, config=config) for seed in range(3)]
        grid[betas] = {
            "mean_entropy": sum(sum(r.entropy) / len(r.entropy) for r in runs) / len(runs),
            "dH_beta1": [sum(r.dH_beta1) for r in runs],
            "dH_beta2": [sum(r.dH_beta2) for r in runs],
            "beta1_frac": sum(sum(r.beta1_token_frac) for r in runs),
            "beta2_frac": sum(sum(r.beta2_token_frac) for r in runs),
        }
    return grid


def test_toy_betas_move_entropy_in_the_papers_direction(toy_grid):
    for stats in toy_grid.values():  # off-policy enough to clip
        assert stats["beta1_frac"] > 0 and stats["beta2_frac"] > 0
    # A larger beta1 lowers entropy: the restored gradient of the beta1 set lowers it, in every seed.
    assert toy_grid[(1.0, 1.0)]["mean_entropy"] < toy_grid[(0.5, 1.0)]["mean_entropy"]
    for betas in ((1.0, 0.5), (1.0, 1.0), (0.5, 1.0)):
        assert all(d < 0 for d in toy_grid[betas]["dH_beta1"]), betas
    # A larger beta2 keeps entropy higher.
    assert toy_grid[(1.0, 1.0)]["mean_entropy"] > toy_grid[(1.0, 0.5)]["mean_entropy"]
    assert toy_grid[(0.0, 1.0)]["mean_entropy"] > toy_grid[(0.0, 0.0)]["mean_entropy"]
    for betas in ((1.0, 0.5), (1.0, 1.0), (0.0, 1.0)):
        assert all(d > 0 for d in toy_grid[betas]["dH_beta2"]), betas
    # beta = 0 restores nothing; the paper's setting keeps more entropy than GRPO.
    assert toy_grid[(0.0, 0.0)]["dH_beta1"] == [0.0] * 3 and toy_grid[(0.0, 0.0)]["dH_beta2"] == [0.0] * 3
    assert toy_grid[(0.5, 1.0)]["mean_entropy"] > toy_grid[(0.0, 0.0)]["mean_entropy"]


def make_controller(**overrides):
    values = dict(
        target=1.0,
        kp=1.0,
        ki=0.05,
        beta1_init=0.5,
        beta2_init=1.0,
        beta1_min=0.0,
        beta1_max=1.0,
        beta2_min=0.5,
        beta2_max=1.5,
    )
    values.update(overrides)
    return EntropyController(**values)


def test_controller_moves_the_betas_against_the_entropy_error():
    controller = make_controller()
    beta1, beta2 = controller.update(0.8)  # below target: beta1 falls, beta2 rises
    assert beta1 < 0.5 and beta2 > 1.0
    assert beta1 == pytest.approx(0.5 - (0.2 + 0.05 * 0.2)) and beta2 == pytest.approx(1.0 + 0.21)
    # Staying below target keeps integrating: the push grows.
    beta1_next, beta2_next = controller.update(0.8)
    assert beta1_next < beta1 and beta2_next > beta2
    controller = make_controller()
    beta1, beta2 = controller.update(1.2)  # above target: beta1 rises, beta2 falls
    assert beta1 > 0.5 and beta2 < 1.0
    assert controller.last_error == pytest.approx(-0.2)
    assert make_controller().update(1.0) == (0.5, 1.0)  # at target: the initial betas


def test_controller_respects_bounds():
    controller = make_controller()
    assert controller.update(-100.0) == (0.0, 1.5)  # far too little entropy: beta1_min, beta2_max
    controller = make_controller()
    assert controller.update(100.0) == (1.0, 0.5)  # far too much: beta1_max, beta2_min
    controller = make_controller(beta1_min=0.2, beta2_max=1.1)
    for _ in range(50):
        beta1, beta2 = controller.update(0.0)
        assert 0.2 <= beta1 <= 1.0 and 0.5 <= beta2 <= 1.1


def test_controller_anti_windup():
    controller = make_controller(kp=0.1)
    limit = controller.integral_limit
    assert limit == pytest.approx(1.0 / 0.05)  # the widest beta range / ki
    for _ in range(1000):
        controller.update(0.0)  # error +1 for 1000 steps
    assert controller.integral == pytest.approx(limit)
    assert controller.beta1 == 0.0
    # Once entropy overshoots, the betas leave their bounds within a few dozen steps, not ~1000 as a wound-up
    # integral would need.
    for steps in range(1, 200):
        beta1, _ = controller.update(2.0)
        if beta1 > 0.0:
            break
    assert steps < 40
    controller = make_controller(ki=0.0)
    controller.update(0.0)
    assert controller.integral == 0.0 and controller.integral_limit == 0.0


def test_controller_state_dict_roundtrip():
    controller = make_controller()
    for entropy in (0.7, 0.9, 1.3):
        controller.update(entropy)
    state = json.loads(json.dumps(dataclasses.asdict(controller)))  # what the checkpoint file holds
    restored = EntropyController(**state)
    assert restored == controller
    assert restored.num_updates == 3
    for entropy in (0.5, 1.1):
        assert restored.update(entropy) == controller.update(entropy)
    assert restored.integral == controller.integral


def test_controller_from_config(tmp_path):
    config = cpu_config(CEGPPOConfig, tmp_path, cegppo_entropy_target=0.7, cegppo_entropy_kp=2.0, cegppo_beta1=0.25)
    controller = EntropyController.from_config(config)
    assert (controller.target, controller.kp, controller.beta1, controller.beta2) == (0.7, 2.0, 0.25, 1.0)


def test_trainer_saves_checkpoints_and_resumes_them_with_the_controller_state(tiny_trainer, tiny_model, tmp_path):
    import copy

    from transformers import AutoModelForCausalLM

    start_weights = copy.deepcopy(tiny_model)
    # A random tiny model has ~log(vocab) nats of entropy; a target above that means "entropy too low". kp=0: pure
    # integral action, so the betas move monotonically while the error stays positive.
    controller_args = dict(cegppo_entropy_target=7.0, cegppo_entropy_kp=0.0, cegppo_entropy_ki=0.05)
    saving = dict(output_dir=tmp_path / "run", save_strategy="steps", save_steps=2, **controller_args)
    trainer = tiny_trainer(max_steps=4, **saving)
    trainer.train()
    beta1, beta2 = (list(history(trainer, key).values()) for key in ("cegppo/beta1", "cegppo/beta2"))
    assert len(beta1) == 4 and beta1[0] == 0.5 and beta2[0] == 1.0  # step 1 runs with the initial betas
    assert all(b < a for a, b in zip(beta1, beta1[1:])), beta1  # entropy below target: beta1 keeps falling
    assert all(b > a for a, b in zip(beta2, beta2[1:])), beta2
    errors = list(history(trainer, "cegppo/entropy_error").values())
    assert len(errors) == 4 and all(e > 0 for e in errors)

    saved = controller_state(tmp_path / "run" / "checkpoint-2")
    assert saved["num_updates"] == 2 and saved["target"] == 7.0
    assert saved["beta1"] == pytest.approx(beta1[2])  # the betas in force at step 3
    assert controller_state(tmp_path / "run" / "checkpoint-4") == dataclasses.asdict(trainer._controller)
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").exists()
    assert "CE-GPPO" in (tmp_path / "run" / "README.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-4")
    for (name, p), q in zip(trainer.model.named_parameters(), reloaded.parameters()):
        assert torch.equal(p.detach(), q.detach()), name

    # Resume from step 2 with a fresh trainer, 4 more steps: the controller state comes back from the checkpoint file.
    resumed = tiny_trainer(start_weights, max_steps=6, **saving)
    assert resumed._controller.num_updates == 0
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.state.global_step == 6 and (tmp_path / "run" / "checkpoint-6").exists()
    assert resumed._controller.num_updates == 6  # 2 restored + 4 new
    resumed_beta1 = history(resumed, "cegppo/beta1")
    assert resumed_beta1[3] == pytest.approx(saved["beta1"])  # not the initial 0.5
    assert resumed_beta1[4] < resumed_beta1[3]


QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")


class _RecordingTrainer(CEGPPOTrainer):
    """Records each micro-batch's advantages and completion mask (one micro-batch per step here)."""

    def _compute_loss(self, model, inputs):
        if self.model.training:
            self.recorded.append((inputs["advantages"].detach().clone(), inputs["completion_mask"].clone()))
        return super()._compute_loss(model, inputs)


def test_off_policy_training_changes_every_weight_and_logs_the_clipping_and_the_quadrants(tiny_trainer, tmp_path):
    """Also: without an entropy target the betas stay fixed and no controller state is saved."""
    from cegppo_trl.divergence import EXTRA_STATE_FILE
    from cegppo_trl.trainer import CONTROLLER_STATE_KEY

    trainer = tiny_trainer(cls=_RecordingTrainer, max_steps=8, steps_per_generation=4, learning_rate=1e-2,
                           cegppo_beta1=1.0, cegppo_beta2=1.0, save_strategy="steps", save_steps=8)  # fmt: skip
    trainer.recorded = []
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    assert CONTROLLER_STATE_KEY not in json.loads((tmp_path / "checkpoint-8" / EXTRA_STATE_FILE).read_text())
    assert not history(trainer, "cegppo/entropy_error")
    logs = [h for h in trainer.state.log_history if "cegppo/beta1_token_frac" in h]
    assert len(logs) == 8 == len(trainer.recorded)
    for log in logs:
        # TRL's clip_ratio/low_mean (float32) counts the same tokens as CE-GPPO's beta1 set.
        assert log["clip_ratio/low_mean"] == pytest.approx(log["cegppo/beta1_token_frac"], rel=1e-6)
        assert (log["cegppo/beta1"], log["cegppo/beta2"]) == (1.0, 1.0)
        assert all(math.isfinite(log[key]) for key in ("entropy", "cegppo/beta1_grad_share")), log
    any_clipped = False
    for log, (advantages, mask) in zip(logs, trainer.recorded):
        q = {
            (name, stat): log[f"cegppo/quadrant/{name}/{stat}"]
            for name in QUADRANTS
            for stat in ("token_frac", "grad_share", "clip_frac", "restored_grad_share")
        }
        assert all(0.0 <= v <= 1.0 + 1e-6 for v in q.values()), q
        # The four quadrants partition exactly the tokens with a non-zero advantage.
        nonzero = ((advantages != 0).float().unsqueeze(1) * mask).sum() / mask.sum()
        assert sum(q[(n, "token_frac")] for n in QUADRANTS) == pytest.approx(nonzero.item(), abs=1e-5)
        positive = ((advantages > 0).float().unsqueeze(1) * mask).sum() / mask.sum()
        assert q[("pos_high", "token_frac")] + q[("pos_low", "token_frac")] == pytest.approx(positive.item(), abs=1e-5)
        # Zero-advantage tokens carry no gradient weight, so the quadrants carry all of it.
        if nonzero > 0:
            assert sum(q[(n, "grad_share")] for n in QUADRANTS) == pytest.approx(1.0, abs=1e-5)
        # Clipped tokens: the beta2 set lies in the positive quadrants, the beta1 set in the negative ones.
        pos_clipped = sum(q[(n, "clip_frac")] * q[(n, "token_frac")] for n in ("pos_high", "pos_low"))
        neg_clipped = sum(q[(n, "clip_frac")] * q[(n, "token_frac")] for n in ("neg_high", "neg_low"))
        assert pos_clipped == pytest.approx(log["cegppo/beta2_token_frac"], abs=1e-5)
        assert neg_clipped == pytest.approx(log["cegppo/beta1_token_frac"], abs=1e-5)
        restored = sum(q[(n, "restored_grad_share")] for n in QUADRANTS)
        assert restored == pytest.approx(log["cegppo/beta1_grad_share"] + log["cegppo/beta2_grad_share"], abs=1e-5)
        for n in QUADRANTS:
            assert q[(n, "restored_grad_share")] <= q[(n, "grad_share")] + 1e-6
        any_clipped |= restored > 0
    assert any_clipped, "off-policy mini-batches must clip some tokens and restore their gradient"
    # The first mini-batch of each generation batch is on-policy: nothing is clipped there.
    for index in (0, 4):
        assert logs[index]["cegppo/beta1_token_frac"] == 0 and logs[index]["cegppo/beta2_token_frac"] == 0
