"""Two machines on one box: two `accelerate launch` commands with accelerate's own multi-machine flags
(`--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1`, one gloo process each) sharing output_dir, as
several nodes share a file system. DDP (`multi_gpu.yaml`) and ZeRO-3 (`zero3.yaml`): they train and save checkpoints,
resume from one, and end equal, bit for bit, to one machine running 2 processes (losses, betas, weights, the entropy
controller's state). Each machine reads the controller's state itself: a machine whose copy of the checkpoint lacks it
stops with the message naming the file.

What this cannot show: machines that do not share memory bandwidth or a network stack, NCCL, GPUs (docs/launch.md).
"""

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from launching import controller_state, free_port, launcher, saved_weights, step_logs, subprocess_env


pytestmark = pytest.mark.slow  # launches 2-process runs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_cegppo.py"
TINY_RECIPE = ROOT / "recipes" / "tiny" / "cegppo" / "config_cpu.yaml"
TIMEOUT_S = 900  # generous: the machine is shared; a run takes 15-40 s on an idle 2-core machine
MAX_STEPS, BOUNDARY = 4, 2  # steps_per_generation 2 with accumulation 1: checkpoint-2 ends a generation batch
RUN_ARGS = (
    "--max_steps", str(MAX_STEPS), "--steps_per_generation", "2", "--learning_rate", "3e-4",
    # The entropy controller on, integral action only, so the betas carry the whole history (tests/test_resume.py).
    "--cegppo_entropy_target", "2.0", "--cegppo_entropy_kp", "0.0", "--cegppo_entropy_ki", "0.05",
    "--save_strategy", "steps", "--save_steps", str(BOUNDARY),
)  # fmt: skip


def _launcher(config: str, port: int, machines: int, rank: int = 0) -> list[str]:
    cmd = launcher(2, config, port)
    if machines == 2:
        cmd += ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
    return cmd


def _start(config: str, model: Path, outputs: list[Path], machines: int, extra=((),)) -> list[subprocess.Popen]:
    """One launcher per machine, started together; machine r writes to outputs[r] (the same folder: shared)."""
    port, train = (
        free_port(),
        [str(SCRIPT), "--config", str(TINY_RECIPE), "--model_name_or_path", str(model), *RUN_ARGS],
    )
    io = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return [
        subprocess.Popen(
            [*_launcher(config, port, machines, rank), *train, "--output_dir", str(outputs[rank]), *extra[rank]],
            cwd=ROOT,
            env=subprocess_env(),
            **io,
        )
        for rank in range(machines)
    ]


def _finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT_S) -> list[str]:
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outputs


def _train(config: str, model: Path, out: Path, machines: int, *extra: str) -> dict:
    procs = _start(config, model, [out, out], machines, (extra, extra))
    outputs = _finish(procs)
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-8000:]
    return step_logs(out, MAX_STEPS)


@pytest.mark.parametrize("config", ["multi_gpu.yaml", "zero3.yaml"], ids=["ddp", "zero3"])
def test_two_machines_train_save_and_resume_as_one_machine(tiny_recipe_model_dir, tmp_path, config):
    one = _train(config, tiny_recipe_model_dir, tmp_path / "one", machines=1)
    two = _train(config, tiny_recipe_model_dir, tmp_path / "two", machines=2)
    beta1 = [one[s]["cegppo/beta1"] for s in sorted(one)]
    assert len(set(beta1)) == MAX_STEPS and all(one[s]["grad_norm"] > 0 for s in one), one
    assert two == one
    checkpoint = tmp_path / "two" / f"checkpoint-{BOUNDARY}"
    assert controller_state(checkpoint)["num_updates"] == BOUNDARY
    resumed = _train(config, tiny_recipe_model_dir, tmp_path / "resumed", 2, "--resume_from_checkpoint", checkpoint)
    assert resumed == one
    ones = saved_weights(tmp_path / "one")
    for out in ("two", "resumed"):
        theirs = saved_weights(tmp_path / out)
        assert theirs.keys() == ones.keys() and all(torch.equal(theirs[k], ones[k]) for k in ones), out
    last = f"checkpoint-{MAX_STEPS}"
    assert controller_state(tmp_path / "resumed" / last) == controller_state(tmp_path / "one" / last)
    print(f"\n{config}: beta1 {[round(b, 4) for b in beta1]}, the same on one machine, two, and two resumed")

    if config != "multi_gpu.yaml":
        return
    # Machine 1 resumes from its own copy of the checkpoint, without the controller's state: it must stop and say so
    # (it reads the state itself; restarting it from the recipe's betas would train the machines apart).
    from cegppo_trl.trainer import CONTROLLER_STATE_FILE

    copy = tmp_path / "machine1" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    (copy / CONTROLLER_STATE_FILE).unlink()
    procs = _start(config, tiny_recipe_model_dir, [tmp_path / "again", tmp_path / "again"], 2,
                   (("--resume_from_checkpoint", str(checkpoint)), ("--resume_from_checkpoint", str(copy))))  # fmt: skip
    try:
        output = procs[1].communicate(timeout=TIMEOUT_S)[0]
    finally:
        _finish(procs, timeout=5) if procs[0].poll() is None else None
    assert procs[1].returncode != 0
    assert f"needs its state, {copy / CONTROLLER_STATE_FILE}, which process 1 cannot see" in output, output[-6000:]
