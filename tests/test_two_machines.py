"""Two machines on one box: two `accelerate launch` commands with accelerate's own multi-machine flags
(`--num_machines 2 --machine_rank 0|1 --main_process_ip 127.0.0.1`, one gloo process each) sharing output_dir, as
several nodes share a file system. DDP (`multi_gpu.yaml`) and ZeRO-3 (`zero3.yaml`): they train and save checkpoints,
resume from one, and end equal, bit for bit, to one machine running 2 processes (losses, betas, weights, the entropy
controller's state). Each machine reads the controller's state itself: a machine whose copy of the checkpoint lacks it
stops with the message naming the file. The runs are tests/test_resume.py's (the one-machine DDP run is shared).

What this cannot show: machines that do not share memory bandwidth or a network stack, NCCL, GPUs (docs/launch.md).
"""

import shutil

import pytest
import torch
from launching import controller_state, saved_weights
from test_resume import BOUNDARY, MAX_STEPS, finish, start, train, uninterrupted


pytestmark = pytest.mark.slow  # launches 2-process runs


@pytest.mark.parametrize("config", ["multi_gpu.yaml", "zero3.yaml"], ids=["ddp", "zero3"])
def test_two_machines_train_save_and_resume_as_one_machine(tiny_recipe_model_dir, tmp_path, tmp_path_factory, config):
    one_dir, one = uninterrupted(tiny_recipe_model_dir, tmp_path_factory, 2, config)
    two = train(tmp_path / "two", tiny_recipe_model_dir, machines=2, config=config)
    beta1 = [one[s]["cegppo/beta1"] for s in sorted(one)]
    assert len(set(beta1)) == MAX_STEPS and all(one[s]["grad_norm"] > 0 for s in one), one
    assert two == one
    checkpoint = tmp_path / "two" / f"checkpoint-{BOUNDARY}"
    assert controller_state(checkpoint)["num_updates"] == BOUNDARY
    resumed = train(tmp_path / "resumed", tiny_recipe_model_dir, "--resume_from_checkpoint", checkpoint, machines=2,
                    config=config)  # fmt: skip
    assert resumed == one
    ones = saved_weights(one_dir)
    for out in ("two", "resumed"):
        theirs = saved_weights(tmp_path / out)
        assert theirs.keys() == ones.keys() and all(torch.equal(theirs[k], ones[k]) for k in ones), out
    last = f"checkpoint-{MAX_STEPS}"
    assert controller_state(tmp_path / "resumed" / last) == controller_state(one_dir / last)
    print(f"\n{config}: beta1 {[round(b, 4) for b in beta1]}, the same on one machine, two, and two resumed")

    if config != "multi_gpu.yaml":
        return
    # Machine 1 resumes from its own copy of the checkpoint, without the controller's state: it must stop and say so
    # (it reads the state itself; restarting it from the recipe's betas would train the machines apart).
    from cegppo_trl.divergence import EXTRA_STATE_FILE

    copy = tmp_path / "machine1" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    (copy / EXTRA_STATE_FILE).unlink()
    procs = start(tiny_recipe_model_dir, [tmp_path / "again"] * 2,
                  [("--resume_from_checkpoint", checkpoint), ("--resume_from_checkpoint", copy)])  # fmt: skip
    try:
        output = finish(procs[1:])[0]
    finally:
        finish(procs[:1], timeout=5)  # machine 0 waits for machine 1: stopped after 5 s
    assert procs[1].returncode != 0
    assert f"needs its state, {copy / EXTRA_STATE_FILE}, which process 1 cannot see" in output, output[-6000:]
