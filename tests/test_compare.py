"""`cegppo-compare` as a user runs it: the console command on the tiny CPU recipe through each launcher (this machine;
`accelerate launch` on 2 gloo processes, plain DDP and DeepSpeed ZeRO-2; SLURM under the stand-ins of
tests/standins/slurm), stopped by SIGTERM and started again (the finished run reused, the stopped one resumed from its
checkpoint), the report rebuilt from copied run folders byte for byte, bad input refused in one line before any
work, and its statistics against hand-computed values."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import free_port, subprocess_env
from shared import ROOT, run_checked

from cegppo_trl.comparison import report
from cegppo_trl.comparison.settings import parse_arm
from cegppo_trl.scripts.compare import main


TINY = "recipes/tiny/cegppo/config_cpu.yaml"
BIN = Path(sys.executable).parent
#: The size flags of the tests' comparisons: steps (cegppo-train's flag, overriding the recipe), problems, k.
SIZES = ["--seeds", "0", "--eval_problems", "12", "--eval_k", "4"]
TIMEOUT_S = 900  # generous: the machine is shared


def _numbers(value):
    if isinstance(value, dict | list):
        return [n for item in (value.values() if isinstance(value, dict) else value) for n in _numbers(item)]
    return [float(value)] if isinstance(value, int | float) and not isinstance(value, bool) else []


def _compare(out, *flags, env=None):
    command = [str(BIN / "cegppo-compare"), "--recipe", TINY, "--arms", "grpo", "cegppo", *SIZES, "--out", str(out),
               *map(str, flags)]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env or subprocess_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip


def _wait_for(paths, process, what: str) -> None:
    deadline = time.time() + TIMEOUT_S
    while not all(p.is_file() for p in paths) and process.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert all(p.is_file() for p in paths), f"{what}:\n" + process.communicate()[0][-4000:]


LAUNCHERS = {
    "local": ["--launcher", "local", "--jobs", "1"],
    "accelerate multi_gpu": [
        "--launcher",
        "accelerate",
        "--accelerate_config",
        "accelerate_configs/multi_gpu.yaml",
        "--num_processes",
        "2",
    ],  # fmt: skip
    "accelerate zero2": [
        "--launcher",
        "accelerate",
        "--accelerate_config",
        "accelerate_configs/zero2.yaml",
        "--num_processes",
        "2",
    ],  # fmt: skip
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_compare_trains_measures_reports_and_resumes_after_sigterm(launcher, tmp_path):
    """Each run trains through the launcher (with accelerate: on 2 processes, both ranks in its log) and is measured
    by cegppo-eval; SIGTERM to the command in the middle of the second run, then the same command: the first run and
    its measurement are reused as they were, the second resumes from its checkpoint; the table, JSON and figure have
    finite numbers, and the report rebuilt from a copy of the folders is the same table byte for byte."""
    out, flags = tmp_path / "cmp", [*LAUNCHERS[launcher], "--max_steps", "24"]
    first = _compare(out, *flags)
    done, second_run = out / "runs" / "grpo-seed0", out / "runs" / "cegppo-seed0"
    _wait_for([done / "eval-boxed.json", second_run / "checkpoint-4" / "trainer_state.json"], first, "first call")
    first.send_signal(signal.SIGTERM)
    stopped = first.communicate(timeout=300)[0]
    assert first.returncode == 143, stopped[-3000:]
    assert "cegppo-compare: stopped. Run the same command again to resume" in stopped
    assert not (second_run / "trainer_state.json").exists(), "the second run finished before the signal"
    kept = {
        name: (done / name).read_bytes() for name in ("eval-boxed.json", "trainer_state.json", "model.safetensors")
    }

    second = _compare(out, *flags)
    log = second.communicate(timeout=TIMEOUT_S)[0]
    assert second.returncode == 0, log[-4000:]
    reused = "start measurement (boxed), grpo-seed0 training, grpo-seed0 measurement (boxed)"
    assert f"reused (finished before): {reused}" in log
    assert "resumed from their newest complete checkpoint: cegppo-seed0 training from checkpoint-" in log
    assert all((done / name).read_bytes() == value for name, value in kept.items())  # not redone
    second_log = (second_run / "train.log").read_text()
    assert "Resuming from" in second_log.split("[cegppo-compare]")[-1]  # cegppo-train resumed the checkpoint
    if launcher != "local":
        for run in (done, second_run):
            text = (run / "train.log").read_text()
            assert "[default0]:" in text and "[default1]:" in text, f"{run.name}: not both ranks"
    result = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["grpo-seed0", "cegppo-seed0"]
    arms = result["summary"]["arms"].values()
    numbers = _numbers([result["summary"]["per_run"], [a["boxed"]["avg"]["mean"] for a in arms]])
    assert numbers and all(math.isfinite(v) for v in numbers)
    table = (out / "results.md").read_text()
    for row in ("| start |", "| GRPO seed 0 |", "| CE-GPPO (0.5, 1) seed 0 |", "Each arm minus GRPO"):
        assert row in table
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    eval_report = json.loads((second_run / "eval-boxed.json").read_text())
    assert len(eval_report["datasets"]["builtin:arithmetic_eval"]["problems"]) == 12

    copy = tmp_path / "copied"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("results.*", "curves.png", "checkpoint-*"))
    run_checked([BIN / "cegppo-compare", "--report_only", "--out", copy], tmp_path)
    assert (copy / "results.md").read_bytes() == (out / "results.md").read_bytes()

    changed = run_checked([BIN / "cegppo-compare", "--recipe", TINY, *SIZES, "--out", out, *flags[:-1], "12"],
                          ROOT, expect=2)  # fmt: skip
    assert "holds a comparison with other settings" in changed.stderr and "'24'] -> [" in changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1


def _slurm_env(log: Path) -> dict:
    env = subprocess_env()
    env.update(PATH=os.pathsep.join([str(ROOT / "tests" / "standins" / "slurm"), str(BIN), env["PATH"]]),
               CEGPPO_STANDIN_SLURM_LOG=str(log), MASTER_PORT=str(free_port()))  # fmt: skip
    env.pop("SLURM_GPUS_ON_NODE", None)
    return env


def _jobs(log: Path) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "sbatch"]


@pytest.mark.slow
def test_slurm_submits_a_training_and_a_dependent_measuring_job_per_run_and_resumes(tmp_path):
    """Under the SLURM stand-ins (sbatch runs each job at once): the start's measurement, per run a train.slurm job
    and an evaluate.slurm job after it (afterok), then the report's job. A run cut after its first checkpoint (its
    later files gone, as a time limit leaves it) is submitted again alone and resumes from that checkpoint."""
    out, log = tmp_path / "cmp", tmp_path / "slurm.jsonl"
    flags = ["--launcher", "slurm", "--accelerate_config", "multi_gpu", "--num_processes", "1", "--max_steps", "8"]
    proc = _compare(out, *flags, env=_slurm_env(log))
    text = proc.communicate(timeout=TIMEOUT_S)[0]
    assert proc.returncode == 0, text[-4000:]
    jobs = _jobs(log)
    scripts = [next(Path(a).name if a.endswith(".slurm") else "report" for a in j["argv"] if a.endswith(".slurm")
                    or a.startswith("--wrap=") and "--report_only" in a) for j in jobs]  # fmt: skip
    assert scripts == ["evaluate.slurm", "train.slurm", "evaluate.slurm", "train.slurm", "evaluate.slurm", "report"]
    for train, measure in ((jobs[1], jobs[2]), (jobs[3], jobs[4])):
        assert f"--dependency=afterok:{train['job']}" in measure["argv"]
    assert all(j["status"] == 0 for j in jobs), jobs
    assert (out / "results.md").is_file() and "| CE-GPPO (0.5, 1) seed 0 |" in (out / "results.md").read_text()

    cut = out / "runs" / "cegppo-seed0"
    for name in ("trainer_state.json", "eval-boxed.json", "model.safetensors"):
        (cut / name).unlink()
    shutil.rmtree(cut / "checkpoint-8")
    again = _compare(out, *flags, env=_slurm_env(log))
    text = again.communicate(timeout=TIMEOUT_S)[0]
    assert again.returncode == 0, text[-4000:]
    assert "resumed from their newest complete checkpoint: cegppo-seed0 training from checkpoint-4" in text
    new = _jobs(log)[len(jobs) :]
    assert len(new) == 3 and "--cegppo_beta1" in new[0]["argv"] and all(j["status"] == 0 for j in new)
    assert (cut / "trainer_state.json").is_file() and "checkpoint-4" in (cut / "train.log").read_text()


def test_slurm_dry_run_prints_every_sbatch_command_with_the_recipe_and_the_arms(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: --dry_run needs none
    out = tmp_path / "cmp"
    flags = ["--recipe", TINY, "--arms", "grpo", "dapo", "--seeds", "0", "--launcher", "slurm", "--dry_run",
             "--accelerate_config", "zero2", "--num_processes", "8", "--out", str(out)]  # fmt: skip
    assert main(flags) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sbatch ")]
    assert len(lines) == 6, lines  # the start's measurement, 2 x (training, measurement), the report
    trains = [line for line in lines if "train.slurm" in line]
    recipe = str(ROOT / TINY)
    assert all(f"--recipe {recipe}" in line and "zero2.yaml" in line and "--processes-per-node 8" in line
               for line in trains)  # fmt: skip
    assert "--cegppo_beta1 0 --cegppo_beta2 0 --seed 0" in trains[0] and "--epsilon_high 0.28" in trains[1]
    assert "'--dependency=afterok:<grpo-seed0 training>'" in lines[2] and "evaluate.slurm" in lines[2]
    assert not out.exists()  # nothing written, nothing built


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--recipe", "no/such.yaml"], "--recipe no/such.yaml: no such file"),
        (["--launcher", "accelerate", "--accelerate_config", "no_such"], "--accelerate_config no_such: no such file"),
        (["--arms", "grpo", "banana"], "--arms 'banana': an arm is grpo, dapo, cegppo"),
        (["--launcher", "slurm"], "--launcher slurm: sbatch is not on the PATH"),
        (["--model_name_or_path", "no/such/dir/"], "model_name_or_path no/such/dir/: "),
        (["--seed", "3"], "--seed: each run sets it"),
        (["--max_stepz", "3"], "--max_stepz 3: neither a cegppo-compare flag nor a cegppo-train one"),
    ],
)
def test_bad_input_is_one_line_before_any_work(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(BIN))  # no sbatch here
    out = tmp_path / "x"
    assert main(["--recipe", TINY, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_an_output_folder_of_other_settings_is_refused(tmp_path, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "comparison.json").write_text(json.dumps({"shaping": {"train_flags": ["--max_steps", "8"]}}))
    assert main(["--recipe", TINY, "--out", str(out), "--max_steps", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "holds a comparison with other settings (" in err
        and "train_flags ['--max_steps', '8'] -> ['--max_steps', '4']" in err
    )
    assert len(err.splitlines()) == 1 and not (out / "runs").exists()


def test_arms():
    assert parse_arm("grpo") == parse_arm("GRPO") and parse_arm("grpo").flags() == ["--cegppo_beta1", "0",
                                                                                    "--cegppo_beta2", "0"]  # fmt: skip
    assert (
        parse_arm("dapo").flags()[-2:] == ["--epsilon_high", "0.28"]
        and parse_arm("cegppo").label == "CE-GPPO (0.5, 1)"
    )
    assert (parse_arm("0,1").name, parse_arm("0,1").label) == ("b0-1", "CE-GPPO (0, 1)")


def test_paired_differences_and_the_verdict_rule():
    assert report.paired([1.0, 0.5, 0.0], [0.5, 0.5, 0.5]) == pytest.approx((0.0, math.sqrt(0.25 / 3)))
    assert report.verdict([0.03, 0.04, 0.05]) == "yes"  # mean 0.04, se 0.0058
    assert report.verdict([-0.03, -0.04, -0.05]) == "no" and report.verdict([-0.03, -0.04, -0.05], -1) == "yes"
    assert report.verdict([0.01, 0.2, 0.0001]) == "inside the noise"  # every seed above, mean < 2 se
    assert report.verdict([0.05]) == "inside the noise" and report.direction([0.01, -0.02]) == "inside the noise"


def _eval_report(correct: list[int], k: int = 4) -> dict:
    problems = [{"index": i, "num_correct": c} for i, c in enumerate(correct)]
    return {"pending": [], "datasets": {"builtin:arithmetic_eval": {"k": k, "problems": problems}}}


def _folders(out: Path) -> None:
    """A comparison's folders as the runs leave them: the settings, the start's and each run's measurement, each
    run's training log."""
    training = {"model": "builtin:tiny", "max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
                "steps_per_generation": 1, "learning_rate": 1e-3, "temperature": 1.0, "max_completion_length": 16,
                "use_peft": False}  # fmt: skip
    shaping = {"protocols": ["boxed"], "eval_datasets": ["builtin:arithmetic_eval"], "eval_k": 4, "eval_problems": 4,
               "eval_preset": None}  # fmt: skip
    (out / "start").mkdir(parents=True)
    (out / "comparison.json").write_text(json.dumps({"shaping": shaping, "arms": ["grpo", "cegppo"],
                                                     "seeds": [0, 1], "training": training}))  # fmt: skip
    (out / "start" / "eval-boxed.json").write_text(json.dumps(_eval_report([0, 1, 2, 0])))
    counts = {("grpo", 0): [1, 1, 2, 0], ("grpo", 1): [2, 1, 2, 0], ("cegppo", 0): [4, 1, 2, 0],
              ("cegppo", 1): [4, 2, 2, 0]}  # fmt: skip
    for (arm, seed), correct in counts.items():
        folder = out / "runs" / f"{arm}-seed{seed}"
        folder.mkdir(parents=True)
        arm_ = parse_arm(arm)
        (folder / "compare_run.json").write_text(json.dumps({"name": folder.name, "arm": arm, "label": arm_.label,
                                                             "seed": seed, "beta1": arm_.beta1, "beta2": arm_.beta2}))  # fmt: skip
        history = [{"step": s, "reward": 0.1 * s, "entropy": 0.5 - 0.1 * s + 0.01 * seed} for s in (1, 2)]
        (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
        (folder / "eval-boxed.json").write_text(json.dumps(_eval_report(correct)))


def test_report_only_rebuilds_the_same_table_from_copied_run_folders(tmp_path, capsys):
    out = tmp_path / "made-here"
    _folders(out)
    assert main(["--report_only", "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    # CE-GPPO seed 0: 7 of 16 samples right (43.8%), GRPO seed 0: 4 of 16; paired per problem +18.75 pp
    assert "| CE-GPPO (0.5, 1) seed 0 | 43.8 +- " in table and "| GRPO seed 0 | 25.0 +- " in table
    # CE-GPPO minus GRPO over seeds: +18.75 and +18.75 pp: every seed above, spread 0: "above"
    assert "| CE-GPPO (0.5, 1) | +18.8 +- 0.0 (above) |" in table
    copy = tmp_path / "copied-back"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("results.*", "curves.png"))
    assert main(["--report_only", "--out", str(copy)]) == 0
    assert (copy / "results.md").read_bytes() == (out / "results.md").read_bytes()
    assert main(["--report_only", "--out", str(tmp_path / "empty")]) == 2
    assert "holds no comparison" in capsys.readouterr().err


def test_local_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["--recipe", TINY, "--arms", "dapo", "--seeds", "3", "--dry_run", "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " -m cegppo_trl.scripts." in line]
    assert (
        len(lines) == 3 and "scripts.eval" in lines[0] and "scripts.eval" in lines[2]
    )  # start, training, its measurement
    assert f"--config {ROOT / TINY} " in lines[1] and "--epsilon_high 0.28 --seed 3 --output_dir" in lines[1]
    assert not out.exists()


@pytest.mark.slow
def test_a_failing_run_names_itself_and_its_log_in_one_line(tmp_path):
    """A run that cannot start (a reward that does not import: cegppo-train refuses it at the start of the run) is
    one line naming it and its log; the start's measurement, which finished, stays finished."""
    out = tmp_path / "cmp"
    flags = ["--arms", "grpo", "--eval_problems", "2", "--eval_k", "1", "--tiny_sft_steps", "1", "--reward_funcs",
             "no_such_module.reward"]  # fmt: skip
    command = [BIN / "cegppo-compare", "--recipe", TINY, "--seeds", "0", "--out", out, *flags]
    failed = run_checked(command, ROOT, subprocess_env(), timeout=TIMEOUT_S, expect=1)
    log = out / "runs" / "grpo-seed0" / "train.log"
    assert f"grpo-seed0 training failed (exit status 2); its log: {log}" in failed.stdout
    assert failed.stderr.strip().splitlines()[-1].startswith("cegppo-compare: 1 command(s) failed")
    assert "cannot import 'no_such_module.reward'" in log.read_text()
    assert (out / "start" / "eval-boxed.json").is_file()
    again = run_checked(command, ROOT, subprocess_env(), timeout=TIMEOUT_S, expect=1)
    assert "reused (finished before): start measurement (boxed)" in again.stdout
