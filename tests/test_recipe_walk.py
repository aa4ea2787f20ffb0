"""Every shipped recipe, walked (docs/launch.md, "On a CPU", says what and how): each recipe under
`recipes/` but `tiny/` runs through `accelerate launch` on 2 gloo processes with `multi_gpu.yaml` and with every config
its own header names (`single_gpu.yaml`: 1 process), with all of its own options on and only size and hardware
swapped on the command line after `--config` (`SIZE_OVERRIDES`, `HARDWARE_OVERRIDES`).

Size: the tiny model warm-started with `WALK_SFT_STEPS` SFT steps on the sums of `builtin:arithmetic`, and those sums
(in a `.jsonl`, with the tiny recipe's instruction) as the data: ~65% of 8-sample groups at temperature 1 have both
right and wrong answers, enough to fill the training batch of a recipe that over-generates 2x. Each run checks that
every other key of the recipe reached the trainer unchanged (`training_args.bin`, `model_init_kwargs`, the LoRA
adapter's config, the logged rewards); that it saved a model (or adapter) that loads and differs from the start; the
CE-GPPO metrics at both steps with the recipe's betas; and, with dynamic sampling on, that groups were dropped and
kept and `cegppo/batch_fill` is 1.0 at every step with enough informative groups (and a 2x recipe had such a step).
The walks are `slow`; the plan and the docs' launch lines are checked fast.
"""

import json
import re
import shlex
import time
from pathlib import Path

import pytest
import torch
import yaml
from doc_blocks import DOCS, code_blocks
from launching import assert_trained_full_model, launcher, logged_steps, run_launched
from shared import ROOT, assert_trained_lora_adapter, parse_train_args, recipe_id
from test_launch import ADDED as LAUNCHED_CONFIGS


SCRIPT = ROOT / "examples" / "train_cegppo.py"
RECIPES_DIR = ROOT / "recipes"
CONFIGS_DIR = ROOT / "accelerate_configs"
TINY_RECIPE = RECIPES_DIR / "tiny" / "cegppo" / "config_cpu.yaml"
TIMEOUT_S = 1800  # generous: the machine is shared; a walk took 32-105 s on a loaded 2-core machine
# Warm start and data, measured with 8 samples at temperature 1, 16 new tokens (tiny model, seed 0): 200 SFT steps (the
# demo's) on the sums give ~22% right answers and ~65% informative groups (256 prompts); 300 steps give 82% right
# and 39% informative on the sums, 22% on all of builtin:arithmetic (its differences and word problems always wrong).
# A recipe that over-generates 2x fills its training batch only when >= 50% of the groups are informative.
WALK_SFT_STEPS = 200
WALK_PROBLEMS = "sums"  # the tiny model's warm-start problems (cegppo_trl.tiny_model.PROBLEM_SETS)
WALK_SEED = 0
MAX_STEPS = 2
DATA_ROWS = 1457  # rows of the walk's data (the sums of builtin:arithmetic); test_walk_data checks it
DDP_CONFIG = "multi_gpu.yaml"
ERC_METRICS = ("cegppo/erc_low_frac", "cegppo/erc_high_frac")  # logged with cegppo_entropy_ratio_clip
DDP_PROCESSES = 2

# What the walk changes; everything else is the recipe's own value. The launcher adds `--mixed_precision no`.
SIZE_OVERRIDES = {
    "model_name_or_path": None,  # filled with the tiny model's folder
    "dataset_name": None,  # filled with the walk's data file (the sums of builtin:arithmetic), with its columns
    "problem_column": "problem",
    "answer_column": "answer",
    "instruction": yaml.safe_load(TINY_RECIPE.read_text())["instruction"],  # the tiny model's prompt format
    "max_completion_length": "16",
    "max_steps": str(MAX_STEPS),
    "output_dir": None,  # filled with a temporary folder
}
HARDWARE_OVERRIDES = {"use_vllm": "false", "bf16": "false", "dtype": "float32", "use_cpu": "true"}  # no GPU
OVERRIDES = {**SIZE_OVERRIDES, **HARDWARE_OVERRIDES}
# (accelerate config, recipe) pairs that tests/test_launch.py runs (the tiny recipe on 2 processes).
LAUNCH_TESTED = frozenset((f"{config}.yaml", "tiny/cegppo/config_cpu.yaml") for config in LAUNCHED_CONFIGS)


GPU_RECIPES = sorted(p for p in RECIPES_DIR.rglob("*.yaml") if p.relative_to(RECIPES_DIR).parts[0] != "tiny")


def _shell_commands(text: str):
    """Shell commands in `text` (backslash continuations joined, trailing `# comments` dropped)."""
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line:
            yield line


def _launch_target(command: str) -> tuple[str | None, str | None, list[str]]:
    """(accelerate config file, `--config` recipe, tokens) of an `accelerate launch` command."""
    tokens = shlex.split(command)
    tokens = tokens[tokens.index("launch") + 1 :]
    config_file = tokens[tokens.index("--config_file") + 1] if "--config_file" in tokens else None
    recipe = tokens[tokens.index("--config") + 1] if "--config" in tokens else None
    return config_file, recipe, tokens


def header_launch_configs(recipe: Path) -> list[str]:
    """The accelerate configs of the `accelerate launch` lines in the recipe's header comment, for this recipe."""
    header = "\n".join(line[1:].lstrip() for line in recipe.read_text().splitlines() if line.startswith("#"))
    configs = []
    for command in _shell_commands(header):
        if "accelerate launch" not in command:
            continue
        config_file, target, _ = _launch_target(command)
        if config_file and target and Path(target).as_posix() == f"recipes/{recipe_id(recipe)}":
            configs.append(Path(config_file).name)
    return configs


def config_processes(config: str) -> int:
    """2 processes, or 1 for a config that is one process by definition (`distributed_type: "NO"`)."""
    values = yaml.safe_load((CONFIGS_DIR / config).read_text())
    return 1 if str(values["distributed_type"]).upper() == "NO" else DDP_PROCESSES


def _walk_plan() -> list[tuple[str, str, int]]:
    plan = []
    for recipe in GPU_RECIPES:
        for config in [DDP_CONFIG, *header_launch_configs(recipe)]:
            entry = (recipe_id(recipe), config, config_processes(config))
            if entry not in plan:
                plan.append(entry)
    return plan


WALK = _walk_plan()


def _walk_id(entry) -> str:
    recipe, config, processes = entry
    return f"{recipe.removesuffix('.yaml')}@{Path(config).stem}-{processes}proc"


def override_args(model_dir, output_dir, data_file) -> list[str]:
    values = dict(
        OVERRIDES, model_name_or_path=str(model_dir), output_dir=str(output_dir), dataset_name=str(data_file)
    )
    return [item for key, value in values.items() for item in (f"--{key}", value)]


def test_walk_covers_every_gpu_recipe():
    assert GPU_RECIPES, "no GPU recipe found under recipes/"
    walked = {(recipe, config) for recipe, config, _ in WALK}
    for recipe in GPU_RECIPES:
        # Each recipe's header says how to launch it, and the walk runs that line and DDP on 2 processes.
        own = header_launch_configs(recipe)
        assert own, (
            f"{recipe_id(recipe)}: its header has no `accelerate launch ... --config recipes/{recipe_id(recipe)}` line"
        )
        for config in [DDP_CONFIG, *own]:
            assert (CONFIGS_DIR / config).is_file(), f"{recipe_id(recipe)} names a missing accelerate config {config}"
            assert (recipe_id(recipe), config) in walked
    # The CE-GPPO paper recipe (1.5B) also runs under its own ZeRO-2 config.
    assert ("DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_paper.yaml", "zero2.yaml", 2) in WALK
    assert all(processes == 2 for recipe, config, processes in WALK if config != "single_gpu.yaml")


def test_override_list_is_size_and_hardware_only():
    assert not SIZE_OVERRIDES.keys() & HARDWARE_OVERRIDES.keys()


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=recipe_id)
def test_overrides_change_only_size_and_hardware(recipe, tmp_path):
    """The walk's command line changes exactly the `OVERRIDES` fields: parsed with and without it, the three argument
    dataclasses differ nowhere else, and every other key of the recipe keeps its YAML value."""
    import dataclasses

    values = yaml.safe_load(recipe.read_text())
    as_shipped = parse_train_args("--config", recipe)  # with `--use_cpu true`, as the walk's hardware swap has it
    walked = parse_train_args("--config", recipe, *override_args(tmp_path / "m", tmp_path / "o", tmp_path / "w.jsonl"))
    changed = set()
    for ours, theirs in zip(as_shipped, walked):
        a, b = dataclasses.asdict(ours), dataclasses.asdict(theirs)
        changed |= {k for k in a if a[k] != b[k]}
        for key, value in values.items():
            if key in a and key not in OVERRIDES:
                assert _same(getattr(theirs, key), value), f"{key}: recipe {value!r}, walked {getattr(theirs, key)!r}"
    assert changed <= set(OVERRIDES), f"the walk changes {sorted(changed - set(OVERRIDES))}, not in OVERRIDES"
    # Every size / hardware key the recipe sets to something else is overridden.
    assert {k for k in OVERRIDES if k in values} <= changed | {"use_cpu"}


def _same(actual, expected) -> bool:
    """A parsed / saved argument equals the recipe's YAML value (enums by value; `report_to: none` is [])."""
    if hasattr(actual, "value") and not isinstance(actual, (int, float, bool)):
        actual = actual.value
    if expected == "none" and actual in ([], "none", ["none"]):
        return True
    if isinstance(actual, tuple):
        actual = list(actual)
    return actual == expected


def test_doc_launch_lines_use_a_walked_config_and_recipe():
    """Every `accelerate launch` of a shell block of the docs, skipped blocks too."""
    walked = {(config, recipe) for recipe, config, _ in WALK} | LAUNCH_TESTED
    blocks = [b for doc in DOCS for b in code_blocks(doc) if b.lang in ("", "bash", "sh", "shell", "console")]
    lines = [
        (b.doc.name, c) for b in blocks for c in _shell_commands(b.body) if re.search(r"\baccelerate launch\b", c)
    ]
    assert len({doc for doc, _ in lines}) >= 2 and len(lines) >= 5, lines  # README.md and docs/launch.md at least
    for doc, command in lines:
        config_file, recipe, tokens = _launch_target(command)
        assert config_file and recipe, f"{doc}: `{command}` needs --config_file and --config"
        assert config_file.startswith("accelerate_configs/") and recipe.startswith("recipes/"), f"{doc}: `{command}`"
        assert str(SCRIPT.relative_to(ROOT)) in tokens or "cegppo_trl.scripts.train" in tokens, f"{doc}: `{command}`"
        pair = (Path(config_file).name, recipe.removeprefix("recipes/"))
        assert pair in walked, f"{doc}: `{command}` launches {pair}, which neither the walk nor test_launch runs"


def write_walk_data(path: Path) -> Path:
    """The walk's data set: the `WALK_PROBLEMS` rows of builtin:arithmetic, as a `.jsonl` with `problem` / `answer`."""
    from cegppo_trl.data import write_jsonl
    from cegppo_trl.tiny_model import load_rows

    write_jsonl(load_rows("builtin:arithmetic", problems=WALK_PROBLEMS), path)
    return path


def test_walk_data(tmp_path):
    """The walk's data file loads as the walk loads it: `DATA_ROWS` sums in the tiny model's prompt format."""
    from cegppo_trl.data import load_math_dataset

    data = load_math_dataset(str(write_walk_data(tmp_path / "walk.jsonl")), problem_column="problem",
                             answer_column="answer", instruction=OVERRIDES["instruction"])  # fmt: skip
    assert len(data) == DATA_ROWS
    assert all(re.fullmatch(r"What is \d+\+\d+\? Put the final answer in \\boxed\{\}\.", row["prompt"][-1]["content"])
               for row in data), data[0]  # fmt: skip


@pytest.fixture(scope="module")
def walk_data_file(tmp_path_factory):
    return write_walk_data(tmp_path_factory.mktemp("walk-data") / "walk.jsonl")


@pytest.fixture(scope="module")
def walk_model_dir(tmp_path_factory):
    """The tiny model, warm-started for `WALK_SFT_STEPS` steps (how `builtin:tiny` builds it), built once."""
    from cegppo_trl.tiny_model import materialize_tiny

    path = tmp_path_factory.mktemp("walk-model") / "tiny"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared 2-core machine: 1 thread is faster
    try:
        materialize_tiny(str(path), seed=WALK_SEED, sft_steps=WALK_SFT_STEPS)
    finally:
        torch.set_num_threads(threads)
    return path


def _launch(recipe: Path, config: str, processes: int, model_dir: Path, data_file: Path, output_dir: Path) -> float:
    cmd = [*launcher(processes, config), str(SCRIPT), "--config", str(recipe)]
    cmd += override_args(model_dir, output_dir, data_file)
    start = time.perf_counter()
    run_launched(cmd, cwd=ROOT, timeout=TIMEOUT_S, clean=output_dir)
    return time.perf_counter() - start


def _check_logs(output_dir: Path, values: dict, processes: int):
    steps = logged_steps(output_dir, MAX_STEPS)
    controller = values.get("cegppo_entropy_target") is not None
    for entry in steps:
        if not controller:
            assert entry["cegppo/beta1"] == values.get("cegppo_beta1", 0.5)
            assert entry["cegppo/beta2"] == values.get("cegppo_beta2", 1.0)
    erc = values.get("cegppo_entropy_ratio_clip") is not None
    # Entropy-ratio clipping's metrics, exactly when the recipe turns it on (their values: tests/test_erc_trainer.py;
    # at the recipes' lr 1e-6 two steps barely move the entropy, so here they are only shares).
    for entry in steps:
        shares = [entry.get(m) for m in ERC_METRICS]
        if erc:
            assert all(v is not None and 0.0 <= v <= 1.0 for v in shares), (entry["step"], shares)
        else:
            assert shares == [None, None], (entry["step"], shares)
    first = steps[0]  # the step that generated the batch
    # The reward the recipe names, with its values: math's correct / wrong rewards give reward = c*acc + w*(1-acc).
    rewards = values.get("reward_funcs", ["math"])
    for name in rewards:
        assert f"rewards/{name}_reward/mean" in first, f"no {name} reward logged"
    if rewards == ["math"] and values.get("unparseable_reward") is None:
        accuracy = first["math_reward/accuracy"]
        correct, wrong = values.get("correct_reward", 1.0), values.get("wrong_reward", -1.0)
        assert first["reward"] == pytest.approx(correct * accuracy + wrong * (1 - accuracy), abs=1e-5)
    per_device = values.get("per_device_train_batch_size", 8)
    accumulation = values.get("gradient_accumulation_steps", 1)
    generations = values.get("num_generations", 8)
    per_generation = values.get("steps_per_generation", accumulation)
    oversampling = values.get("cegppo_oversampling", 1.0)
    trained_prompts = per_device * processes * per_generation // generations  # the training batch
    if values.get("cegppo_exclude_zero_advantage_groups"):
        full_steps = _check_dynamic_sampling(steps, trained_prompts, oversampling)
        if oversampling >= 2.0:  # the authors' setting: the walk's data is informative enough to fill the batch
            assert full_steps, f"no step had {trained_prompts} informative groups: batch_fill 1.0 was never checked"
    else:
        assert "cegppo/informative_group_frac" not in first and "cegppo/batch_fill" not in first
    assert any(e["grad_norm"] > 0 for e in steps), "zero gradient at every step"
    # The recipe's batch keys, the number of processes and the over-generation set how far into the data set the run
    # got: a generation batch samples `cegppo_oversampling` times the prompts it trains on.
    prompts_per_step = round(per_device * processes * accumulation // generations * oversampling)
    prompts_per_batch = round(trained_prompts * oversampling)
    epoch_rows = DATA_ROWS // prompts_per_batch * prompts_per_batch
    assert steps[-1]["epoch"] == pytest.approx(MAX_STEPS * prompts_per_step / epoch_rows, rel=1e-3)


def _check_dynamic_sampling(steps: list[dict], trained_prompts: int, oversampling: float) -> list[int]:
    """The groups generated, kept and trained on, from the logs: the first informative groups fill the training batch,
    and every optimizer step is full (`cegppo/batch_fill` 1.0) whenever enough groups were informative. Returns the
    steps that had enough (checked full)."""
    full_steps = []
    generated = round(trained_prompts * oversampling)
    first = steps[0]  # the step that generated the batch
    # Dynamic sampling ran and had something to do: some groups were dropped, others kept.
    assert 0.0 < first["cegppo/informative_group_frac"] < 1.0, first["cegppo/informative_group_frac"]
    for entry in steps:
        informative = entry["cegppo/informative_groups"]
        assert informative == pytest.approx(first["cegppo/informative_group_frac"] * generated)
        assert entry["cegppo/groups_trained"] == min(informative, trained_prompts)
        if informative >= trained_prompts:
            assert entry["cegppo/batch_fill"] == 1.0, (entry["step"], informative, trained_prompts)
            full_steps.append(entry["step"])
        else:
            assert 0.0 <= entry["cegppo/batch_fill"] <= 1.0
    print(f"informative groups {first['cegppo/informative_groups']:g} of {generated} generated, "
          f"training batch {trained_prompts}, batch_fill {[e['cegppo/batch_fill'] for e in steps]}")  # fmt: skip
    return full_steps


def _check_training_args(output_dir: Path, values: dict):
    """Every CEGPPOConfig key of the recipe reached the trainer with the recipe's value, unless overridden."""
    args = torch.load(output_dir / "training_args.bin", weights_only=False)
    overridden = dict(OVERRIDES, output_dir=str(output_dir))
    checked = 0
    for key, value in values.items():
        if not hasattr(args, key) or key in overridden:
            continue
        assert _same(getattr(args, key), value), f"{key}: recipe {value!r}, trainer {getattr(args, key)!r}"
        checked += 1
    assert checked >= 20, f"only {checked} recipe keys are trainer arguments"
    assert args.max_steps == MAX_STEPS and not args.use_vllm and not args.bf16 and args.use_cpu
    # trl.ModelConfig keys travel in model_init_kwargs.
    init = args.model_init_kwargs
    assert init["dtype"] == "float32"
    assert init["attn_implementation"] == values.get("attn_implementation")


def _check_saved_model(output_dir: Path, values: dict, model_dir: Path):
    if not values.get("use_peft"):
        return assert_trained_full_model(output_dir, model_dir)
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter["r"] == values["lora_r"] and adapter["lora_alpha"] == values["lora_alpha"]
    assert adapter["lora_dropout"] == values.get("lora_dropout", 0.05)
    if values.get("lora_target_modules") == "all-linear":
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir)
        linear = {
            name.rsplit(".", 1)[-1]
            for name, module in base.named_modules()
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name
        }
        assert set(adapter["target_modules"]) == linear
    assert_trained_lora_adapter(output_dir, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "config", "processes"), WALK, ids=[_walk_id(e) for e in WALK])
def test_recipe_walk(recipe, config, processes, walk_model_dir, walk_data_file, tmp_path):
    if yaml.safe_load((CONFIGS_DIR / config).read_text()).get("distributed_type") == "DEEPSPEED":
        pytest.importorskip("deepspeed", reason=f"{config} needs DeepSpeed (pip install -e '.[deepspeed]')")
    if yaml.safe_load((RECIPES_DIR / recipe).read_text()).get("use_peft"):
        pytest.importorskip("peft", reason=f"{recipe} needs peft (pip install -e '.[peft]')")
    path = RECIPES_DIR / recipe
    values = yaml.safe_load(path.read_text())
    out = tmp_path / "out"
    seconds = _launch(path, config, processes, walk_model_dir, walk_data_file, out)
    print(f"\nwalk {_walk_id((recipe, config, processes))}: {seconds:.1f} s")
    _check_logs(out, values, processes)
    _check_training_args(out, values)
    _check_saved_model(out, values, walk_model_dir)
