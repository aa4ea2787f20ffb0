"""The shipped SLURM scripts (slurm/train.slurm, slurm/evaluate.slurm), run unmodified with `bash` on one machine under
stand-ins for SLURM (tests/standins/slurm/: `srun` starts each "node" of a step as a local process group with the
SLURM_* variables of its task; `scontrol show hostnames`; the batch shell's SLURM_* variables set here). The nodes are
127.0.0.1 and 127.0.0.2 (both loopback), so the launchers really rendezvous over TCP as separate machines would.

* Fast, with recorders for `accelerate` and `vllm` (tests/standins/recorders/): what each node's launcher and the vLLM
  node are started with.
* Slow: 2 nodes x 1 process (gloo) train the tiny recipe (`builtin:tiny`: both nodes start building it into the shared
  output_dir together), checkpoint, are stopped by SIGTERM sent to every process of the step (as SLURM's
  `--signal=TERM@120` does before the time limit), and the same sbatch command resumes and finishes; `evaluate.slurm`
  runs `cegppo-eval` on the result.

Not run here: real SLURM, several real machines, NCCL, GPUs and a real vLLM server (docs/launch.md lists them).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from launching import free_port, logged_steps, subprocess_env
from shared import ROOT, TINY_RECIPE, assert_trls_vllm_serve_settings, run_checked
from signal_runs import complete_checkpoints


TRAIN_SLURM = ROOT / "slurm" / "train.slurm"
EVALUATE_SLURM = ROOT / "slurm" / "evaluate.slurm"
STANDINS = ROOT / "tests" / "standins"
PAPER_RECIPE = "recipes/DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_paper.yaml"
TIMEOUT_S = 900  # generous: the machine is shared; the slow runs take about a minute each on an idle 2-core machine


def slurm_env(log: Path, nodes: str, recorders: bool = False) -> dict[str, str]:
    """The batch shell's environment on the first node of a job of `nodes`, with SLURM's stand-ins first on PATH."""
    env = subprocess_env()
    env.pop("SLURM_GPUS_ON_NODE", None)
    path = [str(STANDINS / "slurm"), *([str(STANDINS / "recorders")] if recorders else [])]
    env.update(
        PATH=os.pathsep.join([*path, str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        CEGPPO_STANDIN_SLURM_LOG=str(log),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=nodes,
        SLURM_NODEID="0",  # the batch shell runs on the job's first node: this is what the rank trap expands
        SLURM_PROCID="0",
        MASTER_PORT=str(free_port()),
    )
    return env


def events(log: Path, kind: str) -> list[dict]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == kind]


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def machine_ranks(log: Path) -> list[int]:
    """The --machine_rank of each node's `accelerate launch`, in node order: [0, 1, ...] when each node has its own."""
    launches = sorted(events(log, "accelerate"), key=lambda e: int(e["SLURM_NODEID"]))
    return [int(option(e["argv"], "--machine_rank")) for e in launches]


def run_batch(script: Path, args: list[str], env: dict, cwd: Path, timeout: float, expect=0):
    """`bash script args`; it must exit `expect`."""
    return run_checked(["bash", script, *args], cwd, env, timeout, expect)


def recorded_batch(script: Path, args: list[str], nodes: str, tmp_path: Path) -> Path:
    """Run `script` with the recorders for `accelerate` and `vllm`; it must exit 0. Returns the stand-ins' log."""
    log = tmp_path / "slurm.jsonl"
    run_batch(script, args, slurm_env(log, nodes, recorders=True), tmp_path, timeout=300)
    return log


def test_each_node_gets_its_own_machine_rank_and_the_vllm_node_serves(tmp_path):
    args = ["--recipe", PAPER_RECIPE, "--accelerate-config", "zero2", "--processes-per-node", "4", "--vllm-node",
            "--vllm-tp", "2", "--", "--use_cpu", "true", "--gradient_accumulation_steps", "4",
            "--steps_per_generation", "32"]  # fmt: skip
    log = recorded_batch(TRAIN_SLURM, args, "node[1-3]", tmp_path)
    assert machine_ranks(log) == [0, 1]
    launches = events(log, "accelerate")
    recipe = yaml.safe_load((ROOT / PAPER_RECIPE).read_text())
    for launch in launches:
        argv = launch["argv"]
        assert argv[0] == "launch" and option(argv, "--config_file") == str(ROOT / "accelerate_configs/zero2.yaml")
        assert (option(argv, "--num_machines"), option(argv, "--num_processes")) == ("2", "8")
        assert (option(argv, "--main_process_ip"), option(argv, "--rdzv_backend")) == ("node1", "static")
        # The override after `--` wins over the recipe's 8, as it does in the trainer (DeepSpeed needs them equal).
        assert option(argv, "--gradient_accumulation_steps") == "4" != str(recipe["gradient_accumulation_steps"])
        assert option(argv, "--mixed_precision") == "bf16" and recipe["bf16"] is True
        train = argv[argv.index("-m") + 1 :]
        assert train[0] == "cegppo_trl.scripts.train" and option(train, "--config") == PAPER_RECIPE
        assert (option(train, "--vllm_mode"), option(train, "--vllm_server_host")) == ("server", "node3")
    (vllm,) = events(log, "vllm")
    assert vllm["VLLM_SERVER_DEV_MODE"] == "1"
    argv = vllm["argv"]
    assert argv[:2] == ["serve", recipe["model_name_or_path"]]
    assert (option(argv, "--tensor-parallel-size"), option(argv, "--data-parallel-size")) == ("2", "2")
    assert_trls_vllm_serve_settings(argv)
    steps = events(log, "step")
    assert sorted(s["nodes"] for s in steps) == [["node1", "node2"], ["node3"]]
    assert all(s["kill_on_bad_exit"] for s in steps), "every srun needs --kill-on-bad-exit=1"
    assert {tuple(e["statuses"]) for e in events(log, "exit")} == {(0,), (0, 0)}  # the server stopped after training


def test_the_rank_check_catches_a_double_quoted_slurm_nodeid(tmp_path):
    """The trap the script avoids: $SLURM_NODEID expanded by the batch shell (node 0) gives every node rank 0, and a
    static rendezvous never completes. The check of the test above reports it on a copy with the trap."""
    shipped = TRAIN_SLURM.read_text()
    correct = '--machine_rank "$SLURM_NODEID"'
    assert shipped.count(correct) == 1
    trapped = tmp_path / "trapped.slurm"
    trapped.write_text(shipped.replace(correct, "--machine_rank '\"$SLURM_NODEID\"'"))
    args = ["--recipe", PAPER_RECIPE, "--accelerate-config", "multi_gpu", "--", "--use_cpu", "true"]
    log = recorded_batch(trapped, args, "node[1-2]", tmp_path)
    assert machine_ranks(log) == [0, 0]
    # With no override the launcher takes the recipe's gradient accumulation.
    expected = str(yaml.safe_load((ROOT / PAPER_RECIPE).read_text())["gradient_accumulation_steps"])
    assert {option(e["argv"], "--gradient_accumulation_steps") for e in events(log, "accelerate")} == {expected}


def test_unknown_or_missing_options_stop_before_any_step(tmp_path):
    log = tmp_path / "slurm.jsonl"
    env = slurm_env(log, "node[1-2]", recorders=True)
    proc = run_batch(TRAIN_SLURM, ["--accelerate-config", "zero3"], env, tmp_path, timeout=60, expect=2)
    assert "--recipe is required" in proc.stderr
    proc = run_batch(TRAIN_SLURM, ["--recipe", TINY_RECIPE, "--vllm"], env, tmp_path, timeout=60, expect=2)
    assert "unknown option --vllm" in proc.stderr
    assert not log.exists(), "a step was started"


SAVE_STEPS, MAX_STEPS = 4, 8  # the tiny recipe's generation batch feeds 4 optimizer steps: checkpoints at boundaries


def _kill_steps(log: Path, signum: int) -> None:
    """`signum` to every process of every running step, as SLURM signals a job step (proctrack: all its processes)."""
    for step in events(log, "step") if log.exists() else []:
        for pgid in step["pgids"]:
            try:
                os.killpg(pgid, signum)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_two_nodes_train_stop_on_sigterm_and_resume(tmp_path):
    out = tmp_path / "run"
    args = ["--recipe", TINY_RECIPE, "--accelerate-config", "multi_gpu", "--processes-per-node", "1", "--",
            "--output_dir", str(out), "--max_steps", str(MAX_STEPS), "--save_strategy", "steps",
            "--save_steps", str(SAVE_STEPS), "--tiny_sft_steps", "10"]  # fmt: skip
    first_log = tmp_path / "first.jsonl"
    batch = subprocess.Popen(["bash", str(TRAIN_SLURM), *args], env=slurm_env(first_log, "127.0.0.[1-2]"),
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not complete_checkpoints(out) and batch.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert complete_checkpoints(out), "no checkpoint was written before the run ended or timed out"
        _kill_steps(first_log, signal.SIGTERM)
        output, _ = batch.communicate(timeout=300)
    finally:
        if batch.poll() is None:
            _kill_steps(first_log, signal.SIGKILL)
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
    assert batch.returncode == 143, output[-6000:]
    # Each node stops as SIGTERM says (the first to exit makes srun --kill-on-bad-exit=1 send SIGTERM to the other
    # again, which also ends in 143).
    assert [e["statuses"] for e in events(first_log, "exit")] == [[143, 143]], output[-6000:]
    stopped_at = max(complete_checkpoints(out))
    assert stopped_at < MAX_STEPS and not (out / "model.safetensors").exists(), output[-3000:]
    # One builder of builtin:tiny for the two nodes: a complete build, no folder of a second one left over.
    assert (out / "tiny-init" / "tiny_build.json").is_file() and not list(out.glob(".tiny-init.*"))

    second_log = tmp_path / "second.jsonl"
    proc = run_batch(TRAIN_SLURM, args, slurm_env(second_log, "127.0.0.[1-2]"), tmp_path, timeout=TIMEOUT_S)
    assert f"Resuming from {out / f'checkpoint-{stopped_at}'}" in proc.stdout + proc.stderr
    steps = logged_steps(out, MAX_STEPS)
    # Both nodes trained: each of the 2 processes took its own 2 prompts per step from the 256 rows.
    assert steps[-1]["epoch"] == pytest.approx(MAX_STEPS * 2 * 2 / 256)
    assert (out / "model.safetensors").is_file()
    assert re.search(r"2 training node\(s\) \(127\.0\.0\.1,127\.0\.0\.2\) x 1 processes", proc.stdout)

    eval_log = tmp_path / "eval.jsonl"
    report = tmp_path / "eval.json"
    eval_args = [str(out), "--datasets", "builtin:arithmetic_eval", "--max-problems", "2", "--k", "1",
                 "--max-new-tokens", "8", "--output", str(report)]  # fmt: skip
    run_batch(EVALUATE_SLURM, eval_args, slurm_env(eval_log, "127.0.0.1"), tmp_path, timeout=TIMEOUT_S)
    assert "avg@1" in json.dumps(json.loads(report.read_text()))
    assert [s["kill_on_bad_exit"] for s in events(eval_log, "step")] == [True]
