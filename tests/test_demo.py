"""`cegppo-demo` at a reduced size (the shared `quick_demo` of conftest.py: `--quick`, every part and option on): the
toy grid, the paired CE-GPPO / GRPO runs, tables, figures, conclusions consistent with the numbers, saved models and
time split; and the demo's building blocks at tiny sizes."""

import json
from pathlib import Path

import pytest
import torch
from conftest import DEMO_OUTPUT

from cegppo_trl.data import load_math_dataset
from cegppo_trl.demo import run as demo
from cegppo_trl.tiny_model import format_user_message


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("problems", ["sums", "all"])
def test_demo_prompts_are_the_warm_start_prompts(problems):
    """RL trains on exactly the problems, and the user message, that the tiny model was SFT-trained on."""
    dataset = demo.demo_train_dataset(problems)
    rows = demo.load_rows("builtin:arithmetic", problems=problems)
    assert len(dataset) == len(rows) > 1000
    for example, row in zip(dataset, rows):
        assert example["prompt"] == [{"role": "user", "content": format_user_message(row["problem"])}]
        assert example["solution"] == row["answer"]
    if problems == "sums":
        assert all(r["problem"].startswith("What is ") and "+" in r["problem"] for r in rows)
        held_out = demo.load_rows("builtin:arithmetic_eval", problems=problems)
        assert held_out and not {r["problem"] for r in held_out} & {r["problem"] for r in rows}
    else:
        assert len(rows) == len(load_math_dataset("builtin:arithmetic"))


def test_warm_start_is_cached_on_disk(tmp_path):
    rows = demo.load_rows("builtin:arithmetic_eval", 8)
    kwargs = dict(seed=0, sft_steps=3, progress=False, cache_dir=tmp_path / "warm", eval_rows=rows, num_threads=1)
    model, _, info = demo.warm_start(**kwargs)
    assert not info["cached"] and info["sft"]["steps"] == 3
    assert 0.0 <= info["accuracy"] <= 1.0 and info["entropy"] > 0
    again, _, info_again = demo.warm_start(**kwargs)
    assert info_again["cached"] and info_again["accuracy"] == info["accuracy"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    # Different arguments do not reuse the cache.
    _, _, other = demo.warm_start(**{**kwargs, "sft_steps": 2})
    assert not other["cached"]


@pytest.mark.slow
def test_demo_end_to_end(quick_demo):
    """The quick demo (every part and option on, small sizes): files, the paired runs, the saved models and their
    eval commands, the time split."""
    out, printed, summary = quick_demo.out, quick_demo.proc.stdout, quick_demo.summary
    sizes = summary["sizes"]
    assert sizes["seeds"] >= 2 and sizes["toy_seeds"] >= 2 and sizes["steps"] >= 2
    for png in (out / "toy_entropy.png", out / "cegppo_vs_grpo.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads((out / "results.json").read_text()) == summary
    assert (out / "warm_start" / "config.json").is_file()
    results_md = (out / "results.md").read_text()
    for table in ("toy", "lm"):
        assert all(line in printed for line in _table_rows(results_md, table)), table

    # Paired seeds counting up from --seed, both runs of a pair from the same weights with the same seed.
    pairs = summary["pairs"]
    assert [p["seed"] for p in pairs] == [summary["seed"] + i for i in range(sizes["seeds"])]
    eval_samples = sizes["eval_samples"] * sizes["eval_size"]
    for pair in pairs:
        cegppo, grpo = pair["cegppo"], pair["grpo"]
        assert (cegppo["beta1"], cegppo["beta2"], grpo["beta1"], grpo["beta2"]) == (0.5, 1.0, 0.0, 0.0)
        assert cegppo["seed"] == grpo["seed"] == pair["seed"] and cegppo["max_steps"] == sizes["steps"]
        assert cegppo["start_accuracy"] == grpo["start_accuracy"] and cegppo["start_entropy"] == grpo["start_entropy"]
        for run in (cegppo, grpo):
            for key in ("start_accuracy", "end_accuracy"):  # eval_size problems, eval_samples samples each
                assert 0.0 <= run[key] <= 1.0 and round(eval_samples * run[key], 6).is_integer(), (key, run[key])
            assert run["end_entropy"] > 0
        histories = [_steps(out, pair, name) for name in ("cegppo", "grpo")]
        assert [len(h) for h in histories] == [sizes["steps"]] * 2
        assert histories[0][0]["reward"] == histories[1][0]["reward"]  # the same first generation batch
        assert {e["cegppo/beta1"] for e in histories[0]} == {0.5} and {e["cegppo/beta1"] for e in histories[1]} == {0}
        for metric in demo.PLOT_METRICS[1:]:
            assert all(metric in e for e in histories[0]), metric
    assert pairs[0]["cegppo"]["start_accuracy"] == summary["warm_start"]["accuracy"]

    # The first seed's models are saved with their prompt format; the printed commands evaluate them.
    assert summary["runs"] == [pairs[0]["cegppo"], pairs[0]["grpo"]]
    assert "cegppo-eval" in printed and f"{DEMO_OUTPUT}/runs/cegppo/final" in printed  # as the user named it
    assert Path(summary["heldout"]).resolve() == (out / demo.HELDOUT_FILE).resolve()
    for name in ("cegppo", "grpo"):
        final = out / "runs" / name / "final"
        assert (final / "model.safetensors").is_file() and (final / "cegppo_prompt.json").is_file()
        assert summary["eval_commands"][name] in printed
    assert not list((out / "runs").glob("*-seed*/final"))  # later seeds: results only

    # The time split names every phase, and the phases fit in the total.
    timings = summary["timings"]
    phases = {"toy", "warm start", "figures"} | {f"{n}, seed {p['seed']}" for p in pairs for n in ("cegppo", "grpo")}
    assert set(timings) == phases | {"total"}
    assert sum(t["wall"] for n, t in timings.items() if n != "total") <= timings["total"]["wall"]
    assert "time: toy " in printed and "min" in printed and summary["machine"] in printed


@pytest.mark.slow
def test_demo_conclusions_follow_from_the_printed_numbers(quick_demo):
    """Every conclusion is printed, and its verdict is what the numbers in results.json give, recomputed here."""
    printed, summary = quick_demo.proc.stdout, quick_demo.summary
    conclusions = {c["key"]: c for c in summary["conclusions"]}
    assert list(conclusions) == [
        "toy_first_order", "toy_beta1_set", "toy_beta2_set", "toy_beta1_direction", "toy_beta2_direction",
        "lm_clipped_sets", "lm_entropy", "lm_accuracy",
    ]  # fmt: skip
    for c in conclusions.values():
        assert f"{c['claim']}: {c['verdict']}" in printed and c["evidence"] in printed

    runs, seeds = summary["toy"]["runs"], summary["toy"]["seeds"]
    mean_h = {(r["beta1"], r["beta2"], r["seed"]): r["mean_entropy"] for r in runs}
    beta1 = sum(mean_h[1.0, 1.0, s] < mean_h[0.5, 1.0, s] for s in seeds)
    assert _count_words(beta1, len(seeds)) in conclusions["toy_beta1_direction"]["verdict"]
    lowered = [r["dH_beta1"] < 0 for r in runs if r["beta1"] > 0]
    assert _count_words(sum(lowered), len(lowered)) in conclusions["toy_beta1_set"]["verdict"]

    pairs = summary["pairs"]
    for metric in ("accuracy", "entropy"):
        diffs = [p["cegppo"][f"end_{metric}"] - p["grpo"][f"end_{metric}"] for p in pairs]
        mean = sum(diffs) / len(diffs)
        std = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
        half = {2: 12.706, 3: 4.303, 4: 3.182}[len(diffs)] * std / len(diffs) ** 0.5  # Student's t, 95%
        conclusion = conclusions[f"lm_{metric}"]
        assert _count_words(sum(d > 0 for d in diffs), len(diffs)) in conclusion["verdict"], (metric, conclusion)
        if mean - half > 0:
            assert "by the 95% interval: CE-GPPO higher" in conclusion["evidence"], (metric, conclusion)
        elif mean + half < 0:
            assert "by the 95% interval: CE-GPPO lower" in conclusion["evidence"], (metric, conclusion)
        else:
            assert "by the 95% interval: no difference" in conclusion["evidence"], (metric, conclusion)
        digits = 3 if metric == "accuracy" else 4
        assert f"{mean:+.{digits}f} +- {std:.{digits}f} over {len(diffs)} seeds" in conclusion["evidence"]
    assert all(f"| {p['seed']} | {p['cegppo']['end_accuracy']:.3f} | {p['grpo']['end_accuracy']:.3f} |" in printed
               for p in pairs)  # fmt: skip


def _count_words(holds: int, total: int) -> str:
    return "every one" if holds == total else ("none" if holds == 0 else f"only in {holds} of")


def _table_rows(markdown: str, table: str) -> list[str]:
    """The data rows of the toy or LM table of results.md."""
    section = markdown.split("## Exact toy")[1].split("## Tiny LM")[0 if table == "toy" else 1]
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]


def _steps(out: Path, pair: dict, name: str) -> list[dict]:
    state = json.loads((Path(pair[name]["output_dir"]) / "trainer_state.json").read_text())
    assert Path(pair[name]["output_dir"]).parent == out / "runs"
    return [e for e in state["log_history"] if "loss" in e]


def test_run_rl_overrides_and_result(tmp_path):
    """`run_rl` as another experiment uses it: a path as model, config overrides, the returned dict."""
    rows = demo.load_rows("builtin:arithmetic_eval", 8)
    warm = tmp_path / "warm"
    demo.warm_start(seed=1, sft_steps=3, progress=False, cache_dir=warm, eval_rows=rows, evaluate=False, num_threads=1)
    result = demo.run_rl(
        str(warm), None, beta1=0.75, beta2=1.0, seed=1, max_steps=2, output_dir=tmp_path / "rl", eval_rows=rows,
        progress=False, per_device_train_batch_size=16, num_generations=4, steps_per_generation=2, num_iterations=1,
        train_dataset=load_math_dataset("builtin:arithmetic", instruction=demo.DEMO_INSTRUCTION).select(range(64)),
    )  # fmt: skip
    assert result["beta1"] == 0.75 and result["max_steps"] == 2
    steps = [e for e in result["log_history"] if "loss" in e]
    assert len(steps) == 2 and {e["cegppo/beta1"] for e in steps} == {0.75}
    assert set(result) >= {"start_accuracy", "end_accuracy", "start_entropy", "end_entropy", "seconds", "log_history"}
    assert 0 <= result["beta1_grad_share"] <= 1 and 0 <= result["beta2_grad_share"] <= 1
    # A given start_eval is used as the start's figures (no second evaluation of the same model).
    given = {"accuracy": 0.25, "entropy": 0.5, "greedy_accuracy": 0.125}
    again = demo.run_rl(
        str(warm), None, beta1=0.0, beta2=0.0, seed=1, max_steps=1, output_dir=tmp_path / "rl2", eval_rows=rows,
        progress=False, per_device_train_batch_size=16, num_generations=4, steps_per_generation=1,
        train_dataset=load_math_dataset("builtin:arithmetic", instruction=demo.DEMO_INSTRUCTION).select(range(16)),
        start_eval=given, save_final=False,
    )  # fmt: skip
    assert (again["start_accuracy"], again["start_entropy"], again["final_dir"]) == (0.25, 0.5, None)
    assert (tmp_path / "rl" / "trainer_state.json").is_file()
    assert (
        result["final_dir"] == str(tmp_path / "rl" / "final") and (tmp_path / "rl" / "final" / "config.json").is_file()
    )


def test_progress_bar_names_the_clipped_token_fractions():
    """The bar shows the beta1 / beta2 clipped-set token fractions as clip_lo / clip_hi (not b1 / b2, the betas)."""

    class Bar:
        n, postfix = 0, None

        def set_postfix(self, values):
            self.postfix = values

    callback = demo._progress_callback("run")
    callback.bar = Bar()
    logs = {"reward": 0.5, "entropy": 0.1, "cegppo/beta1_token_frac": 0.01, "cegppo/beta2_token_frac": 0.002}
    callback.on_log(None, None, None, logs=logs)
    assert callback.bar.postfix == {"reward": "0.5", "entropy": "0.1", "clip_lo": "0.01", "clip_hi": "0.002"}
