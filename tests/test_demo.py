"""`cegppo-demo` at a reduced size (the shared `quick_demo` of conftest.py): warm start, CE-GPPO and GRPO side by side,
table, JSON and PNG; and the demo's building blocks at tiny sizes."""

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
    out, printed, sizes = quick_demo.out, quick_demo.proc.stdout, quick_demo.summary["sizes"]
    steps_run, eval_samples = sizes["steps"], sizes["eval_samples"] * sizes["eval_size"]
    assert steps_run >= 2 and eval_samples > 0

    # Files: plot, table, summary, one trainer_state.json per run, the cached warm start.
    png = out / "cegppo_vs_grpo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = (out / "results.md").read_text()
    assert "CE-GPPO (beta1=0.5, beta2=1)" in table and "GRPO (beta1=beta2=0)" in table
    assert table.strip() in printed
    summary = json.loads((out / "results.json").read_text())
    assert summary == quick_demo.summary
    assert (out / "warm_start" / "config.json").is_file()

    runs = {r["label"]: r for r in summary["runs"]}
    assert len(runs) == 2
    for run in runs.values():
        assert run["max_steps"] == steps_run and run["seed"] == 0
        for key in ("start_accuracy", "end_accuracy"):  # eval_size held-out problems, eval_samples samples each
            assert 0.0 <= run[key] <= 1.0 and round(eval_samples * run[key], 6).is_integer(), (key, run[key])
        for key in ("start_greedy_accuracy", "end_greedy_accuracy"):  # one greedy completion each
            assert 0.0 <= run[key] <= 1.0 and round(sizes["eval_size"] * run[key], 6).is_integer(), (key, run[key])
        assert run["start_entropy"] > 0 and run["end_entropy"] > 0
    cegppo_label, grpo_label = "CE-GPPO (beta1=0.5, beta2=1)", "GRPO (beta1=beta2=0)"
    cegppo, grpo = runs[cegppo_label], runs[grpo_label]
    assert (cegppo["beta1"], cegppo["beta2"], grpo["beta1"], grpo["beta2"]) == (0.5, 1.0, 0.0, 0.0)
    # Both runs start from the same cached weights with the same seed: same held-out start, same first batch.
    assert cegppo["start_accuracy"] == grpo["start_accuracy"]
    assert cegppo["start_entropy"] == pytest.approx(grpo["start_entropy"])
    assert cegppo["start_accuracy"] == summary["warm_start"]["accuracy"]

    # Every model it trains is saved, with its prompt format, and the eval commands for them are printed.
    assert "cegppo-eval" in printed and f"{DEMO_OUTPUT}/runs/cegppo/final" in printed  # as the user named it
    assert Path(summary["heldout"]).resolve() == (out / demo.HELDOUT_FILE).resolve()
    assert (out / demo.HELDOUT_FILE).is_file()
    for name in ("cegppo", "grpo"):
        final = out / "runs" / name / "final"
        assert (final / "model.safetensors").is_file() and (final / "cegppo_prompt.json").is_file()
        assert summary["eval_commands"][name] in printed
    finals = {Path(r["final_dir"]).resolve() for r in summary["runs"]}
    assert finals == {(out / "runs" / n / "final").resolve() for n in ("cegppo", "grpo")}

    histories = {}
    for name in ("cegppo", "grpo"):
        state = json.loads((out / "runs" / name / "trainer_state.json").read_text())
        steps = [e for e in state["log_history"] if "loss" in e]
        assert len(steps) == steps_run
        for entry in steps:
            for metric in demo.PLOT_METRICS[1:]:
                assert metric in entry, metric
        histories[name] = steps
        rewards = [e["reward"] for e in state["log_history"] if "reward" in e]  # once per generation batch
        result = runs[cegppo_label if name == "cegppo" else grpo_label]
        assert (result["start_reward"], result["end_reward"]) == (rewards[0], rewards[-1])  # first / last 10%
        assert all(-1.0 <= r <= 1.0 for r in rewards)
    assert histories["cegppo"][0]["reward"] == histories["grpo"][0]["reward"]
    assert histories["cegppo"][0]["entropy"] == pytest.approx(histories["grpo"][0]["entropy"])
    assert {e["cegppo/beta1"] for e in histories["cegppo"]} == {0.5}
    assert {e["cegppo/beta1"] for e in histories["grpo"]} == {0.0}


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
