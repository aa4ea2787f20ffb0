"""The work of `cegppo-compare`, one job a process: the start model's measurement and one training run (an arm and a
seed), resumed from its newest finite checkpoint when an earlier call was stopped.

A run's folder ``runs/<arm>-seed<N>/`` holds its checkpoints while it trains (the two newest, one every generation
batch: at its boundaries TRL resumes exactly), ``curve.jsonl`` (held-out points measured during training, one line each as
soon as measured), ``time.json`` (the time split so far) and, when done, ``final/`` (the trained model or adapter with
its prompt and sampling, for `cegppo-eval`) and ``result.json``; then its checkpoints are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .settings import TINY_INSTRUCTION, TINY_MODEL, Arm, CompareArguments


#: TRL 1.16 GRPOTrainer methods timed by wrapping them on the trainer instance (private names, pinned by
#: tests/test_compare.py::test_timed_trl_methods_exist_and_nest_as_the_timer_assumes).
TIMED_METHODS = ("_generate_and_score_completions", "_generate", "_calculate_rewards",
                 "_get_per_token_logps_and_entropies")  # fmt: skip
TIME_KEYS = ("generation", "reward", "old_logprob_pass", "other_scoring", "optimizer_step", "held_out")
CLIPPED = ("cegppo/beta1_token_frac", "cegppo/beta2_token_frac")
MEASURE_SEED = 1234  # every model samples the held-out problems with the same seed


# --------------------------------------------------------------------------------------------------- data
def instruction_of(args: CompareArguments) -> str | None:
    from ..data import DEFAULT_INSTRUCTION, resolve_instruction

    if args.instruction is not None:
        return resolve_instruction(args.instruction)
    return TINY_INSTRUCTION if args.model == TINY_MODEL else DEFAULT_INSTRUCTION


def load_problems(args: CompareArguments):
    """(training set, held-out set) as TRL conversational prompts with a ``solution`` column: the worked example
    (if any) before each problem; the held-out set's first `eval_problems` rows; every held-out problem removed from
    the training set. A ValueError names a held-out set smaller than asked."""
    from ..data import build_prompt, load_math_dataset
    from ..evaluation.datasets import parse_dataset_spec

    instruction = instruction_of(args)
    spec = parse_dataset_spec(args.eval_dataset)
    held_out = load_math_dataset(spec.source, split=spec.split, instruction=instruction)
    if args.eval_problems is not None:
        if args.eval_problems > len(held_out):
            raise ValueError(
                f"--eval_problems {args.eval_problems}: {args.eval_dataset} has {len(held_out)} problems."
            )
        held_out = held_out.select(range(args.eval_problems))
    train = load_math_dataset(args.train_dataset, split="train", instruction=instruction)
    seen = {row["prompt"][-1]["content"] for row in held_out}
    train = train.filter(lambda row: row["prompt"][-1]["content"] not in seen)
    if args.example_problem is not None:
        example = build_prompt(args.example_problem, None, instruction)
        example.append({"role": "assistant", "content": args.example_answer})
        train, held_out = (d.map(lambda row: {"prompt": example + row["prompt"]}) for d in (train, held_out))
    return train, held_out


# --------------------------------------------------------------------------------------------------- measurement
def measure(model, tokenizer, held_out, args: CompareArguments) -> dict[str, Any]:
    """The held-out figures of `model`: per protocol the per-problem correct counts (for paired differences),
    avg@k and pass@k; the share of samples with a boxed answer; the policy's token entropy along the samples."""
    from ..evaluation import evaluate_completions, generate_with_entropy
    from ..rewards.extract import has_boxed_answer

    start, k = time.perf_counter(), args.eval_k
    completions, entropy = generate_with_entropy(
        model, tokenizer, list(held_out["prompt"]), k, temperature=args.eval_sampling_temperature, top_p=1.0,
        max_new_tokens=args.max_completion_length, batch_size=64, seed=MEASURE_SEED,
    )  # fmt: skip
    grades = {}
    for protocol in args.protocols:
        graded = evaluate_completions(completions, list(held_out["solution"]), protocol=protocol, num_workers=1)
        grades[protocol] = {"num_correct": graded["num_correct"], "avg": graded[f"avg@{k}"],
                            "pass": graded[f"pass@{k}"], "status_counts": graded["status_counts"]}  # fmt: skip
    flat = [c for row in completions for c in row]
    return {"k": k, "num_problems": len(completions), "entropy": entropy, "grades": grades,
            "boxed_rate": sum(map(has_boxed_answer, flat)) / len(flat), "examples": [row[0] for row in completions[:3]],
            "seconds": time.perf_counter() - start}  # fmt: skip


def curve_point(step: int, figures: dict[str, Any]) -> dict[str, Any]:
    first = next(iter(figures["grades"].values()))
    return {"step": step, "avg": first["avg"], "pass": first["pass"], "entropy": figures["entropy"],
            "num_correct": first["num_correct"], "k": figures["k"]}  # fmt: skip


# --------------------------------------------------------------------------------------------------- jobs
JOB_THREADS = 1  # torch threads of each job's process


def _one_thread() -> None:
    """A job's process: one torch thread (two one-thread jobs beat one two-thread job on a shared 2-core machine), and
    one progress line per generation batch instead of the libraries' bars."""
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(JOB_THREADS)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()


def load_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tokenizer


def job_measure_start(settings: dict[str, Any], model_dir: str) -> dict[str, Any]:
    _one_thread()
    args = CompareArguments(**settings)
    model, tokenizer = load_model(model_dir)
    return {
        "name": "start",
        "fingerprint": args.fingerprint(),
        **measure(model, tokenizer, load_problems(args)[1], args),
    }


class StepTimer:
    """Seconds in the trainer's generation, reward, old-log-prob pass and the rest of scoring, by wrapping
    `TIMED_METHODS` on the instance; `split` adds the optimizer steps (the loss's forward, backward, update) and the
    held-out measurements. `carried` is the split of the run's earlier parts (a resumed run)."""

    def __init__(self, trainer, carried: dict[str, float] | None = None):
        self.carried = dict.fromkeys(TIME_KEYS, 0.0) | (carried or {})
        self.seconds = {"generation": 0.0, "reward": 0.0, "old_logprob_pass": 0.0, "scoring": 0.0, "held_out": 0.0}
        self.began, self.in_scoring = time.perf_counter(), False
        original = {name: getattr(trainer, name) for name in TIMED_METHODS}

        def timed(name, key, only_in_scoring=False, flag=False):
            def wrapper(*a, **kw):
                start, counts = time.perf_counter(), self.in_scoring or not only_in_scoring
                self.in_scoring = self.in_scoring or flag
                try:
                    return original[name](*a, **kw)
                finally:
                    self.in_scoring = self.in_scoring and not flag
                    if counts:
                        self.seconds[key] += time.perf_counter() - start

            return wrapper

        trainer._generate_and_score_completions = timed("_generate_and_score_completions", "scoring", flag=True)
        trainer._generate = timed("_generate", "generation")
        trainer._calculate_rewards = timed("_calculate_rewards", "reward")
        # inside scoring: the old policy's pass; otherwise the loss's own forward (counted in the optimizer step)
        trainer._get_per_token_logps_and_entropies = timed("_get_per_token_logps_and_entropies", "old_logprob_pass",
                                                           only_in_scoring=True)  # fmt: skip

    def split(self) -> dict[str, float]:
        s, wall = self.seconds, time.perf_counter() - self.began
        now = {"generation": s["generation"], "reward": s["reward"], "old_logprob_pass": s["old_logprob_pass"],
               "other_scoring": max(s["scoring"] - s["generation"] - s["reward"] - s["old_logprob_pass"], 0.0),
               "optimizer_step": max(wall - s["scoring"] - s["held_out"], 0.0), "held_out": s["held_out"]}  # fmt: skip
        return {key: self.carried[key] + now[key] for key in TIME_KEYS}


def _write_json(path: Path, value: Any) -> None:
    """Written whole or not at all (a stop mid-write leaves the previous file)."""
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(staging, path)


def resume_point(run_dir: Path) -> tuple[str | None, list[str]]:
    """The newest checkpoint of `run_dir` the divergence guard resumes from (complete, its weights finite; None: start
    afresh), and a line for each newer one passed over (a stop in the middle of a save leaves one incomplete)."""
    from ..divergence import complete_checkpoints, newest_finite_checkpoint

    return newest_finite_checkpoint(complete_checkpoints(str(run_dir), complete=False))


def training_config(args: CompareArguments, arm: Arm, seed: int, run_dir: Path):
    """The `CEGPPOConfig` of one run: the arm's betas (and clip-higher), everything else the same for every arm."""
    from ..config import CEGPPOConfig

    extra = {} if arm.epsilon_high is None else {"epsilon_high": arm.epsilon_high}
    return CEGPPOConfig(
        output_dir=str(run_dir), seed=seed, max_steps=args.max_steps, cegppo_beta1=arm.beta1, cegppo_beta2=arm.beta2,
        use_cpu=True, bf16=False, per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        gradient_accumulation_steps=1, steps_per_generation=args.steps_per_generation,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=args.temperature, top_p=1.0, learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm,
        cegppo_exclude_zero_advantage_groups=args.dynamic_sampling,
        cegppo_oversampling=args.oversampling if args.dynamic_sampling else 1.0, logging_steps=1,
        save_strategy="steps", save_steps=args.steps_per_generation, save_total_limit=2,
        report_to="none", disable_tqdm=True, activation_checkpointing=False, **extra,
    )  # fmt: skip


def build_trainer(args: CompareArguments, arm: Arm, seed: int, model_dir: str, run_dir: Path, train):
    """`CEGPPOTrainer` for one run (LoRA with `use_peft`), without transformers' printed log dicts."""
    from transformers import PrinterCallback

    from ..rewards import format_reward, math_reward
    from ..trainer import CEGPPOTrainer

    model, tokenizer = load_model(model_dir)
    peft_config = None
    if args.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear",
                                 task_type="CAUSAL_LM")  # fmt: skip
    rewards = [{"math": math_reward, "format": format_reward}[r] for r in args.rewards]
    trainer = CEGPPOTrainer(model=model, reward_funcs=rewards, args=training_config(args, arm, seed, run_dir),
                            train_dataset=train, processing_class=tokenizer, peft_config=peft_config)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    return trainer, tokenizer


def measuring_callback(trainer, timer: StepTimer, name: str, held_out, args: CompareArguments, run_dir: Path):
    """The held-out points every `eval_every` steps (appended to ``curve.jsonl`` as measured), the time split saved
    with each checkpoint, and one progress line per generation batch."""
    from transformers import TrainerCallback

    time_file, curve_file = run_dir / "time.json", run_dir / "curve.jsonl"

    class Measure(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            step = state.global_step
            if args.eval_every and step % args.eval_every == 0 and step < a.max_steps:
                began = time.perf_counter()
                point = curve_point(step, measure(trainer.model, trainer.processing_class, held_out, args))
                timer.seconds["held_out"] += time.perf_counter() - began
                with curve_file.open("a") as f:
                    f.write(json.dumps(point) + "\n")

        def on_save(self, a, state, control, **kwargs):
            _write_json(time_file, timer.split())

        def on_log(self, a, state, control, logs=None, **kwargs):  # one line per generation batch (its reward)
            if logs and "reward" in logs:
                shown = {k: logs[k] for k in ("reward", "entropy", *CLIPPED) if isinstance(logs.get(k), float)}
                text = ", ".join(f"{k.split('/')[-1]} {v:.3g}" for k, v in shown.items())
                print(f"[cegppo-compare] {name} step {state.global_step}/{a.max_steps}: {text}", flush=True)

    return Measure()


def job_train(settings: dict[str, Any], arm: Arm, seed: int, model_dir: str, run_dir: str) -> dict[str, Any]:
    """Train `arm` with `seed` from `model_dir` in `run_dir` (resuming its newest finite checkpoint), measure the
    trained model, save it with its prompt and sampling, and return (and write) ``result.json``."""
    _one_thread()
    from ..prompt_settings import save_eval_settings

    args, run_dir = CompareArguments(**settings), Path(run_dir)
    name = f"{arm.name}-seed{seed}"
    train, held_out = load_problems(args)
    trainer, tokenizer = build_trainer(args, arm, seed, model_dir, run_dir, train)
    resume, passed_over = resume_point(run_dir)
    resumed_at = int(resume.rsplit("-", 1)[-1]) if resume else 0
    for line in passed_over:
        print(f"[cegppo-compare] {name}: {line}", flush=True)
    time_file, curve_file = run_dir / "time.json", run_dir / "curve.jsonl"
    timer = StepTimer(trainer, json.loads(time_file.read_text()) if resume and time_file.is_file() else None)
    curve = []
    if resume and curve_file.is_file():  # the points up to the checkpoint; later ones are measured again
        curve = [p for p in map(json.loads, curve_file.read_text().splitlines()) if p["step"] <= resumed_at]
        print(f"[cegppo-compare] {name}: resuming from {resume} (step {resumed_at} of {args.max_steps})", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    curve_file.write_text("".join(json.dumps(p) + "\n" for p in curve))
    trainer.add_callback(measuring_callback(trainer, timer, name, held_out, args, run_dir))
    trainer.train(resume_from_checkpoint=resume)
    began = time.perf_counter()
    end = measure(trainer.model, tokenizer, held_out, args)
    timer.seconds["held_out"] += time.perf_counter() - began
    final = run_dir / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    save_eval_settings(final, instruction=instruction_of(args), temperature=args.eval_sampling_temperature,
                       max_new_tokens=args.max_completion_length, note="cegppo-compare")  # fmt: skip
    curve = [json.loads(line) for line in curve_file.read_text().splitlines()]
    result = {
        "name": name, "arm": arm.name, "label": arm.label, "seed": seed, "beta1": arm.beta1, "beta2": arm.beta2,
        "epsilon_high": arm.epsilon_high, "fingerprint": args.fingerprint(), "end": end,
        "curve": curve + [curve_point(trainer.state.global_step, end)], "log_history": trainer.state.log_history,
        "time": timer.split(), "resumed_from_step": resumed_at, "final_dir": str(final),
    }  # fmt: skip
    _write_json(run_dir / "result.json", result)
    for checkpoint in run_dir.glob("checkpoint-*"):  # the run is done: its final model and result stay
        shutil.rmtree(checkpoint, ignore_errors=True)
    return result
