"""`cegppo-compare` as a user runs it (the console command on builtin:tiny: its table, JSON and figure; stopped and
started again, it reuses the finished run and resumes the interrupted one; LoRA without peft refused in one line),
and its statistics against hand-computed values (paired differences, the verdict rule, the table)."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from shared import ROOT, load_script, run_checked

from cegppo_trl.comparison import report
from cegppo_trl.comparison.jobs import TIMED_METHODS, load_problems
from cegppo_trl.comparison.settings import CompareArguments, parse_arm


QUICK = ["--model", "builtin:tiny", "--tiny_sft_steps", "150", "--arms", "grpo", "cegppo", "--seeds", "0", "1",
         "--max_steps", "4", "--steps_per_generation", "2", "--prompts_per_step", "4", "--num_generations", "4",
         "--eval_problems", "12", "--eval_k", "4", "--eval_every", "2", "--jobs", "1"]  # fmt: skip


def _compare(out, *extra, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [os.path.join(os.path.dirname(sys.executable), "cegppo-compare"), *QUICK, "--out", str(out), *extra]
    return subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def _numbers(value):
    if isinstance(value, dict | list):
        return [n for item in (value.values() if isinstance(value, dict) else value) for n in _numbers(item)]
    return [float(value)] if isinstance(value, int | float) and not isinstance(value, bool) else []


@pytest.mark.slow
def test_compare_writes_its_results_and_resumes_what_a_stop_cut(tmp_path):
    """Stopped with Ctrl-C (SIGINT to its process group, as a terminal sends it) once the first run is finished and
    the second has a checkpoint, then started again: the first run is reused as it was, the second resumes from its
    checkpoint, and the results have finite figures."""
    out = tmp_path / "cmp"
    first = _compare(out, start_new_session=True)
    finished, checkpoint = out / "runs" / "grpo-seed0" / "result.json", out / "runs" / "cegppo-seed0" / "checkpoint-2"
    deadline = time.time() + 900
    saved = checkpoint / "trainer_state.json"  # written last: the checkpoint is complete
    while not (finished.is_file() and saved.is_file()) and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert finished.is_file() and saved.is_file(), first.communicate()[0][-3000:]
    os.killpg(first.pid, signal.SIGINT)
    stopped = first.communicate(timeout=120)[0]
    assert first.returncode == 130 and "cegppo-compare: stopped. Run the same command again to resume" in stopped
    assert not (out / "results.json").exists() and checkpoint.is_dir()
    kept = finished.read_text()

    second = _compare(out)
    log = second.communicate(timeout=900)[0]
    assert second.returncode == 0, log[-3000:]
    assert "reused (finished before): start, grpo-seed0" in log
    assert "resumed from their newest finite checkpoint: cegppo-seed0 from checkpoint-2" in log
    assert finished.read_text() == kept  # not redone
    result = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["grpo-seed0", "grpo-seed1", "cegppo-seed0", "cegppo-seed1"]
    resumed = next(r for r in result["runs"] if r["name"] == "cegppo-seed0")
    assert resumed["resumed_from_step"] == 2 and [p["step"] for p in resumed["curve"]] == [2, 4]
    assert all(r["time"]["generation"] > 0 and r["time"]["old_logprob_pass"] > 0 for r in result["runs"])
    numbers = _numbers([result["start"], [r["end"] for r in result["runs"]], result["summary"]["per_run"]])
    assert numbers and all(math.isfinite(v) for v in numbers)
    table = (out / "results.md").read_text()
    for row in ("| start |", "| GRPO seed 0 |", "| CE-GPPO (0.5, 1) seed 1 |", "| the paper's claim |", "Time ("):
        assert row in table
    assert "with 1 thread." in table  # the jobs' threads, not the reporting process's
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "runs" / "cegppo-seed1" / "final" / "cegppo_prompt.json").is_file()  # cegppo-eval can measure it
    assert not list(out.glob("runs/*/checkpoint-*"))  # done: only the final models stay

    changed = run_checked([sys.executable, "-m", "cegppo_trl.scripts.compare", *QUICK, "--out", out, "--max_steps",
                           "6"], ROOT, expect=2)  # fmt: skip
    assert "--max_steps 4 -> 6" in changed.stderr and len(changed.stderr.strip().splitlines()) == 1


def test_lora_without_peft_is_refused_in_one_line_before_any_work(tmp_path):
    code = "import sys; sys.modules['peft'] = None; from cegppo_trl.scripts.compare import main; sys.exit(main())"
    proc = run_checked([sys.executable, "-c", code, *QUICK, "--use_peft", "true", "--out", tmp_path / "x"], ROOT,
                       expect=2)  # fmt: skip
    assert proc.stderr.strip() == (
        "cegppo-compare: --use_peft true (LoRA) needs peft, which is not installed: pip install 'cegppo-trl[peft]' "
        "(in a clone: -e '.[peft]')."
    )
    assert not (tmp_path / "x").exists()  # refused before builtin:tiny was built there, or anything ran


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--arms", "grpo", "banana"], "--arms 'banana': an arm is grpo, dapo, cegppo"),
        (["--eval_every", "3"], "--eval_every 3: measure at generation-batch boundaries, a multiple of"),
        (["--protocols", "exact"], "--protocols ['exact']: each must be one of"),
        (["--example_problem", "What is 1+1?"], "--example_problem and --example_answer go together"),
        (["--eval_problems", "301"], "--eval_problems 301: builtin:arithmetic_eval has 300 problems."),
        (["--model", "no/such/dir/"], "--model: "),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(flags, message, tmp_path, capsys):
    from cegppo_trl.scripts.compare import main

    assert main([*QUICK, "--out", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_arms():
    assert parse_arm("grpo") == parse_arm("GRPO") and (parse_arm("grpo").beta1, parse_arm("grpo").beta2) == (0, 0)
    assert parse_arm("dapo").epsilon_high == 0.28 and parse_arm("cegppo").label == "CE-GPPO (0.5, 1)"
    assert (parse_arm("0,1").name, parse_arm("0,1").label) == ("b0-1", "CE-GPPO (0, 1)")


def test_held_out_problems_never_train_and_the_example_leads_every_prompt(tmp_path):
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem": "What is 1+2?", "answer": "3"}\n{"problem": "What is 2+2?", "answer": "4"}\n')
    args = CompareArguments(model="m", train_dataset=str(problems), eval_dataset="builtin:arithmetic_eval",
                            instruction="none", example_problem="What is 12+30?", example_answer="42")  # fmt: skip
    train, held_out = load_problems(args)
    assert "What is 2+2?" in [row["prompt"][-1]["content"] for row in held_out]
    assert [row["prompt"][-1]["content"] for row in train] == ["What is 1+2?"]  # 2+2 is held out
    args.train_dataset, args.eval_problems = "builtin:arithmetic_eval", 5
    train, held_out = load_problems(args)
    assert len(train) == 295 and len(held_out) == 5
    example = [{"role": "user", "content": "What is 12+30?"}, {"role": "assistant", "content": "42"}]
    assert all(row["prompt"][:2] == example for rows in (train, held_out) for row in rows)


def test_paired_differences_and_the_verdict_rule():
    mean, se = report.paired({"num_correct": [2, 4, 0, 4], "k": 4}, {"num_correct": [0, 2, 0, 4], "k": 4}, "avg")
    assert mean == pytest.approx(0.25) and se == pytest.approx(math.sqrt(1 / 12) / 2)  # diffs .5, .5, 0, 0
    assert report.paired({"num_correct": [1, 0, 3], "k": 4}, {"num_correct": [0, 0, 4], "k": 4}, "pass")[0] == (
        pytest.approx(1 / 3)
    )
    assert report.verdict([0.10, 0.12, 0.11]) == "yes" and report.verdict([-0.1, -0.12, -0.11]) == "no"
    assert report.verdict([0.1, 0.2, -0.01]) == "inside the noise"  # one seed of the other sign
    assert report.verdict([0.01, 0.5, 0.02]) == "inside the noise"  # every seed agrees, but under 2 SE
    assert report.verdict([-0.1, -0.12, -0.11], direction=-1) == "yes" and report.verdict([0.3]) == "inside the noise"


def test_summary_table_and_claims():
    def grades(*counts):
        return {p: {"num_correct": list(c), "avg": sum(c) / (2 * len(c)), "pass": sum(x > 0 for x in c) / len(c)}
                for p, c in zip(("boxed", "lighteval"), counts)}  # fmt: skip

    start = {"k": 2, "num_problems": 4, "entropy": 1.0, "boxed_rate": 0.5, "seconds": 1.0,
             "grades": grades([0, 1, 0, 2], [0, 1, 0, 2])}  # fmt: skip

    def run(arm, seed, correct, entropy):
        history = [{"step": s, "entropy": entropy, "reward": 0.0, "cegppo/batch_fill": 1.0} for s in (1, 2)]
        history.append({"step": 3, "entropy": 0.0, "cegppo/batch_fill": 0.0})  # trained nothing: not a measurement
        return {"name": f"{arm.name}-seed{seed}", "arm": arm.name, "label": arm.label, "seed": seed,
                "end": {**start, "grades": grades(correct, correct)}, "log_history": history}  # fmt: skip

    grpo, cegppo = parse_arm("grpo"), parse_arm("cegppo")
    runs = [run(grpo, 0, [1, 1, 0, 2], 0.5), run(grpo, 1, [0, 1, 0, 2], 0.4), run(cegppo, 0, [2, 2, 1, 2], 0.7),
            run(cegppo, 1, [1, 2, 1, 2], 0.61)]  # fmt: skip
    summary = report.summarize(start, runs, ["boxed", "lighteval"])
    assert summary["per_run"]["cegppo-seed0"]["boxed"]["avg_vs_start"][0] == pytest.approx(4 / 8)
    assert summary["per_run"]["grpo-seed0"]["train_entropy"] == pytest.approx(0.5)  # step 3 left out
    assert summary["arms"]["grpo"]["boxed"]["avg_vs_start"]["mean"] == pytest.approx((1 / 8 + 0) / 2)
    versus = summary["versus"]["cegppo"]
    assert [e["boxed"]["avg"][0] for e in versus["per_seed"]] == pytest.approx([3 / 8, 3 / 8])
    assert [e["train_entropy"] for e in versus["per_seed"]] == pytest.approx([0.2, 0.21])
    claims = {c["claim"][:5]: c["verdict"] for c in report.claims(summary, ["boxed"])}
    assert claims == {"(i) C": "yes", "(iii)": "yes"}
    settings = {"protocols": ["boxed", "lighteval"], "eval_dataset": "d", "eval_temperature": None, "temperature": 1.0,
                "max_steps": 3, "prompts_per_step": 2, "num_generations": 2, "steps_per_generation": 1,
                "dynamic_sampling": False, "oversampling": 1.0, "use_peft": False, "lora_r": 1, "learning_rate": 1.0,
                "max_completion_length": 4}  # fmt: skip
    table = report.markdown(start, runs, summary, settings)
    assert "| CE-GPPO (0.5, 1) seed 0 | 87.5 +- 12.5 | 100.0 +- 0.0 | +50.0 +- 20.4 | 87.5 |" in table
    assert "| GRPO | 2 | 43.8 +- 6.2 |" in table
    assert "| (i) CE-GPPO's entropy stays above GRPO's over training | +0.200, +0.210 nats | **yes** |" in table
    # The figure's curves: one point per generation batch, whether logged every step (entropy) or once (reward).
    assert report._smooth([(1, 1.0), (2, 3.0), (9, 5.0)], 8) == ([2, 9], [2.0, 5.0])
    assert report._smooth([(1, 1.0), (9, 3.0), (17, 5.0)], 8) == ([1, 9, 17], [1.0, 3.0, 5.0])
    one_seed = [r for r in runs if r["seed"] == 0]  # no spread over seeds to show: the means alone
    table = report.markdown(start, one_seed, report.summarize(start, one_seed, ["boxed", "lighteval"]), settings)
    assert "| GRPO | 1 | 50.0 | 75.0 | +12.5 | 1.000 | 0.500 |" in table and "+- nan" not in table


def test_timed_trl_methods_exist_and_nest_as_the_timer_assumes():
    """Private TRL 1.16 names the timer wraps: the old-log-prob pass is the call of
    `_get_per_token_logps_and_entropies` made inside `_generate_and_score_completions`, generation `_generate`, the
    reward `_calculate_rewards`."""
    import inspect

    from trl import GRPOTrainer

    from cegppo_trl import CEGPPOTrainer

    for name in TIMED_METHODS:
        assert callable(getattr(CEGPPOTrainer, name)), name
    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for called in ("self._generate(", "self._calculate_rewards(", "self._get_per_token_logps_and_entropies("):
        assert called in scoring, called


def test_a_yaml_file_carries_the_flags_and_the_command_line_wins(tmp_path):
    from cegppo_trl.scripts.compare import parse

    config = tmp_path / "study.yaml"
    config.write_text("arms: [grpo, '0,1']\nseeds: [3, 4]\nmax_steps: 16\nuse_peft: true\n")
    args = parse(["--config", str(config), "--max_steps", "8"])
    assert ([a.name for a in args.arm_list], args.seeds, args.max_steps, args.use_peft) == (
        ["grpo", "b0-1"],
        [3, 4],
        8,
        True,
    )


def test_the_smollm2_wrapper_passes_the_committed_settings_and_the_study_preset():
    learning = load_script(ROOT / "experiments" / "real_model_learning.py")
    from cegppo_trl.scripts.compare import parse

    committed = parse(learning.settings(["--seeds", "0"]))
    assert (committed.arms, committed.seeds, committed.max_steps, committed.eval_k) == (["cegppo", "grpo"], [0], 24, 4)
    assert (committed.temperature, committed.max_completion_length, committed.use_peft) == (0.7, 28, True)
    study = parse(learning.settings(["--study"]))
    assert (study.steps_per_generation, study.dynamic_sampling, study.seeds, study.max_steps) == (
        8,
        True,
        [0, 1, 2],
        48,
    )
    # The committed Part B results (docs/study/smollm2) were made with these settings (the model: where it was built).
    made = json.loads((ROOT / "docs" / "study" / "smollm2" / "results.json").read_text())["settings"]
    shaping = {k: v for k, v in study.shaping().items() if k != "model"}
    assert {k: made[k] for k in shaping} == shaping and made["model"].endswith("SmolLM2-135M-Instruct")


def test_generation_speed_command_prints_its_table(tiny_checkpoint):
    """experiments/generation_speed.py as a user runs it, HF backend only (vLLM's side runs where vLLM is installed:
    docs/real_model.md quotes that run), on the tests' tiny checkpoint instead of SmolLM2."""
    argv = [sys.executable, ROOT / "experiments" / "generation_speed.py", "--model", tiny_checkpoint, "--backends",
            "hf", "--eval_problems", "3"]  # fmt: skip
    proc = run_checked(argv, ROOT, timeout=300)
    assert "| hf | training batch (8 prompts x 8) |" in proc.stdout
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| hf |")]
    assert [int(row[5]) for row in rows] == [64, 12]  # samples: 8 x 8, then 3 problems x 4
    assert all(float(row[4]) >= 0 for row in rows)  # seconds (0.0 when the tiny model is that fast)


def test_the_readme_study_command_made_the_committed_results():
    """The README's and docs/comparison.md's Part A commands have the settings of the committed study results (the
    same fingerprint: `cegppo-compare` with them reuses those runs), and the README shows the committed tables."""
    import shlex

    from doc_blocks import code_blocks

    from cegppo_trl.scripts.compare import parse

    committed = json.loads((ROOT / "docs" / "study" / "tiny" / "results.json").read_text())
    for doc in (ROOT / "README.md", ROOT / "docs" / "comparison.md"):
        lines = [b.body.replace("\\\n", " ") for b in code_blocks(doc) if "--max_steps 256" in b.body]
        command = next(line for body in lines for line in body.splitlines() if "cegppo-compare " in line)
        args = parse(shlex.split(command, comments=True)[1:])
        assert args.shaping() == {k: v for k, v in committed["settings"].items() if k in args.shaping()}, doc
        assert (args.arms, args.seeds) == (committed["settings"]["arms"], committed["settings"]["seeds"])
    table = (ROOT / "docs" / "study" / "tiny" / "results.md").read_text().split("Over seeds")[1].split("\n\nTime (")[0]
    assert table.strip() in (ROOT / "README.md").read_text()  # the arms over seeds, each minus GRPO, the verdicts


def test_a_checkpoint_cut_short_is_passed_over(tmp_path):
    """A stop in the middle of a save leaves a checkpoint without trainer_state.json (written last): resuming passes
    over it to the newest complete one, and says so."""
    from cegppo_trl.comparison.jobs import resume_point
    from cegppo_trl.divergence import EXTRA_STATE_FILE

    for step, complete in ((2, True), (4, True), (6, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / EXTRA_STATE_FILE).write_text("{}")  # the guard checked its weights
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    checkpoint, lines = resume_point(tmp_path)
    assert checkpoint == str(tmp_path / "checkpoint-4")
    assert lines == [f"Skipping {tmp_path / 'checkpoint-6'}: not a complete checkpoint (no trainer_state.json)."]
