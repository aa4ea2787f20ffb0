"""Every place this package repeats TRL 1.16's own logic, as functions over explicit arguments (`trainer` is the
`GRPOTrainer` whose attributes TRL's method would read from `self`), so that a TRL upgrade diffs this one file. It
imports nothing of the package, and TRL only inside the functions that use it. Pinned by `tests/test_trl_parity.py`
(ratio, token weights, the PPO-clip term, the five aggregations), `tests/test_dynamic_sampling.py` (the loader, the
old / reference pass on the training rows, the row layout and dapo's denominator), `tests/test_edges.py` (padding,
rewards, `policy_loss`, the multimodal keys) and `tests/test_evaluation.py` (prompt tokens, completion tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


# Batch keys TRL 1.16 attaches for vision-language models; they are not indexed by completion row, so rows cannot be
# selected or moved between processes (`dynamic_sampling.refuse_multimodal_rows`).
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


def has_old_log_probs(args) -> bool:
    """`_generate_and_score_completions`: old log-probs exist only off-policy; otherwise `_compute_loss` uses
    `per_token_logps.detach()`, the ratio is 1 and CE-GPPO is GRPO."""
    return args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0


def over_generating_loader(get_dataloader: Callable, dataset, args, num_generations: int, num_iterations: int, sizes):
    """`get_train_dataloader` and `_get_train_sampler` with `sizes` (`config.over_generation`: prompts per generation
    batch, rows per process) instead of TRL's: one loader batch is one process's share of the generation batch,
    `cegppo_oversampling` times the rows it trains on. `get_dataloader` is the trainer's `_get_dataloader`."""
    from datasets import IterableDataset
    from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset

    prompts, rows = sizes
    repeats = dict(mini_repeat_count=num_generations, batch_size=round(prompts))
    repeats.update(repeat_count=num_iterations * args.steps_per_generation)
    if isinstance(dataset, IterableDataset):
        dataset = dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset
        dataset = repeat_iterable_dataset(dataset, **repeats)

    def sampler(data) -> RepeatSampler:
        return RepeatSampler(data_source=data, shuffle=args.shuffle_dataset, seed=args.seed, **repeats)

    return get_dataloader(
        dataset=dataset, description="Training", batch_size=round(rows), sampler_fn=sampler, is_training=True
    )


def total_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """Total reward as for "sum_then_normalize" and the logged `reward`: `reward_weights`-weighted nansum over reward
    functions, NaN where every function returned None."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def pad_value(key: str, pad_token_id: int) -> int:
    """The padding value of each per-row key: the pad token for token ids, 1 for `tool_mask`, else 0."""
    if key in ("prompt_ids", "completion_ids"):
        return pad_token_id
    return 1 if key == "tool_mask" else 0


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens the loss covers: `completion_mask`, times `tool_mask` when present (tool output tokens of
    multi-turn rollouts are not the policy's)."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


def is_per_row(value, num_rows: int) -> bool:
    """Whether a batch value is indexed by completion row, as TRL 1.16's `shuffle_sequence_dict` and
    `split_tensor_dict` treat it: every tensor with `ndim > 0` and every list of `num_rows` items."""
    if isinstance(value, torch.Tensor):
        return value.ndim > 0 and value.size(0) == num_rows
    return isinstance(value, list) and len(value) == num_rows


def num_items_in_batch(batch: dict, gather: Callable) -> torch.Tensor:
    """dapo's token-mean denominator as `_generate_and_score_completions` counts it: the loss tokens of the
    generation batch on all processes, `gather(loss_mask.sum()).sum()`."""
    return gather(loss_mask(batch).sum()).sum()


def ppo_clip_per_token_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, params) -> torch.Tensor:
    """Per-token PPO-clip loss exactly as TRL 1.16's `_compute_loss` computes it for `grpo`, `bnpo`, `dr_grpo`, `dapo`
    and `luspo`, with the clip range and `delta` of `params` (a `core.ClipParams`; the betas play no part):
    `coef_2 = clamp(r, 1 - eps_low, 1 + eps_high)`, optional `coef_1 = clamp(r, max=delta)`, `-min(coef_1 A, coef_2
    A)`. `tests/test_trl_parity.py` checks it against TRL's own trainer."""
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - params.epsilon_low, 1 + params.epsilon_high)
    if params.delta is not None:
        coef_1 = torch.clamp(coef_1, max=params.delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt exactly as TRL 1.16's `GRPOTrainer._tokenize_prompts` builds them for text-only prompts
    without tools (the chat template with the generation prompt for conversational prompts, the tokenizer on the text
    otherwise); tests/test_evaluation.py compares the two."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def completion_token_mask(new_tokens: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """The completion tokens TRL 1.16 counts (its `completion_mask`): every generated token up to and including the
    first eos."""
    is_eos = torch.isin(new_tokens, eos_ids)
    return (is_eos.long().cumsum(1) - is_eos.long()) == 0


def old_policy_pass(
    output: dict, logps_of: Callable, trainer, old: bool, reference: bool, old_entropies: bool
) -> None:
    """`_generate_and_score_completions`' old- and reference-log-prob passes (same inputs, chunk size, `no_grad`,
    `disable_gradient_checkpointing`, `use_adapter` for a PEFT reference) on the rows of `output`. `logps_of` is the
    trainer's `_get_per_token_logps_and_entropies`; `old` / `reference` are TRL's conditions; with `old_entropies` the
    same forward gives `output["cegppo_old_entropies"]`."""
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    model, ref_model, args = trainer.model, trainer.ref_model, trainer.args
    input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    kwargs = {key: output[key] for key in ("token_type_ids", "mm_token_type_ids") if key in output}
    kwargs.update(logits_to_keep=output["completion_ids"].size(1), batch_size=args.per_device_train_batch_size)
    with torch.no_grad(), disable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs):
        if old or old_entropies:
            logps, entropies, _ = logps_of(model, input_ids, attention_mask, compute_entropy=old_entropies, **kwargs)
            if old:
                output["old_per_token_logps"] = logps
            if old_entropies:
                output["cegppo_old_entropies"] = entropies
        if reference and ref_model is not None:
            output["ref_per_token_logps"], _, _ = logps_of(ref_model, input_ids, attention_mask, **kwargs)
        elif reference:  # PEFT: the base model (a new adapter) or the initial adapter "ref"
            unwrapped = trainer.accelerator.unwrap_model(model)
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                output["ref_per_token_logps"], _, _ = logps_of(model, input_ids, attention_mask, **kwargs)


class PolicyTermInputs(NamedTuple):
    """Per-token tensors `_compute_loss` builds its PPO-clip term from."""

    log_ratio: torch.Tensor  # (B, T) token level or (B, 1) sequence level
    advantages: torch.Tensor  # (B, 1) or (B, T)
    mask: torch.Tensor  # (B, T) completion mask x tool mask
    token_weight: torch.Tensor | None  # off-policy mask x entropy mask x vLLM IS ratio, or None


def policy_term_inputs(trainer, inputs: dict, per_token_logps, entropies) -> PolicyTermInputs:
    """The ratio and the per-token multipliers exactly as `_compute_loss` builds them."""
    mask = loss_mask(inputs)
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_per_token_logps = inputs.get("old_per_token_logps")
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    log_ratio = per_token_logps - old_per_token_logps
    if trainer.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    token_weight = None
    if trainer.off_policy_mask_threshold is not None:
        sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)
        token_weight = trainer.get_off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, trainer.off_policy_mask_threshold
        )
    if trainer.top_entropy_quantile < 1.0:
        entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - trainer.top_entropy_quantile)
        token_weight = entropy_mask if token_weight is None else token_weight * entropy_mask
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        is_ratio = inputs["importance_sampling_ratio"]
        token_weight = is_ratio if token_weight is None else token_weight * is_ratio
    return PolicyTermInputs(log_ratio, advantages, mask, token_weight)


def token_mean_normalizer(trainer, num_tokens: torch.Tensor, mode: str) -> torch.Tensor:
    """dapo's denominator: the count spans the generation batch on all processes, rescaled to one accumulation
    window."""
    normalizer = num_tokens.clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return normalizer


def aggregate(trainer, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: dict, mode: str) -> torch.Tensor:
    """Reduce a per-token loss to the scalar `_compute_loss` would, for grpo / bnpo / dr_grpo / dapo / luspo."""
    loss_type = trainer.loss_type  # grpo / bnpo / dr_grpo / luspo divide by accumulation (none in eval)
    divisor = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / divisor
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / divisor
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * trainer.max_completion_length) / divisor
    if loss_type == "dapo":
        return (per_token_loss * mask).sum() / token_mean_normalizer(trainer, inputs["num_items_in_batch"], mode)
    if loss_type == "luspo":
        return (per_token_loss * mask).sum(-1).mean() / divisor
    raise ValueError(f"loss_type={loss_type!r} is not supported by CEGPPOTrainer.")


def policy_loss_scale(trainer, mode: str) -> float:
    """`_compute_loss` logs `policy_loss` before the division by accumulation (dapo: the normalised value)."""
    return trainer.current_gradient_accumulation_steps if mode == "train" and trainer.loss_type != "dapo" else 1.0
