"""Does RL make a real chat model better? SmolLM2-135M-Instruct on the built-in sums, on a CPU: `cegppo-compare` with
the SmolLM2 settings (docs/real_model.md) as a recipe, on the model built offline as the real-model tier builds it.

    pip install -e ".[real]"                                                   # peft, matplotlib, gguf
    python experiments/real_model_learning.py --out build/real-model/learning  # the committed run (docs/real_model.md)
    python experiments/real_model_learning.py --study --out build/study/smollm2  # the study's Part B (docs/comparison.md)

The preset (`--study`, else the committed run) is written as a `cegppo-train` recipe in ``<out>/recipe.yaml`` plus
`cegppo-compare`'s arms, seeds and measurement; any further flag is `cegppo-compare`'s or `cegppo-train`'s and wins
(e.g. ``--seeds 0 --max_steps 2``). Run it again with the same --out to resume.

Every prompt starts with one worked example (`What is 12+30?` and `12 + 30 = 42. \\boxed{42}`, a user and an assistant
turn: the recipe's `example_problem` / `example_answer`), which every saved model carries for `cegppo-eval`.
"""

from __future__ import annotations

import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.7  # at 1.0 every group of SmolLM2's sums had zero reward variance (docs/real_model.md)
MAX_NEW_TOKENS = 28  # the equation and its box fit; at 16 most boxes were cut
#: The recipe of every SmolLM2 run (docs/real_model.md): LoRA r 16, lr 1e-4 from the first step, the math reward.
SMOLLM2 = {"dataset_name": "builtin:arithmetic", "instruction": "none", "example_problem": "What is 12+30?",
           "example_answer": "12 + 30 = 42. \\boxed{42}", "reward_funcs": ["math"],
           "temperature": TEMPERATURE, "top_p": 1.0, "max_completion_length": MAX_NEW_TOKENS, "use_peft": True,
           "lora_r": 16, "lora_alpha": 32, "lora_target_modules": ["all-linear"], "learning_rate": 1.0e-4,
           "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 0, "max_grad_norm": 1.0, "num_generations": 8,
           "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "use_cpu": True, "bf16": False,
           "dtype": "float32", "activation_checkpointing": False, "logging_steps": 1, "save_strategy": "no",
           "report_to": "none", "disable_tqdm": True, "seed": 0}  # fmt: skip
#: The committed run (README, docs/real_model.md): steps_per_generation 4, no dynamic sampling, 24 steps, avg@4.
COMMITTED = ({"max_steps": 24, "steps_per_generation": 4, "cegppo_exclude_zero_advantage_groups": False},
             ["--arms", "cegppo", "grpo", "--seeds", "0", "1", "--eval_k", "4", "--protocols", "boxed"])  # fmt: skip
#: The study's Part B (docs/comparison.md): the paper's 8 optimizer steps per generation batch, dynamic sampling.
STUDY = ({"max_steps": 48, "steps_per_generation": 8, "cegppo_exclude_zero_advantage_groups": True,
          "cegppo_oversampling": 2.0},
         ["--arms", "grpo", "cegppo", "--seeds", "0", "1", "2", "--eval_k", "8", "--protocols", "boxed", "lighteval"])  # fmt: skip
MEASURE = ["--eval_problems", "200", "--jobs", "2"]


def smollm2_dir() -> str:
    """The built SmolLM2 directory (tests/real_model/build_smollm2.py, cached); one line naming the fix if gguf is
    missing."""
    from cegppo_trl.run_checks import missing_extra

    missing = missing_extra("gguf", "real", "building SmolLM2-135M-Instruct from its GGUF file")
    if missing:
        raise SystemExit(f"real_model_learning: {missing}")
    sys.path.insert(0, str(ROOT / "tests" / "real_model"))
    from build_smollm2 import BuildError, build

    try:
        return str(build())
    except BuildError as error:
        raise SystemExit(f"real_model_learning: {error}") from None


def settings(argv) -> tuple[dict, list[str]]:
    """(the recipe, `cegppo-compare`'s arguments but --recipe): the SmolLM2 recipe with the preset (``--study`` or
    the committed run), then `argv` (later flags win)."""
    argv = list(argv)
    recipe, flags = STUDY if "--study" in argv else COMMITTED
    return {**SMOLLM2, **recipe}, flags + MEASURE + [a for a in argv if a != "--study"]


def main(argv=None) -> int:
    import yaml

    from cegppo_trl.comparison.settings import parse, preflight
    from cegppo_trl.scripts.compare import main as compare

    recipe, arguments = settings(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(arguments):  # this wrapper's words (and --study), then cegppo-compare's flags
        print(__doc__)
        return compare(["--help"])
    args = parse(["--recipe", "recipe.yaml", *arguments])
    problems = preflight(args)[:1] if args.out else []  # before the model is built: a missing extra costs seconds
    if problems and "--recipe" not in problems[0]:
        print(f"real_model_learning: {problems[0]}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    model = [] if "--model_name_or_path" in arguments else ["--model_name_or_path", smollm2_dir()]
    return compare(["--recipe", str(out / "recipe.yaml"), *arguments, *model])


if __name__ == "__main__":
    sys.exit(main())
