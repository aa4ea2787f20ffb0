"""`CEGPPOTrainer`: TRL's `GRPOTrainer` with CE-GPPO's gradient-preserving clipping (paper Eq. 8).

Two overrides do the work. `_compute_loss` adds `aggregate(correction)` (`core.gradient_preserving_correction`,
zero outside the clipped sets) to TRL's own loss from the same forward pass (`_ForwardCapture`), on a copy of the
micro-batch whose old log-probs are clamped. `_generate_and_score_completions` attaches the optional extras of the
authors' scripts: dynamic sampling (`_select_training_rows`: the informative groups of an over-generated batch fill the
training batch, moved between processes; dropped rows keep an empty loss mask) and the SFT mask. The code that mirrors
TRL 1.16 is marked "TRL 1.16" and pinned by `tests/test_trl_parity.py`, `tests/test_edges.py` and
`tests/test_dynamic_sampling.py`; why the sum is CE-GPPO's loss exactly, what dynamic sampling trains on, and which
test covers which private TRL name: `docs/method.md`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import textwrap
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
import trl
from accelerate.utils import gather_object
from datasets import IterableDataset
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import RepeatSampler, get_config_model_id, repeat_iterable_dataset

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
# Batch keys TRL 1.16 attaches for vision-language models; they are not indexed by completion row, so rows cannot be
# selected or moved between processes (cegppo_exclude_zero_advantage_groups refuses them).
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
# Per-row keys TRL 1.16 pads on the left (the prompt side); the others with a sequence dimension are right-padded.
LEFT_PADDED_KEYS = ("prompt_ids", "prompt_mask")

# The token-set sums of `_log_token_metrics`: rows (all loss tokens, beta1 set, beta2 set, the 4 quadrants, their
# clipped parts, clamped tokens) x columns (tokens, gradient weight), flattened; each metric is one sum over another.
_ALL, _BETA1, _BETA2, _QUADRANT, _QUADRANT_CLIPPED, _CLAMPED = 0, 1, 2, 3, 7, 11


def _cell(token_set: int, column: int) -> int:
    return 2 * token_set + column


TOKEN_METRICS = (
    ("cegppo/beta1_token_frac", _cell(_BETA1, 0), _cell(_ALL, 0)),
    ("cegppo/beta2_token_frac", _cell(_BETA2, 0), _cell(_ALL, 0)),
    ("cegppo/beta1_grad_share", _cell(_BETA1, 1), _cell(_ALL, 1)),
    ("cegppo/beta2_grad_share", _cell(_BETA2, 1), _cell(_ALL, 1)),
    *(
        metric
        for i, name in enumerate(QUADRANTS)
        for metric in (
            (f"cegppo/quadrant/{name}/token_frac", _cell(_QUADRANT + i, 0), _cell(_ALL, 0)),
            (f"cegppo/quadrant/{name}/grad_share", _cell(_QUADRANT + i, 1), _cell(_ALL, 1)),
            (f"cegppo/quadrant/{name}/clip_frac", _cell(_QUADRANT_CLIPPED + i, 0), _cell(_QUADRANT + i, 0)),
            (f"cegppo/quadrant/{name}/restored_grad_share", _cell(_QUADRANT_CLIPPED + i, 1), _cell(_ALL, 1)),
        )
    ),
    ("cegppo/log_ratio_clamped_frac", _cell(_CLAMPED, 0), _cell(_ALL, 0)),
)
TOKEN_METRIC_NAMES = tuple(name for name, _, _ in TOKEN_METRICS)
# Logged once per optimizer step under dynamic sampling: the step's fill, and its generation batch's group counts.
STEP_FILL_METRICS = ("cegppo/batch_fill", "cegppo/informative_groups", "cegppo/groups_trained")


@dataclass(frozen=True)
class _Ratios:
    """How `log` turns one recorded tensor of sums into metrics: `names[i] = sums[nums[i]] / sums[dens[i]]`."""

    names: tuple[str, ...]
    nums: tuple[int, ...]
    dens: tuple[int, ...]
    tokens: int  # the loss tokens of the micro-batch on all processes

    def shares(self, sums: list[float]) -> list[float]:
        """0 where nothing was counted, NaN everywhere when the micro-batch has no loss token on any process (TRL's
        `log` skips NaN when it averages, so such a micro-batch adds nothing to the logged means)."""
        if sums[self.tokens] <= 0:
            return [math.nan] * len(self.names)
        return [sums[n] / sums[d] if sums[d] > 0 else 0.0 for n, d in zip(self.nums, self.dens)]


TOKEN_RATIOS = _Ratios(
    TOKEN_METRIC_NAMES,
    tuple(num for _, num, _ in TOKEN_METRICS),
    tuple(den for _, _, den in TOKEN_METRICS),
    _cell(_ALL, 0),
)


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


class CEGPPOTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] with the CE-GPPO policy loss. Same constructor; pass a [`CEGPPOConfig`].

    Replacing `GRPOTrainer` with `CEGPPOTrainer` in a working GRPO script is all a switch needs: a plain `GRPOConfig`
    is accepted and upgraded to a `CEGPPOConfig` with the paper's `cegppo_beta1=0.5`, `cegppo_beta2=1.0` (a warning
    says so). CE-GPPO only differs from GRPO off-policy: set `steps_per_generation` to a multiple of
    `gradient_accumulation_steps` (the paper: 8x) or `num_iterations > 1`.

    TRL's own metrics from the loss path describe the loss actually optimised: `policy_loss` (logged by TRL only with
    the entropy bonus on) is corrected to the CE-GPPO policy term (+ KL, as in TRL); `clip_ratio/*` count the tokens
    outside the clip range, which are exactly CE-GPPO's beta1 / beta2 sets (they still get gradient under CE-GPPO);
    `entropy`, `kl`, `entropy_coef` and `aux_loss` are unchanged by the correction. With dynamic sampling the token
    means cover the kept rows only (dropped rows have an empty loss mask).

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
    * With `cegppo_exclude_zero_advantage_groups`: `informative_group_frac` (per generation batch, the fraction of
      generated groups that are informative); per optimizer step `batch_fill` (the step's kept rows / the rows it
      holds, 1.0 = as full as the paper's), and, of the generation batch it came from, `informative_groups` (informative
      groups generated) and `groups_trained` (groups in the training batch: at most the training batch's prompts).
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
        self._step_sums: torch.Tensor | None = None  # the optimizer step's sums so far (`_accumulate_step`)
        self._generation_stats: torch.Tensor | None = None  # (informative groups, groups trained) of the batch
        self._device_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}  # until `log`
        if args.cegppo_exclude_zero_advantage_groups and self.aux_loss_enabled:
            raise ValueError(
                "cegppo_exclude_zero_advantage_groups=True with a MoE router aux loss (`output_router_logits=True` in "
                "the model config): a dropped row stays in its micro-batch with an empty loss mask, and the router's "
                "load-balancing loss would still count its tokens. Set output_router_logits=False, or "
                "cegppo_exclude_zero_advantage_groups=False."
            )

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
    # Over-generation: the generation batch holds `cegppo_oversampling` times the training batch's prompts.
    # ------------------------------------------------------------------------------------------------------------
    @property
    def _generated_prompts(self) -> int:
        """Prompts per generation batch on all processes (the training batch's, times `cegppo_oversampling`)."""
        return round(self.args.generation_batch_size * self.args.cegppo_oversampling) // self.num_generations

    def _oversampled_train_sampler(self, dataset) -> RepeatSampler:
        """TRL 1.16's `_get_train_sampler` with `_generated_prompts` prompts per generation batch."""
        return RepeatSampler(
            data_source=dataset,
            mini_repeat_count=self.num_generations,
            batch_size=self._generated_prompts,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )

    def get_train_dataloader(self):
        if self.args.cegppo_oversampling == 1:
            return super().get_train_dataloader()
        # TRL 1.16's `get_train_dataloader`: one loader batch is one process's share of the generation batch, here
        # `cegppo_oversampling` times the rows it trains on (`_generate_and_score_completions` keeps those).
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            if self.shuffle_dataset:
                dataset = dataset.shuffle(seed=self.args.seed)
            dataset = repeat_iterable_dataset(
                dataset,
                mini_repeat_count=self.num_generations,
                batch_size=self._generated_prompts,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
            )
        rows = self.args.train_batch_size * self.args.steps_per_generation * self.args.cegppo_oversampling
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=round(rows),
            sampler_fn=self._oversampled_train_sampler,
            is_training=True,
        )

    # ------------------------------------------------------------------------------------------------------------
    # Generation: select the rows to train on, attach the optional extras to the batch.
    # ------------------------------------------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes, (N_total, num_funcs)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        rewards = self._total_rewards(self._last_rewards_per_func)  # the generation batch on all processes
        keep = None
        if self.args.cegppo_exclude_zero_advantage_groups:
            output, rows = self._select_training_rows(output, rewards)
            rewards, keep = rewards[rows.to(rewards.device)], output["cegppo_keep"]
        if self.args.cegppo_sft_coef > 0:
            local_size = output["completion_ids"].size(0)
            first = self.accelerator.process_index * local_size
            self._attach_sft_mask(output, rewards[first : first + local_size], keep)
        return output

    def _total_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """Total reward exactly as TRL 1.16 computes it for "sum_then_normalize" and for its logged `reward`:
        `reward_weights`-weighted nansum over reward functions, NaN where every function returned None."""
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def _select_training_rows(self, output: dict, rewards: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """Dynamic sampling: this process's share of the training batch, and the training batch's rows (indices into
        the generation batch on all processes).

        The informative groups (rewards not all equal: the authors' `filter_groups`) fill the training batch in
        generation order; when too few are, the first uninformative groups fill the rest as dropped rows, which keep
        an empty loss mask (`cegppo_keep` = 0). The training batch is split over processes in that order, so rows
        move between processes (docs/method.md, "Dynamic sampling"). dapo's token count covers the kept rows.
        """
        present = [key for key in MULTIMODAL_KEYS if key in output]
        if present:
            raise ValueError(
                f"`cegppo_exclude_zero_advantage_groups=True` moves rows between processes, but this batch has "
                f"multimodal inputs {present} that are not indexed by row. Set "
                "cegppo_exclude_zero_advantage_groups=False for vision-language models."
            )
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        informative = ~equal_reward_groups(rewards, group_size)
        factor = self.args.cegppo_oversampling if mode == "train" else 1.0
        # Informative groups first, each kind in generation order (a stable sort); the training batch takes the first.
        groups = torch.argsort((~informative).to(torch.int8), stable=True)[: round(informative.numel() / factor)]
        rows = (groups.unsqueeze(1) * group_size + torch.arange(group_size, device=groups.device)).flatten()
        share = rows.numel() // self.accelerator.num_processes
        local = slice(self.accelerator.process_index * share, (self.accelerator.process_index + 1) * share)
        output = self._take_rows(output, rows[local])
        keep = informative[groups].repeat_interleave(group_size)[local].to(output["completion_mask"].device)
        output["completion_mask"] = output["completion_mask"] * keep.unsqueeze(1).to(output["completion_mask"].dtype)
        output["cegppo_keep"] = keep.float()
        # dapo's token-mean denominator, as TRL 1.16 computes it (`gather(loss_mask.sum()).sum()`), over the kept rows.
        output["num_items_in_batch"] = self.accelerator.gather(_loss_mask(output).sum()).sum()
        self._log_on_device(mode, ("cegppo/informative_group_frac",), informative.float().mean().unsqueeze(0))
        if mode == "train":
            self._generation_stats = torch.stack([informative.sum(), informative[groups].sum()]).float()
        return output, rows

    def _take_rows(self, output: dict, rows: torch.Tensor) -> dict:
        """The batch made of generation-batch rows `rows` (indices over all processes, in process order).

        Every tensor with `ndim > 0` and every list is indexed by row, as TRL 1.16's `shuffle_sequence_dict` /
        `split_tensor_dict` treat them; sequences are padded to a common length first, on TRL's side for each key.
        """
        num_rows, moving = output["completion_ids"].size(0), self.accelerator.num_processes > 1
        taken = {}
        for key, value in output.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == num_rows:
                if moving and value.ndim > 1:
                    value = self.accelerator.pad_across_processes(
                        value, dim=1, pad_index=self._pad_value(key), pad_first=key in LEFT_PADDED_KEYS
                    )
                value = self.accelerator.gather(value) if moving else value
                taken[key] = value.index_select(0, rows.to(value.device))
            elif isinstance(value, list) and len(value) == num_rows:
                value = gather_object(value) if moving else value
                taken[key] = [value[i] for i in rows.tolist()]
            else:
                taken[key] = value
        return taken

    def _pad_value(self, key: str) -> int:
        """TRL 1.16's padding value of each per-row key: the pad token for token ids, 1 for `tool_mask`, else 0."""
        if key in ("prompt_ids", "completion_ids"):
            return getattr(self.processing_class, "tokenizer", self.processing_class).pad_token_id
        return 1 if key == "tool_mask" else 0

    def _attach_sft_mask(self, output: dict, rewards: torch.Tensor, keep) -> None:
        """Mark the completions that get the SFT term (`cegppo_sft_mask`) and count their tokens on all processes."""
        loss_mask = _loss_mask(output)
        sft_mask = (rewards >= self.args.cegppo_sft_reward_threshold) & ~torch.isnan(rewards)
        sft_mask = sft_mask.to(loss_mask.device)
        if keep is not None:  # dropped groups get no SFT term either (the authors' pipeline never sees them)
            sft_mask = sft_mask & keep.bool()
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
        keep = inputs.pop("cegppo_keep", None)  # dropped rows already have an empty loss mask
        with self._capture.around(inputs) as capture:
            loss = super()._compute_loss(model, inputs)  # TRL's PPO-clip loss + KL + entropy bonus + aux loss
        return loss + self._cegppo_loss_delta(inputs, capture.forward, keep)

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

    def _cegppo_loss_delta(self, inputs, forward: _Forward, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Everything CE-GPPO adds to TRL's loss for one micro-batch: the correction (plus the SFT term), its metrics
        and the step's sums (controller, batch fill). No host transfer. `benchmarks/bench_scaling.py` times this
        method as CE-GPPO's own cost."""
        mode = "train" if self.model.training else "eval"
        terms = self._policy_term_inputs(inputs, forward.logps, forward.entropies)
        params = self.clip_params
        correction, sets = self._correction_loss(inputs, terms, params)
        if self._entropy_bonus_enabled:
            self._correct_policy_loss_metric(mode, correction)
        loss_delta = correction
        if self.args.cegppo_sft_coef > 0:
            loss_delta = loss_delta + self._sft_loss(inputs, forward.logps, terms.mask, mode)
        self._log_token_metrics(mode, terms, sets, forward.logps, forward.clamped)
        if mode == "train":
            if self.accelerator.sync_gradients:
                self._metrics[mode]["cegppo/beta1"].append(params.beta1)
                self._metrics[mode]["cegppo/beta2"].append(params.beta2)
            if self._controller is not None or keep is not None:
                self._accumulate_step(forward.entropies, terms.mask, keep)
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
        sft_tokens, tokens = sft_mask.sum(), mask.sum()
        sums = torch.stack(
            [
                torch.stack([-(per_token_logps.detach() * sft_mask).sum(), sft_tokens]),  # cegppo/sft_nll
                torch.stack([sft_tokens, tokens]),  # cegppo/sft_token_frac
                torch.stack([tokens, tokens]),  # the micro-batch's loss tokens (NaN when none on any process)
            ]
        )
        self._log_token_sums(mode, ("cegppo/sft_nll", "cegppo/sft_token_frac"), sums)
        return self.args.cegppo_sft_coef * nll

    # ------------------------------------------------------------------------------------------------------------
    # Metrics: kept on the device until `log` (one host transfer per log, none per micro-batch)
    # ------------------------------------------------------------------------------------------------------------
    def _log_on_device(self, mode: str, names: tuple[str, ...] | _Ratios, values: torch.Tensor) -> None:
        """Record one value per name (`values`, on the device), or the sums `names` takes its ratios of; `log` turns
        them into TRL's metric lists."""
        self._device_metrics[mode][names].append(values.detach().float())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._flush_device_metrics("train" if self.model.training else "eval")
        super().log(logs, start_time)  # TRL averages `_metrics` (skipping NaN), logs and clears them

    def _flush_device_metrics(self, mode: str) -> None:
        """Move the recorded values to the host in one transfer and append them to TRL's per-mode metric lists.

        `policy_loss` holds CE-GPPO's correction of TRL's metric of the same name, one value per micro-batch: it is
        added to TRL's last values (TRL 1.16 appends one per `_compute_loss` call with the entropy bonus on).
        """
        pending = list(self._device_metrics[mode].items())
        self._device_metrics[mode].clear()
        if not pending:
            return
        flat = torch.cat([torch.stack(values).flatten() for _, values in pending]).tolist()
        position = 0
        for key, values in pending:
            width = values[0].numel()
            block = flat[position : position + len(values) * width]
            position += len(block)
            names = key
            if isinstance(key, _Ratios):  # sums recorded per micro-batch: one share per name and micro-batch
                names = key.names
                block = [share for j in range(len(values)) for share in key.shares(block[j * width : (j + 1) * width])]
            for i, name in enumerate(names):
                column = block[i :: len(names)]
                trl_values = self._metrics[mode][name]
                if name != "policy_loss":
                    trl_values.extend(column)
                elif len(trl_values) >= len(column):  # the last ones: TRL's entries of the same micro-batches
                    start = len(trl_values) - len(column)
                    trl_values[start:] = [trl + delta for trl, delta in zip(trl_values[start:], column)]
                else:
                    warnings.warn(
                        "TRL logged `policy_loss` a different number of times than CE-GPPO corrected it; the logged "
                        "value is TRL's PPO-clip term. Check the installed TRL version (tests/test_edges.py).",
                        UserWarning,
                        stacklevel=2,
                    )

    def _log_token_sums(self, mode: str, names: tuple[str, ...], sums: torch.Tensor) -> None:
        """Log `sum(num) / sum(den)` over all processes for each name, from `sums` = (num, den) rows, and
        `(num tokens, num tokens)` last: one all-reduce, no host transfer."""
        totals = self.accelerator.reduce(sums.detach().float(), reduction="sum").flatten()
        last = totals.numel() - 2  # the (num tokens, num tokens) row
        self._log_on_device(mode, _Ratios(names, tuple(range(0, last, 2)), tuple(range(1, last, 2)), last), totals)

    def _correct_policy_loss_metric(self, mode: str, correction: torch.Tensor) -> None:
        """Make TRL's `policy_loss` metric the CE-GPPO policy term (plus KL, as in TRL) instead of PPO-clip's.

        TRL 1.16 logs `policy_loss` only with the entropy bonus on, as `gather(policy_loss).nanmean()`, where
        `policy_loss` is the aggregated policy + KL term before the division by gradient accumulation (grpo, bnpo,
        dr_grpo, luspo) or dapo's normalised value. The correction, at the same scale and averaged over processes the
        same way, is added to it when the metrics are logged.
        """
        scale = 1.0 if self.loss_type == "dapo" else self._accumulation(mode)
        delta = self.accelerator.reduce((correction.detach().float() * scale).unsqueeze(0), reduction="mean")
        self._log_on_device(mode, ("policy_loss",), delta)

    def _log_token_metrics(self, mode, terms: _PolicyTermInputs, sets: ClippedSets, per_token_logps, clamped) -> None:
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
        # Rows: token sets (see TOKEN_METRICS); columns: (tokens, gradient weight). One matmul and one all-reduce
        # instead of ~50 small reductions per micro-batch; the sums stay on the device until `log` divides them.
        clamped = torch.zeros_like(clipped) if clamped is None else clamped.expand(shape)
        token_sets = torch.stack(
            [torch.ones_like(clipped), beta1_set, beta2_set, *quadrants, *(q & clipped for q in quadrants), clamped]
        )
        sums = token_sets.flatten(1).float() @ torch.stack([mask.flatten(), weight.flatten()], dim=1)
        totals = self.accelerator.reduce(sums.detach(), reduction="sum").flatten()
        self._log_on_device(mode, TOKEN_RATIOS, totals)  # the shares are taken on the host, at `log`

    # ------------------------------------------------------------------------------------------------------------
    # Optimizer-step sums: the entropy controller and the batch fill
    # ------------------------------------------------------------------------------------------------------------
    def _accumulate_step(self, entropies: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Sum the micro-batches of one optimizer step on the device: (entropy, loss tokens) for the controller and
        (kept rows, rows) for the batch fill. At the step's boundary (`sync_gradients`, as TRL's adaptive entropy),
        one all-reduce over processes and `_close_step`."""
        kept = keep.sum() if keep is not None else mask.new_zeros(())
        stats = torch.stack(
            [
                (entropies.detach() * mask).sum(),
                mask.sum(),
                kept,
                torch.tensor(float(mask.size(0)), device=mask.device),
            ]
        ).float()
        self._step_sums = stats if self._step_sums is None else self._step_sums + stats
        if self.accelerator.sync_gradients:
            totals = self.accelerator.reduce(self._step_sums, reduction="sum")
            self._step_sums = None
            self._close_step(totals, dynamic_sampling=keep is not None)

    def _close_step(self, totals: torch.Tensor, dynamic_sampling: bool) -> None:
        if dynamic_sampling:
            fill = (totals[2] / totals[3]).unsqueeze(0)
            stats = self._generation_stats
            if stats is None:  # a direct `_compute_loss` call, outside TRL's loop: no generation batch to count
                stats = torch.full_like(totals[:2], math.nan)
            self._log_on_device("train", STEP_FILL_METRICS, torch.cat([fill, stats.to(fill.device)]))
        if self._controller is None:
            return
        # The one host transfer per optimizer step: the controller's betas are Python floats for the next step.
        entropy_sum, tokens = totals[:2].tolist()
        if tokens == 0:  # every row of the step was dropped (dynamic sampling): nothing was measured
            return
        self._controller.update(entropy_sum / tokens)
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
