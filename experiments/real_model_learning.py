"""Does RL make a real chat model better? SmolLM2-135M-Instruct on the built-in sums, on a CPU: `cegppo-compare` with
the SmolLM2 settings (docs/real_model.md), on the model built offline as the real-model tier builds it.

    pip install -e ".[real]"                                                   # peft, matplotlib, gguf
    python experiments/real_model_learning.py --out build/real-model/learning  # the committed run (docs/real_model.md)
    python experiments/real_model_learning.py --study --out build/study/smollm2  # the study's Part B (docs/comparison.md)

Any further flag is `cegppo-compare`'s and wins (e.g. ``--seeds 0 --max_steps 2``). Run it again with the same --out
to resume.
"""

from __future__ import annotations

import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.7  # at 1.0 every group of SmolLM2's sums had zero reward variance (docs/real_model.md)
MAX_NEW_TOKENS = 28  # the equation and its box fit; at 16 most boxes were cut
#: The prompt of every SmolLM2 run (the third configuration of docs/real_model.md): one worked example (a sum in
#: neither data set) before the problem, so the model writes the equation and boxes its result from the first sample.
SMOLLM2 = ["--instruction", "none", "--example_problem", "What is 12+30?", "--example_answer",
           "12 + 30 = 42. \\boxed{42}", "--temperature", str(TEMPERATURE), "--max_completion_length",
           str(MAX_NEW_TOKENS), "--use_peft", "true", "--lora_r", "16", "--learning_rate", "1e-4", "--warmup_steps",
           "0", "--rewards", "math", "--eval_problems", "200", "--jobs", "2"]  # fmt: skip
#: The committed run (README, docs/real_model.md): on-policy ratio 4, no dynamic sampling, 24 steps, avg@4.
COMMITTED = ["--arms", "cegppo", "grpo", "--seeds", "0", "1", "--max_steps", "24", "--steps_per_generation", "4",
             "--prompts_per_step", "2", "--num_generations", "8", "--dynamic_sampling", "false", "--eval_k", "4",
             "--protocols", "boxed"]  # fmt: skip
#: The study's Part B (docs/comparison.md): the paper's 8 optimizer steps per generation batch, dynamic sampling.
STUDY = ["--arms", "grpo", "cegppo", "--seeds", "0", "1", "2", "--max_steps", "48", "--steps_per_generation", "8",
         "--prompts_per_step", "2", "--num_generations", "8", "--dynamic_sampling", "true", "--oversampling", "2",
         "--eval_k", "8", "--eval_every", "16", "--protocols", "boxed", "lighteval"]  # fmt: skip


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


def settings(argv) -> list[str]:
    """`cegppo-compare`'s arguments: the SmolLM2 settings, the preset (``--study`` or the committed run), then
    `argv` (later flags win)."""
    argv = list(argv)
    preset = STUDY if "--study" in argv else COMMITTED
    return SMOLLM2 + preset + [a for a in argv if a != "--study"]


def main(argv=None) -> int:
    from cegppo_trl.comparison.settings import preflight
    from cegppo_trl.scripts.compare import main as compare
    from cegppo_trl.scripts.compare import parse

    arguments = settings(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(arguments):  # this wrapper's words (and --study), then cegppo-compare's flags
        print(__doc__)
    problems = preflight(parse(arguments))  # before the model is built: a missing extra costs seconds
    if problems:
        print("\n".join(f"real_model_learning: {p}" for p in problems), file=sys.stderr)
        return 2
    model = [] if "--model" in arguments else ["--model", smollm2_dir()]
    return compare(arguments + model)


if __name__ == "__main__":
    sys.exit(main())
