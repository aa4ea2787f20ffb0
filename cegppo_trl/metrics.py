"""CE-GPPO's token metrics, beside `core.py`: the sums every `cegppo/` token metric is a ratio of (pure functions of
tensors, checked against per-token counts in `tests/test_metrics.py`), and `DeviceMetrics`, which keeps what the trainer
records (on the device, or host floats) and turns it into TRL's metric lists at `log`: the trainer's one metric path.

TRL's own metrics are TRL's: `policy_loss` (logged by TRL only with the entropy bonus on) is its PPO-clip term (+ KL);
`clip_ratio/*` are exactly CE-GPPO's beta1 / beta2 sets. With dynamic sampling the token means cover the kept rows only.
Added under `cegppo/`:

* `policy_loss`: the CE-GPPO policy term (Eq. 8, without KL), at the scale TRL logs its `policy_loss`, every micro-batch.
* `beta1`, `beta2` (in force); `beta1_token_frac`, `beta2_token_frac` (loss tokens in each clipped set);
  `beta1_grad_share`, `beta2_grad_share` (each set's share of the gradient weight `sum |d loss / d log pi|`).
* `quadrant/{pos,neg}_{high,low}/{token_frac,grad_share,clip_frac,restored_grad_share}`: advantage sign x
  `pi_theta(y_t)` above / below `cegppo_low_prob_threshold` (zero-advantage tokens are in none): token fraction,
  gradient share, clipped fraction of the quadrant, and the gradient share CE-GPPO gave back to its clipped tokens.
* `log_ratio_clamped_frac`: loss tokens whose `|log pi_theta - log pi_old|` hit the clamp at 20 (should be 0).
* dynamic sampling: `informative_group_frac` (per generation batch); per optimizer step `batch_fill` (kept rows /
  rows), `informative_groups` and `groups_trained` (of the generation batch it came from).
* `erc_low_frac`, `erc_high_frac` (entropy-ratio clipping: loss tokens with `rho <= low` / `>= high`); `sft_nll`,
  `sft_token_frac` (SFT term); `entropy_error`, `entropy_integral` (entropy controller).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

import torch


QUADRANTS = ("pos_high", "pos_low", "neg_high", "neg_low")
# The token sets `token_set_sums` sums over, one row each: all loss tokens, CE-GPPO's beta1 / beta2 sets, the paper's
# four quadrants (advantage sign x pi_theta above / below the low-probability threshold), their clipped tokens, and
# the tokens whose old log-prob was clamped.
TOKEN_SETS = (
    "all",
    "beta1",
    "beta2",
    *QUADRANTS,
    *(f"{quadrant}/clipped" for quadrant in QUADRANTS),
    "clamped",
)
# Per token set: its loss tokens, and its gradient weight `sum |d loss / d log pi|`.
COLUMNS = ("tokens", "weight")


def _quadrant_metrics(quadrant: str) -> dict:
    return {
        f"cegppo/quadrant/{quadrant}/token_frac": ((quadrant, "tokens"), ("all", "tokens")),
        f"cegppo/quadrant/{quadrant}/grad_share": ((quadrant, "weight"), ("all", "weight")),
        f"cegppo/quadrant/{quadrant}/clip_frac": ((f"{quadrant}/clipped", "tokens"), (quadrant, "tokens")),
        f"cegppo/quadrant/{quadrant}/restored_grad_share": ((f"{quadrant}/clipped", "weight"), ("all", "weight")),
    }


# Each token metric: name -> (numerator, denominator), each a (token set, column) of `token_set_sums`.
TOKEN_METRICS = {
    "cegppo/beta1_token_frac": (("beta1", "tokens"), ("all", "tokens")),
    "cegppo/beta2_token_frac": (("beta2", "tokens"), ("all", "tokens")),
    "cegppo/beta1_grad_share": (("beta1", "weight"), ("all", "weight")),
    "cegppo/beta2_grad_share": (("beta2", "weight"), ("all", "weight")),
    **{name: cell for quadrant in QUADRANTS for name, cell in _quadrant_metrics(quadrant).items()},
    "cegppo/log_ratio_clamped_frac": (("clamped", "tokens"), ("all", "tokens")),
}
# Logged once per optimizer step under dynamic sampling: the step's fill, and its generation batch's group counts.
STEP_FILL_METRICS = ("cegppo/batch_fill", "cegppo/informative_groups", "cegppo/groups_trained")


def token_set_sums(
    mask: torch.Tensor,
    grad_coef: torch.Tensor,
    token_weight: torch.Tensor | None,
    beta1_mask: torch.Tensor,
    beta2_mask: torch.Tensor,
    advantages: torch.Tensor,
    logps: torch.Tensor,
    low_prob_threshold: float,
    clamped: torch.Tensor | None,
) -> torch.Tensor:
    """The (tokens, gradient weight) sums of every set in `TOKEN_SETS` over one micro-batch, flattened row by row.

    `mask` is the (B, T) loss mask; `grad_coef`, `beta1_mask`, `beta2_mask` come from `core.ClippedSets` and
    `advantages` is (B, 1) or (B, T) (all broadcast to (B, T)); `token_weight` is TRL's per-token multiplier (or
    None); `clamped` marks the tokens whose old log-prob was clamped (None: none). One matmul instead of ~50 small
    reductions; zero-advantage tokens belong to no quadrant.
    """
    mask = mask.float()
    shape = mask.shape
    weight = grad_coef.abs().float().expand(shape) * mask
    if token_weight is not None:
        weight = weight * token_weight.float().expand(shape)
    beta1, beta2 = beta1_mask.expand(shape), beta2_mask.expand(shape)
    clipped = beta1 | beta2
    advantages = advantages.expand(shape)
    low_prob = logps.detach() < math.log(low_prob_threshold)
    positive, negative = advantages > 0, advantages < 0
    quadrants = [positive & ~low_prob, positive & low_prob, negative & ~low_prob, negative & low_prob]
    clamped = torch.zeros_like(clipped) if clamped is None else clamped.expand(shape)
    token_sets = torch.stack(
        [torch.ones_like(clipped), beta1, beta2, *quadrants, *(q & clipped for q in quadrants), clamped]
    )
    return (token_sets.flatten(1).float() @ torch.stack([mask.flatten(), weight.flatten()], dim=1)).flatten()


@dataclass(frozen=True)
class Ratios:
    """How recorded sums become metrics: `names[i] = sums[nums[i]] / sums[dens[i]]`, and `sums[tokens]` the loss
    tokens of the micro-batch on all processes."""

    names: tuple[str, ...]
    nums: tuple[int, ...]
    dens: tuple[int, ...]
    tokens: int

    @classmethod
    def of_token_sets(cls) -> Ratios:
        """The ratios of `TOKEN_METRICS` over the flattened `token_set_sums`."""

        def position(cell: tuple[str, str]) -> int:
            token_set, column = cell
            return TOKEN_SETS.index(token_set) * len(COLUMNS) + COLUMNS.index(column)

        nums, dens = zip(*((position(num), position(den)) for num, den in TOKEN_METRICS.values()))
        return cls(tuple(TOKEN_METRICS), nums, dens, position(("all", "tokens")))

    @classmethod
    def of_pairs(cls, names: tuple[str, ...]) -> Ratios:
        """The ratios of sums recorded as (num, den) rows, one per name, then a (tokens, tokens) row, flattened."""
        return cls(names, tuple(range(0, 2 * len(names), 2)), tuple(range(1, 2 * len(names), 2)), 2 * len(names))

    def shares(self, sums: list[float]) -> list[float]:
        """0 where nothing was counted, NaN everywhere when the micro-batch has no loss token on any process (TRL's
        `log` skips NaN when it averages, so such a micro-batch adds nothing to the logged means)."""
        if sums[self.tokens] <= 0:
            return [math.nan] * len(self.names)
        return [sums[n] / sums[d] if sums[d] > 0 else 0.0 for n, d in zip(self.nums, self.dens)]


TOKEN_RATIOS = Ratios.of_token_sets()
SFT_RATIOS = Ratios.of_pairs(("cegppo/sft_nll", "cegppo/sft_token_frac"))
ERC_RATIOS = Ratios.of_pairs(("cegppo/erc_low_frac", "cegppo/erc_high_frac"))


def erc_sums(below: torch.Tensor, above: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sums `ERC_RATIOS` takes its ratios of: (loss tokens below the band, loss tokens), (above, loss tokens) and
    the micro-batch's loss tokens `mask` (NaN metrics when none on any process); `below` / `above` from
    `core.entropy_ratio_band`."""
    mask = mask.float()
    tokens = mask.sum()
    below, above = (below.float() * mask).sum(), (above.float() * mask).sum()
    return torch.stack([below, tokens, above, tokens, tokens, tokens]).detach().float()


def sft_sums(logps: torch.Tensor, sft_mask: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sums `SFT_RATIOS` takes its ratios of: (NLL, tokens) of the SFT tokens `sft_mask`, (SFT tokens, loss tokens)
    and the micro-batch's loss tokens `mask` (NaN metrics when none on any process)."""
    sft_tokens, tokens = sft_mask.sum(), mask.sum()
    nll = -(logps.detach() * sft_mask).sum()
    return torch.stack([nll, sft_tokens, sft_tokens, tokens, tokens, tokens]).detach().float()


class StepSums:
    """The sums of one optimizer step's micro-batches (`step_sums`), totalled over processes at the step's boundary
    (`sync_gradients`, as TRL's adaptive entropy) in one all-reduce."""

    def __init__(self, reduce: Callable):
        self._reduce, self._sums = reduce, None

    def add(self, sums: torch.Tensor, boundary: bool) -> torch.Tensor | None:
        """Add one micro-batch's sums; at the boundary, the step's totals over all processes (else None)."""
        self._sums = sums if self._sums is None else self._sums + sums
        if not boundary:
            return None
        totals, self._sums = self._reduce(self._sums, reduction="sum"), None
        return totals


def fill_metrics(totals: torch.Tensor, group_counts: torch.Tensor | None) -> torch.Tensor:
    """`STEP_FILL_METRICS` of one optimizer step from its `StepSums` totals and its generation batch's group counts
    (NaN when there is none: a direct `_compute_loss` call, outside TRL's loop)."""
    fill = (totals[2] / totals[3]).unsqueeze(0)
    if group_counts is None:
        group_counts = torch.full_like(totals[:2], math.nan)
    return torch.cat([fill, group_counts.to(fill)])


def step_sums(entropies: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch's share of its optimizer step's sums: (entropy, loss tokens) for the entropy controller and
    (kept rows, rows) for `cegppo/batch_fill` (kept rows 0 without dynamic sampling)."""
    kept = keep.sum() if keep is not None else mask.new_zeros(())
    rows = torch.tensor(float(mask.size(0)), device=mask.device)
    return torch.stack([(entropies.detach() * mask).sum(), mask.sum(), kept, rows]).float()


class DeviceMetrics:
    """Metric values kept on the device until `log`: one host transfer per log, none per micro-batch. `reduce` is
    `accelerator.reduce`: values are totalled (or averaged) over processes on the device when recorded. Values already
    on the host (the betas, the controller's state) take the same path without a transfer."""

    def __init__(self, reduce: Callable):
        self._reduce = reduce
        self._pending = {"train": defaultdict(list), "eval": defaultdict(list)}

    def record(self, mode: str, names: tuple[str, ...] | Ratios, values: torch.Tensor | tuple[float, ...]) -> None:
        """One value per name (`values`, on the device, or host floats), or the sums `names` takes its ratios of."""
        on_device = isinstance(values, torch.Tensor)
        self._pending[mode][names].append(values.detach().float() if on_device else [float(v) for v in values])

    def record_sums(self, mode: str, ratios: Ratios, sums: torch.Tensor) -> None:
        """This process's sums, totalled over processes (one all-reduce); `ratios` divides them at `flush`."""
        self.record(mode, ratios, self._reduce(sums.detach().float(), reduction="sum"))

    def record_mean(self, mode: str, names: tuple[str, ...], values: torch.Tensor) -> None:
        """One value per name, averaged over processes."""
        self.record(mode, names, self._reduce(values.detach().float(), reduction="mean"))

    def flush(self, mode: str, metrics: dict[str, list[float]]) -> None:
        """Move the recorded values to the host in one transfer and append them to `metrics` (TRL's per-mode lists)."""
        pending = list(self._pending[mode].items())
        self._pending[mode].clear()
        on_device = [torch.stack(values).flatten() for _, values in pending if isinstance(values[0], torch.Tensor)]
        flat = iter(torch.cat(on_device).tolist() if on_device else [])
        for key, values in pending:
            width = len(values[0])
            block = (
                [v for row in values for v in row]
                if isinstance(values[0], list)
                else list(islice(flat, width * len(values)))
            )
            names = key
            if isinstance(key, Ratios):  # sums recorded per micro-batch: one share per name and micro-batch
                names = key.names
                block = [share for j in range(len(values)) for share in key.shares(block[j * width : (j + 1) * width])]
            for i, name in enumerate(names):
                metrics[name].extend(block[i :: len(names)])
