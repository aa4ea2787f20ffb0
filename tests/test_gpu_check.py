"""benchmarks/gpu_check, the GPU check as one command: its refusal without a GPU, each part in process
(loss benchmark + EQ8, ERC, host-sync count), the plan of its recipe runs, the reward that splits groups, and
`python benchmarks/gpu_check --smoke` end to end as a user runs it (every part on CPU, slow); bench_scaling.py's
smallest setting."""

import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from shared import ROOT, run_checked


sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_scaling  # noqa: E402
import gpu_check  # noqa: E402
import harness  # noqa: E402
import split_reward  # noqa: E402
from gpu_check import recipes as gpu_check_recipes  # noqa: E402


SMOKE_TIMEOUT_S = 3600  # generous: 2 shared CPU cores; 109 s at a load average of ~3, 214-292 s at 7-10


@pytest.mark.parametrize("flags", [["--force-no-cuda"], []], ids=["flag", "no-cuda-visible"])
def test_gpu_check_refusal_as_a_command(flags):
    """`python benchmarks/gpu_check` without a GPU: exit 2 and one line that says why and names `--smoke`."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # torch.cuda.is_available() is False on any machine
    proc = run_checked([sys.executable, "benchmarks/gpu_check", *flags], ROOT, env, timeout=300, expect=2)
    assert proc.stderr.startswith("gpu_check: REFUSED: no CUDA GPU") and proc.stderr.count("\n") == 1, proc.stderr
    assert "--smoke" in proc.stderr and not proc.stdout


def test_every_runnable_benchmark_is_in_the_table_with_its_command():
    folder = Path(bench_scaling.__file__).parent
    readme = (folder / "README.md").read_text()
    runnable = [p.name for p in folder.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()]
    assert "bench_scaling.py" in runnable
    for name in [*runnable, "gpu_check"]:
        assert f"| `python benchmarks/{name}" in readme, name
    assert readme.count("| `python benchmarks/gpu_check") == 2  # one command, and its --smoke form


def _line(out: str, prefix: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one line starting {prefix!r}, got {lines}\n{out[-4000:]}"
    return lines[0]


def _field(line: str, name: str) -> str:
    match = re.search(rf"(?:^|\s){re.escape(name)}=(\S+)", line)
    assert match, f"no {name}= in: {line}"
    return match.group(1)


def check_loss_lines(out: str) -> None:
    """One RESULT line per loss case with positive finite ratios, and EQ8 PASS."""
    for case in ("qwen2-1.5b", "qwen2-1.5b-lora", "qwen2-7b"):
        line = _line(out, f"RESULT {case}:")
        assert "grad_ckpt=1" in line
        for name in ("step_ratio", "lb_ratio", "mem_ratio", "tok_per_s", "delta_frac"):
            value = float(_field(line, name))
            assert math.isfinite(value) and (value > 0 or name == "delta_frac"), (name, line)
    assert _line(out, "EQ8 ").startswith("EQ8 PASS")


def check_sync_line(out: str) -> None:
    """GRPO's count is positive, no CE-GPPO variant makes fewer, and every extra one is in CE-GPPO's own code."""
    line = _line(out, "RESULT sync:")
    assert line.startswith("RESULT sync: ok") and "method=python_host_reads" in line, line  # CPU; CUDA's on a GPU
    grpo = int(_field(line, "grpo"))
    assert grpo > 0, line
    for name in ("cegppo", "cegppo_entropy", "cegppo_sft"):
        assert int(_field(line, name)) >= grpo, line
        where = _line(out, f"# sync {name} beyond grpo at:")
        assert all(key.startswith("cegppo_trl/") for key in re.findall(r"'([^']+)':", where)), where


def check_erc_lines(out: str) -> None:
    """ERC on / off: positive finite ratios and some tokens outside the band; the gradient check passed."""
    line = _line(out, "RESULT erc:")
    assert 0.0 < float(_field(line, "out_frac")) < 1.0, line
    for name in ("lb_ratio", "step_ratio", "mem_ratio", "old_pass_time_ratio", "old_pass_mem_ratio"):
        value = float(_field(line, name))
        assert math.isfinite(value) and value > 0, (name, line)
    assert _line(out, "ERC ").startswith("ERC PASS"), out[-3000:]


@pytest.mark.parametrize(
    "part, check, done",
    [
        ("loss", check_loss_lines, "loss 3/3 case(s)"),
        ("erc", check_erc_lines, "erc PASS"),
        ("sync", check_sync_line, "sync"),
    ],
)
def test_gpu_check_part_on_cpu(part, check, done, capsys):
    """Each part in process at tiny shapes: loss (every case and EQ8), erc (on / off and the gradient check), sync
    (CE-GPPO's host reads next to GRPO's)."""
    rc = gpu_check.main(["--smoke", "--parts", part])
    out = capsys.readouterr().out
    assert rc == 0, out
    check(out)
    assert f"GPU_CHECK DONE ok: {done} in" in out


def test_erc_gradient_check_fails_with_a_wrong_band():
    """The ERC line's check can fail: a reference whose band is shifted does not match the trainer."""
    model = harness.build_model(harness.TINY, 1, torch.device("cpu"))
    trainers = harness.make_trainers(model, torch.device("cpu"), 32, {"base": {}, "erc": gpu_check.ERC_VARIANT})
    batch = harness.make_batch(trainers["grpo"], harness.TINY["vocab_size"], 4, 32, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    assert gpu_check.erc_gradient_check(trainers, model, params, batch)[0]
    ok, text = gpu_check.erc_gradient_check(trainers, model, params, batch, band=(0.9, 1.1))
    assert not ok and text.startswith("ERC FAIL"), text


def test_split_reward_splits_some_groups_and_leaves_others_uniform():
    """With math's -1, the total is +1 / -1 in split groups and -1 throughout the others (dynamic sampling's case)."""
    prompts = [[{"role": "user", "content": f"What is {i}+{i}?"}] for i in range(40)]
    split, uniform = 0, 0
    for prompt in prompts:
        completions = [[{"role": "assistant", "content": f"answer {j} {prompt[0]['content']}"}] for j in range(8)]
        rewards = split_reward.split_groups(completions, prompts=[prompt] * 8)
        assert set(rewards) <= {0.0, 2.0}
        if split_reward.prompt_is_split(prompt):
            split += len(set(rewards)) == 2
        else:
            uniform += set(rewards) == {0.0}
    assert split >= 10 and uniform >= 10, (split, uniform)
    assert split_reward.split_groups(["a", "b"]) == split_reward.split_groups(["a", "b"])  # deterministic


# What the recipe runs may give on the command line after --config: size and hardware, nothing else.
RECIPE_SIZE_FLAGS = {
    "model_name_or_path",
    "dataset_name",
    "problem_column",
    "answer_column",
    "reward_funcs",
    "max_completion_length",
    "max_steps",
    "output_dir",
    "gradient_accumulation_steps",
    "steps_per_generation",
}
RECIPE_HARDWARE_FLAGS = {"use_vllm", "use_cpu", "bf16", "dtype", "use_transformers_continuous_batching"}


@pytest.mark.parametrize("smoke", [True, False], ids=["smoke", "gpu"])
@pytest.mark.parametrize("run", gpu_check_recipes.RUNS, ids=lambda r: r.name)
def test_recipe_runs_launch_as_users_do_and_change_only_size_and_hardware(run, smoke, tmp_path):
    sizes = gpu_check_recipes.Sizes.for_mode(smoke)
    command = gpu_check_recipes.train_command(run, tmp_path / "m", tmp_path / "o", sizes, generation="hf")
    launch = command.index("examples/train_cegppo.py")
    assert command[1:5] == ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/single_gpu.yaml"]
    assert command[launch + 1 : launch + 3] == ["--config", str(run.recipe.relative_to(ROOT))]
    assert run.recipe.exists()
    flags = {word[2:] for word in command[launch + 3 :] if word.startswith("--")}
    assert flags <= RECIPE_SIZE_FLAGS | RECIPE_HARDWARE_FLAGS, flags - RECIPE_SIZE_FLAGS - RECIPE_HARDWARE_FLAGS
    assert ("use_cpu" in flags) == smoke and ("bf16" in flags) == smoke
    recipe = gpu_check_recipes.read_recipe(run)
    # the run keeps the recipe's off-policy structure: 8 optimizer steps per generation batch, max_steps one batch
    assert recipe["steps_per_generation"] // recipe["gradient_accumulation_steps"] == sizes.max_steps == 8
    assert recipe["cegppo_exclude_zero_advantage_groups"] is True
    assert "use_transformers_continuous_batching" not in flags and command[command.index("--use_vllm") + 1] == "false"


def test_recipe_runs_say_which_generation_replaced_vllm(tmp_path):
    run, sizes = gpu_check_recipes.RUNS[0], gpu_check_recipes.Sizes.for_mode(False)
    command = gpu_check_recipes.train_command(run, tmp_path, tmp_path, sizes, generation="continuous_batching")
    assert command[command.index("--use_transformers_continuous_batching") + 1] == "true"
    assert command[command.index("--use_vllm") + 1] == "false"
    assert "--use_vllm" not in gpu_check_recipes.train_command(run, tmp_path, tmp_path, sizes, generation="vllm")
    said = gpu_check_recipes.swaps(run, sizes, "continuous_batching")
    assert any("use_transformers_continuous_batching=true" in text for text in said), said
    assert gpu_check_recipes.generation_backend(smoke=True) == "hf"  # CPU: TRL's HF generate


def test_bench_scaling_smallest_setting(capsys):
    argv = "--tiny --points 16x2 --variants base sft entropy erc --repeats 1 --overhead-points 16x2"
    results = bench_scaling.main(argv.split())
    out = capsys.readouterr().out
    assert [r["variant"] for r in results] == ["base", "sft", "entropy", "erc"]
    for r in results:
        for key in ("lb_ratio", "step_ratio", "mem_ratio", "extra_ms", "extra_mib"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["variant"], key, r[key])  # not NaN, not inf
        for key in ("lb_ratio", "step_ratio", "mem_ratio"):
            assert r[key] > 0, (r["variant"], key, r[key])  # a CE-GPPO / GRPO ratio of two positive costs
        assert r["clipped_frac"] > 0  # the batch is off-policy: CE-GPPO has clipped tokens to act on
    assert "# worst:" in out and "variant" in out
    assert "correction backward=" in out
    erc = _line(out, "# erc/base T=16 B=2:")  # ERC on / off, and the old pass with entropies kept / dropped
    assert "old pass entropies kept/dropped" in erc


@pytest.mark.slow
def test_gpu_check_smoke_as_one_command_prints_every_part(tmp_path):
    """`python benchmarks/gpu_check --smoke`: every part on CPU, each with its line and sane values."""
    start = time.perf_counter()
    argv = [sys.executable, "benchmarks/gpu_check", "--smoke", "--workdir", tmp_path]
    out = run_checked(argv, ROOT, timeout=SMOKE_TIMEOUT_S).stdout
    check_loss_lines(out)
    check_erc_lines(out)
    check_sync_line(out)
    for name, marker in (("lora", "adapter_config.json"), ("paper", "config.json")):
        line = _line(out, f"RECIPE {name}:")
        assert line.startswith(f"RECIPE {name}: ok rc=0"), line
        assert _field(line, "steps") == "8/8", line
        saved = Path(_field(line, "saved"))
        assert (saved / marker).exists(), line
        assert 0.0 < float(_field(line, "kept_groups")) <= 1.0, line  # informative groups kept (dynamic sampling)
        assert "use_vllm=false" in line and "bf16=false" in line, line  # the CPU swaps are said
        evaluation = _line(out, f"EVAL {name}:")
        assert evaluation.startswith(f"EVAL {name}: ok rc=0"), evaluation
        assert 0.0 <= float(_field(evaluation, "accuracy")) <= 1.0, evaluation
        assert int(_field(evaluation, "problems")) == gpu_check_recipes.Sizes.for_mode(True).eval_problems
        assert Path(_field(evaluation, "report")).exists()
    assert "lora_alpha" in (tmp_path / "out_lora" / "adapter_config.json").read_text()  # LoRA stayed on
    # The comparison smoke: GRPO and CE-GPPO through cegppo-compare's accelerate launcher (2 gloo ranks on CPU),
    # each measured by cegppo-eval, the table written.
    compare = _line(out, "COMPARE:")
    assert compare.startswith("COMPARE: ok rc=0 runs=grpo-seed0,cegppo-seed0"), compare
    assert 0.0 <= float(_field(compare, "cegppo-seed0_avg")) <= 1.0 and Path(_field(compare, "table")).is_file()
    train_log = (tmp_path / "compare" / "runs" / "cegppo-seed0" / "train.log").read_text()
    assert "[default0]:" in train_log and "[default1]:" in train_log
    assert (tmp_path / "compare" / "runs" / "cegppo-seed0" / "eval-boxed.json").is_file()
    assert _line(out, "GPU_CHECK DONE ok:").endswith(" s")
    print(f"gpu_check --smoke: {time.perf_counter() - start:.0f} s")
