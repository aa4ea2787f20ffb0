"""The tiny-LM half of `cegppo-demo`: the warm start, one RL run with `CEGPPOTrainer`, and the held-out figures.

`warm_start`, `run_rl` and `evaluate_policy` are also the building blocks of other experiments::

    model, tokenizer, info = warm_start(seed=0, cache_dir="out/warm")
    cegppo = run_rl(model, tokenizer, beta1=0.5, beta2=1.0, seed=0, max_steps=48, output_dir="out/cegppo")
    grpo = run_rl("out/warm", None, beta1=0.0, beta2=0.0, seed=0, max_steps=48, output_dir="out/grpo")

Every model is saved with its prompt format and sampling settings, and the held-out figures are computed with
`cegppo-eval`'s code, so ``cegppo-eval MODEL_DIR --datasets heldout.jsonl --k K --seed S`` (`eval_command`) gives them
again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from ..data import build_prompt, load_builtin_rows, load_math_dataset, write_jsonl
from ..evaluation import (
    DEFAULT_BATCH_SIZE,
    evaluate_completions,
    generate_completions,
    generate_with_entropy,
    save_eval_settings,
)
from ..tiny_model import (
    DEFAULT_PROBLEMS,
    PROMPT_INSTRUCTION,
    load_rows,
    load_tiny,
    problem_indices,
    save_tiny,
    warm_tiny,
)


__all__ = [
    "DEMO_INSTRUCTION",
    "HELDOUT_FILE",
    "PLOT_METRICS",
    "RL_DEFAULTS",
    "demo_train_dataset",
    "eval_command",
    "evaluate_policy",
    "load_rows",
    "load_tiny",
    "run_rl",
    "save_demo_model",
    "warm_start",
    "write_rows",
]

#: `load_math_dataset(..., instruction=DEMO_INSTRUCTION)` gives exactly the user message the tiny model is SFT-trained
#: on (`tiny.format_user_message`): "What is 3+4? Put the final answer in \boxed{}."
DEMO_INSTRUCTION = "{problem} " + PROMPT_INSTRUCTION

# The measurements behind these sizes: docs/entropy_results.md, section 4.
DEFAULT_SFT_STEPS = 300
DEFAULT_RL_STEPS = 48  # per run; several seeds x two runs fit the demo's ten minutes
DEFAULT_EVAL_SAMPLES = 8  # sampled completions per held-out problem: +-0.015 sampling noise on 119 sums
PLOT_METRICS = (
    "reward",
    "entropy",
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
    "cegppo/beta1_grad_share",
    "cegppo/beta2_grad_share",
)

#: CEGPPOConfig values of every demo run; `run_rl(**config_overrides)` replaces any of them.
RL_DEFAULTS: dict[str, Any] = dict(
    use_cpu=True,  # GRPOConfig's bf16 default fails on a CPU-only machine
    bf16=False,
    per_device_train_batch_size=128,  # completions per optimizer step: 16 prompts x 8 completions
    num_generations=8,
    gradient_accumulation_steps=1,
    # Off-policy, as in the paper: one generation batch feeds 8 mini-batches, each used once, so the ratio moves away
    # from 1 on 7 of every 8 optimizer steps (docs/entropy_results.md: why not 4 x 2 re-use).
    steps_per_generation=8,
    num_iterations=1,
    max_completion_length=20,  # the warm-started answer "49-27=22. \boxed{22}" + eos is 16 tokens
    temperature=1.0,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=1.0,
    beta=0.0,  # no KL term (paper)
    epsilon=0.2,
    loss_type="dapo",
    activation_checkpointing=False,  # nothing to save on a 1M-parameter model
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,  # run_rl draws its own progress bar instead of printing every log line
)


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


def demo_train_dataset(problems: str = DEFAULT_PROBLEMS):
    """``builtin:arithmetic`` as a TRL data set (``prompt``, ``solution``), restricted to `problems`, with exactly the
    user message the tiny model is warm-started on (`DEMO_INSTRUCTION`)."""
    dataset = load_math_dataset("builtin:arithmetic", instruction=DEMO_INSTRUCTION)
    keep = problem_indices(load_builtin_rows("builtin:arithmetic"), problems)
    return dataset if len(keep) == len(dataset) else dataset.select(keep)


# --------------------------------------------------------------------------------------------------------------
# Evaluation: sampled accuracy and entropy on held-out problems
# --------------------------------------------------------------------------------------------------------------


#: How the demo's held-out figures are sampled (the same as RL's rollouts: temperature 1, no top-p / top-k cut).
EVAL_TEMPERATURE = 1.0
EVAL_TOP_P = 1.0


def _prompt_and_solution(row: dict) -> tuple[list[dict[str, str]], str]:
    """A held-out row as `load_math_dataset(..., instruction=DEMO_INSTRUCTION)` gives it: ``{"problem", "answer"}``
    rows are turned into the tiny model's prompt; ``{"prompt", "solution"}`` rows are used as they are."""
    if "prompt" in row and "solution" in row:
        return row["prompt"], str(row["solution"])
    return build_prompt(str(row["problem"]).strip(), instruction=DEMO_INSTRUCTION), str(row["answer"]).strip()


def evaluate_policy(
    model,
    tokenizer,
    rows: Sequence[dict],
    *,
    temperature: float = EVAL_TEMPERATURE,
    top_p: float = EVAL_TOP_P,
    seed: int = 0,
    max_new_tokens: int = 20,
    samples_per_row: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> dict[str, float]:
    """Sample `samples_per_row` completions per held-out row; return ``{"accuracy", "entropy", "greedy_accuracy"}``.

    `accuracy`: avg@`samples_per_row`, the fraction of samples the math-verify reward grades correct, sampling at
    `temperature` (1.0 = what RL trains on); `entropy`: token-mean entropy (nats) of the policy along those samples
    (each generated token up to and including eos, as TRL's `entropy` metric);
    `greedy_accuracy`: the same check with greedy decoding (once per row). `rows` are ``{"problem", "answer"}``
    (prompted as the tiny model is trained, `DEMO_INSTRUCTION`) or ``{"prompt", "solution"}``.

    This is `cegppo-eval`'s code path (`generate_completions`, `evaluate_completions`; `generate_with_entropy` draws
    the same samples), so ``cegppo-eval MODEL_DIR
    --datasets ROWS.jsonl --k samples_per_row --seed seed`` on a model saved with `save_demo_model` gives the same
    `accuracy` (see `eval_command`).
    """
    pairs = [_prompt_and_solution(row) for row in rows]
    if not pairs:
        raise ValueError("no held-out rows")
    prompts, solutions = [p for p, _ in pairs], [s for _, s in pairs]
    generation = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
    sampled, entropy = generate_with_entropy(
        model, tokenizer, prompts, samples_per_row, temperature=temperature, top_p=top_p, **generation
    )
    report = evaluate_completions(sampled, solutions)
    greedy = generate_completions(model, tokenizer, prompts, 1, temperature=0.0, **generation)
    greedy_report = evaluate_completions(greedy, solutions)
    return {
        "accuracy": float(report[f"avg@{samples_per_row}"]),
        "entropy": entropy,
        "greedy_accuracy": float(greedy_report["avg@1"]),
    }


def write_rows(rows: Sequence[dict], path: str | os.PathLike) -> str:
    """Write ``{"problem", "answer"}`` rows as JSON lines (a data set for `cegppo-eval --datasets`)."""
    return write_jsonl(({"problem": row["problem"], "answer": row["answer"]} for row in rows), path)


def save_demo_model(model, tokenizer, path: str | os.PathLike, *, max_new_tokens: int = 20) -> str:
    """Save a demo model with its prompt format and held-out sampling settings (`save_eval_settings`), so that
    `cegppo-eval path` prompts and samples it as the demo does."""
    save_tiny(model, tokenizer, path)
    _save_demo_settings(path, max_new_tokens)
    return os.fspath(path)


def _save_demo_settings(path: str | os.PathLike, max_new_tokens: int = 20) -> None:
    save_eval_settings(
        path,
        instruction=DEMO_INSTRUCTION,
        temperature=EVAL_TEMPERATURE,
        top_p=EVAL_TOP_P,
        max_new_tokens=max_new_tokens,
        note="cegppo-demo: the tiny model is trained on '<problem> Put the final answer in \\boxed{}.' and evaluated "
        "sampling at temperature 1 (top_p 1, no top-k), 20 new tokens; cegppo-eval uses these unless flags say "
        "otherwise.",
    )


def eval_command(
    model_dir: str, data_path: str, samples_per_row: int, seed: int = 0, output: str | None = None
) -> str:
    """The `cegppo-eval` command that reproduces `evaluate_policy`'s accuracy for a model saved by `save_demo_model`."""
    import shlex

    words = ["cegppo-eval", model_dir, "--datasets", data_path, "--k", str(samples_per_row), "--seed", str(seed)]
    if output is not None:
        words += ["--output", output]
    return shlex.join(words)


# --------------------------------------------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------------------------------------------

_WARM_START_FILE = "warm_start.json"
#: The held-out rows of a demo run, written to its output directory for `cegppo-eval --datasets`.
HELDOUT_FILE = "heldout.jsonl"


def warm_start(
    seed: int = 0,
    sft_steps: int = DEFAULT_SFT_STEPS,
    progress: bool = True,
    *,
    cache_dir: str | os.PathLike | None = None,
    train_rows: Sequence[dict] | None = None,
    eval_rows: Sequence[dict] | None = None,
    batch_size: int = 64,
    lr: float = 3e-3,
    num_threads: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    evaluate: bool = True,
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
):
    """`tiny.warm_tiny` (build, SFT, cache) plus the held-out figures of the warm-started model.

    Returns ``(model, tokenizer, info)``; `info` has the SFT statistics (``sft``), the held-out ``accuracy`` (sampled,
    temperature 1), ``greedy_accuracy`` and ``entropy`` (see `evaluate_policy`; left out with ``evaluate=False``),
    ``seconds``, ``num_parameters`` and ``cached``. `train_rows` / `eval_rows` default to the "sums" of
    ``builtin:arithmetic`` / ``builtin:arithmetic_eval``. With `cache_dir` the model is saved there with its prompt
    format (`save_demo_model`) and a later call with the same arguments loads it and its figures.
    """
    eval_rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    model, tokenizer, build = warm_tiny(
        seed, sft_steps, train_rows=train_rows, cache_dir=cache_dir, batch_size=batch_size, lr=lr,
        model_kwargs=model_kwargs, progress=progress, num_threads=num_threads,
    )  # fmt: skip
    key = {
        **build["key"],
        "evaluate": evaluate,
        "eval_samples": eval_samples,
        "eval_rows": hashlib.sha256(json.dumps(eval_rows, sort_keys=True).encode()).hexdigest(),
    }
    info_path = os.path.join(os.fspath(cache_dir), _WARM_START_FILE) if cache_dir is not None else None
    if build["cached"] and info_path is not None and os.path.isfile(info_path):
        with open(info_path) as f:
            saved = json.load(f)
        if saved.get("key") == key:
            return model, tokenizer, {**saved["info"], "cached": True, "path": build["path"]}

    start = time.perf_counter()
    info = {"sft": build["sft"]}
    if evaluate:
        info.update(evaluate_policy(model, tokenizer, eval_rows, seed=seed, samples_per_row=eval_samples))
    info["seconds"] = build["seconds"] + time.perf_counter() - start
    info["num_parameters"] = build["num_parameters"]
    if info_path is not None:
        _save_demo_settings(cache_dir)
        with open(info_path, "w") as f:
            json.dump({"key": key, "info": info}, f, indent=2)
    return model, tokenizer, {**info, "cached": False, "path": build["path"]}


# --------------------------------------------------------------------------------------------------------------
# RL
# --------------------------------------------------------------------------------------------------------------


def _progress_callback(desc: str):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class _Progress(TrainerCallback):
        """One tqdm bar per run with the latest reward / entropy / clipped-token fractions as postfix."""

        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.bar = tqdm(total=state.max_steps, desc=desc, unit="step", dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs:
                shown = {
                    "reward": logs.get("reward"),
                    "entropy": logs.get("entropy"),
                    # fractions of tokens in the two clipped sets (r < 1 - eps, A < 0 / r > 1 + eps, A > 0)
                    "clip_lo": logs.get("cegppo/beta1_token_frac"),
                    "clip_hi": logs.get("cegppo/beta2_token_frac"),
                }
                self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if isinstance(v, (int, float))})

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return _Progress()


def _window_mean(history: Sequence[dict], metric: str, first: bool, fraction: float = 0.1) -> float:
    """Mean of `metric` over the first (or last) `fraction` of the log entries that have it (at least one)."""
    values = [e[metric] for e in history if isinstance(e.get(metric), (int, float)) and math.isfinite(e[metric])]
    if not values:
        return float("nan")
    k = max(1, round(fraction * len(values)))
    chosen = values[:k] if first else values[-k:]
    return sum(chosen) / len(chosen)


def run_rl(
    model,
    tokenizer,
    *,
    beta1: float,
    beta2: float,
    seed: int,
    max_steps: int,
    output_dir: str | os.PathLike,
    train_dataset=None,
    eval_rows: Sequence[dict] | None = None,
    progress: bool = True,
    label: str | None = None,
    reward_funcs=None,
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
    save_final: bool = True,
    start_eval: dict[str, float] | None = None,
    **config_overrides,
) -> dict[str, Any]:
    """Train `model` (in place) with `CEGPPOTrainer` at (beta1, beta2) for `max_steps` optimizer steps.

    `model` is a model object (trained in place; pass a fresh copy per run, e.g. from `load_tiny`) or a path.
    `train_dataset` defaults to `demo_train_dataset()` (``builtin:arithmetic`` in the tiny model's prompt format),
    `eval_rows` to ``builtin:arithmetic_eval`` (`eval_samples`
    sampled completions each), `reward_funcs` to ``[math_reward]`` (+1 correct / -1 otherwise). Every other
    keyword is a `CEGPPOConfig` field and replaces the value in `RL_DEFAULTS` (e.g. ``learning_rate=3e-4``,
    ``steps_per_generation=8, num_iterations=1``). beta1 = beta2 = 0 is GRPO (PPO-clip's gradient). `start_eval`
    (an `evaluate_policy` result of the same model, rows, seed and samples) saves evaluating the start again.

    Returns a dict: ``label``, ``beta1``, ``beta2``, ``seed``, ``max_steps``, ``seconds`` (training only),
    ``log_history`` (`trainer.state.log_history`), held-out ``start_accuracy`` / ``end_accuracy`` (sampled at
    temperature 1), ``start_entropy`` / ``end_entropy`` (nats, along those samples), ``start_greedy_accuracy`` /
    ``end_greedy_accuracy``, ``start_reward`` / ``end_reward`` (mean training reward over the first / last 10%
    of the logs), the mean over the logged steps of the clipped sets' token fractions and gradient shares
    (``beta1_token_frac``, ``beta2_token_frac``, ``beta1_grad_share``, ``beta2_grad_share``) and ``final_dir``.
    ``trainer_state.json`` is saved in `output_dir` and, with `save_final`, the trained
    model in ``output_dir/final`` (`save_demo_model`: with its prompt format and held-out sampling settings, so that
    ``cegppo-eval output_dir/final`` evaluates it as this function does; None without `save_final`).
    """
    from ..config import CEGPPOConfig
    from ..rewards import math_reward
    from ..trainer import CEGPPOTrainer

    if isinstance(model, (str, os.PathLike)):
        model, loaded_tokenizer = load_tiny(model)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    eval_rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    label = label or f"beta1={beta1:g}, beta2={beta2:g}"
    values = {**RL_DEFAULTS, "logging_steps": max(1, max_steps // 50), **config_overrides}
    values.update(output_dir=os.fspath(output_dir), seed=seed, max_steps=max_steps)
    args = CEGPPOConfig(**values, cegppo_beta1=beta1, cegppo_beta2=beta2)
    evaluate = dict(seed=seed, max_new_tokens=args.max_completion_length, samples_per_row=eval_samples)
    start_eval = start_eval or evaluate_policy(model, tokenizer, eval_rows, **evaluate)
    trainer = CEGPPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs) if reward_funcs is not None else [math_reward],
        args=args,
        train_dataset=train_dataset if train_dataset is not None else demo_train_dataset(),
        processing_class=tokenizer,
    )
    seconds = _train(trainer, label if progress else None)
    final_dir = None
    if save_final:
        final = os.path.join(os.fspath(output_dir), "final")
        final_dir = save_demo_model(trainer.model, tokenizer, final, max_new_tokens=args.max_completion_length)
    end_eval = evaluate_policy(trainer.model, tokenizer, eval_rows, **evaluate)
    history = list(trainer.state.log_history)
    return {
        "label": label,
        "beta1": beta1,
        "beta2": beta2,
        "seed": seed,
        "max_steps": max_steps,
        "seconds": seconds,
        "output_dir": os.fspath(output_dir),
        "final_dir": final_dir,
        "log_history": history,
        **{f"start_{k}": v for k, v in start_eval.items()},
        **{f"end_{k}": v for k, v in end_eval.items()},
        "start_reward": _window_mean(history, "reward", first=True),
        "end_reward": _window_mean(history, "reward", first=False),
        **{
            name: _window_mean(history, f"cegppo/{name}", first=True, fraction=1.0)
            for name in ("beta1_token_frac", "beta2_token_frac", "beta1_grad_share", "beta2_grad_share")
        },
    }


def _train(trainer, progress_label: str | None) -> float:
    """`trainer.train()` with one progress bar named `progress_label` (None: no bar) instead of transformers' bar and
    log prints; saves the trainer state; returns the training seconds."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)  # it would print every log dict
    trainer.remove_callback(ProgressCallback)
    if progress_label is not None:
        trainer.add_callback(_progress_callback(progress_label))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_state()
    return seconds
