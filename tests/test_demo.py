"""`cegppo-demo` as a user sees it: what it prints, the files it writes, the exact toy's findings (the same on every
machine), its tiny-LM part as a `cegppo-compare` run of its recipe, and the in-process tiny-LM helpers of the
experiments (experiments/tiny_lm.py). The end-to-end run is conftest's shared `quick_demo` (`--quick`, every part and
option on, through the installed wheel's console script)."""

import dataclasses
import json
import re
import statistics
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from conftest import DEMO_OUTPUT
from shared import ROOT, load_script

from cegppo_trl.comparison.report import summarize
from cegppo_trl.data import load_math_dataset, write_jsonl
from cegppo_trl.demo.run import LM_LIMITS, _lm_text, build_parser, demo_recipe, main, run_toy_part
from cegppo_trl.demo.toy import TOY_GRID, TOY_PRESETS, run_toy
from cegppo_trl.tiny_model import format_user_message, load_rows


lm = load_script(ROOT / "experiments" / "tiny_lm.py")


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


def _run(arm, seed, correct, entropy):
    label = {"grpo": "GRPO", "cegppo": "CE-GPPO (0.5, 1)"}[arm]
    avg = [c / 4 for c in correct]
    history = [{"step": 1, "reward": 0.5, "entropy": entropy}]
    return {"name": f"{arm}-seed{seed}", "arm": arm, "label": label, "seed": seed, "log_history": history,
            "grades": {"boxed": {"k": 4, "avg": avg, "pass": [float(c > 0) for c in correct]}}}  # fmt: skip


def test_lm_text_states_each_arm_against_its_warm_start_from_the_numbers():
    """The LM part's sentences, from the comparison's summary: each arm's end - start over seeds, counted, and
    CE-GPPO - GRPO (here CE-GPPO above the start in 1 of 2 seeds, GRPO in 2 of 2)."""
    start = {"boxed": {"k": 4, "avg": [0.5, 0.5], "pass": [1.0, 1.0]}}
    runs = [_run("grpo", 5, [3, 2], 0.10), _run("grpo", 6, [4, 3], 0.20), _run("cegppo", 5, [3, 3], 0.15),
            _run("cegppo", 6, [1, 2], 0.20)]  # fmt: skip
    lm_part = {"table": "TABLE\n", "summary": summarize(start, runs, ["boxed"]), "start_accuracy": 0.5}
    text = _lm_text(lm_part, {"steps": 3, "sft_steps": 7, "eval_samples": 4})
    assert text.startswith("TABLE\n") and "Start (the warm start, 7 SFT steps): held-out accuracy 0.500" in text
    # gains: CE-GPPO +0.250, -0.125; GRPO +0.125, +0.375
    assert "CE-GPPO (0.5, 1) +0.062 +- 0.265 (above the start in 1 of 2 seeds, -0.125 to +0.250)" in text
    assert "GRPO +0.250 +- 0.177 (above the start in 2 of 2 seeds, +0.125 to +0.375)" in text
    # CE-GPPO - GRPO: accuracy +0.125, -0.500; training entropy +0.05, 0
    assert "training entropy +0.0250 +- 0.0354 nats (higher in 1 of 2)" in text
    assert "held-out accuracy -0.188 +- 0.442 (higher in 1 of 2)" in text and LM_LIMITS.format(steps=3) in text


def test_bad_sizes_get_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "0", "--output-dir", "unused"])
    assert exit_info.value.code == 2
    assert "argument --steps: must be at least 1, got 0" in capsys.readouterr().err
    assert not Path("unused").exists()


@pytest.mark.parametrize("problems", ["sums", "all"])
def test_the_demo_recipe_trains_on_the_warm_start_prompts(problems, tmp_path):
    """The demo's recipe parses as cegppo-train parses it (the settings the runs get), and its training file holds
    exactly the problems, with the user message, that the tiny model was SFT-trained on."""
    from cegppo_trl.scripts.train import make_parser

    args = build_parser().parse_args(["--quick", "--problems", problems])
    sizes = {"toy_seeds": 2, "toy_steps": 40, "sft_steps": 150, "seeds": 2, "steps": 16, "prompts_per_step": 8,
             "num_generations": 4, "eval_size": 64, "eval_samples": 1}  # fmt: skip
    rows = load_rows("builtin:arithmetic", problems=problems)
    train_file = write_jsonl(rows, tmp_path / "train.jsonl")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(demo_recipe(args, sizes, train_file)))
    script, training, model = make_parser().parse_args_and_config(["--config", str(recipe)])
    assert (model.model_name_or_path, script.tiny_sft_steps, training.max_steps) == ("builtin:tiny", 150, 16)
    assert (training.per_device_train_batch_size, training.num_generations, training.steps_per_generation) == (
        32,
        4,
        8,
    )
    assert (training.loss_type, training.beta, training.learning_rate, training.warmup_steps) == ("dapo", 0.0, 1e-4, 8)
    dataset = load_math_dataset(script.dataset_name, instruction=script.instruction)
    assert len(dataset) == len(rows) > 1000
    for example, row in zip(dataset, rows):
        assert example["prompt"] == [{"role": "user", "content": format_user_message(row["problem"])}]
        assert example["solution"] == row["answer"]
    if problems == "sums":
        held_out = load_rows("builtin:arithmetic_eval", problems=problems)
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
    commands, the time split) and the files it writes (figures, results, the comparison's run folders: every run a
    cegppo-train run of its recipe from one start model, every model measured by cegppo-eval)."""
    out, printed, summary = quick_demo.out, quick_demo.proc.stdout, quick_demo.summary
    sizes, lm_part = summary["sizes"], summary["lm"]
    assert sizes["seeds"] >= 2 and sizes["toy_seeds"] >= 2 and sizes["steps"] >= 2
    for png in (out / "toy_entropy.png", out / "lm" / "curves.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert json.loads((out / "results.json").read_text()) == summary
    results_md = (out / "results.md").read_text()
    for section in results_md.split("## ")[1:]:
        assert section.split("\n", 1)[1].strip() in printed  # the same text, printed and written
    for finding in summary["toy"]["findings"]:
        assert f"{finding['finding']}: " in printed and finding["numbers"] in printed
    assert LM_LIMITS.format(**sizes) in printed
    assert printed.count("| GRPO seed 0 |") == 1  # the comparison's table, printed once (by the demo)

    # Seeds counting up from --seed, both arms from the same start model with the same seed and data.
    seeds = [summary["seed"] + i for i in range(sizes["seeds"])]
    assert [(r["arm"], r["seed"]) for r in lm_part["runs"]] == [(a, s) for a in ("grpo", "cegppo") for s in seeds]
    for seed in seeds:
        histories = {}
        for arm, beta1 in (("grpo", 0.0), ("cegppo", 0.5)):
            run = out / "lm" / "runs" / f"{arm}-seed{seed}"
            log = (run / "train.log").read_text()
            assert f"--model_name_or_path {out / 'lm' / 'start-model'}" in log and f"--seed {seed}" in log
            state = json.loads((run / "trainer_state.json").read_text())
            histories[arm] = [e for e in state["log_history"] if "loss" in e]
            assert len(histories[arm]) == sizes["steps"] and {e["cegppo/beta1"] for e in histories[arm]} == {beta1}
            report = json.loads((run / "eval-boxed.json").read_text())
            assert report["datasets"][str(out / "heldout.jsonl")]["num_problems"] == sizes["eval_size"]
        assert histories["grpo"][0]["reward"] == histories["cegppo"][0]["reward"]  # the same first generation batch
    versus = lm_part["summary"]["versus"]["cegppo"]["over_seeds"]
    accuracy = versus["boxed"]["avg"]["values"]
    spread = f"{statistics.fmean(accuracy):+.3f} +- {statistics.stdev(accuracy):.3f}"
    assert re.search(rf"held-out accuracy {re.escape(spread)} \(higher in {sum(d > 0 for d in accuracy)} of", printed)

    # The start and the first seed's models carry their prompt format; the printed commands measure them.
    assert (
        f"cegppo-eval {DEMO_OUTPUT}/lm/runs/cegppo-seed{summary['seed']}" in printed
    )  # the path as the user named it
    assert set(summary["eval_commands"]) == {"start", "grpo", "cegppo"}
    for command in summary["eval_commands"].values():
        assert command in printed

    # The time split names every phase, and the phases fit in the total.
    timings = summary["timings"]
    assert set(timings) == {"toy", "tiny LM (cegppo-compare)", "figures", "total"}
    assert sum(timings.values()) <= 2 * timings["total"]
    assert "[cegppo-demo] time: toy " in printed and " min " in printed and summary["machine"] in printed
