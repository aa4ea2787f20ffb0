"""Dynamic sampling (`cegppo_exclude_zero_advantage_groups`, `cegppo_oversampling`) on one and on two processes: the
rows trained on, and the update, are what docs/method.md ("Dynamic sampling") says; the options and launchers checked
are listed there too.

`training_worker.py` trains two optimizer steps (one generation batch, off-policy) with plain SGD, so that any change
of scale moves the parameters, and records the generation batch before and after the selection and every micro-batch
the loss saw. The test checks the selection against the rewards (which rows, in which order, on which process, with
their prompts, completions, advantages and old log-probs), then replays the recorded micro-batches on one process
through `CEGPPOTrainer` with the option off: the dropped rows sliced away, empty pairs skipped, the step's
accumulation set to its (process, micro-batch) pairs, then the same SGD step. The rewards fix which groups are
informative independently of the sampled text, and the test asserts that the runs cover: full micro-batches
everywhere, rows moved between processes, processes keeping different numbers of rows, a process keeping none, and a
micro-batch left empty on every process.
"""

import math

import pytest
import torch
from training_worker import make_config, make_dataset, position_reward
from trl_batches import build, build_trainer, launched_runs, logged, select_rows, update_error


LOSS_TYPES = ("bnpo", "dapo")
OPTIONS = dict(beta=0.05, entropy_coef=0.02, cegppo_sft_coef=0.1, cegppo_entropy_target=1.5)
GROUP_SIZE = 4  # the worker's num_generations
# Prompt kinds, per (processes, cegppo_oversampling, importance_sampling_level). A "varied" prompt's group is
# informative, a "flat" one's is not. Training batch: 4 groups per process; over-generation samples twice as many.
KINDS = {
    (1, 1.0, "token"): ["flat", "varied", "flat", "flat"],  # empty micro-batches
    (1, 1.0, "sequence"): ["flat", "varied", "flat", "flat"],
    (1, 2.0, "token"): ["varied", "flat", "varied", "flat", "varied", "varied", "flat", "varied"],  # full
    (1, 2.0, "sequence"): ["flat", "flat", "varied", "flat", "flat", "varied", "flat", "flat"],  # too few
    (2, 1.0, "token"): ["flat", "flat", "flat", "varied", "flat", "flat", "flat", "flat"],  # a process keeps none
    (2, 1.0, "sequence"): ["varied", "flat", "varied", "flat", "flat", "varied", "flat", "flat"],
    (2, 2.0, "token"): ["varied"] * 10 + ["flat"] * 6,  # 10 of 16 (sampled in shuffled order): full, rows move
    (2, 2.0, "sequence"): ["flat"] * 5 + ["varied"] + ["flat"] * 4 + ["varied", "varied"] + ["flat"] * 4,  # too few
}
METRICS_SUMMED = (
    "entropy",
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
    "cegppo/quadrant/neg_low/token_frac",
)


def _scenarios(world: int) -> list[dict]:
    return [
        {
            "name": f"{loss_type}-{level}-x{oversampling:g}",
            "kinds": KINDS[(world, oversampling, level)],
            "oversampling": oversampling,
            "config": dict(OPTIONS, loss_type=loss_type, importance_sampling_level=level),
        }
        for loss_type in LOSS_TYPES
        for level in ("token", "sequence")
        for oversampling in (1.0, 2.0)
    ]


def _kept_rows(batch: dict) -> list[int]:
    return batch["cegppo_keep"].nonzero().squeeze(1).tolist()


def _expected_rows(rewards: torch.Tensor, oversampling: float) -> list[int]:
    """The training batch's rows, computed here from the rewards: informative groups first, then the others, each in
    generation order, cut to the training batch."""
    groups = rewards.view(-1, GROUP_SIZE)
    informative = [bool(g.max() - g.min() > 1e-6) for g in groups]
    order = [i for i, x in enumerate(informative) if x] + [i for i, x in enumerate(informative) if not x]
    return [g * GROUP_SIZE + j for g in order[: round(len(order) / oversampling)] for j in range(GROUP_SIZE)]


def _check_selection(selections: list[dict], oversampling: float) -> set[str]:
    """Every process holds its share of the training batch, each row with its own prompt, completion, advantage and
    old log-probs as generated (on whichever process generated it); dropped rows have an empty loss mask."""
    seen = set()
    rows = _expected_rows(selections[0]["rewards"], oversampling)
    generated_share = selections[0]["generated"]["completion_ids"].size(0)
    trained_share = len(rows) // len(selections)
    for selection in selections:
        assert selection["rows"].tolist() == rows
    for position, row in enumerate(rows):
        source = selections[row // generated_share]["generated"]
        target = selections[position // trained_share]["trained"]
        i, j = row % generated_share, position % trained_share
        assert source["prompt_ids"][i][source["prompt_mask"][i].bool()].tolist() == (
            target["prompt_ids"][j][target["prompt_mask"][j].bool()].tolist()
        )
        length = int(source["completion_mask"][i].sum())
        assert torch.equal(source["completion_ids"][i, :length], target["completion_ids"][j, :length])
        source_old, target_old = source["old_per_token_logps"][i, :length], target["old_per_token_logps"][j, :length]
        if oversampling == 1:  # computed with the generation batch, then moved
            assert torch.equal(source_old, target_old)
        else:  # select first, then compute: on the training rows only (the worker recomputed the generated rows')
            assert torch.allclose(source_old, target_old, rtol=0, atol=1e-5), (source_old - target_old).abs().max()
        assert source["advantages"][i] == target["advantages"][j]
        kept = bool(target["cegppo_keep"][j])
        assert int(target["completion_mask"][j].sum()) == (length if kept else 0)
        if kept and row // generated_share != position // trained_share:
            seen.add("rows move between processes")
    if all(bool(s["trained"]["cegppo_keep"].all()) for s in selections):
        seen.add("full micro-batches everywhere")
    return seen


def _clip_extremes(records, m, level, per_pair):
    """TRL's `clip_ratio/low_min` / `high_max` of micro-batch m: over the kept rows of all processes (a dropped row
    has no loss token, so its per-row mean is NaN and skipped); at sequence level TRL does not mask the per-row
    value, and a dropped row enters as an unclipped row (0)."""
    lows, highs = per_pair["clip_ratio/low_min"], per_pair["clip_ratio/high_max"]
    if level == "sequence" and any(not bool(rank[m]["cegppo_keep"].all()) for rank in records):
        lows, highs = [*lows, 0.0], [*highs, 0.0]
    return (min(lows) if lows else math.nan), (max(highs) if highs else math.nan)


def _replay(model_dir, scenario: dict, records: list[list[dict]], tmp_path):
    """The physically selected run: returns (parameters after each step, expected metrics per step, betas)."""
    args = make_config(tmp_path / "reference" / scenario["name"], scenario, exclude=False)
    reference = build_trainer(str(model_dir), None, make_dataset(scenario), args, reward_funcs=position_reward)
    model = reference.model
    model.train()
    params = dict(model.named_parameters())
    world, accumulation, per_generation = len(records), args.gradient_accumulation_steps, args.steps_per_generation
    num_steps = per_generation // accumulation
    all_batches = [batch for rank in records for batch in rank]
    # The training batch's kept tokens and SFT tokens on all processes, counted here from the masks.
    kept_tokens = sum((b["completion_mask"] * b["cegppo_keep"].unsqueeze(1)).sum() for b in all_batches)
    sft_tokens = sum((b["completion_mask"] * b["cegppo_sft_mask"].unsqueeze(1)).sum() for b in all_batches)
    for batch in all_batches:
        assert batch["num_items_in_batch"] == kept_tokens
        assert batch["cegppo_num_sft_tokens"] == sft_tokens
        assert not (batch["cegppo_sft_mask"].bool() & ~batch["cegppo_keep"].bool()).any()

    expected_metrics = []
    for step in range(num_steps):
        micro_batches = range(step * accumulation, (step + 1) * accumulation)
        pairs = [(rank, m) for m in micro_batches for rank in range(world) if _kept_rows(records[rank][m])]
        model.zero_grad()
        # Every (process, micro-batch) pair counts in the step, the empty ones with nothing (TRL 1.16 divides by the
        # accumulation, DDP / ZeRO average over processes); dapo's / the SFT term's normaliser: the training batch's
        # tokens / optimizer steps per generation.
        reference.current_gradient_accumulation_steps = world * accumulation
        reference.args.steps_per_generation = world * accumulation
        sums = {m: {name: [0.0, 0.0] for name in METRICS_SUMMED} for m in micro_batches}
        extremes = {m: {"clip_ratio/low_min": [], "clip_ratio/high_max": []} for m in micro_batches}
        for i, (rank, m) in enumerate(pairs):
            batch = select_rows(records[rank][m], _kept_rows(records[rank][m]))
            batch.pop("cegppo_keep")
            batch["num_items_in_batch"] = kept_tokens / num_steps
            batch["cegppo_num_sft_tokens"] = sft_tokens / num_steps
            reference.accelerator.gradient_state._set_sync_gradients(i == len(pairs) - 1)
            reference._compute_loss(model, batch).backward()
            tokens, logged_now = batch["completion_mask"].sum().item(), logged(reference)
            for name in METRICS_SUMMED:
                sums[m][name][0] += logged_now[name][-1] * tokens
                sums[m][name][1] += tokens
            for name in extremes[m]:
                extremes[m][name].append(logged_now[name][-1])
        # transformers' loop calls it between the last backward and the optimizer step: the step check (the guard),
        # which also moves the controller's sums to the host and updates the betas for the next step.
        reference._get_grad_norm(model)
        with torch.no_grad():
            for p in params.values():
                if p.grad is not None:
                    p -= args.learning_rate * p.grad
        expected = {name: [] for name in (*METRICS_SUMMED, "clip_ratio/low_min", "clip_ratio/high_max")}
        for m in micro_batches:
            for name in METRICS_SUMMED:
                empty = 0.0 if name == "entropy" else math.nan  # TRL's token mean of no token is 0; CE-GPPO's NaN
                expected[name].append(sums[m][name][0] / sums[m][name][1] if sums[m][name][1] else empty)
            low, high = _clip_extremes(records, m, scenario["config"]["importance_sampling_level"], extremes[m])
            expected["clip_ratio/low_min"].append(low)
            expected["clip_ratio/high_max"].append(high)
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
    return seen


@pytest.mark.slow
# Sharded: the same check on both loss types (one normalised per micro-batch, one per training batch). Not fsdp2.yaml:
# accelerate 1.16 runs FSDP configs as DDP on CPU, so it would test DDP again.
@pytest.mark.parametrize("world, backend", [(1, "single"), (2, "ddp"), (2, "zero2"), (2, "zero3")])
def test_dynamic_sampling_equals_physical_selection(world, backend, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    if backend.startswith("zero"):
        pytest.importorskip("deepspeed", reason="the `deepspeed` extra is not installed")
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_checkpoint).named_parameters())
    scenarios = _scenarios(world)
    # DDP, or the shipped accelerate config, as the recipes launch it
    config = None if backend in ("single", "ddp") else f"{backend}.yaml"
    runs = launched_runs(world, scenarios, tiny_checkpoint, tmp_path, config)
    covered = set()
    for scenario in scenarios:
        name, ranks = scenario["name"], runs[scenario["name"]]
        records = [r["recorded"] for r in ranks]
        assert all(len(r["selections"]) == 1 for r in ranks)  # one generation batch
        covered |= _check_selection([r["selections"][0] for r in ranks], scenario["oversampling"])
        covered |= _coverage(records)
        final, expected_metrics, betas = _replay(tiny_checkpoint, scenario, records, tmp_path)
        error = update_error(ranks[0]["final"], initial, final)
        assert error < 1e-4, f"{name}: the update differs from the physically selected batch's by {error:.2e}"
        assert ranks[0]["betas"] == pytest.approx(betas, rel=1e-5), name  # the controller saw the kept tokens only
        for step, expected in enumerate(expected_metrics):
            step_logs = ranks[0]["logged"][step]
            for metric, values in expected.items():
                expected_values = pytest.approx(values, rel=1e-5, abs=1e-7, nan_ok=True)
                assert step_logs.get(metric, []) == expected_values, (name, step, metric)
            fill = sum(len(_kept_rows(records[r][m])) for r in range(world) for m in _step_range(step, ranks))
            rows = sum(records[r][m]["completion_ids"].size(0) for r in range(world) for m in _step_range(step, ranks))
            assert step_logs["cegppo/batch_fill"] == pytest.approx([fill / rows]), (name, step)
    wanted = {"a micro-batch is empty on every process", "full micro-batches everywhere"}
    if world == 2:
        wanted |= {"processes keep different numbers of rows", "a process keeps no row", "rows move between processes"}
    assert wanted <= covered, f"the scenarios no longer cover {wanted - covered}"


def _step_range(step: int, ranks) -> range:
    accumulation = len(ranks[0]["recorded"]) // len(ranks[0]["logged"])
    return range(step * accumulation, (step + 1) * accumulation)


@pytest.mark.parametrize("iterable", [False, True])
def test_oversampling_enlarges_each_generation_batch(
    iterable, tiny_model, tiny_tokenizer, arithmetic_dataset, tmp_path
):
    """Each loader batch (one process's share of a generation batch) holds `cegppo_oversampling` times the rows it
    trains on: whole groups of distinct prompts, repeated for the batch's optimizer steps as TRL's sampler does."""
    dataset = arithmetic_dataset.to_iterable_dataset() if iterable else arithmetic_dataset
    rows, options = {}, dict(steps_per_generation=2, cegppo_exclude_zero_advantage_groups=True)
    for oversampling in (1.0, 2.0):
        out = tmp_path / str(oversampling)
        trainer = build(tiny_model, tiny_tokenizer, dataset, out, cegppo_oversampling=oversampling, **options)
        batches = iter(trainer.get_train_dataloader())
        first, repeat = next(batches), next(batches)
        prompts = [str(example["prompt"]) for example in first]
        assert [prompts[i : i + 4] for i in range(0, len(prompts), 4)] == [[p] * 4 for p in prompts[::4]]  # groups
        assert len(set(prompts)) == len(prompts) // 4  # distinct prompts
        assert [str(example["prompt"]) for example in repeat] == prompts  # the same batch for its 2 micro-batches
        rows[oversampling] = len(first)
    assert rows == {1.0: 8 * 2, 2.0: 2 * 8 * 2}  # per_device_train_batch_size x steps_per_generation x oversampling


def test_select_first_computes_old_and_reference_log_probs_for_the_training_rows_only(
    tiny_trainer, tiny_checkpoint, arithmetic_dataset, tmp_path, monkeypatch
):
    """With `cegppo_oversampling` 2.0 and KL on, TRL's old- and reference-log-prob passes run on the training rows
    only (half the generated rows), and give the values TRL's own passes give those rows when they run on the whole
    generated batch (the mirror in `dynamic_sampling.old_policy_pass`, pinned to TRL 1.16)."""
    from trl import GRPOTrainer

    model_dir = str(tiny_checkpoint)  # beta > 0: TRL loads the reference by name
    trainer = tiny_trainer(model_dir, tmp_path / "run", beta=0.1, cegppo_exclude_zero_advantage_groups=True,
                           cegppo_oversampling=2.0)  # fmt: skip
    trainer.model.train()
    rows_seen = []
    trl_pass = GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, model, input_ids, *args, **kwargs):
        rows_seen.append((model is self.ref_model, input_ids.size(0)))
        return trl_pass(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    prompts = [arithmetic_dataset[i % 16] for i in range(16) for _ in range(4)]  # 16 groups of 4: 2x the batch
    batches = {}
    for select_first in (True, False):
        monkeypatch.setattr(type(trainer), "_old_policy_pass_after_selection", lambda self, mode: select_first)
        rows_seen.clear()
        torch.manual_seed(0)
        batches[select_first] = trainer._generate_and_score_completions(prompts)
        rows = 32 if select_first else 64  # one old (policy) and one reference pass, each on this many rows
        assert sorted(rows_seen) == [(False, rows), (True, rows)], rows_seen
    first, after = batches[True], batches[False]
    assert torch.equal(first["completion_ids"], after["completion_ids"]) and first["completion_ids"].size(0) == 32
    assert torch.equal(first["advantages"], after["advantages"])
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        mask = first["completion_mask"].bool()
        assert torch.allclose(first[key][mask], after[key][mask], rtol=0, atol=1e-5), key


@pytest.mark.parametrize("oversampling, world", [(1.0, 1), (2.0, 2), (2.0, 1)])
def test_selection_is_informative_groups_first_in_generation_order(oversampling, world):
    """`dynamic_sampling.select_training_rows` against `_expected_rows` (written out here), for every process."""
    from cegppo_trl.dynamic_sampling import select_training_rows

    flat = [0, 3, 4, 6, 7]  # groups whose 4 rewards are equal
    rewards = torch.tensor([[1.0] * 4 if g in flat else [0.0, 1.0, 1.0, 0.0] for g in range(8)]).flatten()
    expected = _expected_rows(rewards, oversampling)
    shares = [select_training_rows(rewards, GROUP_SIZE, oversampling, world, rank) for rank in range(world)]
    assert torch.cat([s.local_rows for s in shares]).tolist() == expected
    assert torch.cat([s.local_keep for s in shares]).tolist() == [r // GROUP_SIZE not in flat for r in expected]
    assert shares[0].group_counts(GROUP_SIZE).tolist() == [3.0, 3.0]  # 3 informative, all in the training batch
