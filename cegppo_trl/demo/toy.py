"""An exact toy of CE-GPPO's entropy mechanics: tabular softmax policies trained with the real loss of `core.py`.

Each of `num_states` "prompts" is answered by `seq_len` tokens, each position with its own logits over `num_actions`
actions. Only the first `num_key_positions` positions decide the +1 / -1 reward; the other "filler" tokens share the
sequence's advantage without affecting it, like most tokens of an LLM's answer (`seq_len=1`: a plain bandit). One RL
step samples `group_size` sequences per prompt (the policy becomes `pi_old`), group-normalises the rewards as TRL does,
and takes `num_epochs` x `num_minibatches` SGD steps on the token mean of `cegppo_per_token_loss`; all but the first
are off-policy, so ratios leave `[1 - eps_low, 1 + eps_high]` and the beta1 / beta2 sets fill.

A tabular softmax's logit gradient is exactly `coef * (e_a - p)`, so a step changes the entropy by
`dH = -eta * F * A * s_a` up to O(eta^2) (`s_a = p_a (log p_a + H) - sum_b p_b^2 (log p_b + H)`, the paper's
section 3), and each update's change splits into the parts carried by the beta1 set, the beta2 set and the other
tokens. Everything is float64 and deterministic per seed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

import torch

from ..core import ClipParams, cegppo_per_token_loss


@dataclass
class ToyConfig:
    """One toy run. Initial logits: per position one dominant action at `init_peak`, the others `N(0, init_scale^2)`
    (a peaked, LLM-like policy); the correct set is `num_correct` random actions. SGD with learning rate `lr` on the
    token-mean loss of each mini-batch."""

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
    delta: float | None = None


#: "sequence" (the demo's toy) and "bandit": one rewarded position, no filler, the same per-token step.
TOY_PRESETS = {"sequence": ToyConfig(), "bandit": ToyConfig(seq_len=1, lr=1.0)}
#: The (beta1, beta2) grid: GRPO's gradient (0, 0), beta1-heavy (1, 0.5), the paper's (0.5, 1), (0, 1) and GPPO (1, 1).
TOY_GRID = ((0.0, 0.0), (1.0, 0.5), (0.5, 1.0), (0.0, 1.0), (1.0, 1.0))


@dataclass
class ToyRun:
    """Traces of one run: states before each step and at the end (`steps + 1`), per-step sums (`steps`)."""

    beta1: float
    beta2: float
    seed: int
    config: dict
    entropy: list[float] = field(default_factory=list)  # mean over states of H(pi(.|s))
    correct_mass: list[float] = field(default_factory=list)  # probability of the correct set at the key positions
    reward: list[float] = field(default_factory=list)
    beta1_token_frac: list[float] = field(default_factory=list)
    beta2_token_frac: list[float] = field(default_factory=list)
    dH_beta1: list[float] = field(default_factory=list)  # first-order entropy change carried by the beta1 set
    dH_beta2: list[float] = field(default_factory=list)
    dH_unclipped: list[float] = field(default_factory=list)
    key_entropy: list[float] = field(default_factory=list)  # seq_len > 1: the rewarded positions' entropy
    filler_entropy: list[float] = field(default_factory=list)  # ... and the others'


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def entropy_change_first_order(probs: torch.Tensor, action: int, advantage: float, weight: float, lr: float) -> float:
    """`dH = -lr * weight * A * s_a` of one policy-gradient step on `action` (the closed form of `s_a`)."""
    log_p = torch.log(probs)
    entropy = -(probs * log_p).sum()
    s_a = probs[action] * (log_p[action] + entropy) - (probs**2 * (log_p + entropy)).sum()
    return float(-lr * weight * advantage * s_a)


def entropy_sensitivity(probs: torch.Tensor) -> torch.Tensor:
    """`s_a` of every action by autograd, `-grad_logits H . (e_a - p)` (tests check it against the closed form)."""
    logits = torch.log(probs).detach().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(softmax_entropy(logits).sum(), logits)
    return (grad * probs).sum(-1, keepdim=True) - grad


def initial_logits(config: ToyConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    S, K = config.num_states * config.seq_len, config.num_actions
    logits = config.init_scale * torch.randn(S, K, generator=generator, dtype=torch.float64)
    dominant = torch.randint(0, K, (S,), generator=generator)
    logits[torch.arange(S), dominant] = config.init_peak
    correct = torch.zeros(S, K, dtype=torch.bool)
    for s in range(S):
        correct[s, torch.randperm(K, generator=generator)[: config.num_correct]] = True
    return logits, correct


def cegppo_update(
    logits, states, actions, advantages, old_logp, lr, beta1, beta2, eps_low=0.2, eps_high=0.2, delta=None
):
    """One SGD step of the token-mean CE-GPPO loss on `(states, actions)`: the new logits, the beta1 / beta2 masks,
    `grad_coef` and the first-order change of the mean entropy carried by each set (from `s_a` before the step)."""
    theta = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)[states, actions]
    params = ClipParams(eps_low, eps_high, beta1, beta2, delta)
    out = cegppo_per_token_loss((logp - old_logp).unsqueeze(-1), advantages.unsqueeze(-1), params)
    (grad,) = torch.autograd.grad(out.per_token_loss.mean(), theta)
    with torch.no_grad():
        s_a = entropy_sensitivity(torch.softmax(logits, dim=-1))[states, actions]
        # logits[s] += lr * grad_coef / n * (e_a - p[s])  =>  dH_mean = mean_s(-lr * grad_coef / n * s_a)
        dH = -lr * out.grad_coef.squeeze(-1) / len(actions) * s_a / logits.shape[0]
    beta1_mask, beta2_mask = out.beta1_mask.squeeze(-1), out.beta2_mask.squeeze(-1)
    return {
        "logits": (theta - lr * grad).detach(),
        "beta1_mask": beta1_mask,
        "beta2_mask": beta2_mask,
        "grad_coef": out.grad_coef.squeeze(-1),
        "dH": (float(dH[beta1_mask].sum()), float(dH[beta2_mask].sum()), float(dH[~(beta1_mask | beta2_mask)].sum())),
    }


def run_toy(beta1: float, beta2: float, seed: int = 0, config: ToyConfig | None = None) -> ToyRun:
    """Train the tabular policy with CE-GPPO (`beta1`, `beta2`). The initial policy and the sampling stream depend
    only on `seed`, so every setting of the grid starts from the same policy."""
    config = config or ToyConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # tabular updates are tiny: intra-op threads only add contention (20x slower on 2 busy cores)
    try:
        return _run_toy(beta1, beta2, seed, config)
    finally:
        torch.set_num_threads(threads)


def _run_toy(beta1: float, beta2: float, seed: int, config: ToyConfig) -> ToyRun:
    logits, correct = initial_logits(config, torch.Generator().manual_seed(10_000 + seed))
    gen = torch.Generator().manual_seed(seed)
    P, G, T = config.num_states, config.group_size, config.seq_len
    run = ToyRun(beta1=beta1, beta2=beta2, seed=seed, config=asdict(config))
    key = torch.zeros(T, dtype=torch.bool)
    key[: config.num_key_positions] = True
    key_states = key.repeat(P)

    def record_state(logits):
        H = softmax_entropy(logits)
        run.entropy.append(float(H.mean()))
        run.correct_mass.append(float((torch.softmax(logits, dim=-1) * correct).sum(-1)[key_states].mean()))
        if T > config.num_key_positions:
            run.key_entropy.append(float(H[key_states].mean()))
            run.filler_entropy.append(float(H[~key_states].mean()))

    record_state(logits)
    seq_states = torch.arange(P).repeat_interleave(G).unsqueeze(1) * T + torch.arange(T)  # (P*G, T): token t's state
    for _ in range(config.steps):
        old_logp_all = torch.log_softmax(logits, dim=-1)
        actions = torch.multinomial(old_logp_all.exp()[seq_states.reshape(-1)], 1, generator=gen).view(P * G, T)
        key_correct = correct[seq_states[:, key], actions[:, key]].all(dim=1)
        rewards = torch.where(key_correct, 1.0, -1.0).to(torch.float64).view(P, G)
        advantages = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)).reshape(-1)
        old_logp = old_logp_all[seq_states, actions]
        n1 = n2 = total = 0
        dH = [0.0, 0.0, 0.0]
        for _epoch in range(config.num_epochs):
            for chunk in torch.randperm(P * G, generator=gen).chunk(config.num_minibatches):
                step = cegppo_update(
                    logits, seq_states[chunk].reshape(-1), actions[chunk].reshape(-1),
                    advantages[chunk].repeat_interleave(T), old_logp[chunk].reshape(-1), config.lr, beta1, beta2,
                    config.epsilon_low, config.epsilon_high, config.delta,
                )  # fmt: skip
                logits = step["logits"]
                n1, n2 = n1 + int(step["beta1_mask"].sum()), n2 + int(step["beta2_mask"].sum())
                total += step["beta1_mask"].numel()
                dH = [a + b for a, b in zip(dH, step["dH"])]
        run.reward.append(float(rewards.mean()))
        run.beta1_token_frac.append(n1 / total)
        run.beta2_token_frac.append(n2 / total)
        for trace, value in zip((run.dH_beta1, run.dH_beta2, run.dH_unclipped), dH):
            trace.append(value)
        record_state(logits)
    return run


def single_step_entropy_change(logits, action, advantage, ratio, lr, beta1, beta2, eps_low=0.2, eps_high=0.2):
    """`(measured dH, first-order dH, weight F)` of one SGD step of the CE-GPPO loss on one token of a softmax over
    `logits` (1-D) with advantage `advantage` and ratio `ratio` (`pi_old(a) = pi(a) / ratio`); `F = grad_coef / A`."""
    logits = logits.to(torch.float64)
    old_logp = torch.log_softmax(logits, -1)[action] - math.log(ratio)
    step = cegppo_update(
        logits.unsqueeze(0), torch.tensor([0]), torch.tensor([action]), torch.tensor([advantage], dtype=torch.float64),
        old_logp.reshape(1), lr, beta1, beta2, eps_low, eps_high,
    )  # fmt: skip
    measured = float(softmax_entropy(step["logits"][0]) - softmax_entropy(logits))
    weight = float(step["grad_coef"][0]) / advantage
    return measured, entropy_change_first_order(torch.softmax(logits, -1), action, advantage, weight, lr), weight


def first_order_check(lr: float = 1e-4, seed: int = 0, num_actions: int = 8, trials: int = 64) -> dict:
    """Measured vs first-order entropy change over random single-token steps in the four branches:
    ``{"max_rel_error", "trials", "lr", "rows"}``; the relative error shrinks linearly with `lr`."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    branches = (("beta1", -1.0, 0.7), ("beta2", 1.0, 1.4), ("unclipped_pos", 1.0, 1.05), ("unclipped_neg", -1.0, 0.95))
    for trial in range(trials):
        logits = 1.5 * torch.randn(num_actions, generator=gen, dtype=torch.float64)
        action = int(torch.randint(0, num_actions, (1,), generator=gen))
        branch, sign, ratio = branches[trial % len(branches)]
        advantage = sign * (0.5 + float(torch.rand(1, generator=gen)))
        measured, predicted, weight = single_step_entropy_change(logits, action, advantage, ratio, lr, 0.5, 1.0)
        rel_error = abs(measured - predicted) / max(abs(predicted), 1e-300)
        rows.append({"branch": branch, "measured": measured, "predicted": predicted, "rel_error": rel_error})
    return {"max_rel_error": max(r["rel_error"] for r in rows), "trials": trials, "lr": lr, "rows": rows}


def summarize_toy_run(run: ToyRun) -> dict:
    """The demo's view of a run: the entropy curve and its mean, per-set entropy changes summed over the run, per RL
    step the measured next to the first-order predicted change, the clipped sets' mean token fractions."""
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
    return [summarize_toy_run(run_toy(beta1, beta2, seed, config)) for seed in seeds for beta1, beta2 in grid]


def toy_findings(runs: list[dict], checks: list[dict]) -> list[dict]:
    """What the toy shows, counted over the runs of `run_toy_grid` (over `TOY_GRID`) and the `first_order_check`s
    `checks` (larger lr first): ``[{"finding", "holds", "of", "numbers"}]``. The toy is exact (float64, tabular), so
    these counts are the same on every machine for the same sizes."""
    coarse, fine = checks[0], checks[-1]
    error_ratio, lr_ratio = coarse["max_rel_error"] / fine["max_rel_error"], coarse["lr"] / fine["lr"]
    correlation = min(statistics.correlation(r["measured_dH"], r["predicted_dH"]) for r in runs)
    h = {(r["beta1"], r["beta2"], r["seed"]): r["mean_entropy"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    with_b1, with_b2 = [r["dH_beta1"] for r in runs if r["beta1"] > 0], [r["dH_beta2"] for r in runs if r["beta2"] > 0]

    def vs(a, b):
        return " vs ".join(f"({x[0]:g}, {x[1]:g}) {statistics.fmean(h[(*x, s)] for s in seeds):.3f}" for x in (a, b))

    findings = [
        ("one step changes entropy by the first-order prediction -eta*F*A*s_a, the error shrinking with the step",
         int(lr_ratio / 3 < error_ratio < 3 * lr_ratio), 1, f"max relative error {coarse['max_rel_error']:.1e} at lr "
         f"{coarse['lr']:g}, {fine['max_rel_error']:.1e} at lr {fine['lr']:g}; per RL step, measured and predicted "
         f"correlate at {correlation:.3f} or more"),
        ("the beta1 set's gradient (A < 0, r < 1-eps) lowers entropy (runs with beta1 > 0)",
         sum(v < 0 for v in with_b1), len(with_b1), f"summed over a run: {min(with_b1):+.3f} to {max(with_b1):+.3f}"),
        ("the beta2 set's gradient (A > 0, r > 1+eps) raises entropy (runs with beta2 > 0)",
         sum(v > 0 for v in with_b2), len(with_b2), f"summed over a run: {min(with_b2):+.3f} to {max(with_b2):+.3f}"),
        ("larger beta1 lowers entropy: (1, 1) below (0.5, 1) (seeds)", sum(h[1, 1, s] < h[0.5, 1, s] for s in seeds),
         len(seeds), "mean entropy over the run, " + vs((1.0, 1.0), (0.5, 1.0))),
        ("larger beta2 keeps entropy higher: (1, 1) above (1, 0.5) and (0, 1) above (0, 0) (seeds)",
         sum(h[1, 1, s] > h[1, 0.5, s] and h[0, 1, s] > h[0, 0, s] for s in seeds), len(seeds),
         vs((1.0, 1.0), (1.0, 0.5)) + "; " + vs((0.0, 1.0), (0.0, 0.0))),
    ]  # fmt: skip
    return [dict(zip(("finding", "holds", "of", "numbers"), finding)) for finding in findings]
