"""Dynamic sampling (`cegppo_exclude_zero_advantage_groups`, `cegppo_oversampling`) as functions of explicit arguments:
the over-generation arithmetic and loader, the choice of the training rows, moving them between processes and marking
the dropped ones. Why the training batch is exact: docs/method.md, "Dynamic sampling". Code that mirrors TRL 1.16 is
marked so and pinned by `tests/test_dynamic_sampling.py` and `tests/test_edges.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object
from datasets import IterableDataset
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import RepeatSampler, repeat_iterable_dataset, use_adapter

from .core import equal_reward_groups


# Batch keys TRL 1.16 attaches for vision-language models; they are not indexed by completion row, so rows cannot be
# selected or moved between processes (`refuse_multimodal_rows`).
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
# Scalars put in the training batch for the optimizer steps it feeds (0-dim tensors: TRL's shuffle and split hand them
# to every micro-batch): the generation batch's informative groups, and those in the training batch.
GROUP_COUNT_KEYS = ("cegppo_informative_groups", "cegppo_groups_trained")
# Per-row keys TRL 1.16 pads on the left (the prompt side); the others with a sequence dimension are right-padded.
LEFT_PADDED_KEYS = ("prompt_ids", "prompt_mask")


def over_generation(args) -> tuple[float, float]:
    """(prompts per generation batch on all processes, rows per process and generation batch): TRL's two sizes times
    `cegppo_oversampling`. The one place this is computed (the config checks both are whole, the loader uses them)."""
    k = args.cegppo_oversampling
    prompts = args.generation_batch_size * k / args.num_generations
    return prompts, args.per_device_train_batch_size * args.steps_per_generation * k


def over_generating_loader(get_dataloader: Callable, dataset, args, num_generations: int, num_iterations: int):
    """TRL 1.16's `get_train_dataloader` and `_get_train_sampler` with `over_generation(args)` prompts per
    generation batch: one loader batch is one process's share of the generation batch, `cegppo_oversampling` times
    the rows it trains on. `get_dataloader` is the trainer's (transformers') `_get_dataloader`."""
    prompts, rows = over_generation(args)
    if isinstance(dataset, IterableDataset):
        if args.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        dataset = repeat_iterable_dataset(
            dataset,
            mini_repeat_count=num_generations,
            batch_size=round(prompts),
            repeat_count=num_iterations * args.steps_per_generation,
        )

    def sampler(data) -> RepeatSampler:
        return RepeatSampler(
            data_source=data,
            mini_repeat_count=num_generations,
            batch_size=round(prompts),
            repeat_count=num_iterations * args.steps_per_generation,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )

    return get_dataloader(
        dataset=dataset, description="Training", batch_size=round(rows), sampler_fn=sampler, is_training=True
    )


def total_rewards(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """Total reward exactly as TRL 1.16 computes it for "sum_then_normalize" and for its logged `reward`:
    `reward_weights`-weighted nansum over reward functions, NaN where every function returned None."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


@dataclass(frozen=True)
class Selection:
    """The training batch chosen from one generation batch (all processes)."""

    rows: torch.Tensor  # its rows: indices into the generation batch on all processes, in training-batch order
    keep: torch.Tensor  # per row of `rows`: True for an informative group's row, False for a dropped (filler) row
    informative: torch.Tensor  # per generated group: its rewards are not all equal
    local: slice  # this process's share of `rows` and `keep`

    @property
    def local_rows(self) -> torch.Tensor:
        return self.rows[self.local]

    @property
    def local_keep(self) -> torch.Tensor:
        return self.keep[self.local]

    def group_counts(self, group_size: int) -> torch.Tensor:
        """(informative groups generated, informative groups in the training batch): `cegppo/informative_groups` and
        `cegppo/groups_trained` of the optimizer steps this batch feeds."""
        return torch.stack([self.informative.sum(), self.keep.sum() // group_size]).float()


def select_training_rows(
    rewards: torch.Tensor, group_size: int, oversampling: float, num_processes: int, process_index: int
) -> Selection:
    """The informative groups (rewards not all equal: the authors' `filter_groups`) fill the training batch in
    generation order; when too few are, the first uninformative groups fill the rest as dropped rows. The training
    batch holds `1 / oversampling` of the generated groups and is split over processes in that order, so rows move
    between processes (docs/method.md, "Dynamic sampling")."""
    informative = ~equal_reward_groups(rewards, group_size)
    # Informative groups first, each kind in generation order (a stable sort); the training batch takes the first.
    groups = torch.argsort((~informative).to(torch.int8), stable=True)[: round(informative.numel() / oversampling)]
    rows = (groups.unsqueeze(1) * group_size + torch.arange(group_size, device=groups.device)).flatten()
    share = rows.numel() // num_processes
    local = slice(process_index * share, (process_index + 1) * share)
    return Selection(rows, informative[groups].repeat_interleave(group_size), informative, local)


def take_training_rows(
    output: dict, rewards: torch.Tensor, group_size: int, oversampling: float, accelerator, pad_token_id: int
) -> tuple[dict, Selection]:
    """This process's share of the training batch chosen from the generation batch `output` (this process's rows)
    by `rewards` (all processes'), and the selection."""
    refuse_multimodal_rows(output)
    num_processes, rank = accelerator.num_processes, accelerator.process_index
    selection = select_training_rows(rewards, group_size, oversampling, num_processes, rank)
    return take_rows(output, selection.local_rows, accelerator, pad_token_id), selection


def pop_group_counts(batch: dict) -> torch.Tensor | None:
    """Take the `GROUP_COUNT_KEYS` out of a micro-batch: (informative groups, groups trained), or None without."""
    counts = [batch.pop(key, None) for key in GROUP_COUNT_KEYS]
    return None if counts[0] is None else torch.stack(counts)


def refuse_router_aux_loss(aux_loss_enabled: bool) -> None:
    if aux_loss_enabled:
        raise ValueError(
            "cegppo_exclude_zero_advantage_groups=True with a MoE router aux loss (`output_router_logits=True` in "
            "the model config): a dropped row stays in its micro-batch with an empty loss mask, and the router's "
            "load-balancing loss would still count its tokens. Set output_router_logits=False, or "
            "cegppo_exclude_zero_advantage_groups=False."
        )


def refuse_multimodal_rows(output: dict) -> None:
    present = [key for key in MULTIMODAL_KEYS if key in output]
    if present:
        raise ValueError(
            f"`cegppo_exclude_zero_advantage_groups=True` moves rows between processes, but this batch has "
            f"multimodal inputs {present} that are not indexed by row. Set "
            "cegppo_exclude_zero_advantage_groups=False for vision-language models."
        )


def pad_value(key: str, pad_token_id: int) -> int:
    """TRL 1.16's padding value of each per-row key: the pad token for token ids, 1 for `tool_mask`, else 0."""
    if key in ("prompt_ids", "completion_ids"):
        return pad_token_id
    return 1 if key == "tool_mask" else 0


def take_rows(output: dict, rows: torch.Tensor, accelerator, pad_token_id: int) -> dict:
    """The batch made of generation-batch rows `rows` (indices over all processes, in process order).

    Every tensor with `ndim > 0` and every list is indexed by row, as TRL 1.16's `shuffle_sequence_dict` /
    `split_tensor_dict` treat them; sequences are padded to a common length first, on TRL's side for each key.
    """
    num_rows, moving = output["completion_ids"].size(0), accelerator.num_processes > 1
    taken = {}
    for key, value in output.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == num_rows:
            if moving and value.ndim > 1:
                value = accelerator.pad_across_processes(
                    value, dim=1, pad_index=pad_value(key, pad_token_id), pad_first=key in LEFT_PADDED_KEYS
                )
            value = accelerator.gather(value) if moving else value
            taken[key] = value.index_select(0, rows.to(value.device))
        elif isinstance(value, list) and len(value) == num_rows:
            value = gather_object(value) if moving else value
            taken[key] = [value[i] for i in rows.tolist()]
        else:
            taken[key] = value
    return taken


def old_policy_pass(
    output: dict,
    logps_of: Callable,
    model,
    ref_model,
    accelerator,
    old: bool,
    reference: bool,
    args,
    old_entropies: bool = False,
) -> None:
    """Select first, then compute: TRL 1.16 `_generate_and_score_completions`' old- and reference-log-prob passes (same
    inputs, chunk size, `no_grad`, `disable_gradient_checkpointing`, `use_adapter` for a PEFT reference) on the
    training rows only. `logps_of` is the trainer's `_get_per_token_logps_and_entropies`; `old` / `reference` are
    TRL's conditions; with `old_entropies` the same forward gives `output["cegppo_old_entropies"]`."""
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
            unwrapped = accelerator.unwrap_model(model)
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                output["ref_per_token_logps"], _, _ = logps_of(model, input_ids, attention_mask, **kwargs)


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens the loss covers, as TRL 1.16 builds them: `completion_mask`, times `tool_mask` when present (tool
    output tokens of multi-turn rollouts are not the policy's)."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


def mark_dropped_rows(output: dict, keep: torch.Tensor, gather: Callable) -> None:
    """Give the dropped rows an empty loss mask (as TRL's `mask_truncated_completions` masks a truncated row), record
    which rows are kept (`cegppo_keep`, per row, so it travels through TRL's shuffle and split), and recount dapo's
    token-mean denominator over the kept rows as TRL 1.16 counts it (`gather(loss_mask.sum()).sum()`)."""
    keep = keep.to(output["completion_mask"].device)
    output["completion_mask"] = output["completion_mask"] * keep.unsqueeze(1).to(output["completion_mask"].dtype)
    output["cegppo_keep"] = keep.float()
    output["num_items_in_batch"] = gather(loss_mask(output).sum()).sum()


def attach_sft_mask(output: dict, rewards: torch.Tensor, threshold: float, keep, gather: Callable) -> None:
    """Mark the completions that get the SFT term (`cegppo_sft_mask`: reward >= `threshold`; `rewards` are this
    process's rows') and count their tokens on all processes (`cegppo_num_sft_tokens`)."""
    mask = loss_mask(output)
    sft_mask = ((rewards >= threshold) & ~torch.isnan(rewards)).to(mask.device)
    if keep is not None:  # dropped groups get no SFT term either (the authors' pipeline never sees them)
        sft_mask = sft_mask & keep.to(mask.device).bool()
    sft_mask = sft_mask.to(mask.dtype)
    output["cegppo_sft_mask"] = sft_mask
    output["cegppo_num_sft_tokens"] = gather((mask * sft_mask.unsqueeze(1)).sum()).sum()
