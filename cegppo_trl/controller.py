"""Entropy-target PI controller for CE-GPPO's beta1 / beta2 (beyond the paper; off by default).

The paper (Fig. 6) rescues a run by switching beta1 from 0 to 0.5 by hand when entropy drifts. Section 5.1 gives the
direction: a larger beta1 lowers entropy faster, a larger beta2 keeps it higher. This controller turns that into a
feedback loop. With error `e_k = target - H_k` (positive when entropy is too low):

    I_k    = clip(I_{k-1} + e_k, -I_max, I_max)        (anti-windup: the integral never runs away)
    u_k    = kp * e_k + ki * I_k
    beta1  = clip(beta1_0 - u_k, beta1_min, beta1_max)  (too little entropy -> less exploitation push)
    beta2  = clip(beta2_0 + u_k, beta2_min, beta2_max)  (too little entropy -> more exploration push)

`I_max` is chosen so that the integral term alone can traverse the widest beta range (`ki * I_max = span`), beyond
which it could only add lag. The controller is a pure function of the entropy sequence it sees, so processes that see
the same (all-reduced) entropy compute the same betas.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EntropyController:
    """PI controller state. `update(entropy)` returns the new `(beta1, beta2)`."""

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

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> EntropyController:
        return cls(**state)

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
