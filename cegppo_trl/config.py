"""`CEGPPOConfig`: TRL's `GRPOConfig` plus the CE-GPPO fields, with the paper's defaults."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig
from trl.trainer.utils import get_config_model_id

from .vllm_support import warn_if_config_uses_untested_vllm


# Loss types whose per-token term in TRL 1.16's `GRPOTrainer._compute_loss` is PPO-clip `-min(r A, clip(r) A)` (TRL's
# branch `loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]`): CE-GPPO replaces exactly that term, so it composes
# with each of their aggregations. `tests/test_trl_parity.py` checks each against TRL's own trainer.
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# Why each other TRL 1.16 loss type is refused: none has a clipped set whose gradient PPO-clip zeroes, so there is no
# gradient for CE-GPPO to preserve. Used in the error message.
UNSUPPORTED_LOSS_TYPES = {
    "cispo": "its per-token loss is `-sg(min(r, epsilon_high)) * A * log pi`, a REINFORCE term with a detached, "
    "truncated ratio: every token already keeps its gradient, so there is no clipped set to give it back to",
    "sapo": "its per-token loss is a soft sigmoid gate `-sigmoid(tau (r - 1)) * 4 / tau * A` with no hard clip: "
    "no token has its gradient set to zero, so there is no clipped set to give it back to",
    "vespo": "its per-token loss is `-phi(w) * A * log pi` with detached gamma weights `phi` of the sequence ratio: "
    "there is no clip, so there is no clipped set to give gradient back to",
}


@dataclass
class CEGPPOConfig(GRPOConfig):
    r"""
    Configuration class for [`CEGPPOTrainer`]: every field of TRL's [`~trl.GRPOConfig`] plus the fields below.

    CE-GPPO (Su et al., ACL 2026, Eq. 8) keeps PPO-clip's forward value on the clipped tokens, times `beta`, and gives
    them back a bounded gradient (`docs/method.md`). Defaults follow the paper: `epsilon = 0.2` (`epsilon_high=None`
    reads as `epsilon`), `loss_type="dapo"`, no KL term (`beta=0.0`), `beta1 = 0.5`, `beta2 = 1.0` (1.5B; 7B: `beta1 =
    0.75`). CE-GPPO acts only off-policy (the trainer warns otherwise): the paper takes 8 optimizer steps per
    generation batch, `steps_per_generation = 8 * gradient_accumulation_steps`. The authors' dual-clip `c = 10` is
    TRL's `delta` (it must exceed `1 + epsilon_high`). Loss types: `SUPPORTED_LOSS_TYPES` (same PPO-clip term,
    different aggregation); `UNSUPPORTED_LOSS_TYPES` are refused, each with its reason.

    Parameters:
        > CE-GPPO coefficients

        cegppo_beta1 (`float`, *optional*, defaults to `0.5`):
            Gradient coefficient of negative-advantage tokens whose ratio fell below `1 - epsilon`. Larger values lower
            entropy faster; `0` gives PPO-clip's gradient, `1` GPPO's.
        cegppo_beta2 (`float`, *optional*, defaults to `1.0`):
            Gradient coefficient of positive-advantage tokens whose ratio rose above `1 + epsilon_high`. Larger values
            keep entropy higher.

        > Extras from the authors' scripts (off by default; not described in the paper)

        cegppo_sft_coef (`float`, *optional*, defaults to `0.0`):
            Coefficient of an NLL term, `coef * token-mean(-log pi)` over the completions whose total reward is at
            least `cegppo_sft_reward_threshold` (the authors: `0.1`). `0.0` disables it.
        cegppo_sft_reward_threshold (`float`, *optional*, defaults to `1.0`):
            Completions whose total (weighted) reward is `>=` this value get the NLL term.
        cegppo_exclude_zero_advantage_groups (`bool`, *optional*, defaults to `False`):
            Dynamic sampling (the authors' `filter_groups`): train only on the groups whose rewards are not all equal
            (within `core.EQUAL_REWARD_RTOL`); when too few are, the rest of the training batch are dropped rows (an
            empty loss mask). Exact for `loss_type` "dapo" or "bnpo" (docs/method.md, "Dynamic sampling"); refused
            with a row-normalised loss type, batch-wide advantage normalisation, `steps_per_generation` not a multiple
            of `gradient_accumulation_steps`, a MoE router aux loss, or multimodal inputs.
        cegppo_oversampling (`float`, *optional*, defaults to `1.0`):
            With dynamic sampling, each generation batch samples this many times the training batch's prompts and
            trains on the first informative groups (the authors: `2.0`, 256 prompts for 128). Must give whole prompts
            per generation batch and rows per process; above 1 it needs dynamic sampling.

        > Entropy-ratio clipping (the authors' follow-up, ERC, arXiv 2512.05591; off by default)

        cegppo_entropy_ratio_clip (`list[float]` of two numbers, *optional*, defaults to `None`):
            `[low, high]`, `0 < low < 1 < high`: tokens whose entropy ratio `H(pi_theta) / H(pi_old)` leaves the open
            interval keep their policy-loss value but give it no gradient (KL, entropy bonus and SFT term untouched).
            Off-policy only, like CE-GPPO. The authors' scripts: `[0.95, 1.05]`. Metrics `cegppo/erc_*`.

        > Diagnostics

        cegppo_low_prob_threshold (`float`, *optional*, defaults to `0.5`):
            A token is "low probability" in the `cegppo/quadrant/*` metrics when `pi_theta(y_t) < threshold`.

        > Entropy-target controller (beyond the paper; off by default)

        cegppo_entropy_target (`float`, *optional*):
            If set, a PI controller (`cegppo_trl.controller`) moves `beta1` and `beta2` after every optimizer step to
            hold the mean token entropy (nats) near this target, starting from `cegppo_beta1` / `cegppo_beta2`; its
            state is saved with checkpoints.
        cegppo_entropy_kp (`float`, *optional*, defaults to `1.0`):
            Proportional gain (betas per nat).
        cegppo_entropy_ki (`float`, *optional*, defaults to `0.05`):
            Integral gain (betas per nat-step).
        cegppo_beta1_min, cegppo_beta1_max, cegppo_beta2_min, cegppo_beta2_max (`float`, *optional*, defaults to
            `0.0`, `1.0`, `0.5`, `1.5`): bounds of `beta1` / `beta2` under the controller.

        > When a run diverges (`cegppo_trl.divergence`)

        cegppo_max_skipped_steps (`int`, *optional*, defaults to `0`):
            How many optimizer steps, in all, may be skipped (gradients dropped, not applied) because the loss, the
            gradient norm or the controller's entropy was non-finite on a process, or because their generation batch
            got no reward at all, or (DeepSpeed) because the engine passed over them itself (its overflow check);
            counted in `cegppo/skipped_steps/non_finite`, `cegppo/skipped_steps/unscored` and
            `cegppo/skipped_steps/deepspeed`. One more stops the run. `0`: stop at the first (`NonFiniteStepError`,
            `RewardCoverageError`). The same budget as `CEGPPOTrainer(..., max_skipped_steps=N)` (set it in one
            place; two different values are refused).
    """

    # Paper defaults for fields TRL already has (restated so the paper's choice is explicit here).
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range (paper: 0.2)."})
    loss_type: str = field(
        default="dapo",
        metadata={"help": "Aggregation of the per-token loss: one of grpo, bnpo, dr_grpo, dapo, luspo (paper: dapo)."},
    )
    beta: float = field(default=0.0, metadata={"help": "KL coefficient (paper: 0.0, no KL term)."})

    cegppo_beta1: float = field(
        default=0.5, metadata={"help": "Gradient coefficient of tokens with A < 0, ratio < 1 - epsilon (paper: 0.5)."}
    )
    cegppo_beta2: float = field(
        default=1.0, metadata={"help": "Gradient coefficient of tokens with A > 0, ratio > 1 + eps_high (paper: 1.0)."}
    )
    cegppo_sft_coef: float = field(
        default=0.0, metadata={"help": "SFT (NLL) term on completions rewarded >= the threshold below (authors: 0.1)."}
    )
    cegppo_sft_reward_threshold: float = field(
        default=1.0, metadata={"help": "Completions with total reward >= this value get the NLL term."}
    )
    cegppo_exclude_zero_advantage_groups: bool = field(
        default=False, metadata={"help": "Drop groups whose rewards are all equal (the authors' filter_groups)."}
    )
    cegppo_oversampling: float = field(
        default=1.0, metadata={"help": "Prompts generated / prompts trained on, with dynamic sampling (authors: 2)."}
    )
    cegppo_entropy_ratio_clip: list[float] | None = field(
        default=None, metadata={"help": "ERC band `low high`, 0 < low < 1 < high (authors: 0.95 1.05); None: off."}
    )
    cegppo_low_prob_threshold: float = field(
        default=0.5, metadata={"help": "pi(y_t) below this is 'low probability' in the quadrant metrics."}
    )
    cegppo_entropy_target: float | None = field(
        default=None, metadata={"help": "Entropy target (nats) of the optional PI controller on beta1/beta2."}
    )
    cegppo_entropy_kp: float = field(default=1.0, metadata={"help": "Proportional gain of the entropy controller."})
    cegppo_entropy_ki: float = field(default=0.05, metadata={"help": "Integral gain of the entropy controller."})
    cegppo_beta1_min: float = field(default=0.0, metadata={"help": "Controller lower bound of beta1."})
    cegppo_beta1_max: float = field(default=1.0, metadata={"help": "Controller upper bound of beta1."})
    cegppo_beta2_min: float = field(default=0.5, metadata={"help": "Controller lower bound of beta2."})
    cegppo_beta2_max: float = field(default=1.5, metadata={"help": "Controller upper bound of beta2."})
    cegppo_max_skipped_steps: int = field(
        default=0,
        metadata={
            "help": "Non-finite, unscored or DeepSpeed-skipped steps to skip (counted) before stopping; 0: stop."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        validate_cegppo_config(self)
        check_training_args(self)  # TRL's fields that TRL leaves unchecked


def check_training_args(args) -> None:
    """Refuse `GRPOConfig` values that TRL accepts and that train on nothing, save nothing or fail later in another
    library's words (`ValueError` naming the flag and the fix); warn once about checkpoints that do not resume the same
    run."""
    if args.max_completion_length is not None and args.max_completion_length < 1:
        raise ValueError(
            f"--max_completion_length {args.max_completion_length}: the longest completion, in tokens, must be at "
            "least 1 (the paper's recipes use 8192; the tiny recipe 16)."
        )
    if args.per_device_train_batch_size < 1:
        raise ValueError(
            f"--per_device_train_batch_size {args.per_device_train_batch_size}: completions per process and "
            "micro-batch must be at least 1."
        )
    if args.temperature <= 0:
        raise ValueError(
            f"--temperature {args.temperature}: CE-GPPO learns from the differences between the num_generations "
            "completions of a prompt, so the sampling temperature must be > 0 (the paper: 1.0)."
        )
    if args.save_strategy == "steps" and args.save_steps <= 0:
        raise ValueError(
            f"--save_steps {args.save_steps:g} with --save_strategy steps would save no checkpoint: set save_steps to "
            "a number of optimizer steps (a multiple of the steps per generation batch), or --save_strategy no."
        )
    per_generation = args.steps_per_generation * args.num_iterations  # micro-batches fed by one generation batch
    if args.save_strategy == "steps" and args.save_steps >= 1:
        if (args.save_steps * args.gradient_accumulation_steps) % per_generation:
            steps = per_generation / args.gradient_accumulation_steps
            warnings.warn(
                f"save_steps {args.save_steps:g} is not a multiple of the {steps:g} "
                "optimizer steps per generation batch (steps_per_generation x num_iterations / "
                "gradient_accumulation_steps): a run resumed from a checkpoint inside a generation batch generates "
                "fresh completions there, so it is not the uninterrupted run.",
                UserWarning,
                stacklevel=3,
            )


def over_generation(args) -> tuple[float, float]:
    """(prompts per generation batch on all processes, rows per process and generation batch): TRL's two sizes times
    `cegppo_oversampling`. The one place this is computed (the config checks both are whole, the loader uses them)."""
    k = args.cegppo_oversampling
    prompts = args.generation_batch_size * k / args.num_generations
    return prompts, args.per_device_train_batch_size * args.steps_per_generation * k


def as_cegppo_config(args, model) -> CEGPPOConfig:
    """The trainer's `args` as a `CEGPPOConfig`: None gives the defaults (output dir named after `model`, as TRL does),
    a plain `GRPOConfig` is upgraded with the paper's betas and a warning (drop-in use)."""
    if args is None:
        model_name = model if isinstance(model, str) else get_config_model_id(model.config)
        return CEGPPOConfig(f"{model_name.split('/')[-1]}-CEGPPO")
    if isinstance(args, CEGPPOConfig):
        return args
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"`args` must be a CEGPPOConfig (or a GRPOConfig), got {type(args).__name__}.")
    warnings.warn(
        "CEGPPOTrainer got a plain GRPOConfig; using CEGPPOConfig with the paper's cegppo_beta1=0.5, "
        "cegppo_beta2=1.0. Pass a CEGPPOConfig to choose them.",
        UserWarning,
        stacklevel=3,
    )
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    # GRPOConfig.__post_init__ derived it from steps_per_generation; passing both back is an error.
    return CEGPPOConfig(**dict(values, generation_batch_size=None))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# What to do about a field that must be a finite number >= 0: each message names its own field and its own fix.
_NON_NEGATIVE_FIXES = {
    "cegppo_beta1": "Set it to the paper's 0.5 (0.75 for 7B), or 0 to give the beta1 set PPO-clip's zero gradient.",
    "cegppo_beta2": "Set it to the paper's 1.0, or 0 to give the beta2 set PPO-clip's zero gradient.",
    "cegppo_sft_coef": "Set it to 0.0 to disable the NLL (SFT) term, or to the authors' 0.1 to enable it.",
    "cegppo_entropy_kp": "Set the controller's proportional gain to its default 1.0, or 0 for a pure I controller.",
    "cegppo_entropy_ki": "Set the controller's integral gain to its default 0.05, or 0 for a pure P controller.",
    "cegppo_beta1_min": "Set the controller's lower bound of beta1 to its default 0.0 (or any value <= cegppo_beta1).",
    "cegppo_beta2_min": "Set the controller's lower bound of beta2 to its default 0.5 (or any value <= cegppo_beta2).",
}


def _finite_non_negative(args, name: str) -> None:
    value = getattr(args, name)
    _require(
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
        f"`{name}` must be a finite number >= 0, got {value!r}. {_NON_NEGATIVE_FIXES[name]}",
    )


def validate_cegppo_config(args) -> None:
    """Reject settings that would give a silently wrong CE-GPPO loss. Each error names the field and the fix."""
    for name in ("cegppo_beta1", "cegppo_beta2", "cegppo_sft_coef"):
        _finite_non_negative(args, name)
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    _require(
        isinstance(args.epsilon, (int, float)) and math.isfinite(args.epsilon) and 0 < args.epsilon < 1,
        f"`epsilon` must be in (0, 1) so that the lower clip bound 1 - epsilon is positive, got {args.epsilon!r}. "
        "The paper uses epsilon=0.2.",
    )
    _require(
        isinstance(epsilon_high, (int, float)) and math.isfinite(epsilon_high) and epsilon_high > 0,
        f"`epsilon_high` must be a finite number > 0, got {epsilon_high!r}. The paper uses epsilon_high=0.2.",
    )
    if args.loss_type in UNSUPPORTED_LOSS_TYPES:
        raise ValueError(
            f"`loss_type={args.loss_type!r}` is not supported by CE-GPPO: {UNSUPPORTED_LOSS_TYPES[args.loss_type]}. "
            f"Use one of {list(SUPPORTED_LOSS_TYPES)} (the paper uses 'dapo'), or use trl.GRPOTrainer for "
            f"loss_type={args.loss_type!r}."
        )
    _require(
        args.loss_type in SUPPORTED_LOSS_TYPES,
        f"`loss_type={args.loss_type!r}` is not a loss type CE-GPPO knows. Use one of {list(SUPPORTED_LOSS_TYPES)} "
        "(the paper uses 'dapo').",
    )
    if args.delta is not None:
        _require(
            math.isfinite(args.delta) and args.delta > 1 + epsilon_high,
            f"`delta` (dual-clip cap, the authors' c=10) must be > 1 + epsilon_high = {1 + epsilon_high}, got "
            f"{args.delta!r}. Set delta=10.0 as in the authors' scripts, or delta=None to disable dual-clip.",
        )
    _require(
        math.isfinite(args.cegppo_sft_reward_threshold),
        f"`cegppo_sft_reward_threshold` must be finite, got {args.cegppo_sft_reward_threshold!r}.",
    )
    _require(
        0 < args.cegppo_low_prob_threshold < 1,
        f"`cegppo_low_prob_threshold` must be in (0, 1), got {args.cegppo_low_prob_threshold!r}.",
    )
    if args.cegppo_entropy_target is not None:
        _validate_entropy_controller(args)
    _validate_entropy_ratio_clip(args.cegppo_entropy_ratio_clip)
    skips = args.cegppo_max_skipped_steps
    _require(
        isinstance(skips, int) and not isinstance(skips, bool) and skips >= 0,
        f"`cegppo_max_skipped_steps` must be a whole number >= 0, got {skips!r}. Set 0 to stop at the first "
        "non-finite step (the default), or N to skip up to N such steps in all.",
    )
    _validate_oversampling(args)
    if args.cegppo_exclude_zero_advantage_groups:
        _validate_dynamic_sampling(args)
    warn_if_config_uses_untested_vllm(args)  # one line if use_vllm and vLLM is not the tested one


def _validate_entropy_controller(args) -> None:
    """The entropy controller's target, gains and bounds (checked only when `cegppo_entropy_target` is set)."""
    _require(
        math.isfinite(args.cegppo_entropy_target) and args.cegppo_entropy_target > 0,
        f"`cegppo_entropy_target` must be a positive number of nats, got {args.cegppo_entropy_target!r}; "
        "set None to disable the controller.",
    )
    for name in ("cegppo_entropy_kp", "cegppo_entropy_ki", "cegppo_beta1_min", "cegppo_beta2_min"):
        _finite_non_negative(args, name)
    for low, high, start in (
        ("cegppo_beta1_min", "cegppo_beta1_max", "cegppo_beta1"),
        ("cegppo_beta2_min", "cegppo_beta2_max", "cegppo_beta2"),
    ):
        lo, hi, b0 = getattr(args, low), getattr(args, high), getattr(args, start)
        _require(
            math.isfinite(hi) and lo <= b0 <= hi,
            f"The entropy controller needs `{low}` <= `{start}` <= `{high}`, got {lo} <= {b0} <= {hi}. "
            f"Widen the bounds or move `{start}` inside them.",
        )


def _validate_entropy_ratio_clip(band) -> None:
    """`cegppo_entropy_ratio_clip`: None, or two finite numbers `low < 1 < high` with `low > 0` (a band that holds
    `rho = 1`, where the current and old entropies agree; otherwise every on-policy token would lose its gradient)."""
    if band is None:
        return
    numbers = isinstance(band, (list, tuple)) and len(band) == 2
    numbers = numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in band)
    _require(
        numbers and all(math.isfinite(v) for v in band) and 0 < band[0] < 1 < band[1],
        f"`cegppo_entropy_ratio_clip` must be two numbers [low, high] with 0 < low < 1 < high, got {band!r}. Use the "
        "authors' [0.95, 1.05] (on the command line: --cegppo_entropy_ratio_clip 0.95 1.05), or None to disable "
        "entropy-ratio clipping.",
    )


def _validate_oversampling(args) -> None:
    """`cegppo_oversampling`: a finite number >= 1, used with dynamic sampling, giving whole prompts and rows."""
    value = args.cegppo_oversampling
    _require(
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 1,
        f"`cegppo_oversampling` must be a finite number >= 1, got {value!r}. Set 1.0 to generate only the training "
        "batch, or the authors' 2.0 (with cegppo_exclude_zero_advantage_groups=True).",
    )
    if value == 1:
        return
    _require(
        args.cegppo_exclude_zero_advantage_groups,
        f"`cegppo_oversampling={value}` needs cegppo_exclude_zero_advantage_groups=True: without dynamic sampling "
        "every group is trained on, so the extra groups would be generated for nothing. Set "
        "cegppo_exclude_zero_advantage_groups=True, or cegppo_oversampling=1.0.",
    )
    prompts, rows = over_generation(args)
    _require(
        prompts == int(prompts) and rows == int(rows),
        f"`cegppo_oversampling={value}` gives {prompts:g} prompts per generation batch and {rows:g} rows per "
        "process; both must be whole numbers. Choose a value such as 2.0 that makes them whole.",
    )


# Loss types whose per-micro-batch normaliser counts rows (TRL 1.16): a dropped row, kept with an empty loss mask,
# would still count and dilute the micro-batch's loss, so dynamic sampling could not equal removal.
ROW_NORMALISED_LOSS_TYPES = {
    "grpo": "it averages the per-sequence means over the micro-batch's rows",
    "dr_grpo": "it divides by the micro-batch's rows x max_completion_length",
    "luspo": "it averages the per-sequence sums over the micro-batch's rows",
}


def _validate_dynamic_sampling(args) -> None:
    """Settings under which dropping groups could not equal removing them from the batch are refused."""
    flag = "cegppo_exclude_zero_advantage_groups=True"
    if args.loss_type in ROW_NORMALISED_LOSS_TYPES:
        raise ValueError(
            f"{flag} with `loss_type={args.loss_type!r}`: {ROW_NORMALISED_LOSS_TYPES[args.loss_type]}, and a dropped "
            "row stays in the micro-batch with an empty loss mask, so it would dilute the loss. Use "
            "loss_type='dapo' (the paper's) or 'bnpo', or set cegppo_exclude_zero_advantage_groups=False."
        )
    _require(
        args.scale_rewards in ("group", "none"),
        f"{flag} with `scale_rewards={args.scale_rewards!r}`: TRL scales advantages by the standard deviation of the "
        "whole batch, dropped groups included, so the kept rows would not get the advantages they would have had "
        "with those groups removed. Set scale_rewards='group' (the paper's) or 'none', or set "
        "cegppo_exclude_zero_advantage_groups=False.",
    )
    _require(
        args.multi_objective_aggregation == "sum_then_normalize",
        f"{flag} with `multi_objective_aggregation={args.multi_objective_aggregation!r}`: TRL normalises the summed "
        "rewards over the whole batch, dropped groups included, so the kept rows would not get the advantages they "
        "would have had with those groups removed. Use multi_objective_aggregation='sum_then_normalize', or set "
        "cegppo_exclude_zero_advantage_groups=False.",
    )
    spg, accumulation = args.steps_per_generation, args.gradient_accumulation_steps
    _require(
        spg % accumulation == 0,
        f"{flag} needs every optimizer step to lie inside one generation batch (to count the micro-batches that "
        f"kept rows), but `steps_per_generation={spg}` is not a multiple of `gradient_accumulation_steps="
        f"{accumulation}`. Set steps_per_generation to a multiple of it (the paper: 8 x gradient_accumulation_steps "
        f"= {8 * accumulation}).",
    )
