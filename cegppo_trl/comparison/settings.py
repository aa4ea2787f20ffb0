"""What `cegppo-compare` is told: its own flags (the arms, seeds, launcher, measurement), the user's recipe with the
`cegppo-train` flags that override it, the arms, and the checks made before any work."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any


#: Named arms: (beta1, beta2, epsilon_high). GRPO is CE-GPPO with both betas 0 (the same gradient, CEGPPO.md);
#: DAPO's clip-higher is epsilon_high 0.28 (its dynamic sampling is the recipe's).
NAMED_ARMS = {"grpo": (0.0, 0.0, None), "dapo": (0.0, 0.0, 0.28), "cegppo": (0.5, 1.0, None)}
#: `cegppo-train` flags each run sets itself: an override of one would make the arms or seeds the same.
RUN_FLAGS = ("config", "cegppo_beta1", "cegppo_beta2", "seed", "output_dir", "resume_from_checkpoint")
LAUNCHERS = ("local", "accelerate", "slurm")


@dataclass(frozen=True)
class Arm:
    """One training configuration: its name in folders and tables, and the values it sets."""

    name: str
    beta1: float
    beta2: float
    epsilon_high: float | None = None

    @property
    def label(self) -> str:
        if self.name in ("grpo", "dapo"):
            return self.name.upper()
        return f"CE-GPPO ({self.beta1:g}, {self.beta2:g})"

    def flags(self) -> list[str]:
        """The `cegppo-train` flags of this arm: its betas, and clip-higher for DAPO."""
        extra = [] if self.epsilon_high is None else ["--epsilon_high", f"{self.epsilon_high:g}"]
        return ["--cegppo_beta1", f"{self.beta1:g}", "--cegppo_beta2", f"{self.beta2:g}", *extra]


def parse_arm(text: str) -> Arm:
    """``grpo``, ``dapo``, ``cegppo`` or ``beta1,beta2`` (e.g. ``0,1``); a ValueError names the accepted forms."""
    word = text.strip().lower()
    if word in NAMED_ARMS:
        return Arm(word, *NAMED_ARMS[word])
    try:
        beta1, beta2 = (float(p) for p in word.split(","))
    except ValueError:
        raise ValueError(
            f"--arms {text!r}: an arm is grpo, dapo, cegppo (beta1 0.5, beta2 1) or a pair beta1,beta2 such as 0,1."
        ) from None
    if min(beta1, beta2) < 0:
        raise ValueError(f"--arms {text!r}: beta1 and beta2 must be >= 0.")
    return Arm(f"b{beta1:g}-{beta2:g}", beta1, beta2)


def threads_per_process(processes_at_once: int) -> int:
    """The one thread policy (cegppo-compare's processes, cegppo-demo): the cores that other jobs leave idle (by the
    last minute's load average) shared out, at least one each. Two threads on one busy core spin against the other
    job and run several times slower (NOTES); 1 or 2 threads give the same figures."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    idle = max(1, cores - round(os.getloadavg()[0]))
    return max(1, idle // max(1, processes_at_once))


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's documented hook: a ValueError, printed as one line by main
        raise ValueError(f"{message} (`cegppo-compare --help` lists the options)")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="cegppo-compare", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --recipe RECIPE.yaml [--arms ARM ...] [--seeds N ...] [--launcher local|accelerate|slurm] "
        "[options] [cegppo-train flags ...]\n       %(prog)s --report_only --out DIR",
        description="Train each arm of a recipe for each seed with cegppo-train, measure every model (the start "
        "model too) with cegppo-eval, and compare them with paired statistics (docs/comparison.md). Flags this "
        "command does not know are cegppo-train's and override the recipe for every run, e.g. --max_steps 8.",
    )  # fmt: skip
    add = parser.add_argument
    add("--recipe", help="any file cegppo-train --config takes, e.g. recipes/tiny/cegppo/config_cpu.yaml")
    add(
        "--arms",
        nargs="+",
        default=["grpo", "cegppo"],
        help="grpo, dapo (clip-higher 0.28), cegppo (0.5, 1) or beta1,beta2 pairs; the first is the reference",
    )
    add("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one run per arm and seed")
    add("--out", default="cegppo-compare-output", help="output folder; run the same command again to resume")
    add(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="local: several runs at once on this machine; accelerate: each run on --num_processes processes, one "
        "after another; slurm: each run a train.slurm job, its measurement an evaluate.slurm job after it",
    )
    add("--jobs", type=int, default=2, help="local: runs at once")
    add(
        "--accelerate_config",
        default="multi_gpu",
        help="accelerate / slurm: multi_gpu, zero2, zero3, fsdp2 or the path of an accelerate config",
    )
    add(
        "--num_processes",
        type=int,
        default=None,
        help="accelerate: processes per run (default: the config's); slurm: processes per node",
    )
    add("--nodes", type=int, default=1, help="slurm: nodes per training job")
    add("--sbatch_args", default="", help="slurm: more sbatch options for every job, e.g. '--partition gpu'")
    add("--dry_run", action="store_true", help="print every command instead of running it")
    add("--report_only", action="store_true", help="only rebuild the table, JSON and figure from the run folders")
    add("--eval_datasets", nargs="+", default=["builtin:arithmetic_eval"], help="cegppo-eval --datasets")
    add("--eval_k", type=int, default=8, help="samples per held-out problem (avg@k, pass@k)")
    add("--eval_problems", type=int, default=None, help="measure the first N problems of each set (all)")
    add(
        "--protocols",
        nargs="+",
        default=["boxed"],
        help="gradings (cegppo-eval --protocol), one measurement each; the first is the main one",
    )
    add(
        "--eval_preset",
        choices=("paper",),
        default=None,
        help="cegppo-eval --preset: its data sets, k and sampling instead of the recipe's sampling",
    )
    add("--eval_backend", choices=("hf", "vllm"), default="hf", help="cegppo-eval --backend")
    add("--eval_args", default="", help="more cegppo-eval flags for every measurement, e.g. '--batch_size 16'")
    return parser  # fmt: skip


@dataclass
class CompareArguments:
    recipe: str | None
    arms: list[str]
    seeds: list[int]
    out: str
    launcher: str
    jobs: int
    accelerate_config: str
    num_processes: int | None
    nodes: int
    sbatch_args: str
    dry_run: bool
    report_only: bool
    eval_datasets: list[str]
    eval_k: int
    eval_problems: int | None
    protocols: list[str]
    eval_preset: str | None
    eval_backend: str
    eval_args: str
    train_flags: list[str]

    def __post_init__(self):
        self.arm_list = [parse_arm(a) for a in self.arms]  # a bad arm fails here
        names = [a.name for a in self.arm_list]
        if len(set(names)) != len(names) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--arms {self.arms} / --seeds {self.seeds}: each arm and seed once.")
        for name in ("jobs", "eval_k", "nodes", "eval_problems", "num_processes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: must be at least 1.")
        from ..rewards.protocols import PROTOCOLS

        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown:
            raise ValueError(f"--protocols {unknown[0]!r}: each must be one of {', '.join(sorted(PROTOCOLS))}.")
        owned = [
            f for f in self.train_flags if f.startswith("--") and f[2:].split("=")[0].replace("-", "_") in RUN_FLAGS
        ]
        if owned:
            raise ValueError(f"{owned[0]}: each run sets it (the arm its betas, the seed its seed and folder); "
                             "put the value in the recipe or leave it out.")  # fmt: skip
        if not self.report_only and not self.recipe:
            raise ValueError("--recipe is required: any file cegppo-train --config takes, e.g. "
                             "recipes/tiny/cegppo/config_cpu.yaml.")  # fmt: skip

    def shaping(self, recipe_text: str) -> dict[str, Any]:
        """What shapes every run and measurement (not which runs, nor how they are launched): the recipe's text, the
        cegppo-train overrides and the measurement. A second call with the same --out must keep them."""
        return {"recipe_sha256": hashlib.sha256(recipe_text.encode()).hexdigest()[:16], "train_flags": self.train_flags,
                **{k: getattr(self, k) for k in ("eval_datasets", "eval_k", "eval_problems", "protocols",
                                                   "eval_preset", "eval_backend", "eval_args")}}  # fmt: skip


def parse(argv) -> CompareArguments:
    """The command line: this command's flags, the rest `cegppo-train`'s (a ValueError is the one line to print)."""
    known, rest = build_parser().parse_known_args(argv)
    return CompareArguments(**vars(known), train_flags=rest)


def preflight(args: CompareArguments) -> list[str]:
    """What the comparison needs, checked before any work: each problem as one line naming the fix (empty: go)."""
    from ..resources import resolve_shipped_path
    from ..run_checks import first_problem

    problems = [first_problem(extras=[("matplotlib", "plot", "cegppo-compare's figure")],
                              writable=[(args.out, "--out", True)])]  # fmt: skip
    if args.report_only:
        return [p for p in problems if p]
    try:
        args.recipe = os.path.abspath(resolve_shipped_path(args.recipe))
    except FileNotFoundError:
        problems.append(f"--recipe {args.recipe}: no such file (`cegppo-recipes --list` lists the shipped ones).")
    if args.launcher != "local":
        try:
            args.accelerate_config = accelerate_config_path(args.accelerate_config)
        except FileNotFoundError:
            problems.append(f"--accelerate_config {args.accelerate_config}: no such file; pass multi_gpu, zero2, "
                            "zero3, fsdp2 or the path of an accelerate config.")  # fmt: skip
    if args.launcher == "slurm" and not args.dry_run and shutil.which("sbatch") is None:
        problems.append("--launcher slurm: sbatch is not on the PATH; run on a SLURM login node, or add --dry_run to "
                        "print the commands.")  # fmt: skip
    return [p for p in problems if p]


def accelerate_config_path(name: str) -> str:
    from ..resources import resolve_shipped_path

    if "/" not in name and not name.endswith(".yaml"):
        name = f"accelerate_configs/{name}.yaml"
    return os.path.abspath(resolve_shipped_path(name))


def check_model(model: str) -> str | None:
    """A start model that cannot be found, as one line (None: found, or built here)."""
    if model == "builtin:tiny":
        return None
    from ..model_source import resolve_model_source

    try:
        resolve_model_source(model)
    except (FileNotFoundError, ValueError) as error:
        return f"model_name_or_path {model}: {error}"
    return None


def check_same_settings(shaping: dict[str, Any], saved_path: Path) -> None:
    """A second call with the same --out keeps the run-shaping settings (finished runs are reused): a ValueError
    names each one that differs."""
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text()).get("shaping", {})
    changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in shaping.items() if saved.get(k) != v]
    if changed:
        raise ValueError(
            f"--out {saved_path.parent} holds a comparison with other settings ({'; '.join(changed)}): pass another "
            "--out, or the same recipe, overrides and measurement to resume (--arms, --seeds and the launcher may "
            "change)."
        )
