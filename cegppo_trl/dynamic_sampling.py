"""Dynamic sampling (`cegppo_exclude_zero_advantage_groups`, `cegppo_oversampling`) as functions of explicit arguments:
the choice of the training rows, moving them between processes, marking the dropped ones, and its refusals (the loader
and the old-policy pass it needs mirror TRL: `trl_mirror.py`). Why the training batch is exact: docs/method.md,
"Dynamic sampling".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object

from .core import equal_reward_groups
from .trl_mirror import LEFT_PADDED_KEYS, MULTIMODAL_KEYS, is_per_row, loss_mask, num_items_in_batch, pad_value


# Scalars put in the training batch for the optimizer steps it feeds (0-dim tensors: TRL's shuffle and split hand them
# to every micro-batch): the generation batch's informative groups, and those in the training batch.
GROUP_COUNT_KEYS = ("cegppo_informative_groups", "cegppo_groups_trained")


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


def take_rows(output: dict, rows: torch.Tensor, accelerator, pad_token_id: int) -> dict:
    """The batch made of generation-batch rows `rows` (indices over all processes, in process order).

    Rows are what `trl_mirror.is_per_row` says; sequences are padded to a common length first, on TRL's side for
    each key."""
    num_rows, moving = output["completion_ids"].size(0), accelerator.num_processes > 1
    taken = {}
    for key, value in output.items():
        if isinstance(value, torch.Tensor) and is_per_row(value, num_rows):
            if moving and value.ndim > 1:
                value = accelerator.pad_across_processes(
                    value, dim=1, pad_index=pad_value(key, pad_token_id), pad_first=key in LEFT_PADDED_KEYS
                )
            value = accelerator.gather(value) if moving else value
            taken[key] = value.index_select(0, rows.to(value.device))
        elif is_per_row(value, num_rows):
            value = gather_object(value) if moving else value
            taken[key] = [value[i] for i in rows.tolist()]
        else:
            taken[key] = value
    return taken


def mark_dropped_rows(output: dict, keep: torch.Tensor, gather: Callable) -> None:
    """Give the dropped rows an empty loss mask (as TRL's `mask_truncated_completions` masks a truncated row), record
    which rows are kept (`cegppo_keep`, per row, so it travels through TRL's shuffle and split), and recount dapo's
    token-mean denominator over the kept rows (`trl_mirror.num_items_in_batch`)."""
    keep = keep.to(output["completion_mask"].device)
    output["completion_mask"] = output["completion_mask"] * keep.unsqueeze(1).to(output["completion_mask"].dtype)
    output["cegppo_keep"] = keep.float()
    output["num_items_in_batch"] = num_items_in_batch(output, gather)


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
