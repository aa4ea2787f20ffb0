"""[`EntropyController`] (beyond the paper; off by default): a PI loop on the mean token entropy that owns the betas
in force while it runs (the config keeps only the starting values), with error `e_k = target - H_k` (positive when
entropy is too low):

    I_k    = clip(I_{k-1} + e_k, -I_max, I_max)        (anti-windup)
    u_k    = kp * e_k + ki * I_k
    beta1  = clip(beta1_0 - u_k, beta1_min, beta1_max)
    beta2  = clip(beta2_0 + u_k, beta2_min, beta2_max)

Why this direction, and why `ki * I_max` equals the widest beta range: `docs/method.md`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EntropyController:
    """PI controller state (`dataclasses.asdict` is what a checkpoint holds). `update(entropy)` returns the new
    `(beta1, beta2)`."""

    target: float
    kp: float
    ki: float
    beta1_init: float
    beta2_init: float
    beta1_min: float
    beta1_max: float
    beta2_min: float
    beta2_max: float
    integral: float = 0.0
    beta1: float | None = None
    beta2: float | None = None
    last_error: float = 0.0
    num_updates: int = 0

    def __post_init__(self):
        if self.beta1 is None:
            self.beta1 = self.beta1_init
        if self.beta2 is None:
            self.beta2 = self.beta2_init

    @property
    def integral_limit(self) -> float:
        if self.ki == 0:
            return 0.0
        span = max(self.beta1_max - self.beta1_min, self.beta2_max - self.beta2_min)
        return span / self.ki

    def update(self, entropy: float) -> tuple[float, float]:
        error = self.target - entropy
        limit = self.integral_limit
        self.integral = min(max(self.integral + error, -limit), limit)
        control = self.kp * error + self.ki * self.integral
        self.beta1 = min(max(self.beta1_init - control, self.beta1_min), self.beta1_max)
        self.beta2 = min(max(self.beta2_init + control, self.beta2_min), self.beta2_max)
        self.last_error = error
        self.num_updates += 1
        return self.beta1, self.beta2

    @classmethod
    def from_config(cls, args) -> EntropyController:
        return cls(
            target=args.cegppo_entropy_target,
            kp=args.cegppo_entropy_kp,
            ki=args.cegppo_entropy_ki,
            beta1_init=args.cegppo_beta1,
            beta2_init=args.cegppo_beta2,
            beta1_min=args.cegppo_beta1_min,
            beta1_max=args.cegppo_beta1_max,
            beta2_min=args.cegppo_beta2_min,
            beta2_max=args.cegppo_beta2_max,
        )
