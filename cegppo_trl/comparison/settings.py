"""The arguments of `cegppo-compare` (a dataclass for `TrlParser`, so a YAML recipe can carry them), its arms, and the
checks made before any work."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any


TINY_MODEL = "builtin:tiny"
#: The tiny model's SFT prompt (tiny_model.PROMPT_INSTRUCTION after the problem): the default with builtin:tiny.
TINY_INSTRUCTION = "{problem} Put the final answer in \\boxed{}."
#: Named arms: (beta1, beta2, epsilon_high). GRPO is CE-GPPO with both betas 0 (the same gradient, CEGPPO.md);
#: DAPO's clip-higher is epsilon_high 0.28 (DAPO's dynamic sampling is the comparison-wide `dynamic_sampling`).
NAMED_ARMS = {"grpo": (0.0, 0.0, None), "dapo": (0.0, 0.0, 0.28), "cegppo": (0.5, 1.0, None)}
#: The fields that shape a run or a measurement: a second call with the same --out must keep them (the others choose
#: which runs to make and how to schedule them).
SCHEDULING_FIELDS = ("arms", "seeds", "jobs", "out", "config")


@dataclass(frozen=True)
class Arm:
    """One training configuration: its name in files and tables, and the values it sets."""

    name: str
    beta1: float
    beta2: float
    epsilon_high: float | None = None

    @property
    def label(self) -> str:
        if self.name in ("grpo", "dapo"):
            return self.name.upper()
        return f"CE-GPPO ({self.beta1:g}, {self.beta2:g})"


def parse_arm(text: str) -> Arm:
    """``grpo``, ``dapo``, ``cegppo`` or ``beta1,beta2`` (e.g. ``0,1``); a ValueError names the accepted forms."""
    word = text.strip().lower()
    if word in NAMED_ARMS:
        return Arm(word, *NAMED_ARMS[word])
    parts = word.split(",")
    try:
        beta1, beta2 = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--arms {text!r}: an arm is grpo, dapo, cegppo (beta1 0.5, beta2 1) or a pair beta1,beta2 such as 0,1."
        ) from None
    if min(beta1, beta2) < 0:
        raise ValueError(f"--arms {text!r}: beta1 and beta2 must be >= 0.")
    return Arm(f"b{beta1:g}-{beta2:g}", beta1, beta2)


@dataclass
class CompareArguments:
    """`cegppo-compare`'s settings; every field is also ``--name`` on the command line and a key of ``--config``."""

    model: str = field(
        default=TINY_MODEL,
        metadata={
            "help": "The start model: a local directory, a Hub id, or builtin:tiny (built and SFT-warm-started)."
        },
    )
    tiny_sft_steps: int = field(default=200, metadata={"help": "builtin:tiny: SFT warm-start steps."})
    train_dataset: str = field(
        default="builtin:arithmetic", metadata={"help": "Training problems (load_math_dataset)."}
    )
    eval_dataset: str = field(
        default="builtin:arithmetic_eval",
        metadata={
            "help": "Held-out problems (load_math_dataset); a problem also in the training set is removed there."
        },
    )
    eval_problems: int | None = field(default=None, metadata={"help": "Measure the first N held-out problems (all)."})
    instruction: str | None = field(
        default=None,
        metadata={"help": "The prompt, as cegppo-train's --instruction (default: the tiny model's with builtin:tiny, "
                  "else the paper's)."},
    )  # fmt: skip
    example_problem: str | None = field(
        default=None, metadata={"help": "A worked example before each problem (a user turn); needs --example_answer."}
    )
    example_answer: str | None = field(default=None, metadata={"help": "The example's answer (an assistant turn)."})
    arms: list[str] = field(
        default_factory=lambda: ["grpo", "cegppo"],
        metadata={"help": "grpo, dapo (clip-higher 0.28), cegppo (0.5, 1) or beta1,beta2 pairs; the first is the "
                  "reference of the between-arm differences."},
    )  # fmt: skip
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Seeds: one run per arm and seed."})
    max_steps: int = field(default=320, metadata={"help": "Optimizer steps per run."})
    steps_per_generation: int = field(
        default=8, metadata={"help": "Optimizer steps per generation batch (the paper: 8; 1 is on-policy)."}
    )
    prompts_per_step: int = field(default=16, metadata={"help": "Prompts per optimizer step."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (a group)."})
    dynamic_sampling: bool = field(
        default=True,
        metadata={"help": "Train only on groups whose rewards differ (cegppo_exclude_zero_advantage_groups)."},
    )
    oversampling: float = field(
        default=2.0, metadata={"help": "With dynamic sampling, prompts generated per prompt trained on (authors: 2)."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter (rank lora_r, alpha 2 x rank)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    learning_rate: float = field(default=1e-4, metadata={"help": "Learning rate (constant after the warm-up)."})
    warmup_steps: int = field(default=8, metadata={"help": "Linear learning-rate warm-up steps."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature in training."})
    max_completion_length: int = field(default=20, metadata={"help": "Completion tokens, training and held-out."})
    rewards: list[str] = field(default_factory=lambda: ["math"], metadata={"help": "Training rewards: math, format."})
    eval_k: int = field(default=8, metadata={"help": "Samples per held-out problem (avg@k, pass@1..k)."})
    eval_temperature: float | None = field(
        default=None, metadata={"help": "Held-out sampling temperature (default: the training temperature)."}
    )
    protocols: list[str] = field(
        default_factory=lambda: ["boxed", "lighteval"],
        metadata={"help": "Gradings of the held-out answers: the first is the training reward's, the rest check it."},
    )
    eval_every: int = field(
        default=0,
        metadata={"help": "Also measure every N optimizer steps (a multiple of steps_per_generation; 0: no)."},
    )
    jobs: int = field(default=2, metadata={"help": "Processes at once (one torch thread each)."})
    out: str = field(default="cegppo-compare-output", metadata={"help": "Output folder; run again to resume."})

    def __post_init__(self):
        self.arm_list = [parse_arm(a) for a in self.arms]  # a bad arm fails here
        names = [a.name for a in self.arm_list]
        if len(set(names)) != len(names) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--arms {self.arms} / --seeds {self.seeds}: each arm and seed once.")
        for name in ("max_steps", "steps_per_generation", "prompts_per_step", "eval_k", "jobs", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: must be at least 1.")
        if self.num_generations < 2:
            raise ValueError(f"--num_generations {self.num_generations}: a group needs at least 2 completions.")
        if self.eval_every < 0 or self.eval_every % self.steps_per_generation:
            raise ValueError(
                f"--eval_every {self.eval_every}: measure at generation-batch boundaries, a multiple of "
                f"--steps_per_generation {self.steps_per_generation} (checkpoints there resume exactly), or 0."
            )
        if (self.example_problem is None) != (self.example_answer is None):
            raise ValueError("--example_problem and --example_answer go together: pass both or neither.")
        from ..rewards.protocols import PROTOCOLS

        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown or not self.protocols:
            raise ValueError(f"--protocols {self.protocols}: each must be one of {sorted(PROTOCOLS)}.")
        bad_rewards = [r for r in self.rewards if r not in ("math", "format")]
        if bad_rewards or not self.rewards:
            raise ValueError(f"--rewards {self.rewards}: each must be math or format.")

    @property
    def eval_sampling_temperature(self) -> float:
        return self.temperature if self.eval_temperature is None else self.eval_temperature

    def shaping(self) -> dict[str, Any]:
        """The fields that shape every run and measurement (not which runs, nor how they are scheduled)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in values.items() if k not in SCHEDULING_FIELDS}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.shaping(), sort_keys=True).encode()).hexdigest()[:16]


def preflight(args: CompareArguments) -> list[str]:
    """What the comparison needs, checked before any work: each problem as one line naming the fix (empty: go)."""
    from ..run_checks import first_problem

    extras = [("matplotlib", "plot", "cegppo-compare's figure")]
    extras += [("peft", "peft", "--use_peft true (LoRA)")] if args.use_peft else []
    problems = [first_problem(extras=extras, writable=[(args.out, "--out", True)])]
    if args.model != TINY_MODEL:
        from ..model_source import resolve_model_source

        try:
            resolve_model_source(args.model)
        except (FileNotFoundError, ValueError) as error:
            problems.append(f"--model: {error}")
    return [p for p in problems if p]


def check_same_settings(args: CompareArguments, saved_path: str) -> None:
    """A second call with the same --out keeps the run-shaping settings (finished runs are reused): a ValueError
    names each field that differs."""
    if not os.path.isfile(saved_path):
        return
    with open(saved_path) as f:
        saved = json.load(f).get("shaping", {})
    now = args.shaping()
    changed = [f"--{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k]]
    if changed:
        raise ValueError(
            f"--out {args.out} holds runs made with other settings ({'; '.join(changed)}): pass another --out, or the "
            "same settings to resume (only --arms, --seeds and --jobs may change)."
        )
