"""The work of `cegppo-compare`: every run a `cegppo-train` run of the recipe, every measurement a `cegppo-eval` run,
each a command launched by one of three existing engines (this machine, `accelerate launch`, SLURM's `sbatch`).

A run's folder ``runs/<arm>-seed<N>/`` is its `cegppo-train` output_dir (checkpoints, then the model with its prompt
and sampling and ``trainer_state.json``: done), plus ``compare_run.json`` (the arm and seed), ``train.log``,
``eval-<protocol>.json`` (`cegppo-eval`'s report: per problem its correct count) and ``eval-<protocol>.log``. The start
model's measurement is in ``start/``. A run that was stopped resumes from its newest complete checkpoint
(`cegppo-train`'s own auto-resume); a finished run or measurement is never redone.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .settings import CompareArguments, threads_per_process


@dataclass(eq=False)  # a task is itself: hashed and compared by identity
class Task:
    """One command of the comparison: a run's training or a model's measurement."""

    name: str  # as printed: "grpo-seed0 training", "start measurement (boxed)"
    kind: str  # "train" or "eval"
    folder: Path  # the run's folder (train) or the model's (eval)
    flags: list[str]  # cegppo-train's flags after the recipe, or cegppo-eval's after the model
    log: Path
    marker: Path  # exists when done: trainer_state.json, or the finished eval report
    after: Task | None = None
    seconds: float | None = field(default=None, repr=False)

    def done(self) -> bool:
        if not self.marker.is_file():
            return False
        return self.kind == "train" or not json.loads(self.marker.read_text()).get("pending", [None])


def measurement_flags(args: CompareArguments, script_args, training_args) -> list[str]:
    """`cegppo-eval`'s flags for every model: the held-out sets and k, and the recipe's prompt and sampling (so the
    start model and every trained model are prompted and sampled alike), unless --eval_preset sets them."""
    flags = [
        "--datasets",
        *args.eval_datasets,
        "--k",
        str(args.eval_k),
        "--backend",
        args.eval_backend,
        "--no-progress",
    ]
    flags += [] if args.eval_problems is None else ["--max_problems", str(args.eval_problems)]
    if args.eval_preset:
        flags += ["--preset", args.eval_preset]
    else:
        flags += ["--instruction", script_args.instruction or "none", "--system_prompt", script_args.system_prompt or
                  "none", "--temperature", f"{training_args.temperature:g}", "--top_p", f"{training_args.top_p:g}",
                  "--top_k", str(training_args.top_k or 0), "--max_new_tokens", str(training_args.max_completion_length)]  # fmt: skip
        if script_args.example_problem is not None:
            flags += ["--example_problem", script_args.example_problem, "--example_answer", script_args.example_answer]
    return flags + shlex.split(args.eval_args)


def plan(args: CompareArguments, recipe, out: Path, start_model: str) -> tuple[list[dict], list[Task]]:
    """The runs (their ``compare_run.json`` contents) and the tasks: the start's measurements, then per run its
    training and its measurements after it."""
    script_args, training_args, _ = recipe
    measure = measurement_flags(args, script_args, training_args)
    keep = [] if str(training_args.save_strategy).split(".")[-1].lower() != "no" else [
        "--save_strategy", "steps", "--save_steps", str(training_args.steps_per_generation or 1)]  # fmt: skip
    tasks = [
        _measure(out / "start", start_model, p, measure, f"start measurement ({p})", None) for p in args.protocols
    ]
    runs = []
    for arm in args.arm_list:
        for seed in args.seeds:
            name, folder = f"{arm.name}-seed{seed}", out / "runs" / f"{arm.name}-seed{seed}"
            runs.append({"name": name, "arm": arm.name, "label": arm.label, "seed": seed, "beta1": arm.beta1,
                         "beta2": arm.beta2, "epsilon_high": arm.epsilon_high})  # fmt: skip
            flags = [*args.train_flags, "--model_name_or_path", start_model, *arm.flags(), "--seed", str(seed),
                     "--output_dir", str(folder), *keep]  # fmt: skip
            train = Task(f"{name} training", "train", folder, flags, folder / "train.log",
                         folder / "trainer_state.json")  # fmt: skip
            tasks.append(train)
            tasks += [
                _measure(folder, str(folder), p, measure, f"{name} measurement ({p})", train) for p in args.protocols
            ]
    return runs, tasks


def _measure(folder: Path, model: str, protocol: str, flags: list[str], name: str, after: Task | None) -> Task:
    report = folder / f"eval-{protocol}.json"
    return Task(name, "eval", Path(model), [*flags, "--protocol", protocol, "--output", str(report)],
                folder / f"eval-{protocol}.log", report, after)  # fmt: skip


def build_start_model(args: CompareArguments, recipe, out: Path) -> str:
    """The start model of every run: the recipe's, or for ``builtin:tiny`` the tiny model built and SFT-warm-started
    once in ``<out>/start-model`` (so every arm and seed starts from the same weights), saved with the recipe's prompt
    and sampling (`cegppo-eval` reads them from the model, as from a trained one)."""
    script_args, training_args, model_args = recipe
    if model_args.model_name_or_path != "builtin:tiny":
        return model_args.model_name_or_path
    path = out / "start-model"
    if args.dry_run:
        return str(path)
    import torch

    from ..prompt_settings import save_eval_settings
    from ..tiny_model import materialize_tiny

    torch.set_num_threads(threads_per_process(1))
    print(
        f"[cegppo-compare] builtin:tiny: building (or reusing) {path}, {script_args.tiny_sft_steps} SFT steps",
        flush=True,
    )
    materialize_tiny(path, seed=training_args.seed, sft_steps=script_args.tiny_sft_steps)
    save_eval_settings(path, instruction=script_args.instruction, system_prompt=script_args.system_prompt,
                       temperature=training_args.temperature, top_p=training_args.top_p,
                       top_k=training_args.top_k or 0, max_new_tokens=training_args.max_completion_length,
                       note="cegppo-compare: the start model of every run",
                       example=None if script_args.example_problem is None else (script_args.example_problem,
                                                                                 script_args.example_answer))  # fmt: skip
    return str(path)


# --------------------------------------------------------------------------------------------------- commands
def local_command(task: Task, args: CompareArguments, recipe) -> list[str]:
    """The task on this machine: `cegppo-train` in one process (--launcher local) or through `accelerate launch`
    (--launcher accelerate: its config, --num_processes, the recipe's precision and gradient accumulation, each
    rank's lines prefixed by its rank); `cegppo-eval` in one process."""
    if task.kind == "eval":
        return [sys.executable, "-m", "cegppo_trl.scripts.eval", str(task.folder), *task.flags]
    train = ["-m", "cegppo_trl.scripts.train", "--config", args.recipe, *task.flags]
    return [*(accelerate_prefix(args, recipe) if args.launcher == "accelerate" else [sys.executable]), *train]


def accelerate_prefix(args: CompareArguments, recipe) -> list[str]:
    _, training_args, _ = recipe
    precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no"
    processes = [] if args.num_processes is None else ["--num_processes", str(args.num_processes)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config, *processes,
            "--mixed_precision", precision, "--gradient_accumulation_steps",
            str(training_args.gradient_accumulation_steps), "--main_process_port", str(_free_port()), "--tee", "3"]  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sbatch_command(task: Task, args: CompareArguments, job_of: dict[str, str]) -> list[str]:
    """The task as a SLURM job: training through slurm/train.slurm, a measurement through slurm/evaluate.slurm
    after its training job (``--dependency=afterok``)."""
    from ..resources import resolve_shipped_path

    head = ["sbatch", "--parsable", f"--job-name=cegppo-{task.name.split(' ')[0]}", f"--output={task.log}",
            "--open-mode=append", *shlex.split(args.sbatch_args)]  # fmt: skip
    if task.after is not None and task.after.name in job_of:
        head.append(f"--dependency=afterok:{job_of[task.after.name]}")
    if task.kind == "eval":
        return [*head, os.path.abspath(resolve_shipped_path("slurm/evaluate.slurm")), str(task.folder), *task.flags]
    processes = [] if args.num_processes is None else ["--processes-per-node", str(args.num_processes)]
    return [*head, f"--nodes={args.nodes}", os.path.abspath(resolve_shipped_path("slurm/train.slurm")), "--recipe",
            os.path.abspath(args.recipe), "--accelerate-config", args.accelerate_config, *processes, "--", *task.flags]  # fmt: skip


# --------------------------------------------------------------------------------------------------- launchers
def run_here(tasks: list[Task], args: CompareArguments, recipe, say) -> list[str]:
    """Run the tasks not done on this machine, `--jobs` at once (local) or one at a time (accelerate: a run takes
    the machine's GPUs), each after the task it needs. Returns one line per failure; a failed training's
    measurements are not started, the other runs go on. On SIGINT / SIGTERM every running command gets the same
    signal (each `cegppo-train` finishes its step and keeps its checkpoints) and the exception goes on."""
    at_once = args.jobs if args.launcher == "local" else 1
    threads = threads_per_process(at_once * (args.num_processes or 1) if args.launcher == "accelerate" else at_once)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    waiting = [t for t in tasks if not t.done()]
    running: dict[Task, tuple[subprocess.Popen, float]] = {}
    failed: list[Task] = []
    failures: list[str] = []
    try:
        while waiting or running:
            for task in [t for t in waiting if t.after in failed]:
                waiting.remove(task)
                failed.append(task)
            for task in [t for t in waiting if t.after is None or t.after.done()][: at_once - len(running)]:
                waiting.remove(task)
                task.log.parent.mkdir(parents=True, exist_ok=True)
                command = local_command(task, args, recipe)
                with task.log.open("a") as log:
                    log.write(f"[cegppo-compare] {shlex.join(command)}\n")
                    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True)  # fmt: skip
                running[task] = (process, time.perf_counter())
                say(f"{task.name}: started, log {task.log}")
            time.sleep(0.2)
            for task, (process, began) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[task]
                task.seconds = time.perf_counter() - began
                if process.returncode == 0 and task.done():
                    say(f"{task.name}: done in {task.seconds:.0f} s")
                    _record_time(task)
                else:
                    failed.append(task)
                    failures.append(f"{task.name} failed (exit status {process.returncode}); its log: {task.log}")
                    say(failures[-1])
    except BaseException:
        _stop(running)
        raise
    return failures


def _stop(running: dict) -> None:
    """Each running command's process group gets SIGTERM; they finish their step and save (up to 10 minutes)."""
    for process, _ in running.values():
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process, _ in running.values():
        try:
            process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def _record_time(task: Task) -> None:
    """The command's wall time beside the run (the report puts the engine's cost beside the training's own)."""
    path = (task.marker.parent / "engine_time.json") if task.kind == "train" else task.marker.with_suffix(".time.json")
    path.write_text(json.dumps({"process_seconds": task.seconds}) + "\n")


def submit(tasks: list[Task], args: CompareArguments, out: Path, say) -> list[str]:
    """Submit each task not done as a SLURM job (a measurement after its training job), then a job that writes the
    report after all of them; with --dry_run print the commands instead. Returns the job ids."""
    job_of: dict[str, str] = {}
    for task in [t for t in tasks if not t.done()]:  # done before this call: skipped, their measurements not held
        task.log.parent.mkdir(parents=True, exist_ok=True) if not args.dry_run else None
        job_of[task.name] = _sbatch(sbatch_command(task, args, job_of), task.name, args, say)
    if job_of:
        report = (
            f"{shlex.quote(sys.executable)} -m cegppo_trl.scripts.compare --report_only --out {shlex.quote(str(out))}"
        )
        command = ["sbatch", "--parsable", "--job-name=cegppo-compare-report", f"--output={out / 'report.log'}",
                   "--open-mode=append", *shlex.split(args.sbatch_args),
                   f"--dependency=afterany:{':'.join(job_of.values())}", f"--wrap={report}"]  # fmt: skip
        _sbatch(command, "report", args, say)
    return list(job_of.values())


def _sbatch(command: list[str], name: str, args: CompareArguments, say) -> str:
    if args.dry_run:
        print(shlex.join(command), flush=True)
        return f"<{name}>"
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch refused {name}: {done.stderr.strip() or done.stdout.strip()}")
    job = done.stdout.strip().split(";")[0]
    say(f"{name}: submitted as job {job}")
    return job
