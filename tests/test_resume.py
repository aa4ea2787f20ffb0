"""Resume, said plainly.

TRL keeps the completions of a generation batch in memory only: a run resumed from a checkpoint taken in the middle of
a generation batch generates a fresh batch where the uninterrupted run would have reused the buffered one, so from there
on it is a different run. A checkpoint at a generation-batch boundary resumes the same run (bit for bit on CPU), so
every shipped recipe saves at boundaries, and says why next to `save_steps` (docs/launch.md).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import controller_state, free_port, launcher, saved_weights, step_logs, subprocess_env
from shared import RECIPES, ROOT, RUN_TIMEOUT_S, TINY_RECIPE, parse_train_args, recipe_id


SCRIPT = ROOT / "examples" / "train_cegppo.py"


def optimizer_steps_per_generation_batch(config) -> int:
    """How many optimizer steps one generation batch feeds: TRL generates every `steps_per_generation` micro-batches
    and passes over the batch `num_iterations` times; an optimizer step takes `gradient_accumulation_steps`."""
    assert config.steps_per_generation % config.gradient_accumulation_steps == 0
    return config.steps_per_generation // config.gradient_accumulation_steps * config.num_iterations


@pytest.mark.parametrize("recipe", RECIPES, ids=recipe_id)
def test_recipe_checkpoints_fall_on_generation_batch_boundaries(recipe):
    _, config, _ = parse_train_args("--config", recipe)  # with --use_cpu true: a recipe's bf16 parses without a GPU
    per_batch = optimizer_steps_per_generation_batch(config)
    strategy = config.save_strategy.value
    assert strategy in ("no", "steps"), (
        f"{recipe_id(recipe)}: save_strategy {strategy!r} (epoch ends need not be boundaries)"
    )
    if strategy == "no":
        return
    assert config.save_steps >= 1 and config.save_steps == int(config.save_steps), "save_steps must be a step count"
    assert int(config.save_steps) % per_batch == 0, (
        f"{recipe_id(recipe)}: save_steps {config.save_steps} is not a multiple of the {per_batch} optimizer steps per "
        "generation batch, so its checkpoints resume with fresh completions (docs/launch.md)"
    )
    # The recipe says why, on the save_steps line or in the comment right above it.
    lines = recipe.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("save_steps:"))
    comment = [lines[at]]
    while at > 0 and lines[at - 1].startswith("#"):
        at -= 1
        comment.append(lines[at])
    assert "generation batch" in " ".join(comment), (
        f"{recipe_id(recipe)}: no comment on why save_steps is {config.save_steps}"
    )


ACCUMULATION = 2
PER_GENERATION = 2 * ACCUMULATION  # steps_per_generation = 2 x gradient_accumulation_steps: 2 optimizer steps a batch
MAX_STEPS = 6  # 3 generation batches: steps 1-2, 3-4, 5-6
BOUNDARY, MIDDLE = 4, 3  # checkpoint-4 ends a generation batch; checkpoint-3 is inside one
RUN_ARGS = (
    "--gradient_accumulation_steps", str(ACCUMULATION),
    "--steps_per_generation", str(PER_GENERATION),
    "--max_steps", str(MAX_STEPS),
    # The recipe's 1e-3 drives the barely trained model to all-wrong groups (zero gradient) by step 5; at 3e-4 every
    # step has a policy gradient, so the steps after the resume test the restored weights and optimizer state.
    "--learning_rate", "3e-4",
    # The entropy controller on, pure integral action (kp 0) so that the betas carry the whole history: a resume
    # that lost or changed any of it shows in the betas.
    "--cegppo_entropy_target", "2.0", "--cegppo_entropy_kp", "0.0", "--cegppo_entropy_ki", "0.05",
    "--save_strategy", "steps", "--save_steps", "1",
)  # fmt: skip


def start(model_dir: Path, outputs: list, extras: list, processes=2, config="multi_gpu.yaml") -> list:
    """The tiny recipe with RUN_ARGS (`accelerate launch` with `config` on more than one process), one launcher per
    machine, started together: machine r writes to outputs[r] (the same folder when the machines share it)."""
    port, script = free_port(), [SCRIPT, "--config", TINY_RECIPE, "--model_name_or_path", model_dir, *RUN_ARGS]
    procs = []
    for rank, (out, extra) in enumerate(zip(outputs, extras)):
        cmd = [sys.executable] if processes == 1 else launcher(processes, config, port)
        if len(outputs) == 2:
            cmd += ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
        cmd = [str(a) for a in [*cmd, *script, "--output_dir", out, *extra]]
        io = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), **io))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = RUN_TIMEOUT_S) -> list[str]:
    """Each launcher's output; one still running after `timeout` is killed (with its process group), not waited for."""
    outputs = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                outputs.append(proc.communicate()[0])
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def train(output_dir: Path, model_dir: Path, *extra, machines: int = 1, **kwargs) -> dict:
    procs = start(model_dir, [output_dir] * machines, [extra] * machines, **kwargs)
    for proc, output in zip(procs, finish(procs)):
        assert proc.returncode == 0, output[-8000:]
    return step_logs(output_dir, MAX_STEPS)


_UNINTERRUPTED = {}


def uninterrupted(model_dir: Path, tmp_path_factory, processes=2, config="multi_gpu.yaml") -> tuple[Path, dict]:
    """(output_dir, step logs) of the uninterrupted run on one machine, trained once for this module and
    tests/test_two_machines.py (whose one-machine DDP run is this module's 2-process one)."""
    if (processes, config) not in _UNINTERRUPTED:
        out = tmp_path_factory.mktemp("uninterrupted")
        _UNINTERRUPTED[processes, config] = out, train(out, model_dir, processes=processes, config=config)
    return _UNINTERRUPTED[processes, config]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2], ids=["1-process", "2-processes-ddp"])
def test_resume_at_a_generation_batch_boundary_is_the_uninterrupted_run(
    tiny_recipe_model_dir, tmp_path, tmp_path_factory, processes
):
    full_dir, full = uninterrupted(tiny_recipe_model_dir, tmp_path_factory, processes)
    assert sorted(full) == list(range(1, MAX_STEPS + 1))
    # Generation batches start at steps 1, 3, 5 (only those log the rewards): checkpoint-4 ends one, checkpoint-3 is
    # inside one.
    assert [s for s in full if "reward" in full[s]] == list(range(1, MAX_STEPS + 1, PER_GENERATION // ACCUMULATION))
    # The controller moves the betas every step, so the betas of steps 5-6 depend on the whole run before them.
    beta1 = [full[s]["cegppo/beta1"] for s in sorted(full)]
    assert beta1[0] == 0.5 and len(set(beta1)) == MAX_STEPS, beta1
    assert all(full[s]["grad_norm"] > 0 for s in full), "a step without policy gradient compares nothing"

    checkpoint = full_dir / f"checkpoint-{BOUNDARY}"
    assert controller_state(checkpoint)["num_updates"] == BOUNDARY
    resumed = train(
        tmp_path / "resumed", tiny_recipe_model_dir, "--resume_from_checkpoint", checkpoint, processes=processes
    )
    # Steps 1-4 come from the checkpoint's trainer_state.json; steps 5-6 are trained again. Losses, rewards, entropy,
    # betas, clip fractions, grad norms: all bit for bit.
    assert sorted(resumed) == sorted(full)
    for step in resumed:
        assert resumed[step] == full[step], f"step {step} differs after resuming from checkpoint-{BOUNDARY}"
    ours, theirs = saved_weights(tmp_path / "resumed"), saved_weights(full_dir)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    last = f"checkpoint-{MAX_STEPS}"
    assert controller_state(tmp_path / "resumed" / last) == controller_state(full_dir / last)

    # The other side of the rule: from the checkpoint inside a generation batch the run continues with fresh
    # completions, and is another run from its first step on.
    middle = full_dir / f"checkpoint-{MIDDLE}"
    other = train(tmp_path / "middle", tiny_recipe_model_dir, "--resume_from_checkpoint", middle, processes=processes)
    assert "reward" in other[MIDDLE + 1], "no fresh generation after resuming inside a generation batch"
    assert other[MIDDLE + 1]["loss"] != full[MIDDLE + 1]["loss"]
    assert other[MAX_STEPS]["cegppo/beta1"] != full[MAX_STEPS]["cegppo/beta1"]
    ours = saved_weights(tmp_path / "middle")
    assert any(not torch.equal(ours[k], theirs[k]) for k in ours)
    print(
        f"\n{processes} process(es): beta1 uninterrupted {[round(b, 4) for b in beta1]}; resumed at step {BOUNDARY} "
        f"{[round(resumed[s]['cegppo/beta1'], 4) for s in sorted(resumed)]}; resumed at step {MIDDLE} "
        f"{[round(other[s]['cegppo/beta1'], 4) for s in sorted(other)]}; loss at step {MIDDLE + 1}: uninterrupted "
        f"{full[MIDDLE + 1]['loss']:.6f}, resumed at step {MIDDLE} {other[MIDDLE + 1]['loss']:.6f}"
    )


def test_resume_without_the_controller_state_names_the_file_and_the_fix(tiny_trainer, tmp_path):
    """A process that cannot see `trainer_extra_state.json` (a node without the shared output_dir) must not restart
    the controller from the config's betas while the other processes go on with the saved ones; a checkpoint saved
    with the controller off is refused too, naming the fix."""
    from cegppo_trl.divergence import EXTRA_STATE_FILE

    trainer = tiny_trainer(output_dir=tmp_path / "out", cegppo_entropy_target=2.0)
    checkpoint = tmp_path / "checkpoint-4"
    trainer.save_model(str(checkpoint))  # finite weights: resumable, but without the extra state
    (checkpoint / "trainer_state.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"trainer_extra_state\.json, which process 0 cannot see.*share"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    (checkpoint / EXTRA_STATE_FILE).write_text('{"divergence_guard": {"skipped": {}, "last_finite": null}}')
    with pytest.raises(ValueError, match=r"saved with it off .*resume with cegppo_entropy_target unset"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
