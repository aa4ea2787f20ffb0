"""`cegppo-demo` as a user sees it: what it prints, the files it writes, the exact toy's findings (the same on every
machine), and the building blocks at tiny sizes. The end-to-end run is conftest's shared `quick_demo` (`--quick`,
every part and option on, through the installed wheel's console script)."""

import dataclasses
import json
import re
import statistics
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import DEMO_OUTPUT

from cegppo_trl.data import load_math_dataset
from cegppo_trl.demo import lm
from cegppo_trl.demo.run import LM_LIMITS, _gains, _lm_text, build_parser, main, run_toy_part
from cegppo_trl.demo.toy import TOY_GRID, TOY_PRESETS, run_toy
from cegppo_trl.tiny_model import format_user_message


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# The README's toy figures (`cegppo-demo`, --seed 0: toy seeds 0-2, 100 steps). The toy is float64 on tabular
# policies, so every machine prints these.
README_TOY = {
    "first_order": "max relative error 9.9e-03 at lr 0.001, 9.9e-04 at lr 0.0001",
    "beta1 set": "-0.164 to -0.097",
    "beta2 set": "+0.062 to +0.163",
    "beta1 direction": "(1, 1) 0.618 vs (0.5, 1) 0.667",
    "beta2 direction": "(1, 1) 0.618 vs (1, 0.5) 0.580; (0, 1) 0.754 vs (0, 0) 0.635",
}


@pytest.mark.slow
def test_toy_findings_hold_at_the_demo_size_as_the_readme_says():
    """At the demo's size every toy finding holds in every run and seed, with the README's figures."""
    parser = build_parser()
    toy = run_toy_part(range(3), parser.get_default("toy_steps"))
    assert parser.get_default("toy_seeds") == 3, "the demo's size changed: update README_TOY and the README's table"
    assert all(f["holds"] == f["of"] for f in toy["findings"]), toy["findings"]
    assert [f["of"] for f in toy["findings"]] == [1, 9, 12, 3, 3]
    numbers = " | ".join(f["numbers"] for f in toy["findings"])
    for name, figures in README_TOY.items():
        assert figures in numbers, (name, numbers)


def test_toy_findings_count_what_the_runs_show():
    """Each finding's count is what the per-run numbers give, recounted here; the first-order error is second order."""
    small_toy = run_toy_part(seeds=[3, 4], steps=30)
    runs, (first_order, beta1_set, beta2_set, beta1, beta2) = small_toy["runs"], small_toy["findings"]
    h = {(r["beta1"], r["beta2"], r["seed"]): r["mean_entropy"] for r in runs}
    assert (beta1["holds"], beta1["of"]) == (sum(h[1, 1, s] < h[0.5, 1, s] for s in (3, 4)), 2)
    assert beta2["holds"] == sum(h[1, 1, s] > h[1, 0.5, s] and h[0, 1, s] > h[0, 0, s] for s in (3, 4))
    assert (beta1_set["holds"], beta1_set["of"]) == (sum(r["dH_beta1"] < 0 for r in runs if r["beta1"] > 0), 6)
    assert (beta2_set["holds"], beta2_set["of"]) == (sum(r["dH_beta2"] > 0 for r in runs if r["beta2"] > 0), 8)
    coarse, fine = small_toy["first_order"]
    assert (coarse["lr"], fine["lr"]) == (1e-3, 1e-4) and fine["max_rel_error"] < 2e-3
    assert first_order["holds"] == 1 and 5 < coarse["max_rel_error"] / fine["max_rel_error"] < 20
    # Every setting of the grid for every seed; each summary is the run's own trace, the per-step prediction the sum
    # of the three sets' first-order changes next to the measured change.
    assert [(r["beta1"], r["beta2"], r["seed"]) for r in runs] == [(*b, s) for s in (3, 4) for b in TOY_GRID]
    again = run_toy(1.0, 0.5, seed=4, config=dataclasses.replace(TOY_PRESETS["sequence"], steps=30))
    (summary,) = [r for r in runs if (r["beta1"], r["beta2"], r["seed"]) == (1.0, 0.5, 4)]
    assert summary["entropy"] == again.entropy and summary["dH_beta1"] == sum(again.dH_beta1)
    assert summary["measured_dH"] == [b - a for a, b in zip(again.entropy, again.entropy[1:])]
    assert summary["predicted_dH"] == [sum(d) for d in zip(again.dH_beta1, again.dH_beta2, again.dH_unclipped)]
    assert statistics.correlation(summary["predicted_dH"], summary["measured_dH"]) > 0.9


def _arm(start, end, entropy=0.03):
    shares = dict.fromkeys(("beta1_token_frac", "beta2_token_frac", "beta1_grad_share", "beta2_grad_share"), 0.01)
    return {"start_accuracy": start, "end_accuracy": end, "start_entropy": 0.04, "end_entropy": entropy,
            "end_reward": 0.5, **shares}  # fmt: skip


def test_lm_text_states_each_arm_against_its_warm_start_from_the_numbers():
    """The LM part's table has the warm start's row and every seed's; the sentence on RL vs the warm start counts and
    spreads each arm's own end - start differences (here CE-GPPO above in 1 of 2 seeds, GRPO in 2 of 2)."""
    pairs = [{"seed": 5, "cegppo": _arm(0.5, 0.625), "grpo": _arm(0.5, 0.5625)},
             {"seed": 6, "cegppo": _arm(0.5, 0.375), "grpo": _arm(0.5, 0.75)}]  # fmt: skip
    gains = _gains(pairs)
    assert gains["cegppo"]["values"] == [0.125, -0.125] and gains["grpo"]["values"] == [0.0625, 0.25]
    warm = {"accuracy": 0.5, "entropy": 0.04, "sft": {"steps": 7}}
    diffs = {"accuracy": {"values": [0.0625, -0.375], "mean": -0.15625, "std": 0.3},
             "entropy": {"values": [0.0, 0.0], "mean": 0.0, "std": 0.0}}  # fmt: skip
    text = _lm_text(pairs, warm, diffs, gains, {"steps": 3})
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1] == "| start (warm start) | 0.500 | 0.500 | | 0.0400 | 0.0400 | | | |"
    assert rows[2].startswith("| 5 | 0.625 | 0.562 | +0.062 |")
    assert rows[3].startswith("| 6 | 0.375 | 0.750 | -0.375 |")
    assert "Start (the warm start, 7 SFT steps): held-out accuracy 0.500" in text
    assert "CE-GPPO +0.000 +- 0.177 (above the start in 1 of 2 seeds, -0.125 to +0.125)" in text
    assert "GRPO +0.156 +- 0.133 (above the start in 2 of 2 seeds, +0.062 to +0.250)" in text
    assert LM_LIMITS.format(steps=3) in text


def test_bad_sizes_get_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "0", "--output-dir", "unused"])
    assert exit_info.value.code == 2
    assert "argument --steps: must be at least 1, got 0" in capsys.readouterr().err
    assert not Path("unused").exists()


@pytest.mark.parametrize("problems", ["sums", "all"])
def test_demo_prompts_are_the_warm_start_prompts(problems):
    """RL trains on exactly the problems, and the user message, that the tiny model was SFT-trained on."""
    dataset, rows = lm.demo_train_dataset(problems), lm.load_rows("builtin:arithmetic", problems=problems)
    assert len(dataset) == len(rows) > 1000
    for example, row in zip(dataset, rows):
        assert example["prompt"] == [{"role": "user", "content": format_user_message(row["problem"])}]
        assert example["solution"] == row["answer"]
    if problems == "sums":
        held_out = lm.load_rows("builtin:arithmetic_eval", problems=problems)
        assert held_out and not {r["problem"] for r in held_out} & {r["problem"] for r in rows}
    else:
        assert len(rows) == len(load_math_dataset("builtin:arithmetic"))


def test_warm_start_and_run_rl(tmp_path):
    """The warm start is cached on disk (the same weights again; other arguments train anew); `run_rl` takes a
    path, config overrides and a given start, and returns the figures and clipped-set statistics the demo prints."""
    rows = lm.load_rows("builtin:arithmetic_eval", 8)
    kwargs = dict(seed=1, sft_steps=3, progress=False, cache_dir=tmp_path / "warm", eval_rows=rows)
    model, _, info = lm.warm_start(**kwargs)
    assert not info["cached"] and info["sft"]["steps"] == 3 and 0.0 <= info["accuracy"] <= 1.0 and info["entropy"] > 0
    again, _, info_again = lm.warm_start(**kwargs)
    assert info_again["cached"] and info_again["accuracy"] == info["accuracy"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))

    data = load_math_dataset("builtin:arithmetic", instruction=lm.DEMO_INSTRUCTION)
    small = dict(eval_rows=rows, progress=False, per_device_train_batch_size=16, num_generations=4)
    result = lm.run_rl(str(tmp_path / "warm"), None, beta1=0.75, beta2=1.0, seed=1, max_steps=2,
                       output_dir=tmp_path / "rl", steps_per_generation=2, train_dataset=data.select(range(64)),
                       **small)  # fmt: skip
    steps = [e for e in result["log_history"] if "loss" in e]
    assert result["beta1"] == 0.75 and len(steps) == 2 and {e["cegppo/beta1"] for e in steps} == {0.75}
    assert 0 <= result["beta1_grad_share"] <= 1 and 0 <= result["beta2_token_frac"] <= 1
    assert result["start_accuracy"] == info["accuracy"] and result["end_entropy"] > 0
    assert (tmp_path / "rl" / "trainer_state.json").is_file()
    assert (
        result["final_dir"] == str(tmp_path / "rl" / "final") and (tmp_path / "rl" / "final" / "config.json").is_file()
    )
    given = {"accuracy": 0.25, "entropy": 0.5}  # no second evaluation of the start
    again = lm.run_rl(str(tmp_path / "warm"), None, beta1=0.0, beta2=0.0, seed=1, max_steps=1,
                      output_dir=tmp_path / "rl2", steps_per_generation=1, train_dataset=data.select(range(16)),
                      start_eval=given, save_final=False, **small)  # fmt: skip
    assert (again["start_accuracy"], again["start_entropy"], again["final_dir"]) == (0.25, 0.5, None)
    assert not lm.warm_start(**{**kwargs, "sft_steps": 2})[2]["cached"]  # other arguments: trained anew


def test_progress_bar_names_the_clipped_token_fractions():
    """The bar shows the beta1 / beta2 clipped-set token fractions as clip_lo / clip_hi (not b1 / b2, the betas)."""
    callback = lm._Progress("run")
    callback.training_bar = mock.Mock()
    logs = {"reward": 0.5, "entropy": 0.1, "cegppo/beta1_token_frac": 0.01, "cegppo/beta2_token_frac": 0.002}
    callback.on_log(None, None, None, logs=logs)
    callback.training_bar.set_postfix.assert_called_once_with(
        {"reward": "0.5", "entropy": "0.1", "clip_lo": "0.01", "clip_hi": "0.002"}
    )


@pytest.mark.slow
def test_demo_end_to_end(quick_demo):
    """The quick demo: what it prints (both parts, the tables of results.md, the LM's spread and limits, the eval
    commands, the time split) and the files it writes (figures, results, the saved models, the paired runs)."""
    out, printed, summary = quick_demo.out, quick_demo.proc.stdout, quick_demo.summary
    sizes, pairs = summary["sizes"], summary["pairs"]
    assert sizes["seeds"] >= 2 and sizes["toy_seeds"] >= 2 and sizes["steps"] >= 2
    for png in (out / "toy_entropy.png", out / "cegppo_vs_grpo.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads((out / "results.json").read_text()) == summary
    results_md = (out / "results.md").read_text()
    for section in results_md.split("## ")[1:]:
        assert section.split("\n", 1)[1].strip() in printed  # the same text, printed and written
    for finding in summary["toy"]["findings"]:
        assert f"{finding['finding']}: " in printed and finding["numbers"] in printed
    assert LM_LIMITS.format(**sizes) in printed

    # Paired seeds counting up from --seed, both runs of a pair from the same weights with the same seed; the printed
    # differences are the runs' own, with their mean and spread.
    assert [p["seed"] for p in pairs] == [summary["seed"] + i for i in range(sizes["seeds"])]
    samples = sizes["eval_samples"] * sizes["eval_size"]
    for pair in pairs:
        cegppo, grpo = pair["cegppo"], pair["grpo"]
        assert (cegppo["beta1"], cegppo["beta2"], grpo["beta1"], grpo["beta2"]) == (0.5, 1.0, 0.0, 0.0)
        assert cegppo["seed"] == grpo["seed"] == pair["seed"] and cegppo["max_steps"] == sizes["steps"]
        assert cegppo["start_accuracy"] == grpo["start_accuracy"] and cegppo["start_entropy"] == grpo["start_entropy"]
        for run in (cegppo, grpo):
            assert round(samples * run["end_accuracy"], 6).is_integer() and run["end_entropy"] > 0
        histories = [_steps(out, pair, name) for name in ("cegppo", "grpo")]
        assert [len(h) for h in histories] == [sizes["steps"]] * 2
        assert histories[0][0]["reward"] == histories[1][0]["reward"]  # the same first generation batch
        assert {e["cegppo/beta1"] for e in histories[0]} == {0.5} and {e["cegppo/beta1"] for e in histories[1]} == {0}
        assert all(metric in e for e in histories[0] for metric in ("entropy", *lm.CLIPPED_SETS))  # reward: per batch
        entropy = cegppo["end_entropy"] - grpo["end_entropy"]
        assert f"| {pair['seed']} | {cegppo['end_accuracy']:.3f} | {grpo['end_accuracy']:.3f} |" in printed
        assert f"| {entropy:+.4f} |" in printed
    for metric, digits in (("accuracy", 3), ("entropy", 4)):
        diffs = [p["cegppo"][f"end_{metric}"] - p["grpo"][f"end_{metric}"] for p in pairs]
        spread = f"{statistics.fmean(diffs):+.{digits}f} +- {statistics.stdev(diffs):.{digits}f}"
        higher = f"(higher in {sum(d > 0 for d in diffs)} of {len(diffs)})"
        assert re.search(rf"{metric} {re.escape(spread)}( nats)? {re.escape(higher)}", printed), (metric, spread)
    assert pairs[0]["cegppo"]["start_accuracy"] == summary["warm_start"]["accuracy"]

    # Every arm starts from the warm start (evaluated with its seed); results.json records each arm's end - start and
    # the printed sentence states those numbers (whatever their sign: learning is a measurement, not a test threshold).
    warm = summary["warm_start"]
    assert f"| start (warm start) | {warm['accuracy']:.3f} | {warm['accuracy']:.3f} | |" in printed
    for name, shown in (("cegppo", "CE-GPPO"), ("grpo", "GRPO")):
        gains = [p[name]["end_accuracy"] - p[name]["start_accuracy"] for p in pairs]
        assert pairs[0][name]["start_accuracy"] == warm["accuracy"]  # later seeds evaluate it with their own seed
        assert summary["gains"][name]["values"] == gains
        above = f"above the start in {sum(g > 0 for g in gains)} of {len(gains)} seeds"
        assert f"{shown} {statistics.fmean(gains):+.3f} +- {statistics.stdev(gains):.3f} ({above}, " in printed

    # The first seed's models are saved with their prompt format; the printed commands evaluate them.
    assert summary["runs"] == [pairs[0]["cegppo"], pairs[0]["grpo"]]
    assert f"cegppo-eval {DEMO_OUTPUT}/runs/cegppo/final" in printed  # the path as the user named it
    assert Path(summary["heldout"]).resolve() == (out / lm.HELDOUT_FILE).resolve()
    for name in ("cegppo", "grpo"):
        final = out / "runs" / name / "final"
        assert (final / "model.safetensors").is_file() and (final / "cegppo_prompt.json").is_file()
        assert summary["eval_commands"][name] in printed
    assert not list((out / "runs").glob("*-seed*/final"))  # later seeds: results only

    # The time split names every phase, and the phases fit in the total.
    timings = summary["timings"]
    phases = {"toy", "warm start", "figures"} | {f"{n}, seed {p['seed']}" for p in pairs for n in ("cegppo", "grpo")}
    assert set(timings) == phases | {"total"} and sum(timings.values()) <= 2 * timings["total"]
    assert "[cegppo-demo] time: toy " in printed and " min " in printed and summary["machine"] in printed


def _steps(out: Path, pair: dict, name: str) -> list[dict]:
    state = json.loads((Path(pair[name]["output_dir"]) / "trainer_state.json").read_text())
    assert Path(pair[name]["output_dir"]).parent == out / "runs"
    return [e for e in state["log_history"] if "loss" in e]
