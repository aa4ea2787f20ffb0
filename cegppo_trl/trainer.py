"""`CEGPPOTrainer`: TRL's `GRPOTrainer` with CE-GPPO's gradient-preserving clipping (paper Eq. 8).

`_compute_loss` adds `aggregate(correction)` (`core.gradient_preserving_correction`, zero outside the clipped sets) to
TRL's own loss from the same forward pass, on a copy of the micro-batch whose old log-probs are clamped.
`_generate_and_score_completions` adds dynamic sampling (`dynamic_sampling.py`) and the SFT mask. Metrics:
`metrics.py`. What TRL's methods pass only among themselves is caught in `_Generation` and `_LossCall`; TRL's logic that CE-GPPO
repeats is in `trl_mirror.py`. Why the sum is CE-GPPO's loss exactly and which test covers which private TRL name:
`docs/method.md`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import NamedTuple

import torch
from trl import GRPOConfig, GRPOTrainer

from . import dynamic_sampling, metrics, trl_mirror
from .config import as_cegppo_config, over_generation, validate_cegppo_config
from .controller import EntropyController
from .core import (
    ClipParams,
    cegppo_per_token_loss,
    clamp_old_log_probs,
    entropy_ratio_band,
    entropy_ratio_clip,
    gradient_preserving_correction,
)
from .divergence import DEEPSPEED, EXTRA_STATE_FILE, FLAGGED, NON_FINITE, UNSCORED_KEY, DivergenceGuardMixin
from .metrics import TOKEN_RATIOS, DeviceMetrics, StepSums, token_set_sums
from .run_checks import (
    RewardCoverageError,
    check_dataset_fills_a_generation_batch,
    check_writable_path,
    explain_model_load_errors,
    warn_if_untested_trl,
)


# CE-GPPO's names of the guard's skipped-step counts (`DivergenceGuardMixin.skipped_steps_log_names`).
SKIPPED_NON_FINITE = "cegppo/skipped_steps/non_finite"
SKIPPED_UNSCORED = "cegppo/skipped_steps/unscored"  # the guard's `flagged`: a generation batch with no reward
SKIPPED_DEEPSPEED = "cegppo/skipped_steps/deepspeed"
CONTROLLER_STATE_KEY = "entropy_controller"  # the controller's entry in each checkpoint's EXTRA_STATE_FILE
LEGACY_CONTROLLER_STATE_FILE = "cegppo_controller_state.json"  # where checkpoints before EXTRA_STATE_FILE keep it


class _Forward(NamedTuple):
    """What TRL's `_compute_loss` computed in its forward pass, reused by the correction (no second forward)."""

    logps: torch.Tensor  # (B, T) log pi_theta of the completion tokens
    entropies: torch.Tensor  # (B, T)
    clamped: torch.Tensor | None  # (B, T) tokens whose old log-prob was clamped, None without old log-probs


@dataclasses.dataclass
class _Generation:
    """What one call of TRL 1.16's `_generate_and_score_completions` passes only among its own methods, caught by the
    overrides it calls (`CEGPPOTrainer._generation` while it runs)."""

    defer_old_pass: bool  # TRL's old / reference passes get placeholders (select first, then compute)
    keep_old_entropies: bool  # TRL's old pass, its first forward, keeps its entropies (entropy-ratio clipping)
    rewards_per_func: torch.Tensor | None = None  # from `_calculate_rewards`, (N, num_funcs) all processes
    old_entropies: torch.Tensor | None = None  # from TRL's old pass
    unscored: bool = False  # `_calculate_rewards` found no reward at all (skip mode: `DivergenceGuardMixin.skip_step`)


@dataclasses.dataclass
class _LossCall:
    """What one call of TRL 1.16's `_compute_loss` computes in its forward pass (`CEGPPOTrainer._loss_call` while it
    runs): the micro-batch whose old log-probs get clamped, and the forward the correction reuses (no second one)."""

    inputs: dict
    forward: _Forward | None = None


class _While:
    """`with _While(trainer, slot, record) as record:` makes `record` `trainer.<slot>` for one call of TRL's, and
    clears it after the call, raised or not."""

    def __init__(self, trainer: CEGPPOTrainer, slot: str, record):
        self.trainer, self.slot, self.record = trainer, slot, record

    def __enter__(self):
        setattr(self.trainer, self.slot, self.record)
        return self.record

    def __exit__(self, *exc_info) -> None:
        setattr(self.trainer, self.slot, None)


class CEGPPOTrainer(DivergenceGuardMixin, GRPOTrainer):
    """[`~trl.GRPOTrainer`] with the CE-GPPO policy loss. Same constructor; pass a [`CEGPPOConfig`].

    A plain `GRPOConfig` is upgraded to a `CEGPPOConfig` with the paper's `cegppo_beta1=0.5`, `cegppo_beta2=1.0` (a
    warning says so). CE-GPPO only differs from GRPO off-policy: set `steps_per_generation` to a multiple of
    `gradient_accumulation_steps` (the paper: 8x) or `num_iterations > 1`. Metrics: `cegppo_trl/metrics.py`.
    """

    _tag_names = ["trl", "grpo", "cegppo"]
    skipped_steps_log_names = {NON_FINITE: SKIPPED_NON_FINITE, FLAGGED: SKIPPED_UNSCORED, DEEPSPEED: SKIPPED_DEEPSPEED}
    max_skipped_steps_name = "cegppo_max_skipped_steps"
    _generation: _Generation | None = None  # while TRL's `_generate_and_score_completions` runs
    _loss_call: _LossCall | None = None  # while TRL's `_compute_loss` runs
    _name = "CE-GPPO"
    _paper = {
        "title": "CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping Policy Optimization in "
        "Reinforcement Learning",
        "id": "2509.20712",
        "citation": """\
@inproceedings{su2026cegppo,
    title        = {{CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping Policy Optimization in Reinforcement Learning}},
    author       = {Zhenpeng Su and Leiyu Pan and Minxuan Lv and Yuntao Li and Wenping Hu and Fuzheng Zhang and Kun Gai and Guorui Zhou},
    booktitle    = {Proceedings of ACL},
    year         = 2026,
    eprint       = {arXiv:2509.20712},
}""",
    }

    def __init__(
        self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, max_skipped_steps=None, **kwargs
    ):
        args = as_cegppo_config(args, model)
        warn_if_untested_trl()
        validate_cegppo_config(args)  # fields may have been changed after the config was built
        budget = _skip_budget(args, max_skipped_steps)  # the guard owns it from here on
        check_writable_path(args.output_dir, "--output_dir", folder=True)  # before the model loads
        with explain_model_load_errors(model):  # a truncated weights file, an uncached Hub kernel: one line each
            super().__init__(model, reward_funcs, args, *pargs, max_skipped_steps=budget, **kwargs)
        check_dataset_fills_a_generation_batch(self.train_dataset, args)
        # The owner of the betas when the entropy controller is on; else they are the config's, constant.
        self._controller = EntropyController.from_config(args) if args.cegppo_entropy_target is not None else None
        self._step_sums = StepSums(self.accelerator.reduce)  # the controller's and the batch fill's
        self._device_metrics = DeviceMetrics(self.accelerator.reduce)  # until `log`
        if args.cegppo_exclude_zero_advantage_groups:
            dynamic_sampling.refuse_router_aux_loss(self.aux_loss_enabled)
        self._has_old_log_probs = trl_mirror.has_old_log_probs(args)
        # Entropy-ratio clipping's band (None: off). The old entropies exist exactly when the old log-probs do.
        band = args.cegppo_entropy_ratio_clip
        self._entropy_ratio_band = None if band is None else (float(band[0]), float(band[1]))
        if not self._has_old_log_probs:
            warnings.warn(
                f"CE-GPPO is inert with this configuration: steps_per_generation ({args.steps_per_generation}) x "
                f"num_iterations ({args.num_iterations}) divides gradient_accumulation_steps "
                f"({args.gradient_accumulation_steps}), so every update is on-policy: the ratio is always 1 and the "
                "loss equals GRPO's"
                + (", and cegppo_entropy_ratio_clip is inert too" if band is not None else "")
                + ". The paper takes 8 optimizer steps per generation batch: set steps_per_generation = "
                f"{8 * args.gradient_accumulation_steps} (8 x gradient_accumulation_steps) or num_iterations > 1.",
                UserWarning,
                stacklevel=2,
            )

    @property
    def clip_params(self) -> ClipParams:
        """The Eq. 8 scalars the next micro-batch uses: TRL's clip range and `delta`, and the betas in force."""
        c = self._controller
        betas = (c.beta1, c.beta2) if c is not None else (self.args.cegppo_beta1, self.args.cegppo_beta2)
        return ClipParams(self.epsilon_low, self.epsilon_high, *map(float, betas), self.args.delta)

    # --- Generation: over-generate, select the rows to train on, then compute their old / reference log-probs
    def get_train_dataloader(self):
        if self.args.cegppo_oversampling == 1:
            return super().get_train_dataloader()
        return trl_mirror.over_generating_loader(
            self._get_dataloader, self.train_dataset, self.args, self.num_generations, self.num_iterations,
            over_generation(self.args),
        )  # fmt: skip

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL 1.16 hands them (all processes', (N, num_funcs)) only to `_generate_and_score_completions`: keep them.
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        unscored = bool(torch.isnan(rewards).all())
        if unscored and self.step_guard.max_skipped_steps == 0:  # TRL only warns, trains on nothing, saves a success
            raise RewardCoverageError(
                f"reward_funcs: every reward function ({', '.join(self.reward_func_names)}) returned None for all "
                f"{rewards.size(0)} completions of a batch, so there is nothing to learn from. A reward function "
                "returns one float per completion (None only for one it does not apply to): fix it, or add one."
            )
        if self._generation is not None:  # None: TRL's own `_generate_and_score_completions` called directly
            self._generation.rewards_per_func = rewards
            self._generation.unscored = unscored  # skip mode: the batch's optimizer steps are skipped and counted
        return rewards

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        deferred = self._old_policy_pass_after_selection(mode)
        # Entropy-ratio clipping: TRL's own old pass (when not deferred) keeps its entropies for the batch.
        erc = self._entropy_ratio_band is not None and self._has_old_log_probs
        with _While(self, "_generation", _Generation(deferred, keep_old_entropies=erc and not deferred)) as caught:
            output = super()._generate_and_score_completions(inputs)
        if caught.old_entropies is not None:  # per row, like `old_per_token_logps`: they travel with their rows
            output["cegppo_old_entropies"] = caught.old_entropies
        rewards = trl_mirror.total_rewards(caught.rewards_per_func, self.reward_weights)  # all processes
        if deferred:  # TRL's placeholders (see `_get_per_token_logps_and_entropies`), computed again below
            output.pop("old_per_token_logps", None), output.pop("ref_per_token_logps", None)
        keep = None
        if self.args.cegppo_exclude_zero_advantage_groups:
            output, selection = self._select_training_rows(output, rewards, mode)
            rewards, keep = rewards[selection.local_rows.to(rewards.device)], selection.local_keep
        else:  # this process's rows
            rewards = rewards.view(self.accelerator.num_processes, -1)[self.accelerator.process_index]
        if deferred:  # the training rows only, with TRL's attention mask (before dropped rows lose theirs)
            logps_of, reference = self._get_per_token_logps_and_entropies, self.beta != 0.0
            trl_mirror.old_policy_pass(output, logps_of, self, self._has_old_log_probs, reference, old_entropies=erc)
        if keep is not None:
            dynamic_sampling.mark_dropped_rows(output, keep, self.accelerator.gather)
        if self.args.cegppo_sft_coef > 0:
            threshold = self.args.cegppo_sft_reward_threshold
            dynamic_sampling.attach_sft_mask(output, rewards, threshold, keep, self.accelerator.gather)
        if caught.unscored:  # skip mode: every row of this batch marks its optimizer steps as skipped
            output[UNSCORED_KEY] = torch.ones(output["completion_ids"].size(0), device=self.accelerator.device)
        return output

    def _old_policy_pass_after_selection(self, mode: str) -> bool:
        """Select first, then compute: with over-generation, TRL's old- and reference-log-prob passes are skipped
        while it generates and run on the training rows only (`trl_mirror.old_policy_pass`). Not with vLLM's
        importance-sampling correction, which TRL 1.16 computes inside generation from every generated row's."""
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
        return mode == "train" and self.args.cegppo_oversampling > 1 and not vllm_is

    def _select_training_rows(self, output: dict, rewards: torch.Tensor, mode: str):
        """Dynamic sampling: this process's share of the training batch, and the `dynamic_sampling.Selection`."""
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        factor = self.args.cegppo_oversampling if mode == "train" else 1.0
        pad_token_id = getattr(self.processing_class, "tokenizer", self.processing_class).pad_token_id
        output, selection = dynamic_sampling.take_training_rows(
            output, rewards, group_size, factor, self.accelerator, pad_token_id
        )
        informative_frac = selection.informative.float().mean()[None]
        self._device_metrics.record(mode, ("cegppo/informative_group_frac",), informative_frac)
        if mode == "train":  # for the optimizer steps this batch feeds (`cegppo/informative_groups`, `groups_trained`)
            output.update(zip(dynamic_sampling.GROUP_COUNT_KEYS, selection.group_counts(group_size)))
        return output, selection

    # --- Loss
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *pargs, **kwargs):
        generation, loss_call = self._generation, self._loss_call
        if generation is not None and generation.defer_old_pass:  # TRL's old / reference pass while it generates:
            return torch.full((input_ids.size(0), logits_to_keep), math.nan, device=input_ids.device), None, None
        # TRL 1.16's old pass is its first forward while it generates: the same forward gives the old entropies.
        old_pass = generation is not None and generation.keep_old_entropies and generation.old_entropies is None
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *pargs, **dict(kwargs, compute_entropy=True)
            if old_pass else kwargs
        )  # fmt: skip
        if old_pass:
            generation.old_entropies = entropies  # TRL 1.16 discards this pass's entropies
        if loss_call is not None:  # TRL 1.16's `_compute_loss` calls this once, at its top, and reads the old
            inputs, clamped = loss_call.inputs, None  # log-probs only afterwards: clamping them here bounds TRL's
            if inputs.get("old_per_token_logps") is not None:  # log-ratio and the correction's alike
                inputs["old_per_token_logps"], clamped = clamp_old_log_probs(logps, inputs["old_per_token_logps"])
            loss_call.forward = _Forward(logps, entropies, clamped)
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        # A shallow copy: TRL reuses the buffered batch over num_iterations, so it must never be modified.
        inputs = dict(inputs)
        keep = inputs.pop("cegppo_keep", None)  # dropped rows already have an empty loss mask
        group_counts = dynamic_sampling.pop_group_counts(inputs)
        old_entropies = inputs.pop("cegppo_old_entropies", None)  # entropy-ratio clipping's H(pi_old)
        unscored = inputs.pop(UNSCORED_KEY, None)
        with _While(self, "_loss_call", _LossCall(inputs)) as caught:
            loss = super()._compute_loss(model, inputs)  # TRL's PPO-clip loss + KL + entropy bonus + aux loss
        loss = loss + self._cegppo_loss_delta(inputs, caught.forward, keep, group_counts, old_entropies)
        if unscored is not None and self.model.training:  # CE-GPPO's rule: a batch without rewards is not trained on
            self.skip_step(unscored)
        return loss

    def _cegppo_loss_delta(self, inputs, forward: _Forward, keep=None, group_counts=None, old_entropies=None):
        """Everything CE-GPPO adds to TRL's loss for one micro-batch: the correction (plus entropy-ratio clipping and
        the SFT term), their metrics and the step's sums (controller, batch fill). No host transfer.
        `benchmarks/bench_scaling.py` times this method as CE-GPPO's own cost."""
        mode = "train" if self.model.training else "eval"
        terms = trl_mirror.policy_term_inputs(self, inputs, forward.logps, forward.entropies)
        params = self.clip_params
        correction, sets = gradient_preserving_correction(terms.log_ratio, terms.advantages, params)
        policy_loss = cegppo_per_token_loss(terms.log_ratio, terms.advantages, params).per_token_loss
        if terms.token_weight is not None:
            correction, policy_loss = correction * terms.token_weight, policy_loss * terms.token_weight
        loss_delta = trl_mirror.aggregate(self, correction, terms.mask, inputs, mode)  # as TRL aggregates its loss
        # `cegppo/policy_loss`: the CE-GPPO policy term (Eq. 8, no KL), at the scale TRL logs its `policy_loss`.
        policy_value = trl_mirror.aggregate(self, policy_loss.detach(), terms.mask, inputs, mode)
        scaled = policy_value * trl_mirror.policy_loss_scale(self, mode)
        self._device_metrics.record_mean(mode, ("cegppo/policy_loss",), scaled.unsqueeze(0))
        if self._entropy_ratio_band is not None and old_entropies is not None:
            # Entropy-ratio clipping (docs/method.md): `aggregate(entropy_ratio_clip(L, keep) - L)`, `L` the policy
            # term's per-token loss with TRL's token weights: 0 in value, and on the tokens outside the band minus the
            # gradient TRL's term and the correction give them.
            band = entropy_ratio_band(forward.entropies, old_entropies, self._entropy_ratio_band)
            erc_sums = metrics.erc_sums(band.below, band.above, terms.mask)
            self._device_metrics.record_sums(mode, metrics.ERC_RATIOS, erc_sums)
            erc = entropy_ratio_clip(policy_loss, band.keep) - policy_loss
            loss_delta = loss_delta + trl_mirror.aggregate(self, erc, terms.mask, inputs, mode)
        if self.args.cegppo_sft_coef > 0:
            loss_delta = loss_delta + self._sft_loss(inputs, forward.logps, terms.mask, mode)
        sums = token_set_sums(
            terms.mask, sets.grad_coef, terms.token_weight, sets.beta1_mask, sets.beta2_mask, terms.advantages,
            forward.logps, self.args.cegppo_low_prob_threshold, forward.clamped,
        )  # fmt: skip
        self._device_metrics.record_sums(mode, TOKEN_RATIOS, sums)  # the shares are taken on the host, at `log`
        if mode == "train":
            if self.accelerator.sync_gradients:
                self._device_metrics.record(mode, ("cegppo/beta1", "cegppo/beta2"), (params.beta1, params.beta2))
            if self._controller is not None or keep is not None:
                self._accumulate_step(forward.entropies, terms.mask, keep, group_counts)
        return loss_delta

    def _sft_loss(self, inputs, per_token_logps, mask, mode: str) -> torch.Tensor:
        """`cegppo_sft_coef` x token-mean NLL of the SFT completions (the authors' scripts), and its two metrics."""
        sft_mask = inputs["cegppo_sft_mask"].unsqueeze(1) * mask
        normalizer = trl_mirror.token_mean_normalizer(self, inputs["cegppo_num_sft_tokens"], mode)
        nll = -(per_token_logps * sft_mask).sum() / normalizer
        self._device_metrics.record_sums(mode, metrics.SFT_RATIOS, metrics.sft_sums(per_token_logps, sft_mask, mask))
        return self.args.cegppo_sft_coef * nll

    # --- Metrics: reduced over processes on the device, moved to the host once per `log` (`metrics.DeviceMetrics`)
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        self._device_metrics.flush(mode, self._metrics[mode])
        super().log(logs, start_time)  # TRL averages `_metrics` (skipping NaN), logs and clears them

    # --- Optimizer-step sums: the entropy controller and the batch fill
    def _accumulate_step(self, entropies, mask, keep, group_counts) -> None:
        """Sum (entropy, loss tokens) for the controller and (kept rows, rows) for the batch fill over one optimizer
        step on the device; at its boundary, log the fill and update the controller."""
        totals = self._step_sums.add(metrics.step_sums(entropies, mask, keep), self.accelerator.sync_gradients)
        if totals is None:
            return
        if keep is not None:
            self._device_metrics.record("train", metrics.STEP_FILL_METRICS, metrics.fill_metrics(totals, group_counts))
        if self._controller is not None:  # to the host with the step's check: its one transfer
            self.check_with_step(totals[:2], self._update_controller)

    def _update_controller(self, sums: list[float]) -> None:
        """The controller's betas are Python floats for the next step, from the step's (entropy, tokens) sums."""
        entropy_sum, tokens = sums
        if tokens == 0:  # every row of the step was dropped (dynamic sampling): nothing was measured
            return
        self._controller.update(entropy_sum / tokens)
        controller_state = (self._controller.last_error, self._controller.integral)
        self._device_metrics.record("train", ("cegppo/entropy_error", "cegppo/entropy_integral"), controller_state)

    # --- Checkpoints: the controller's state rides in the guard's file (`DivergenceGuardMixin.checkpoint_state`)
    def checkpoint_state(self) -> dict:
        state = super().checkpoint_state()
        if self._controller is not None:
            state[CONTROLLER_STATE_KEY] = dataclasses.asdict(self._controller)
        return state

    def restore_checkpoint_state(self, state: dict, checkpoint: str) -> None:
        super().restore_checkpoint_state(state, checkpoint)
        if self._controller is None:
            return
        controller = state.get(CONTROLLER_STATE_KEY)
        legacy = os.path.join(checkpoint, LEGACY_CONTROLLER_STATE_FILE)
        if controller is None and os.path.isfile(legacy):
            with open(legacy) as f:
                controller = json.load(f)
        if controller is None:  # restarting from the config's betas on this process only would train the
            path = os.path.join(checkpoint, EXTRA_STATE_FILE)  # processes with different betas
            target = f"cegppo_entropy_target={self.args.cegppo_entropy_target}"
            if state:
                raise ValueError(
                    f"Resuming with the entropy controller on ({target}) from {checkpoint}, saved with it off (no "
                    f"'{CONTROLLER_STATE_KEY}' in {path}): resume with cegppo_entropy_target unset, or start a new "
                    "run with the controller."
                )
            raise FileNotFoundError(
                f"Resuming with the entropy controller on ({target}) needs its state, {path}, which process "
                f"{self.accelerator.process_index} cannot see. The main process writes it into every checkpoint: on "
                "several nodes put output_dir on a file system all nodes share, or copy the checkpoint folder to "
                "every node (docs/launch.md)."
            )
        self._controller = EntropyController(**controller)


def _skip_budget(args, max_skipped_steps: int | None) -> int:
    """The one skip budget: `CEGPPOTrainer(max_skipped_steps=N)` or the config's `cegppo_max_skipped_steps`."""
    if max_skipped_steps is None or max_skipped_steps == args.cegppo_max_skipped_steps:
        return args.cegppo_max_skipped_steps
    if args.cegppo_max_skipped_steps != 0:
        raise ValueError(
            f"max_skipped_steps={max_skipped_steps!r} and the config's cegppo_max_skipped_steps="
            f"{args.cegppo_max_skipped_steps} disagree: set the skip budget in one place (the config field, which "
            "cegppo-train's --cegppo_max_skipped_steps sets, or the keyword)."
        )
    return max_skipped_steps
