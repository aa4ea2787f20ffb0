"""The launch script end to end on the tiny CPU recipe: one process (the shared `tiny_recipe_run` of conftest.py,
`cegppo-train` from the installed wheel), and `examples/train_cegppo.py` on two CPU processes under each accelerate
config. Runs are 4 optimizer steps of 8 completions per process; nothing is downloaded (HF_HUB_OFFLINE=1). The first
DeepSpeed run compiles a small communication op with g++/ninja (about 25 s, cached afterwards).
"""

import pytest
from launching import assert_trained_full_model, check_logs, launcher, run_launched
from shared import ROOT, assert_trained_lora_adapter


pytestmark = pytest.mark.slow  # trains, on one and on two processes

SCRIPT = ROOT / "examples" / "train_cegppo.py"
RECIPE = ROOT / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml"
TIMEOUT_S = 900  # generous: the machine is shared; a normal run takes well under a minute


def test_single_process_builtin_tiny(tiny_recipe_run):
    out = tiny_recipe_run.out
    check_logs(out, world_size=1)
    # builtin:tiny was built in <output_dir>/tiny-init and trained from there.
    assert_trained_full_model(out, out / "tiny-init")


DYNAMIC_SAMPLING = ("--cegppo_exclude_zero_advantage_groups", "true")
# accelerate config -> what its run adds to the tiny recipe
ADDED = {
    "multi_gpu": ("--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear"),
    "zero2": DYNAMIC_SAMPLING,
    "zero3": DYNAMIC_SAMPLING,
    "fsdp2": DYNAMIC_SAMPLING,
}


@pytest.mark.parametrize("config", ADDED)
def test_two_processes(tmp_path, tiny_recipe_model_dir, config):
    """DDP with LoRA; DeepSpeed ZeRO-2 / ZeRO-3 and the FSDP2 config with dynamic sampling (the processes keep
    different numbers of rows), saving the full model. accelerate 1.16 runs an FSDP config as DDP when no GPU is
    present, so on CPU the fsdp2 case checks that the shipped config launches and trains, not FSDP2 itself.

    The ZeRO-3 case keeps the recipe's ``builtin:tiny``: the model is built (TRL's SFTTrainer warm start) inside the
    2-process DeepSpeed job, which must not pull the builder into the job's process group."""
    out = tmp_path / config
    model = [] if config == "zero3" else ["--model_name_or_path", str(tiny_recipe_model_dir)]
    train = [str(SCRIPT), "--config", str(RECIPE), "--output_dir", str(out), *model, *ADDED[config]]
    run_launched([*launcher(2, f"{config}.yaml"), *train], cwd=ROOT, timeout=TIMEOUT_S, clean=out)
    steps = check_logs(out, world_size=2)
    if config == "multi_gpu":
        return assert_trained_lora_adapter(out, tiny_recipe_model_dir)
    kept = [e["cegppo/informative_group_frac"] for e in steps if "cegppo/informative_group_frac" in e]
    assert kept and min(kept) < 1.0, f"no group was dropped, so dynamic sampling was not exercised: {kept}"
    assert_trained_full_model(out, out / "tiny-init" if config == "zero3" else tiny_recipe_model_dir)
