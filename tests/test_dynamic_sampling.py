"""Dynamic sampling (`cegppo_exclude_zero_advantage_groups`) on one and on two processes equals physical removal.

The meaning checked (docs/method.md, "Dynamic sampling"): dropping a group is deleting its rows from the micro-batches
they landed in; a (process, micro-batch) pair left with no rows is absent, so the optimizer step averages over the
pairs that kept rows, and a micro-batch left empty on every process logs no metrics. dapo's token mean and the SFT term
count the kept tokens of the generation batch.

`dynamic_sampling_worker.py` trains two optimizer steps (one generation batch, off-policy: both clipped sets are
populated) with plain SGD, so that any change of scale moves the parameters, and records every micro-batch before
the drop. The reference here replays the same micro-batches on one process through `CEGPPOTrainer` with the option
off: the dropped rows sliced away by the test, empty pairs skipped, the step's accumulation set to the number of
pairs that kept rows, then the same SGD step. Every supported loss type, at token and sequence level, with KL, the
entropy bonus, the SFT term and the entropy controller on, under DDP (every loss type) and under the shipped
DeepSpeed ZeRO-2 / ZeRO-3 accelerate configs (grpo and dapo). FSDP2 is not checked here: accelerate 1.16 runs an FSDP
config as DDP on a CPU-only machine. The rewards fix which groups are dropped independently of
the sampled text, and the test asserts that the runs cover: processes keeping different numbers of rows, a process
keeping none, and a micro-batch left empty on every process.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import free_port, subprocess_env


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dynamic_sampling_worker import make_config, make_dataset, position_reward  # noqa: E402
from test_edges import select_rows  # noqa: E402


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
OPTIONS = dict(beta=0.05, entropy_coef=0.02, cegppo_sft_coef=0.1, cegppo_entropy_target=1.5)
# 8 prompts on 2 processes: each process's generation batch holds 4 whole groups (4 rows each).
ONE_KEPT_OF_8 = ["flat", "flat", "flat", "varied", "flat", "flat", "flat", "flat"]  # a process keeps nothing
THREE_KEPT_OF_8 = ["varied", "flat", "varied", "flat", "flat", "varied", "flat", "flat"]  # unequal counts
ONE_KEPT_OF_4 = ["flat", "varied", "flat", "flat"]  # 1 process: empty micro-batches
METRICS_SUMMED = (
    "entropy",
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
    "cegppo/quadrant/neg_low/token_frac",
)
TIMEOUT_S = 1800


def _scenarios(world: int, loss_types=LOSS_TYPES) -> list[dict]:
    scenarios = []
    for loss_type in loss_types:
        for level in ("token", "sequence"):
            if world == 1:
                kinds = ONE_KEPT_OF_4
            else:
                kinds = ONE_KEPT_OF_8 if level == "token" else THREE_KEPT_OF_8
            config = dict(OPTIONS, loss_type=loss_type, importance_sampling_level=level)
            scenarios.append({"name": f"{loss_type}-{level}", "kinds": kinds, "config": config})
    return scenarios


def _launch(world: int, backend: str, scenarios: list[dict], model_dir: Path, out_dir: Path) -> None:
    scenarios_file = out_dir / "scenarios.json"
    scenarios_file.write_text(json.dumps(scenarios))
    worker = [str(HERE / "dynamic_sampling_worker.py"), str(model_dir), str(out_dir), str(scenarios_file)]
    if world == 1:
        cmd = [sys.executable, *worker]
    elif backend == "ddp":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
            "--master_port", str(free_port()), *worker,
        ]  # fmt: skip
    else:  # the shipped accelerate config, as the recipes launch it
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(HERE.parent / "accelerate_configs" / f"{backend}.yaml"),
            "--num_processes", str(world), "--mixed_precision", "no", "--main_process_port", str(free_port()),
            *worker,
        ]  # fmt: skip
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"worker failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _kept_rows(batch: dict) -> list[int]:
    return batch["cegppo_keep"].nonzero().squeeze(1).tolist()


def _replay(model_dir: Path, scenario: dict, records: list[list[dict]], tmp_path: Path):
    """The physically filtered run: returns (parameter updates per optimizer step, expected metrics per step)."""
    from cegppo_trl import CEGPPOTrainer

    args = make_config(tmp_path / "reference" / scenario["name"], scenario, exclude=False)
    reference = CEGPPOTrainer(
        model=str(model_dir), reward_funcs=position_reward, args=args, train_dataset=make_dataset(scenario)
    )
    model = reference.model
    model.train()
    params = dict(model.named_parameters())
    accumulation, per_generation = args.gradient_accumulation_steps, args.steps_per_generation
    num_steps = per_generation // accumulation
    all_batches = [batch for rank in records for batch in rank]
    # The generation batch's kept tokens and SFT tokens on all processes, counted here from the masks.
    kept_tokens = sum((b["completion_mask"] * b["cegppo_keep"].unsqueeze(1)).sum() for b in all_batches)
    sft_tokens = sum((b["completion_mask"] * b["cegppo_sft_mask"].unsqueeze(1)).sum() for b in all_batches)
    for batch in all_batches:
        assert batch["num_items_in_batch"] == kept_tokens
        assert batch["cegppo_num_sft_tokens"] == sft_tokens
        assert not (batch["cegppo_sft_mask"].bool() & ~batch["cegppo_keep"].bool()).any()

    updates, expected_metrics = [], []
    for step in range(num_steps):
        micro_batches = range(step * accumulation, (step + 1) * accumulation)
        pairs = [(rank, m) for m in micro_batches for rank in range(len(records)) if _kept_rows(records[rank][m])]
        before = {n: p.detach().clone() for n, p in params.items()}
        model.zero_grad()
        # A step's dapo / SFT normaliser in TRL 1.16: the generation batch's tokens / optimizer steps per generation.
        reference.current_gradient_accumulation_steps = len(pairs)
        reference.args.steps_per_generation = len(pairs)
        sums = {m: {name: [0.0, 0.0] for name in METRICS_SUMMED} for m in micro_batches}
        extremes = {m: {"clip_ratio/low_min": [], "clip_ratio/high_max": []} for m in micro_batches}
        for i, (rank, m) in enumerate(pairs):
            batch = select_rows(records[rank][m], _kept_rows(records[rank][m]))
            batch.pop("cegppo_keep")
            batch["num_items_in_batch"] = kept_tokens / num_steps
            batch["cegppo_num_sft_tokens"] = sft_tokens / num_steps
            reference.accelerator.gradient_state._set_sync_gradients(i == len(pairs) - 1)
            reference._compute_loss(model, batch).backward()
            tokens = batch["completion_mask"].sum().item()
            logged = reference._metrics["train"]
            for name in METRICS_SUMMED:
                sums[m][name][0] += logged[name][-1] * tokens
                sums[m][name][1] += tokens
            for name in extremes[m]:
                extremes[m][name].append(logged[name][-1])
        with torch.no_grad():
            for p in params.values():
                if p.grad is not None:
                    p -= args.learning_rate * p.grad
        updates.append({n: params[n].detach() - before[n] for n in params})
        expected = {name: [] for name in (*METRICS_SUMMED, "clip_ratio/low_min", "clip_ratio/high_max")}
        for m in micro_batches:
            if not extremes[m]["clip_ratio/low_min"]:
                continue  # empty on every process: absent, no metrics
            for name in METRICS_SUMMED:
                expected[name].append(sums[m][name][0] / sums[m][name][1])
            expected["clip_ratio/low_min"].append(min(extremes[m]["clip_ratio/low_min"]))
            expected["clip_ratio/high_max"].append(max(extremes[m]["clip_ratio/high_max"]))
        expected_metrics.append(expected)
    betas = [reference.clip_params.beta1, reference.clip_params.beta2]
    return {n: p.detach().clone() for n, p in params.items()}, expected_metrics, betas


def _coverage(records: list[list[dict]]) -> set[str]:
    seen = set()
    per_rank = [sum(len(_kept_rows(b)) for b in rank) for rank in records]
    if len(set(per_rank)) > 1:
        seen.add("processes keep different numbers of rows")
    if 0 in per_rank:
        seen.add("a process keeps no row")
    for m in range(len(records[0])):
        if not any(_kept_rows(rank[m]) for rank in records):
            seen.add("a micro-batch is empty on every process")
        elif not all(_kept_rows(rank[m]) for rank in records):
            seen.add("a micro-batch is empty on some processes only")
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, backend, loss_types",
    [
        (1, "single", LOSS_TYPES),
        (2, "ddp", LOSS_TYPES),
        # Sharded: the same check on two loss types (one normalised per micro-batch, one per token), every option on.
        (2, "zero2", ("grpo", "dapo")),
        (2, "zero3", ("grpo", "dapo")),
        # Not fsdp2.yaml: accelerate 1.16 runs FSDP configs as DDP on CPU, so it would test DDP again.
    ],
)
def test_dynamic_sampling_equals_physical_removal(world, backend, loss_types, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    if backend.startswith("zero"):
        pytest.importorskip("deepspeed", reason="the `deepspeed` extra is not installed")
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_checkpoint).named_parameters())
    scenarios = _scenarios(world, loss_types)
    _launch(world, backend, scenarios, tiny_checkpoint, tmp_path)
    covered = set()
    for scenario in scenarios:
        ranks = [torch.load(tmp_path / f"{scenario['name']}.rank{r}.pt", weights_only=False) for r in range(world)]
        records = [r["recorded"] for r in ranks]
        covered |= _coverage(records)
        final, expected_metrics, betas = _replay(tiny_checkpoint, scenario, records, tmp_path)
        name = scenario["name"]
        run_update = torch.cat([(ranks[0]["final"][n] - initial[n]).flatten() for n in final])
        reference_update = torch.cat([(final[n] - initial[n]).flatten() for n in final])
        assert reference_update.norm() > 0, name
        error = ((run_update - reference_update).norm() / reference_update.norm()).item()
        assert error < 1e-4, f"{name}: the update differs from physical removal by {error:.2e} (relative)"
        assert ranks[0]["betas"] == pytest.approx(betas, rel=1e-5), name  # the controller saw the kept tokens only
        for step, expected in enumerate(expected_metrics):
            logged = ranks[0]["logged"][step]
            for metric, values in expected.items():
                assert logged.get(metric, []) == pytest.approx(values, rel=1e-5, abs=1e-7), (name, step, metric)
    wanted = {"a micro-batch is empty on every process"}
    if world == 2:
        wanted |= {"processes keep different numbers of rows", "a process keeps no row"}
        wanted |= {"a micro-batch is empty on some processes only"}
    assert wanted <= covered, f"the scenarios no longer cover {wanted - covered}"


@pytest.mark.parametrize(
    "field, value",
    [("scale_rewards", "batch"), ("multi_objective_aggregation", "normalize_then_sum")],
)
def test_dynamic_sampling_refuses_batch_wide_normalisation(field, value, tmp_path):
    from cegppo_trl import CEGPPOConfig

    with pytest.raises(ValueError, match=rf"cegppo_exclude_zero_advantage_groups=True with `{field}={value!r}`"):
        CEGPPOConfig(
            str(tmp_path), use_cpu=True, bf16=False, cegppo_exclude_zero_advantage_groups=True, **{field: value}
        )
    CEGPPOConfig(str(tmp_path), use_cpu=True, bf16=False, **{field: value})  # fine without dynamic sampling


def test_dynamic_sampling_refuses_steps_that_straddle_generation_batches(tmp_path):
    from cegppo_trl import CEGPPOConfig

    with pytest.raises(
        ValueError, match="steps_per_generation=6` is not a multiple of `gradient_accumulation_steps=4"
    ):
        CEGPPOConfig(
            str(tmp_path),
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=4,
            steps_per_generation=6,
            cegppo_exclude_zero_advantage_groups=True,
        )
