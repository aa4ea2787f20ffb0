"""An exact toy of CE-GPPO's entropy mechanics: tabular softmax policies trained with the real loss of `core.py`.

Each of `num_states` "prompts" is answered by a sequence of `seq_len` tokens, one per position, every position with
its own row of logits over `num_actions` actions. Only the first position(s) decide the reward (+1 if the action
there is in the prompt's correct set, else -1); the other "filler" positions share the sequence's advantage without
affecting the reward, like most tokens of an LLM's answer (`seq_len=1` is a plain bandit). One RL step:

1. sample a group of `group_size` sequences per prompt from the current policy (which becomes `pi_old`);
2. group-normalise the +1 / -1 rewards into advantages, `(r - mean) / (std + 1e-4)` as TRL does, and give every
   token of a sequence its sequence's advantage;
3. shuffle the sequences, split them into `num_minibatches` mini-batches and take one SGD step per mini-batch for
   `num_epochs` passes, each on the token-mean of `cegppo_per_token_loss` (`core.py`, paper Eq. 8) with
   `log_ratio = log pi_theta(a) - log pi_old(a)`. Only the first update sees `r == 1`; the later ones are
   off-policy, so ratios leave `[1 - eps_low, 1 + eps_high]` and CE-GPPO's beta1 / beta2 sets are non-empty.

Because a tabular softmax's logit gradient is exactly `coef * (e_a - p)`, the first-order entropy change of a step,
`dH = -eta * F * A * s_a` (step size `eta`, gradient weight `F`, `s_a = p_a (log p_a + H) - sum_b p_b^2 (log p_b + H)`:
the softmax entropy dynamics of the paper's section 3), is exact up to O(eta^2), which `first_order_check` measures,
and the entropy change of every update splits (to first order) into the parts carried by the beta1 set, the beta2 set
and the unclipped tokens (`ToyRun.dH_beta1`, `dH_beta2`, `dH_unclipped`): the mechanism by which beta1 lowers
entropy and beta2 raises it.

Everything is float64 and deterministic for a given seed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field

import torch

from ..core import ClipParams, cegppo_per_token_loss


@dataclass
class ToyConfig:
    """Settings of one toy run. The defaults are the "sequence" toy of `docs/entropy_results.md`.

    A "prompt" (`num_states` of them) is answered by a sequence of `seq_len` tokens, one per position; each position
    has its own row of logits (a tabular policy, positions independent). Only the first `num_key_positions`
    positions decide the reward (+1 if all of them hold a correct action, else -1); the others are "filler" whose
    tokens share the sequence's advantage without affecting it -- like most tokens of an LLM's answer. `seq_len=1`
    is a plain contextual bandit.

    Initial logits: at every position one "dominant" action gets logit `init_peak` and the others draw from
    `N(0, init_scale^2)` (a peaked, LLM-like policy with low-probability alternatives); the correct set is
    `num_correct` actions drawn at random (`dominant_correct=True`: the dominant action plus `num_correct - 1`
    others), so the dominant action is sometimes right and sometimes wrong.

    Updates: `num_epochs` passes over the batch in `num_minibatches` mini-batches of whole sequences, each one SGD
    step with learning rate `lr` on the token-mean loss (per-token step `lr / tokens per mini-batch`).
    """

    num_actions: int = 8
    num_correct: int = 2
    num_states: int = 8
    group_size: int = 8
    seq_len: int = 8
    num_key_positions: int = 1
    num_minibatches: int = 8
    num_epochs: int = 2
    lr: float = 8.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    steps: int = 150
    init_peak: float = 4.0
    init_scale: float = 0.5
    dominant_correct: bool = False
    delta: float | None = None


#: The two toys of the results page: "sequence" (the default config) and "bandit", the same policy and per-token step
#: with one rewarded position and no filler tokens.
TOY_PRESETS = {
    "sequence": ToyConfig(),
    "bandit": ToyConfig(seq_len=1, lr=1.0),
}


@dataclass
class ToyRun:
    """Per-RL-step traces of one toy run (lists of length `steps + 1` for states, `steps` for per-step sums)."""

    beta1: float
    beta2: float
    seed: int
    config: dict
    entropy: list[float] = field(default_factory=list)  # mean over states of H(pi(.|s)), before each step and at end
    correct_mass: list[float] = field(default_factory=list)  # mean probability of the correct set (= expected acc.)
    reward: list[float] = field(default_factory=list)  # mean sampled reward (+1 / -1) of each step's batch
    beta1_token_frac: list[float] = field(default_factory=list)  # over all off-/on-policy updates of the step
    beta2_token_frac: list[float] = field(default_factory=list)
    dH_beta1: list[float] = field(default_factory=list)  # first-order entropy change carried by the beta1 set
    dH_beta2: list[float] = field(default_factory=list)  # ... by the beta2 set
    dH_unclipped: list[float] = field(default_factory=list)  # ... by all other tokens
    key_entropy: list[float] = field(default_factory=list)  # seq_len > 1: entropy of the rewarded positions
    filler_entropy: list[float] = field(default_factory=list)  # ... and of the positions the reward ignores

    def to_dict(self) -> dict:
        return asdict(self)


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of `softmax(logits)` along the last dimension."""
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def entropy_change_first_order(probs: torch.Tensor, action: int, advantage: float, weight: float, lr: float) -> float:
    """First-order entropy change of a softmax policy after one policy-gradient step on action `action`.

    The logits move by `lr * weight * A * (e_a - p)`; then `dH = -lr * weight * A * s_a` with
    `s_a = p_a (log p_a + H) - sum_b p_b^2 (log p_b + H)` (the softmax entropy dynamics the paper's section 3 builds
    on). Positive-advantage rare actions raise entropy, negative-advantage rare actions lower it.
    """
    log_p = torch.log(probs)
    entropy = -(probs * log_p).sum()
    s_a = probs[action] * (log_p[action] + entropy) - (probs**2 * (log_p + entropy)).sum()
    return float(-lr * weight * advantage * s_a)


def entropy_sensitivity(probs: torch.Tensor) -> torch.Tensor:
    """`s_a` for every action `a` (last dimension): a policy-gradient step `logits += eta * c * (e_a - p)` changes the
    entropy by `-eta * c * s_a` to first order.

    Computed by autograd, `s_a = -grad_logits H . (e_a - p)`, not from the closed form, which lives once in
    `entropy_change_first_order` (the tests check the two agree).
    """
    logits = torch.log(probs).detach().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(softmax_entropy(logits).sum(), logits)
    return (grad * probs).sum(-1, keepdim=True) - grad


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO advantages of `rewards` shaped `(num_groups, group_size)`: `(r - mean) / (std + 1e-4)` per group."""
    return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)


def initial_logits(config: ToyConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits (S, K), correct (S, K) bool)` drawn as described in [`ToyConfig`]."""
    S, K = config.num_states * config.seq_len, config.num_actions
    logits = config.init_scale * torch.randn(S, K, generator=generator, dtype=torch.float64)
    dominant = torch.randint(0, K, (S,), generator=generator)
    logits[torch.arange(S), dominant] = config.init_peak
    correct = torch.zeros(S, K, dtype=torch.bool)
    for s in range(S):
        if config.dominant_correct:  # the dominant action plus num_correct - 1 others
            others = torch.tensor([a for a in range(K) if a != int(dominant[s])])
            chosen = others[torch.randperm(K - 1, generator=generator)[: config.num_correct - 1]]
            correct[s, chosen] = True
            correct[s, dominant[s]] = True
        else:
            correct[s, torch.randperm(K, generator=generator)[: config.num_correct]] = True
    return logits, correct


def cegppo_update(
    logits: torch.Tensor,
    states: torch.Tensor,
    actions: torch.Tensor,
    advantages: torch.Tensor,
    old_logp: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
) -> dict:
    """One SGD step of the token-mean CE-GPPO loss on `(states, actions)` samples; returns the new logits + stats.

    `logits` is not modified. The stats hold the beta1 / beta2 masks, the per-sample gradient coefficient
    `grad_coef` of `core.cegppo_per_token_loss` and the first-order entropy change (of the mean entropy over all
    states) carried by each set, computed from `s_a` at the pre-step policy.
    """
    theta = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)[states, actions]
    params = ClipParams(epsilon_low, epsilon_high, beta1, beta2, delta)
    out = cegppo_per_token_loss((logp - old_logp).unsqueeze(-1), advantages.unsqueeze(-1), params)
    loss = out.per_token_loss.mean()
    (grad,) = torch.autograd.grad(loss, theta)
    new_logits = (theta - lr * grad).detach()

    n = len(actions)
    with torch.no_grad():
        s_a = entropy_sensitivity(torch.softmax(logits, dim=-1))[states, actions]
        # logits[s] += lr * grad_coef / n * (e_a - p[s])  =>  dH_mean = mean_s(-lr * grad_coef / n * s_a)
        dH = -lr * out.grad_coef.squeeze(-1) / n * s_a / logits.shape[0]
    beta1_mask, beta2_mask = out.beta1_mask.squeeze(-1), out.beta2_mask.squeeze(-1)
    return {
        "logits": new_logits,
        "beta1_mask": beta1_mask,
        "beta2_mask": beta2_mask,
        "grad_coef": out.grad_coef.squeeze(-1),
        "dH_beta1": float(dH[beta1_mask].sum()),
        "dH_beta2": float(dH[beta2_mask].sum()),
        "dH_unclipped": float(dH[~(beta1_mask | beta2_mask)].sum()),
    }


def run_toy(beta1: float, beta2: float, seed: int = 0, config: ToyConfig | None = None) -> ToyRun:
    """Train the tabular policy with CE-GPPO (`beta1`, `beta2`) and return its traces. Deterministic per seed.

    The initial policy and correct sets depend only on `seed` (not on the betas), and so does the sampling stream,
    so the settings of the grid start from the same policy for a given seed.
    """
    config = config or ToyConfig()
    with _single_thread():
        return _run_toy(beta1, beta2, seed, config)


def _run_toy(beta1: float, beta2: float, seed: int, config: ToyConfig) -> ToyRun:
    init_gen = torch.Generator().manual_seed(10_000 + seed)
    logits, correct = initial_logits(config, init_gen)
    gen = torch.Generator().manual_seed(seed)
    P, G, T = config.num_states, config.group_size, config.seq_len
    run = ToyRun(beta1=beta1, beta2=beta2, seed=seed, config=asdict(config))
    key = torch.zeros(T, dtype=torch.bool)
    key[: config.num_key_positions] = True
    key_states = key.repeat(P)

    def record_state(l):
        p = torch.softmax(l, dim=-1)
        H = softmax_entropy(l)
        run.entropy.append(float(H.mean()))
        run.correct_mass.append(float((p * correct).sum(-1)[key_states].mean()))
        if T > config.num_key_positions:
            run.key_entropy.append(float(H[key_states].mean()))
            run.filler_entropy.append(float(H[~key_states].mean()))

    record_state(logits)
    # Sequence i = (prompt, sample) of the batch; its token t lives in state prompt * T + t.
    seq_prompt = torch.arange(P).repeat_interleave(G)  # (P*G,)
    seq_states = seq_prompt.unsqueeze(1) * T + torch.arange(T).unsqueeze(0)  # (P*G, T)
    for _ in range(config.steps):
        old_logp_all = torch.log_softmax(logits, dim=-1)
        actions = torch.multinomial(old_logp_all.exp()[seq_states.reshape(-1)], 1, generator=gen).view(P * G, T)
        # A sequence is correct when every key position holds a correct action (filler positions do not matter).
        key_correct = correct[seq_states[:, key], actions[:, key]].all(dim=1)
        rewards = torch.where(key_correct, 1.0, -1.0).to(torch.float64)
        advantages = group_advantages(rewards.view(P, G)).reshape(-1)
        old_logp = old_logp_all[seq_states, actions]
        logits, (n1, n2, total, dH1, dH2, dH0) = _updates(
            logits, seq_states, actions, advantages, old_logp, beta1, beta2, config, gen
        )
        run.reward.append(float(rewards.mean()))
        run.beta1_token_frac.append(n1 / total)
        run.beta2_token_frac.append(n2 / total)
        run.dH_beta1.append(dH1)
        run.dH_beta2.append(dH2)
        run.dH_unclipped.append(dH0)
        record_state(logits)
    return run


def _updates(logits, seq_states, actions, advantages, old_logp, beta1, beta2, config: ToyConfig, gen):
    """One RL step's `num_epochs` x `num_minibatches` SGD updates on whole sequences; returns the new logits and
    ``(beta1-set tokens, beta2-set tokens, tokens, dH from beta1 set, dH from beta2 set, dH from the others)``."""
    n1 = n2 = total = 0
    dH1 = dH2 = dH0 = 0.0
    T = seq_states.shape[1]
    for _epoch in range(config.num_epochs):
        order = torch.randperm(seq_states.shape[0], generator=gen)
        for chunk in order.chunk(config.num_minibatches):
            step = cegppo_update(
                logits,
                seq_states[chunk].reshape(-1),
                actions[chunk].reshape(-1),
                advantages[chunk].repeat_interleave(T),
                old_logp[chunk].reshape(-1),
                config.lr,
                beta1,
                beta2,
                config.epsilon_low,
                config.epsilon_high,
                config.delta,
            )
            logits = step["logits"]
            n1 += int(step["beta1_mask"].sum())
            n2 += int(step["beta2_mask"].sum())
            total += step["beta1_mask"].numel()
            dH1 += step["dH_beta1"]
            dH2 += step["dH_beta2"]
            dH0 += step["dH_unclipped"]
    return logits, (n1, n2, total, dH1, dH2, dH0)


@contextlib.contextmanager
def _single_thread():
    """Tabular updates are tiny: intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------------
# First-order check: one small step through the real loss vs `dH = -eta * F * A * s_a`.
# ----------------------------------------------------------------------------------------------------------------


def single_step_entropy_change(
    logits: torch.Tensor,
    action: int,
    advantage: float,
    ratio: float,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[float, float, float]:
    """Measured and predicted entropy change of one SGD step of the CE-GPPO loss on a single token.

    The token is `action` of a softmax over `logits` (1-D), with advantage `advantage` and importance ratio `ratio`
    (i.e. `pi_old(a) = pi_theta(a) / ratio`; pick `ratio < 1 - eps_low` with `A < 0` for the beta1 set,
    `ratio > 1 + eps_high` with `A > 0` for the beta2 set). Returns `(measured dH, first-order dH, weight F)`, where
    the step is `logits -= lr * grad(loss)`, the first-order value is `entropy_change_first_order(p, a, A, F, lr)`
    and `F = grad_coef / A` is the CE-GPPO gradient weight of the token (`beta1 (1 - eps_low)`, `beta2 (1 + eps_high)`
    or `ratio`).
    """
    logits = logits.to(torch.float64)
    old_logp = torch.log_softmax(logits, -1)[action] - math.log(ratio)
    step = cegppo_update(
        logits.unsqueeze(0),
        torch.tensor([0]),
        torch.tensor([action]),
        torch.tensor([advantage], dtype=torch.float64),
        old_logp.reshape(1),
        lr,
        beta1,
        beta2,
        epsilon_low,
        epsilon_high,
    )
    measured = float(softmax_entropy(step["logits"][0]) - softmax_entropy(logits))
    weight = float(step["grad_coef"][0]) / advantage
    predicted = entropy_change_first_order(torch.softmax(logits, -1), action, advantage, weight, lr)
    return measured, predicted, weight


def first_order_check(lr: float = 1e-4, seed: int = 0, num_actions: int = 8, trials: int = 64) -> dict:
    """Compare measured vs first-order entropy changes over random single-token steps in all three branches.

    Returns `{"max_rel_error", "trials", "rows": [{branch, action_prob, measured, predicted, rel_error}]}`; the
    relative error is `|measured - predicted| / |predicted|` and shrinks linearly with `lr`.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    branches = (("beta1", -1.0, 0.7), ("beta2", 1.0, 1.4), ("unclipped_pos", 1.0, 1.05), ("unclipped_neg", -1.0, 0.95))
    for trial in range(trials):
        logits = 1.5 * torch.randn(num_actions, generator=gen, dtype=torch.float64)
        action = int(torch.randint(0, num_actions, (1,), generator=gen))
        branch, sign, ratio = branches[trial % len(branches)]
        advantage = sign * (0.5 + float(torch.rand(1, generator=gen)))
        measured, predicted, weight = single_step_entropy_change(logits, action, advantage, ratio, lr, 0.5, 1.0)
        rows.append(
            {
                "branch": branch,
                "action_prob": float(torch.softmax(logits, -1)[action]),
                "weight": weight,
                "measured": measured,
                "predicted": predicted,
                "rel_error": abs(measured - predicted) / max(abs(predicted), 1e-300),
            }
        )
    return {"max_rel_error": max(r["rel_error"] for r in rows), "trials": trials, "lr": lr, "rows": rows}


# ----------------------------------------------------------------------------------------------------------------
# The demo's grid: several (beta1, beta2) settings over several seeds.
# ----------------------------------------------------------------------------------------------------------------

#: The (beta1, beta2) settings of `cegppo-demo` and docs/entropy_results.md: GRPO's gradient (0, 0), beta1-heavy
#: (1, 0.5), the paper's (0.5, 1), beta2 only (0, 1) and GPPO (1, 1).
TOY_GRID = ((0.0, 0.0), (1.0, 0.5), (0.5, 1.0), (0.0, 1.0), (1.0, 1.0))


def summarize_toy_run(run: ToyRun) -> dict:
    """What the demo reports of a toy run: ``entropy`` (the curve), ``mean_entropy`` (averaged over the run), the
    first-order entropy change carried by the beta1 set, the beta2 set and the other tokens (``dH_beta1``,
    ``dH_beta2``, ``dH_unclipped``, summed over the run), per RL step the ``measured_dH`` next to the
    ``predicted_dH`` (first order, summed over the step's updates), and the clipped sets' mean token fractions."""
    return {
        "beta1": run.beta1,
        "beta2": run.beta2,
        "seed": run.seed,
        "entropy": run.entropy,
        "mean_entropy": sum(run.entropy) / len(run.entropy),
        "dH_beta1": sum(run.dH_beta1),
        "dH_beta2": sum(run.dH_beta2),
        "dH_unclipped": sum(run.dH_unclipped),
        "measured_dH": [after - before for before, after in zip(run.entropy, run.entropy[1:])],
        "predicted_dH": [a + b + c for a, b, c in zip(run.dH_beta1, run.dH_beta2, run.dH_unclipped)],
        "beta1_token_frac": sum(run.beta1_token_frac) / len(run.beta1_token_frac),
        "beta2_token_frac": sum(run.beta2_token_frac) / len(run.beta2_token_frac),
    }


def run_toy_grid(seeds, grid=TOY_GRID, config: ToyConfig | None = None) -> list[dict]:
    """`summarize_toy_run` of `run_toy` for every (beta1, beta2) of `grid` and every seed of `seeds`."""
    return [summarize_toy_run(run_toy(beta1, beta2, seed, config)) for seed in seeds for beta1, beta2 in grid]
