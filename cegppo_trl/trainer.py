"""`CEGPPOTrainer`: TRL's `GRPOTrainer` with CE-GPPO's gradient-preserving clipping (paper Eq. 8).

Two overrides do the work. `_compute_loss` adds `aggregate(correction)` (`core.gradient_preserving_correction`,
zero outside the clipped sets) to TRL's own loss from the same forward pass (`_ForwardCapture`), on a copy of the
micro-batch whose old log-probs are clamped and, under dynamic sampling, whose dropped rows are removed
(`_drop_excluded_rows`, weighed by `_kept_unit`). `_generate_and_score_completions` attaches the optional extras of
the authors' scripts: the keep mask of dynamic sampling and the SFT mask. The code that mirrors TRL 1.16 is marked
"TRL 1.16" and pinned by `tests/test_trl_parity.py`, `tests/test_edges.py` and `tests/test_dynamic_sampling.py`; why
the sum is CE-GPPO's loss exactly, what "removed" means, and which test covers which mirrored piece: `docs/method.md`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import textwrap
import warnings
from dataclasses import dataclass

import torch
import trl
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .config import CEGPPOConfig, validate_cegppo_config
from .controller import EntropyController, FixedBetas
from .core import (
    ClipParams,
    ClippedSets,
    clamp_old_log_probs,
    equal_reward_groups,
    gradient_preserving_correction,
)


CONTROLLER_STATE_FILE = "cegppo_controller_state.json"
# The TRL minor versions whose `GRPOTrainer._compute_loss` the mirrored code below was checked against.
TESTED_TRL_MINOR_VERSIONS = ("1.16",)
QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")
# Batch keys TRL 1.16 attaches for vision-language models; they are not indexed by completion row, so the rows of a
# micro-batch cannot be dropped by slicing (cegppo_exclude_zero_advantage_groups refuses them).
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "num_images",
    "num_tiles",
    "image_position_ids",
)


def _share(num: float, den: float) -> float:
    """`num / den` of summed metrics, 0 when nothing was counted."""
    return num / den if den > 0 else 0.0


def _loss_mask(batch: dict) -> torch.Tensor:
    """The tokens the loss covers, as TRL 1.16 builds them: `completion_mask`, times `tool_mask` when present (tool
    output tokens of multi-turn rollouts are not the policy's)."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


def _as_cegppo_config(args: GRPOConfig) -> CEGPPOConfig:
    """Upgrade a plain `GRPOConfig` (drop-in use) to a `CEGPPOConfig` with the paper's CE-GPPO defaults."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    # GRPOConfig.__post_init__ derived generation_batch_size from steps_per_generation; passing both back is an error.
    values["generation_batch_size"] = None
    return CEGPPOConfig(**values)


@dataclass
class _PolicyTermInputs:
    """Per-token tensors TRL's PPO-clip term is built from, recomputed exactly as TRL does (TRL 1.16)."""

    log_ratio: torch.Tensor  # (B, T) token level or (B, 1) sequence level
    advantages: torch.Tensor  # (B, 1) or (B, T)
    mask: torch.Tensor  # (B, T) completion mask x tool mask
    token_weight: torch.Tensor | None  # off-policy mask x entropy mask x vLLM IS ratio, or None


@dataclass
class _KeptUnit:
    """One micro-batch on one process, under dynamic sampling (see `CEGPPOTrainer._kept_unit`)."""

    scale: float  # (process, micro-batch) pairs of the optimizer step / pairs that kept rows; 0 when none did
    kept_processes: int  # processes on which this micro-batch kept rows
    local_empty: bool  # this process dropped every row of it


@dataclass
class _KeptUnitWindow:
    """The keep counts of one optimizer step's micro-batches, summed over processes, consumed in order."""

    kept_per_micro_batch: list[float]
    position: int = 0

    def next(self, num_processes: int, local_empty: bool) -> _KeptUnit:
        kept_pairs = sum(self.kept_per_micro_batch)
        pairs = num_processes * len(self.kept_per_micro_batch)
        kept_processes = int(self.kept_per_micro_batch[self.position])
        self.position += 1
        return _KeptUnit(pairs / kept_pairs if kept_pairs else 0.0, kept_processes, local_empty)

    @property
    def done(self) -> bool:
        return self.position >= len(self.kept_per_micro_batch)


@dataclass
class _Forward:
    """What TRL's `_compute_loss` computed in its forward pass, reused by the correction (no second forward)."""

    logps: torch.Tensor  # (B, T) log pi_theta of the completion tokens
    entropies: torch.Tensor  # (B, T)
    clamped: torch.Tensor | None  # (B, T) tokens whose old log-prob was clamped, None without old log-probs
    aux_loss: torch.Tensor | None  # MoE router loss, None for dense models


class _ForwardCapture:
    """Holds the micro-batch TRL's `_compute_loss` is working on and the forward pass it computes, for one call.

    TRL 1.16's `_compute_loss` calls `_get_per_token_logps_and_entropies` once, at its top, and reads
    `inputs["old_per_token_logps"]` only afterwards, so clamping the (copied) batch's old log-probs in `record` bounds
    TRL's log-ratio and the correction's alike.
    """

    def __init__(self):
        self._inputs: dict | None = None
        self.forward: _Forward | None = None

    @contextlib.contextmanager
    def around(self, inputs: dict):
        self._inputs, self.forward = inputs, None
        try:
            yield self
        finally:
            self._inputs = None

    def record(self, logps, entropies, aux_loss) -> None:
        if self._inputs is None:  # a call outside `_compute_loss` (generation, reference log-probs)
            return
        clamped = None
        if self._inputs.get("old_per_token_logps") is not None:
            self._inputs["old_per_token_logps"], clamped = clamp_old_log_probs(
                logps, self._inputs["old_per_token_logps"]
            )
        self.forward = _Forward(logps, entropies, clamped, aux_loss)


# Metrics appended once per optimizer step (at the accumulation boundary), not once per micro-batch: TRL 1.16's
# `entropy_coef` (in `_compute_loss`, when `sync_gradients`) and this trainer's betas and controller state.
STEP_METRICS = ("entropy_coef", "cegppo/beta1", "cegppo/beta2", "cegppo/entropy_error", "cegppo/entropy_integral")


def _truncate_metrics(metrics: dict[str, list], lengths: dict[str, int]) -> None:
    """Forget the per-micro-batch metrics appended since `lengths` was taken (TRL averages each list at log time)."""
    for name in list(metrics):
        if name in STEP_METRICS:
            continue
        del metrics[name][lengths.get(name, 0) :]
        if not metrics[name]:
            del metrics[name]  # TRL 1.16's `log` divides by the list's length


def _rescale_token_counts(inputs: dict, scale: float) -> dict:
    """Divide the token-mean terms by `scale` ahead of the whole loss being multiplied by it.

    dapo's policy term and the SFT term are normalised by token counts of the whole generation batch on all
    processes, so an absent micro-batch does not change them; the rest of the loss is scaled (`_kept_unit`).
    """
    if scale not in (0.0, 1.0):
        for key in ("num_items_in_batch", "cegppo_num_sft_tokens"):
            if key in inputs:
                inputs[key] = inputs[key] * scale
    return inputs


@contextlib.contextmanager
def _nan_padded_row_gather(accelerator, active: bool, placeholder_only: bool):
    """Let TRL gather per-row metric tensors from processes that hold different numbers of rows.

    TRL 1.16's `_compute_loss` gathers one value per row for `clip_ratio/low_min` and `clip_ratio/high_max`, then
    takes `nanmin` / `nanmax`. After dropped rows are removed the processes hold different numbers of rows, which a
    gather cannot take (gloo aborts with "op.preamble.length <= op.nbytes", NCCL hangs). Rows are padded with NaN,
    which `nanmin` / `nanmax` skip, and a process holding only the placeholder row sends NaN for it.
    """
    if not active:
        yield
        return
    gather = accelerator.gather

    def padded_gather(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.ndim > 0 and tensor.is_floating_point():
            if placeholder_only:
                tensor = torch.full_like(tensor, math.nan)
            tensor = accelerator.pad_across_processes(tensor, dim=0, pad_index=math.nan)
        return gather(tensor)

    accelerator.gather = padded_gather
    try:
        yield
    finally:
        del accelerator.gather  # the instance attribute; the class's method is back


class CEGPPOTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] with the CE-GPPO policy loss. Same constructor; pass a [`CEGPPOConfig`].

    Replacing `GRPOTrainer` with `CEGPPOTrainer` in a working GRPO script is all a switch needs: a plain `GRPOConfig`
    is accepted and upgraded to a `CEGPPOConfig` with the paper's `cegppo_beta1=0.5`, `cegppo_beta2=1.0` (a warning
    says so). CE-GPPO only differs from GRPO off-policy: set `steps_per_generation` to a multiple of
    `gradient_accumulation_steps` (the paper: 8x) or `num_iterations > 1`.

    TRL's own metrics from the loss path describe the loss actually optimised: `policy_loss` (logged by TRL only with
    the entropy bonus on) is corrected to the CE-GPPO policy term (+ KL, as in TRL); `clip_ratio/*` count the tokens
    outside the clip range, which are exactly CE-GPPO's beta1 / beta2 sets (they still get gradient under CE-GPPO);
    `entropy`, `kl`, `entropy_coef` and `aux_loss` are unchanged by the correction. With dynamic sampling all of them
    cover the kept rows only.

    Metrics added under `cegppo/`:

    * `beta1`, `beta2`: the coefficients in force (they move only under the entropy controller).
    * `beta1_token_frac`, `beta2_token_frac`: fraction of loss tokens in the beta1 / beta2 set.
    * `beta1_grad_share`, `beta2_grad_share`: share of the total gradient weight `sum |d loss / d log pi|` carried
      by each set (PPO-clip would give both 0).
    * `quadrant/{pos,neg}_{high,low}/{token_frac,grad_share,clip_frac,restored_grad_share}`: the paper's four token
      quadrants (advantage sign x `pi_theta(y_t)` above / below `cegppo_low_prob_threshold`): token fraction, share of
      gradient weight, fraction of the quadrant's tokens that were clipped, and the share of the total gradient
      weight that CE-GPPO gave back to the quadrant's clipped tokens. Zero-advantage tokens belong to no quadrant.
    * `log_ratio_clamped_frac`: fraction of loss tokens whose `|log pi_theta - log pi_old|` exceeded 20 and was
      clamped (should be 0; anything else points at broken old / sampler log-probs).
    * `informative_group_frac` with `cegppo_exclude_zero_advantage_groups`: fraction of groups kept.
    * `sft_nll` (token-mean NLL of the SFT completions), `sft_token_frac` when `cegppo_sft_coef > 0`;
      `entropy_error`, `entropy_integral` under the entropy controller.
    """

    _tag_names = ["trl", "grpo", "cegppo"]
    _name = "CE-GPPO"
    _paper = {
        "title": "CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping Policy Optimization in "
        "Reinforcement Learning",
        "id": "2509.20712",
        "citation": textwrap.dedent("""\
            @inproceedings{su2026cegppo,
                title        = {{CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping Policy Optimization in Reinforcement Learning}},
                author       = {Zhenpeng Su and Leiyu Pan and Minxuan Lv and Yuntao Li and Wenping Hu and Fuzheng Zhang and Kun Gai and Guorui Zhou},
                booktitle    = {Proceedings of ACL},
                year         = 2026,
                eprint       = {arXiv:2509.20712},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = CEGPPOConfig(f"{model_name.split('/')[-1]}-CEGPPO")
        elif not isinstance(args, CEGPPOConfig):
            if not isinstance(args, GRPOConfig):
                raise TypeError(f"`args` must be a CEGPPOConfig (or a GRPOConfig), got {type(args).__name__}.")
            warnings.warn(
                "CEGPPOTrainer got a plain GRPOConfig; using CEGPPOConfig with the paper's cegppo_beta1=0.5, "
                "cegppo_beta2=1.0. Pass a CEGPPOConfig to choose them.",
                UserWarning,
                stacklevel=2,
            )
            args = _as_cegppo_config(args)
        trl_minor = ".".join(trl.__version__.split(".")[:2])
        if trl_minor not in TESTED_TRL_MINOR_VERSIONS:
            warnings.warn(
                f"cegppo_trl mirrors GRPOTrainer._compute_loss of TRL {TESTED_TRL_MINOR_VERSIONS} but TRL "
                f"{trl.__version__} is installed; run tests/test_trl_parity.py before trusting the loss, or install "
                f"trl=={TESTED_TRL_MINOR_VERSIONS[-1]}.*",
                UserWarning,
                stacklevel=2,
            )
        # Fields may have been changed after the config was built; check again before any work is done.
        validate_cegppo_config(args)
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)

        self._capture = _ForwardCapture()
        # The one owner of the betas in force: the entropy controller when it is on, else the config's values.
        self._betas: EntropyController | FixedBetas = (
            EntropyController.from_config(args)
            if args.cegppo_entropy_target is not None
            else FixedBetas.from_config(args)
        )
        self._controller_window = None
        self._kept_unit_window: _KeptUnitWindow | None = None

        # TRL 1.16 `_generate_and_score_completions`: old log-probs exist only when this condition holds; otherwise the
        # loss uses `per_token_logps.detach()`, r == 1 and CE-GPPO is GRPO.
        generate_every = args.steps_per_generation * args.num_iterations
        if args.gradient_accumulation_steps % generate_every == 0:
            warnings.warn(
                "CE-GPPO is inert with this configuration: steps_per_generation "
                f"({args.steps_per_generation}) x num_iterations ({args.num_iterations}) divides "
                f"gradient_accumulation_steps ({args.gradient_accumulation_steps}), so every update is on-policy, the "
                "ratio is always 1, nothing is clipped and the loss equals GRPO's. The paper takes 8 optimizer steps "
                "per generation batch: set steps_per_generation = 8 * gradient_accumulation_steps "
                f"(= {8 * args.gradient_accumulation_steps}) or num_iterations > 1.",
                UserWarning,
                stacklevel=2,
            )

    @property
    def clip_params(self) -> ClipParams:
        """The Eq. 8 scalars the next micro-batch uses: TRL's clip range and `delta`, and the betas in force."""
        return ClipParams(self.epsilon_low, self.epsilon_high, self._betas.beta1, self._betas.beta2, self.args.delta)

    @property
    def _controller(self) -> EntropyController | None:
        """The entropy controller, or None when `cegppo_entropy_target` is unset."""
        return self._betas if isinstance(self._betas, EntropyController) else None

    # ------------------------------------------------------------------------------------------------------------
    # Generation: attach the optional extras to the batch.
    # ------------------------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes, (N_total, num_funcs)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func = self._last_rewards_per_func  # gathered over processes, (N_total, num_funcs)
        rewards = self._total_rewards(rewards_per_func)
        local_size = output["completion_ids"].size(0)
        local_rows = slice(
            self.accelerator.process_index * local_size, (self.accelerator.process_index + 1) * local_size
        )
        keep = None
        if self.args.cegppo_exclude_zero_advantage_groups:
            mode = "train" if self.model.training else "eval"
            informative = self._informative_groups(rewards_per_func, rewards, mode)
            self._metrics[mode]["cegppo/informative_group_frac"].append(informative.float().mean().item())
            keep = self._attach_keep_mask(output, informative, local_rows, mode)
        if self.args.cegppo_sft_coef > 0:
            self._attach_sft_mask(output, rewards, local_rows, keep)
        return output

    def _total_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """Total reward exactly as TRL 1.16 computes it for "sum_then_normalize" and for its logged `reward`:
        `reward_weights`-weighted nansum over reward functions, NaN where every function returned None."""
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def _informative_groups(self, rewards_per_func: torch.Tensor, rewards: torch.Tensor, mode: str) -> torch.Tensor:
        """The authors' filter_groups: a group is informative unless all its rewards are equal (one bool per group).

        Decided on the rewards, not on the advantages, which keep a float residue of TRL's group mean.
        "normalize_then_sum" normalises each reward function separately, so a group carries signal unless every
        (weighted) function is constant in it.
        """
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        if self.multi_objective_aggregation == "normalize_then_sum":
            scored = rewards_per_func[:, self.reward_weights.to(rewards_per_func.device) != 0]
            return ~equal_reward_groups(scored, group_size)
        return ~equal_reward_groups(rewards, group_size)

    def _attach_keep_mask(self, output: dict, informative: torch.Tensor, local_rows: slice, mode: str) -> torch.Tensor:
        """Mark this process's kept rows (`cegppo_keep`) and make dapo's token count cover the kept tokens only."""
        present = [key for key in MULTIMODAL_KEYS if key in output]
        if present:
            raise ValueError(
                f"`cegppo_exclude_zero_advantage_groups=True` drops rows of each micro-batch, but this batch has "
                f"multimodal inputs {present} that are not indexed by row. Set "
                "cegppo_exclude_zero_advantage_groups=False for vision-language models."
            )
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        keep = informative.repeat_interleave(group_size)[local_rows]
        output["cegppo_keep"] = keep
        # dapo's token-mean denominator: the kept tokens of the generation batch on all processes (TRL 1.16 computes
        # `num_items_in_batch = gather(loss_mask.sum()).sum()` in `_generate_and_score_completions`).
        output["num_items_in_batch"] = self.accelerator.gather((_loss_mask(output) * keep.unsqueeze(1)).sum()).sum()
        return keep

    def _attach_sft_mask(self, output: dict, rewards: torch.Tensor, local_rows: slice, keep) -> None:
        """Mark the completions that get the SFT term (`cegppo_sft_mask`) and count their tokens on all processes."""
        loss_mask = _loss_mask(output)
        scored_top = (rewards >= self.args.cegppo_sft_reward_threshold) & ~torch.isnan(rewards)
        sft_mask = scored_top[local_rows]
        if keep is not None:  # dropped groups get no SFT term either (the authors' pipeline never sees them)
            sft_mask = sft_mask & keep
        sft_mask = sft_mask.to(loss_mask.dtype)
        output["cegppo_sft_mask"] = sft_mask
        output["cegppo_num_sft_tokens"] = self.accelerator.gather((loss_mask * sft_mask.unsqueeze(1)).sum()).sum()

    # ------------------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, *pargs, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*pargs, **kwargs)
        self._capture.record(logps, entropies, aux_loss)
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        # A shallow copy: TRL reuses the buffered batch over num_iterations, so it must never be modified.
        inputs = dict(inputs)
        mode = "train" if self.model.training else "eval"
        unit = metric_lengths = None
        if "cegppo_keep" in inputs:
            unit = self._kept_unit(inputs, mode)
            inputs = _rescale_token_counts(self._drop_excluded_rows(inputs), unit.scale)
            metric_lengths = {name: len(values) for name, values in self._metrics[mode].items()}
        with (
            self._capture.around(inputs) as capture,
            _nan_padded_row_gather(self.accelerator, unit is not None, unit is not None and unit.local_empty),
        ):
            loss = super()._compute_loss(model, inputs)  # TRL's PPO-clip loss + KL + entropy bonus + aux loss
        forward = capture.forward
        loss = loss + self._cegppo_loss_delta(inputs, forward, unit)
        if unit is None:
            return loss
        return self._weigh_kept_unit(loss, unit, mode, forward.aux_loss, metric_lengths)

    def _weigh_kept_unit(self, loss, unit: _KeptUnit, mode: str, aux_loss, metric_lengths: dict) -> torch.Tensor:
        """Dynamic sampling: scale the loss of a micro-batch that kept rows, zero one that kept none, and forget the
        metrics of a micro-batch that no process kept a row of (docs/method.md, "Dynamic sampling")."""
        if self.aux_loss_enabled and unit.kept_processes < self.accelerator.num_processes:
            self._drop_placeholder_aux_metric(mode, aux_loss, unit)  # a collective: every process calls it
        if unit.kept_processes == 0:
            _truncate_metrics(self._metrics[mode], metric_lengths)
        if unit.local_empty:
            # Every row of this micro-batch was dropped on this process: one placeholder row with an empty loss mask
            # ran through the model so that the backward pass (and the collectives of DDP / ZeRO / FSDP) still
            # happen; only the MoE aux loss is non-zero there.
            return loss * 0.0
        return loss * unit.scale

    def _kept_unit(self, inputs: dict, mode: str) -> _KeptUnit:
        """Where this micro-batch stands among the (process, micro-batch) pairs of its optimizer step that kept rows.

        A pair left with no rows counts as absent ("removed" in docs/method.md): TRL divides each micro-batch's loss by
        the `gradient_accumulation_steps` micro-batches of the step (TRL 1.16, grpo / bnpo / dr_grpo / luspo, the
        entropy bonus and the aux loss) and DDP / ZeRO / FSDP average over the processes, so the kept pairs' losses are
        scaled by `pairs / kept pairs`. The count needs the keep masks of the whole optimizer step on all processes:
        TRL 1.16's `_prepare_inputs` buffers the generation batch as `steps_per_generation` micro-batches and serves
        `_buffered_inputs[_step % steps_per_generation]`; the step's micro-batches are the next
        `current_gradient_accumulation_steps` of them (`steps_per_generation` is a multiple of the accumulation, checked
        by the config). One all-reduce per optimizer step.
        """
        if mode == "eval" or self._kept_unit_window is None:
            micro_batches = [inputs]
            if mode == "train" and self._buffered_inputs:
                first = self._step % self.args.steps_per_generation
                window = self._buffered_inputs[first : first + self.current_gradient_accumulation_steps]
                # Outside TRL's training loop (a direct `_compute_loss` call) the micro-batch is a window of its own.
                if window and window[0].get("cegppo_keep") is inputs["cegppo_keep"]:
                    micro_batches = window
            device = inputs["cegppo_keep"].device
            local = torch.tensor([float(bool(b["cegppo_keep"].any())) for b in micro_batches], device=device)
            kept = self.accelerator.reduce(local, reduction="sum").tolist()
            window = _KeptUnitWindow(kept_per_micro_batch=kept)
            if len(micro_batches) == 1:
                return window.next(self.accelerator.num_processes, local_empty=not bool(local[0]))
            self._kept_unit_window = window
        window = self._kept_unit_window
        unit = window.next(self.accelerator.num_processes, local_empty=not bool(inputs["cegppo_keep"].any()))
        if window.done:
            self._kept_unit_window = None
        return unit

    @staticmethod
    def _drop_excluded_rows(inputs: dict) -> dict:
        """The micro-batch without the rows of dropped groups: the batch TRL would see had they been removed.

        Mirrors TRL 1.16's `split_tensor_dict` / `shuffle_sequence_dict`, which treat every tensor with `ndim > 0`
        and every list in the batch as indexed by row (multimodal keys are refused at generation). When every row is
        dropped, row 0 is kept with an empty loss mask (the caller zeroes its loss).
        """
        keep = inputs.pop("cegppo_keep").bool()
        if bool(keep.all()):
            return inputs
        all_dropped = not bool(keep.any())
        if all_dropped:
            keep = torch.zeros_like(keep)
            keep[0] = True
        rows = keep.nonzero().squeeze(1)
        num_rows = keep.numel()
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == num_rows:
                inputs[key] = value.index_select(0, rows.to(value.device))
            elif isinstance(value, list) and len(value) == num_rows:
                inputs[key] = [value[i] for i in rows.tolist()]
        if all_dropped:
            inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
        return inputs

    def _drop_placeholder_aux_metric(self, mode: str, aux_loss, unit: _KeptUnit) -> None:
        """TRL 1.16 logs `aux_loss` as the mean over processes; leave out those that ran only the placeholder row."""
        kept = torch.tensor(0.0 if unit.local_empty else 1.0, device=aux_loss.device)
        gathered = self.accelerator.gather(torch.stack([aux_loss.detach().float() * kept, kept]).unsqueeze(0))
        gathered = gathered.view(-1, 2)
        if gathered[:, 1].sum() > 0 and self._metrics[mode]["aux_loss"]:
            self._metrics[mode]["aux_loss"][-1] = (gathered[:, 0].sum() / gathered[:, 1].sum()).item()

    def _policy_term_inputs(self, inputs, per_token_logps, entropies) -> _PolicyTermInputs:
        """Rebuild the ratio and the per-token multipliers exactly as TRL 1.16's `_compute_loss` does."""
        mask = _loss_mask(inputs)
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
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=sampling_per_token_logps,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            token_weight = entropy_mask if token_weight is None else token_weight * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
            token_weight = is_ratio if token_weight is None else token_weight * is_ratio
        return _PolicyTermInputs(log_ratio, advantages, mask, token_weight)

    def _aggregate_like_trl(self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs) -> torch.Tensor:
        """Reduce a per-token loss to the scalar TRL 1.16 would, for grpo / bnpo / dr_grpo / dapo / luspo."""
        mode = "train" if self.model.training else "eval"
        accumulation = self._accumulation(mode)
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

    def _accumulation(self, mode: str) -> float:
        # TRL 1.16 divides grpo / bnpo / dr_grpo / luspo (and the entropy bonus and aux loss) by this; dapo's
        # normaliser includes it.
        return self.current_gradient_accumulation_steps if mode == "train" else 1.0

    def _token_mean_normalizer(self, num_tokens: torch.Tensor, mode: str) -> torch.Tensor:
        # TRL 1.16 dapo: the count spans the generation batch on all processes; rescale it to one accumulation window.
        normalizer = num_tokens.clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer

    def _cegppo_loss_delta(self, inputs, forward: _Forward, unit: _KeptUnit | None = None) -> torch.Tensor:
        """Everything CE-GPPO adds to TRL's loss for one micro-batch: the correction (plus the SFT term), its metrics
        and the controller's measurement. `benchmarks/bench_scaling.py` times this method as CE-GPPO's own cost."""
        mode = "train" if self.model.training else "eval"
        terms = self._policy_term_inputs(inputs, forward.logps, forward.entropies)
        params = self.clip_params
        correction, sets = self._correction_loss(inputs, terms, params)
        if self._entropy_bonus_enabled:
            self._correct_policy_loss_metric(mode, correction, unit)
        loss_delta = correction
        if self.args.cegppo_sft_coef > 0:
            loss_delta = loss_delta + self._sft_loss(inputs, forward.logps, terms.mask, mode)
        self._log_token_metrics(mode, terms, sets, params, forward.logps, forward.clamped)
        if self._controller is not None and mode == "train":
            self._controller_step(forward.entropies, terms.mask)
        return loss_delta

    def _correction_loss(
        self, inputs, terms: _PolicyTermInputs, params: ClipParams
    ) -> tuple[torch.Tensor, ClippedSets]:
        """CE-GPPO's policy loss minus TRL's PPO-clip loss, aggregated as TRL aggregates its loss."""
        correction, sets = gradient_preserving_correction(terms.log_ratio, terms.advantages, params)
        if terms.token_weight is not None:
            correction = correction * terms.token_weight
        return self._aggregate_like_trl(correction, terms.mask, inputs), sets

    def _sft_loss(self, inputs, per_token_logps, mask, mode: str) -> torch.Tensor:
        """`cegppo_sft_coef` x token-mean NLL of the SFT completions (the authors' scripts), and its two metrics."""
        sft_mask = inputs["cegppo_sft_mask"].unsqueeze(1) * mask
        normalizer = self._token_mean_normalizer(inputs["cegppo_num_sft_tokens"], mode)
        nll = -(per_token_logps * sft_mask).sum() / normalizer
        self._log_sums(
            mode,
            {
                "cegppo/sft_nll": (-(per_token_logps.detach() * sft_mask).sum(), sft_mask.sum()),
                "cegppo/sft_token_frac": (sft_mask.sum(), mask.sum()),
            },
        )
        return self.args.cegppo_sft_coef * nll

    # ------------------------------------------------------------------------------------------------------------
    # Metrics
    # ------------------------------------------------------------------------------------------------------------
    def _log_sums(self, mode: str, ratios: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Log `sum(numerators) / sum(denominators)` over all processes, with one all-reduce for the whole dict."""
        stacked = torch.stack([torch.stack([n.float(), d.float()]) for n, d in ratios.values()]).detach()
        totals = self.accelerator.reduce(stacked, reduction="sum")
        for name, (num, den) in zip(ratios, totals.tolist()):
            self._metrics[mode][name].append(_share(num, den))

    def _correct_policy_loss_metric(self, mode: str, loss_delta: torch.Tensor, unit: _KeptUnit | None) -> None:
        """Make TRL's `policy_loss` metric the CE-GPPO policy term (plus KL, as in TRL) instead of PPO-clip's.

        TRL 1.16 logs `policy_loss` only with the entropy bonus on, as `gather(policy_loss).nanmean()`, where
        `policy_loss` is the aggregated policy + KL term before the division by gradient accumulation (grpo, bnpo,
        dr_grpo, luspo) or dapo's normalised value. The correction is added at the same scale. A process whose rows
        were all dropped logged an exact 0 (empty mask) and is left out of the mean; under dynamic sampling dapo's
        token count was divided by the unit's scale (`_rescale_token_counts`), which is undone here.
        """
        scale = 1.0 if self.loss_type == "dapo" else self._accumulation(mode)
        all_dropped = unit is not None and unit.local_empty
        real = torch.tensor(0.0 if all_dropped else 1.0, device=loss_delta.device)
        local = torch.stack([loss_delta.detach().float() * scale, real])
        gathered = self.accelerator.gather(local.unsqueeze(0)).view(-1, 2)
        num_processes, num_real = gathered.size(0), gathered[:, 1].sum().item()
        trl_total = self._metrics[mode]["policy_loss"][-1] * num_processes  # TRL's mean, the dropped ones count 0
        corrected = (trl_total + (gathered[:, 0] * gathered[:, 1]).sum().item()) / num_real if num_real else math.nan
        if self.loss_type == "dapo" and unit is not None and unit.scale > 0:
            corrected *= unit.scale
        self._metrics[mode]["policy_loss"][-1] = corrected

    def _log_token_metrics(
        self, mode, terms: _PolicyTermInputs, sets: ClippedSets, params: ClipParams, per_token_logps, clamped=None
    ) -> None:
        mask = terms.mask.float()
        shape = mask.shape
        weight = sets.grad_coef.abs().float().expand(shape) * mask
        if terms.token_weight is not None:
            weight = weight * terms.token_weight.float().expand(shape)
        beta1_set, beta2_set = sets.beta1_mask.expand(shape), sets.beta2_mask.expand(shape)
        clipped = beta1_set | beta2_set
        advantages = terms.advantages.expand(shape)
        low_prob = per_token_logps.detach() < math.log(self.args.cegppo_low_prob_threshold)
        positive, negative = advantages > 0, advantages < 0
        quadrants = [positive & ~low_prob, positive & low_prob, negative & ~low_prob, negative & low_prob]
        # Rows: token sets (all, beta1, beta2, 4 quadrants, their clipped parts); columns: (tokens, gradient weight).
        # One matmul and one all-reduce instead of ~50 small reductions per micro-batch.
        clamped = torch.zeros_like(clipped) if clamped is None else clamped.expand(shape)
        token_sets = torch.stack(
            [torch.ones_like(clipped), beta1_set, beta2_set, *quadrants, *(q & clipped for q in quadrants), clamped]
        )
        sums = token_sets.flatten(1).float() @ torch.stack([mask.flatten(), weight.flatten()], dim=1)
        totals = self.accelerator.reduce(sums.detach(), reduction="sum").tolist()

        (num_tokens, total_weight), beta1_totals, beta2_totals = totals[:3]
        metrics = self._metrics[mode]
        metrics["cegppo/beta1_token_frac"].append(_share(beta1_totals[0], num_tokens))
        metrics["cegppo/beta2_token_frac"].append(_share(beta2_totals[0], num_tokens))
        metrics["cegppo/beta1_grad_share"].append(_share(beta1_totals[1], total_weight))
        metrics["cegppo/beta2_grad_share"].append(_share(beta2_totals[1], total_weight))
        for name, (q_tokens, q_weight), (clipped_tokens, clipped_weight) in zip(QUADRANTS, totals[3:7], totals[7:11]):
            metrics[f"cegppo/quadrant/{name}/token_frac"].append(_share(q_tokens, num_tokens))
            metrics[f"cegppo/quadrant/{name}/grad_share"].append(_share(q_weight, total_weight))
            metrics[f"cegppo/quadrant/{name}/clip_frac"].append(_share(clipped_tokens, q_tokens))
            metrics[f"cegppo/quadrant/{name}/restored_grad_share"].append(_share(clipped_weight, total_weight))
        metrics["cegppo/log_ratio_clamped_frac"].append(_share(totals[11][0], num_tokens))
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["cegppo/beta1"].append(params.beta1)
            self._metrics[mode]["cegppo/beta2"].append(params.beta2)

    # ------------------------------------------------------------------------------------------------------------
    # Entropy controller
    # ------------------------------------------------------------------------------------------------------------
    def _controller_step(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        # Same windowing as TRL's adaptive entropy: accumulate the micro-batches of one optimizer step, reduce the
        # (sum, count) pair over processes at the boundary, and apply the new betas from the next step on.
        stats = torch.stack([(entropies.detach() * mask).sum(), mask.sum().float()])
        self._controller_window = stats if self._controller_window is None else self._controller_window + stats
        if self.accelerator.sync_gradients:
            totals = self.accelerator.reduce(self._controller_window, reduction="sum")
            self._controller_window = None
            if totals[1] == 0:  # every row of the step was dropped (dynamic sampling): nothing was measured
                return
            world_entropy = (totals[0] / totals[1]).item()
            self._controller.update(world_entropy)
            self._metrics["train"]["cegppo/entropy_error"].append(self._controller.last_error)
            self._metrics["train"]["cegppo/entropy_integral"].append(self._controller.integral)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._controller is not None and self.args.should_save:
            checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            output_dir = os.path.join(self._get_output_dir(trial=trial), checkpoint_folder)
            with open(os.path.join(output_dir, CONTROLLER_STATE_FILE), "w") as f:
                json.dump(self._controller.state_dict(), f, indent=2)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._controller is not None and checkpoint is not None:
            path = os.path.join(checkpoint, CONTROLLER_STATE_FILE)
            if not os.path.exists(path):
                # Restarting the controller from the config's betas on this process only would train the processes
                # with different betas.
                raise FileNotFoundError(
                    f"Resuming with the entropy controller on (cegppo_entropy_target={self.args.cegppo_entropy_target}) "
                    f"needs its state, {path}, which process {self.accelerator.process_index} cannot see. The main "
                    "process writes it into every checkpoint: on several nodes put output_dir on a file system all "
                    "nodes share, or copy the checkpoint folder to every node (docs/launch.md)."
                )
            with open(path) as f:
                self._betas = EntropyController.from_state_dict(json.load(f))
