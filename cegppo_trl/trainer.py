"""`CEGPPOTrainer`: TRL's `GRPOTrainer` with CE-GPPO's gradient-preserving clipping (paper Eq. 8).

`_compute_loss` adds `aggregate(correction)` (`core.gradient_preserving_correction`, zero outside the clipped sets) to
TRL's own loss from the same forward pass, on a copy of the micro-batch whose old log-probs are clamped.
`_generate_and_score_completions` adds dynamic sampling (`dynamic_sampling.py`) and the SFT mask. Metrics:
`metrics.py`. Code that mirrors TRL 1.16 is marked "TRL 1.16" and pinned by tests; why the sum is CE-GPPO's loss
exactly and which test covers which private TRL name: `docs/method.md`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import NamedTuple

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer

from . import divergence, dynamic_sampling, metrics
from .config import as_cegppo_config, validate_cegppo_config
from .controller import EntropyController
from .core import (
    ClipParams,
    cegppo_per_token_loss,
    clamp_old_log_probs,
    entropy_ratio_band,
    entropy_ratio_clip,
    gradient_preserving_correction,
)
from .metrics import TOKEN_RATIOS, DeviceMetrics, StepSums, token_set_sums
from .run_checks import (
    RewardCoverageError,
    check_dataset_fills_a_generation_batch,
    explain_model_load_errors,
    warn_if_untested_trl,
)


CONTROLLER_STATE_FILE = "cegppo_controller_state.json"


class _PolicyTermInputs(NamedTuple):
    """Per-token tensors TRL's PPO-clip term is built from, recomputed exactly as TRL does (TRL 1.16)."""

    log_ratio: torch.Tensor  # (B, T) token level or (B, 1) sequence level
    advantages: torch.Tensor  # (B, 1) or (B, T)
    mask: torch.Tensor  # (B, T) completion mask x tool mask
    token_weight: torch.Tensor | None  # off-policy mask x entropy mask x vLLM IS ratio, or None


class _Forward(NamedTuple):
    """What TRL's `_compute_loss` computed in its forward pass, reused by the correction (no second forward)."""

    logps: torch.Tensor  # (B, T) log pi_theta of the completion tokens
    entropies: torch.Tensor  # (B, T)
    clamped: torch.Tensor | None  # (B, T) tokens whose old log-prob was clamped, None without old log-probs


class CEGPPOTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] with the CE-GPPO policy loss. Same constructor; pass a [`CEGPPOConfig`].

    A plain `GRPOConfig` is upgraded to a `CEGPPOConfig` with the paper's `cegppo_beta1=0.5`, `cegppo_beta2=1.0` (a
    warning says so). CE-GPPO only differs from GRPO off-policy: set `steps_per_generation` to a multiple of
    `gradient_accumulation_steps` (the paper: 8x) or `num_iterations > 1`. Metrics: `cegppo_trl/metrics.py`.
    """

    _tag_names = ["trl", "grpo", "cegppo"]
    # Values TRL 1.16 passes only between its own methods, held for the one call that needs them:
    _rewards_per_func: torch.Tensor | None = None  # `_calculate_rewards` -> `_generate_and_score_completions`
    _deferring_old_policy_pass = False  # TRL's old / reference pass is skipped (select first, then compute)
    _capturing_old_entropies = False  # TRL's old pass is next, and must keep its entropies (entropy-ratio clipping)
    _old_entropies: torch.Tensor | None = None  # what it kept -> `_generate_and_score_completions`
    _loss_inputs: dict | None = None  # the micro-batch `_compute_loss` is working on
    _forward: _Forward | None = None  # and its forward pass (`_get_per_token_logps_and_entropies`)
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

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        args = as_cegppo_config(args, model)
        warn_if_untested_trl()
        validate_cegppo_config(args)  # fields may have been changed after the config was built
        with explain_model_load_errors(model):  # a truncated weights file, an uncached Hub kernel: one line each
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        check_dataset_fills_a_generation_batch(self.train_dataset, args)
        # The owner of the betas when the entropy controller is on; else they are the config's, constant.
        self._controller = EntropyController.from_config(args) if args.cegppo_entropy_target is not None else None
        self._step_sums = StepSums(self.accelerator.reduce)  # the controller's and the batch fill's
        self._device_metrics = DeviceMetrics(self.accelerator.reduce)  # until `log`
        # Issue 35: each optimizer step is checked before it is applied (`divergence.py`, `_get_grad_norm`).
        self._step_guard = divergence.StepGuard(self.accelerator.gather, args.cegppo_max_skipped_steps)
        self._controller_totals = None  # the controller's step sums, moved to the host with the step's check
        self._unscored_batch = False  # skip mode: the batch being generated got no reward at all
        if args.cegppo_exclude_zero_advantage_groups:
            dynamic_sampling.refuse_router_aux_loss(self.aux_loss_enabled)
        # TRL 1.16 `_generate_and_score_completions`: old log-probs exist only when this condition holds; otherwise the
        # loss uses `per_token_logps.detach()`, r == 1 and CE-GPPO is GRPO.
        generate_every = args.steps_per_generation * args.num_iterations
        self._has_old_log_probs = args.gradient_accumulation_steps % generate_every != 0
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
        return dynamic_sampling.over_generating_loader(
            self._get_dataloader, self.train_dataset, self.args, self.num_generations, self.num_iterations
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL 1.16 hands them (all processes', (N, num_funcs)) only to `_generate_and_score_completions`: keep them.
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if torch.isnan(rewards).all() and self.args.cegppo_max_skipped_steps > 0:
            self._unscored_batch = True  # its optimizer steps are skipped and counted (`divergence.StepGuard`)
        elif torch.isnan(rewards).all():  # TRL only warns, trains on nothing and saves the model as a success
            raise RewardCoverageError(
                f"reward_funcs: every reward function ({', '.join(self.reward_func_names)}) returned None for all "
                f"{rewards.size(0)} completions of a batch, so there is nothing to learn from. A reward function "
                "returns one float per completion (None only for one it does not apply to): fix it, or add one."
            )
        self._rewards_per_func = rewards
        return rewards

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        deferred = self._deferring_old_policy_pass = self._old_policy_pass_after_selection(mode)
        # Entropy-ratio clipping: TRL's own old pass (when not deferred) keeps its entropies for the batch.
        erc = self._entropy_ratio_band is not None and self._has_old_log_probs
        self._capturing_old_entropies = erc and not deferred
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._deferring_old_policy_pass = self._capturing_old_entropies = False
        if self._old_entropies is not None:  # per row, like `old_per_token_logps`: they travel with their rows
            output["cegppo_old_entropies"], self._old_entropies = self._old_entropies, None
        rewards_per_func, self._rewards_per_func = self._rewards_per_func, None
        rewards = dynamic_sampling.total_rewards(rewards_per_func, self.reward_weights)  # all processes
        if deferred:  # TRL's placeholders (see `_get_per_token_logps_and_entropies`), computed again below
            output.pop("old_per_token_logps", None), output.pop("ref_per_token_logps", None)
        keep = None
        if self.args.cegppo_exclude_zero_advantage_groups:
            output, selection = self._select_training_rows(output, rewards, mode)
            rewards, keep = rewards[selection.local_rows.to(rewards.device)], selection.local_keep
        else:  # this process's rows
            rewards = rewards.view(self.accelerator.num_processes, -1)[self.accelerator.process_index]
        if deferred:  # the training rows only, with TRL's attention mask (before dropped rows lose theirs)
            dynamic_sampling.old_policy_pass(
                output, self._get_per_token_logps_and_entropies, self.model, self.ref_model, self.accelerator,
                old=self._has_old_log_probs, reference=self.beta != 0.0, args=self.args, old_entropies=erc,
            )  # fmt: skip
        if keep is not None:
            dynamic_sampling.mark_dropped_rows(output, keep, self.accelerator.gather)
        if self.args.cegppo_sft_coef > 0:
            threshold = self.args.cegppo_sft_reward_threshold
            dynamic_sampling.attach_sft_mask(output, rewards, threshold, keep, self.accelerator.gather)
        if self._unscored_batch:  # skip mode: every row of this batch marks its optimizer steps as skipped
            self._unscored_batch = False
            output[divergence.UNSCORED_KEY] = torch.ones(
                output["completion_ids"].size(0), device=self.accelerator.device
            )
        return output

    def _old_policy_pass_after_selection(self, mode: str) -> bool:
        """Select first, then compute: with over-generation, TRL's old- and reference-log-prob passes are skipped
        while it generates and run on the training rows only (`dynamic_sampling.old_policy_pass`). Not with vLLM's
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
        self._device_metrics.record(
            mode, ("cegppo/informative_group_frac",), selection.informative.float().mean()[None]
        )
        if mode == "train":  # for the optimizer steps this batch feeds (`cegppo/informative_groups`, `groups_trained`)
            output.update(zip(dynamic_sampling.GROUP_COUNT_KEYS, selection.group_counts(group_size)))
        return output, selection

    # --- Loss
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *pargs, **kwargs):
        if self._deferring_old_policy_pass:  # TRL's old / reference pass while it generates: run later on fewer rows
            return torch.full((input_ids.size(0), logits_to_keep), math.nan, device=input_ids.device), None, None
        if self._capturing_old_entropies:  # TRL 1.16's old pass, its first forward while it generates: the same
            self._capturing_old_entropies = False  # forward gives the old policy's entropies (no second one)
            logps, self._old_entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *pargs, **dict(kwargs, compute_entropy=True)
            )
            return logps, self._old_entropies, aux_loss  # TRL 1.16 discards this pass's entropies
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *pargs, **kwargs
        )
        inputs = self._loss_inputs
        if inputs is not None:  # TRL 1.16's `_compute_loss` calls this once, at its top, and reads the old log-probs
            clamped = None  # only afterwards: clamping them here bounds TRL's log-ratio and the correction's alike
            if inputs.get("old_per_token_logps") is not None:
                inputs["old_per_token_logps"], clamped = clamp_old_log_probs(logps, inputs["old_per_token_logps"])
            self._forward = _Forward(logps, entropies, clamped)
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        # A shallow copy: TRL reuses the buffered batch over num_iterations, so it must never be modified.
        inputs = dict(inputs)
        keep = inputs.pop("cegppo_keep", None)  # dropped rows already have an empty loss mask
        group_counts = dynamic_sampling.pop_group_counts(inputs)
        old_entropies = inputs.pop("cegppo_old_entropies", None)  # entropy-ratio clipping's H(pi_old)
        unscored = inputs.pop(divergence.UNSCORED_KEY, None)
        self._loss_inputs, self._forward = inputs, None
        try:
            loss = super()._compute_loss(model, inputs)  # TRL's PPO-clip loss + KL + entropy bonus + aux loss
        finally:
            self._loss_inputs = None
        loss = loss + self._cegppo_loss_delta(inputs, self._forward, keep, group_counts, old_entropies)
        if self.model.training:  # the step's check (`_get_grad_norm`) reads these, on the device until then
            self._step_guard.add_loss(loss)
            if unscored is not None:
                self._step_guard.add_unscored(unscored)
        return loss

    def _policy_term_inputs(self, inputs, per_token_logps, entropies) -> _PolicyTermInputs:
        """Rebuild the ratio and the per-token multipliers exactly as TRL 1.16's `_compute_loss` does."""
        mask = dynamic_sampling.loss_mask(inputs)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old_per_token_logps = inputs.get("old_per_token_logps")
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()
        log_ratio = per_token_logps - old_per_token_logps
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        token_weight = None
        if self.off_policy_mask_threshold is not None:
            sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)
            token_weight = self.get_off_policy_mask(
                advantages, per_token_logps, sampling_per_token_logps, mask, self.off_policy_mask_threshold
            )
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            token_weight = entropy_mask if token_weight is None else token_weight * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
            token_weight = is_ratio if token_weight is None else token_weight * is_ratio
        return _PolicyTermInputs(log_ratio, advantages, mask, token_weight)

    def _aggregate_like_trl(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs, mode: str) -> torch.Tensor:
        """Reduce a per-token loss to the scalar TRL 1.16 would, for grpo / bnpo / dr_grpo / dapo / luspo."""
        # TRL 1.16 divides grpo / bnpo / dr_grpo / luspo (and entropy bonus, aux loss) by this; dapo's normaliser too.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":
            return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if self.loss_type == "bnpo":
            return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        if self.loss_type == "dr_grpo":
            return (per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length) / accumulation
        if self.loss_type == "dapo":
            return (per_token_loss * mask).sum() / self._token_mean_normalizer(inputs["num_items_in_batch"], mode)
        if self.loss_type == "luspo":
            return (per_token_loss * mask).sum(-1).mean() / accumulation
        raise ValueError(f"loss_type={self.loss_type!r} is not supported by CEGPPOTrainer.")

    def _token_mean_normalizer(self, num_tokens: torch.Tensor, mode: str) -> torch.Tensor:
        # TRL 1.16 dapo: the count spans the generation batch on all processes; rescale it to one accumulation window.
        normalizer = num_tokens.clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer

    def _cegppo_loss_delta(self, inputs, forward: _Forward, keep=None, group_counts=None, old_entropies=None):
        """Everything CE-GPPO adds to TRL's loss for one micro-batch: the correction (plus entropy-ratio clipping and
        the SFT term), their metrics and the step's sums (controller, batch fill). No host transfer.
        `benchmarks/bench_scaling.py` times this method as CE-GPPO's own cost."""
        mode = "train" if self.model.training else "eval"
        terms = self._policy_term_inputs(inputs, forward.logps, forward.entropies)
        params = self.clip_params
        correction, sets = gradient_preserving_correction(terms.log_ratio, terms.advantages, params)
        if terms.token_weight is not None:
            correction = correction * terms.token_weight
        loss_delta = self._aggregate_like_trl(correction, terms.mask, inputs, mode)  # as TRL aggregates its loss
        if self._entropy_bonus_enabled:
            # TRL 1.16 logs `policy_loss` (policy + KL term) only with the entropy bonus on, before the division by
            # accumulation (dapo: normalised); the correction at that scale is added to it at `log`.
            scale = self.current_gradient_accumulation_steps if mode == "train" and self.loss_type != "dapo" else 1.0
            self._device_metrics.record_mean(mode, ("policy_loss",), (loss_delta.detach() * scale).unsqueeze(0))
        if self._entropy_ratio_band is not None and old_entropies is not None:
            # Entropy-ratio clipping (docs/method.md): `aggregate(entropy_ratio_clip(L, keep) - L)`, `L` the policy
            # term's per-token loss with TRL's token weights: 0 in value, and on the tokens outside the band minus the
            # gradient TRL's term and the correction give them.
            band = entropy_ratio_band(forward.entropies, old_entropies, self._entropy_ratio_band)
            erc_sums = metrics.erc_sums(band.below, band.above, terms.mask)
            self._device_metrics.record_sums(mode, metrics.ERC_RATIOS, erc_sums)
            policy_loss = cegppo_per_token_loss(terms.log_ratio, terms.advantages, params).per_token_loss
            if terms.token_weight is not None:
                policy_loss = policy_loss * terms.token_weight
            erc = entropy_ratio_clip(policy_loss, band.keep) - policy_loss
            loss_delta = loss_delta + self._aggregate_like_trl(erc, terms.mask, inputs, mode)
        if self.args.cegppo_sft_coef > 0:
            loss_delta = loss_delta + self._sft_loss(inputs, forward.logps, terms.mask, mode)
        sums = token_set_sums(
            terms.mask, sets.grad_coef, terms.token_weight, sets.beta1_mask, sets.beta2_mask, terms.advantages,
            forward.logps, self.args.cegppo_low_prob_threshold, forward.clamped,
        )  # fmt: skip
        self._device_metrics.record_sums(mode, TOKEN_RATIOS, sums)  # the shares are taken on the host, at `log`
        if mode == "train":
            if self.accelerator.sync_gradients:
                self._metrics[mode]["cegppo/beta1"].append(params.beta1)
                self._metrics[mode]["cegppo/beta2"].append(params.beta2)
            if self._controller is not None or keep is not None:
                self._accumulate_step(forward.entropies, terms.mask, keep, group_counts)
        return loss_delta

    def _sft_loss(self, inputs, per_token_logps, mask, mode: str) -> torch.Tensor:
        """`cegppo_sft_coef` x token-mean NLL of the SFT completions (the authors' scripts), and its two metrics."""
        sft_mask = inputs["cegppo_sft_mask"].unsqueeze(1) * mask
        normalizer = self._token_mean_normalizer(inputs["cegppo_num_sft_tokens"], mode)
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
        if self._controller is not None:  # to the host with the step's check: its one transfer (`_get_grad_norm`)
            self._controller_totals = totals[:2]

    def _update_controller(self, entropy_sum: float, tokens: float) -> None:
        """The controller's betas are Python floats for the next step, from the step's (entropy, tokens) sums."""
        if tokens == 0:  # every row of the step was dropped (dynamic sampling): nothing was measured
            return
        self._controller.update(entropy_sum / tokens)
        self._metrics["train"]["cegppo/entropy_error"].append(self._controller.last_error)
        self._metrics["train"]["cegppo/entropy_integral"].append(self._controller.integral)

    # --- Issue 35: the check before each optimizer step is applied, and before each save (`divergence.py`)
    def _get_grad_norm(self, model, grad_norm=None):
        # transformers 5.x calls it once per optimizer step, after the last backward and before `optimizer.step()`
        # (DeepSpeed: after its engine stepped, which skips a non-finite gradient itself in fp32 / bf16).
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        totals, self._controller_totals = self._controller_totals, None
        step = self.state.global_step + 1
        outcome = self._step_guard.end_step(step, grad_norm, self.accelerator.device, totals)  # raises to stop
        if outcome.skip and not self.is_deepspeed_enabled:
            model.zero_grad(set_to_none=True)  # the optimizer passes over parameters without a gradient
        elif outcome.extra is not None:
            self._update_controller(*outcome.extra)
        if self.args.cegppo_max_skipped_steps > 0:
            for name, count in self._step_guard.skipped.items():
                self._metrics["train"][name].append(count)
        return grad_norm

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        # Every process calls it (checkpoints and the final save): a non-finite weight anywhere stops them all.
        where = output_dir or self.args.output_dir
        divergence.check_weights_finite(
            self.model.parameters(), self.accelerator.reduce, self.state.global_step, where
        )
        super().save_model(output_dir, _internal_call)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._controller is not None and self.args.should_save:
            checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            output_dir = os.path.join(self._get_output_dir(trial=trial), checkpoint_folder)
            with open(os.path.join(output_dir, CONTROLLER_STATE_FILE), "w") as f:
                json.dump(dataclasses.asdict(self._controller), f, indent=2)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._controller is not None and checkpoint is not None:
            path = os.path.join(checkpoint, CONTROLLER_STATE_FILE)
            if not os.path.exists(path):  # restarting from the config's betas on this process only would train the
                raise FileNotFoundError(  # processes with different betas
                    f"Resuming with the entropy controller on (cegppo_entropy_target={self.args.cegppo_entropy_target}) "
                    f"needs its state, {path}, which process {self.accelerator.process_index} cannot see. The main "
                    "process writes it into every checkpoint: on several nodes put output_dir on a file system all "
                    "nodes share, or copy the checkpoint folder to every node (docs/launch.md)."
                )
            with open(path) as f:
                self._controller = EntropyController(**json.load(f))
