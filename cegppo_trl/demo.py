"""`cegppo-demo`: CE-GPPO next to GRPO on a tiny arithmetic model, on a CPU, offline, in under ten minutes.

What it does, with nothing downloaded:

1. builds the ~1M-parameter Qwen2-style model and its tokenizer locally (`cegppo_trl.tiny`) and warm-starts it with a
   short SFT on the built-in arithmetic problems (``builtin:arithmetic``; by default its "What is a+b?" problems,
   ``--problems all`` adds differences and one-line word problems), so that it solves some but not all of the
   held-out problems (``builtin:arithmetic_eval``) when sampling at temperature 1;
2. saves the warm-started weights, then trains two copies of them with the same seed, data order and budget:
   CE-GPPO (paper: beta1 = 0.5, beta2 = 1) and GRPO (the same trainer with beta1 = beta2 = 0, which has PPO-clip's
   gradient), with the paper's +1 / -1 math-verify reward (`cegppo_trl.math_reward`) and off-policy updates (each
   generation batch is used for ``steps_per_generation x num_iterations`` optimizer steps; on-policy, CE-GPPO would
   equal GRPO);
3. prints a table of training reward, held-out accuracy (sampled, temperature 1) and policy entropy at the start and
   end of each run, and writes ``results.md``, ``results.json`` and ``cegppo_vs_grpo.png`` (reward, entropy and the
   beta1 / beta2 token fractions and gradient shares over steps) to the output directory;
4. saves every model it trains (``warm_start/``, ``runs/cegppo/final/``, ``runs/grpo/final/``), each with the prompt
   format it is trained on and the sampling of the held-out evaluation (``cegppo_prompt.json``,
   ``generation_config.json``; `cegppo_trl.evaluation.save_eval_settings`), and the held-out problems
   (``heldout.jsonl``), and prints the ``cegppo-eval`` command for each model. The held-out figures are computed with
   `cegppo-eval`'s own code (`generate_completions`, math-verify grading in `evaluate_completions`), so the printed
   command gives the demo's figure again, to the sample with the same torch thread count.

``cegppo-demo --quick`` runs a reduced version (a smoke test: too short to learn anything). The functions
`warm_start`, `run_rl` and `evaluate_policy` are the building blocks, importable by other experiments::

    from cegppo_trl.demo import warm_start, run_rl, load_tiny
    model, tokenizer, info = warm_start(seed=0, cache_dir="out/warm")
    cegppo = run_rl(model, tokenizer, beta1=0.5, beta2=1.0, seed=0, max_steps=160, output_dir="out/cegppo")
    model, tokenizer = load_tiny("out/warm")            # the same starting weights again
    grpo = run_rl(model, tokenizer, beta1=0.0, beta2=0.0, seed=0, max_steps=160, output_dir="out/grpo")
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from .data import BUILTIN_DATASETS, build_prompt, load_math_dataset
from .evaluation import DEFAULT_BATCH_SIZE, evaluate_completions, generate_completions, save_eval_settings
from .tiny import (
    PROMPT_INSTRUCTION,
    arithmetic_sft_examples,
    build_tiny_model,
    build_tiny_tokenizer,
    load_tiny,
    save_tiny,
    sft_warmstart,
)


__all__ = [
    "DEMO_INSTRUCTION",
    "RL_DEFAULTS",
    "eval_command",
    "evaluate_policy",
    "format_table",
    "demo_train_dataset",
    "load_rows",
    "load_tiny",
    "main",
    "run_demo",
    "run_rl",
    "save_demo_model",
    "warm_start",
    "write_rows",
]

#: `load_math_dataset(..., instruction=DEMO_INSTRUCTION)` gives exactly the user message the tiny model is SFT-trained
#: on (`tiny.format_user_message`): "What is 3+4? Put the final answer in \boxed{}."
DEMO_INSTRUCTION = "{problem} " + PROMPT_INSTRUCTION

# Sized for <= 10 minutes on 2 CPU cores (measured: ~75 s of SFT, ~180 s per RL run). On the "sums" problems, 300 SFT
# steps sit on the steep part of the SFT curve: held-out accuracy 0.43 sampled / 0.55 greedy on one machine (250 steps:
# 0.40 / 0.58; 350: 0.84 / 0.91), 0.706 / 0.832 on another (AMD EPYC, AVX2; the same with 1 or 2 torch threads, bit for
# bit). Float kernels differ by CPU (torch's AVX2 / AVX-512 code, MKL's code paths) in the 7th digit, and 300 steps of
# training amplify that, so the warm start, and everything after it, varies from machine to machine.
DEFAULT_SFT_STEPS = 300
DEFAULT_RL_STEPS = 160
DEFAULT_EVAL_SAMPLES = 2  # sampled completions per held-out problem
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
    # Off-policy, as in the paper: one generation batch (128 prompts x 8) feeds 8 mini-batches, each used once, so
    # 8 optimizer steps per generation batch and the ratio moves away from 1 on 7 of them. (Re-using each mini-batch
    # twice, steps_per_generation=4 x num_iterations=2, costs less generation but made CE-GPPO (0.5, 1) unstable on
    # this model: held-out accuracy 0.43 -> 0.36 in 230 steps where GRPO reached 0.64.)
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
    activation_checkpointing=False,  # no memory to save on a 1M-parameter model; ~20% faster
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,  # run_rl draws its own progress bar instead of printing every log line
)


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


#: Which built-in problems the demo uses: "sums" ("What is a+b?", a, b < 50: short sequences, so the demo fits in ten
#: minutes on 2 cores; `DEFAULT_SFT_STEPS` leaves the model solving about half of them) or "all" (sums, differences
#: and one-line word problems, ~40% longer sequences; `cegppo_trl.tiny.sft_warmstart`'s 800-step default is tuned on
#: them, ~6 minutes of SFT on 2 cores).
PROBLEM_SETS = {
    "sums": re.compile(r"What is \d+\+\d+\?"),
    "all": re.compile(r".*", re.DOTALL),
}
DEFAULT_PROBLEMS = "sums"


def _selected(rows: Sequence[dict], problems: str) -> list[int]:
    if problems not in PROBLEM_SETS:
        raise ValueError(f"problems must be one of {sorted(PROBLEM_SETS)}, got {problems!r}.")
    pattern = PROBLEM_SETS[problems]
    return [i for i, row in enumerate(rows) if pattern.fullmatch(str(row["problem"]))]


def load_rows(
    name: str = "builtin:arithmetic_eval", n: int | None = None, problems: str = DEFAULT_PROBLEMS
) -> list[dict[str, str]]:
    """The ``{"problem", "answer"}`` rows of a built-in arithmetic data set: those of the `problems` set (see
    `PROBLEM_SETS`), the first `n` of them (or all)."""
    if name not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in data set {name!r}; available: {', '.join(BUILTIN_DATASETS)}.")
    with open(BUILTIN_DATASETS[name], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [rows[i] for i in _selected(rows, problems)]
    return rows[:n] if n is not None else rows


def demo_train_dataset(problems: str = DEFAULT_PROBLEMS):
    """``builtin:arithmetic`` as a TRL data set (``prompt``, ``solution``), restricted to `problems`, with exactly the
    user message the tiny model is warm-started on (`DEMO_INSTRUCTION`)."""
    dataset = load_math_dataset("builtin:arithmetic", instruction=DEMO_INSTRUCTION)
    keep = _selected(load_rows("builtin:arithmetic", problems="all"), problems)
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


@torch.no_grad()
def _mean_completion_entropy(
    model, tokenizer, prompts: Sequence[Any], completions: Sequence[str], batch_size: int = 128
) -> float:
    """Token-mean entropy (nats) of the policy along sampled completions (+ eos), as TRL's `entropy` metric is
    computed: at each completion position, the entropy of the next-token distribution given the prefix."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(prompts), batch_size):
            encoded = []
            for prompt, text in zip(prompts[start : start + batch_size], completions[start : start + batch_size]):
                prompt_ids = tokenizer.apply_chat_template(
                    list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
                completion = tokenizer(text, add_special_tokens=False)["input_ids"]
                encoded.append((list(prompt_ids), completion + [tokenizer.eos_token_id]))
            width = max(len(p) + len(c) for p, c in encoded)
            input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
            # positions whose next token is a completion token
            targets = torch.zeros((len(encoded), width), dtype=torch.bool)
            for i, (p, c) in enumerate(encoded):
                input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                targets[i, len(p) - 1 : len(p) + len(c) - 1] = True
            # Right padding + causal attention: real tokens never attend to the padding after them.
            logits = model(input_ids=input_ids.to(model.device), use_cache=False).logits.float()
            logp = torch.log_softmax(logits, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1).cpu()
            total += entropy[targets].sum().item()
            count += int(targets.sum())
    finally:
        model.train(was_training)
    return total / max(count, 1)


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
    `temperature` (1.0 = what RL trains on); `entropy`: token-mean entropy (nats) of the policy along those samples;
    `greedy_accuracy`: the same check with greedy decoding (once per row). `rows` are ``{"problem", "answer"}``
    (prompted as the tiny model is trained, `DEMO_INSTRUCTION`) or ``{"prompt", "solution"}``.

    This is `cegppo-eval`'s code path (`generate_completions`, `evaluate_completions`), so ``cegppo-eval MODEL_DIR
    --datasets ROWS.jsonl --k samples_per_row --seed seed`` on a model saved with `save_demo_model` gives the same
    `accuracy` (see `eval_command`).
    """
    pairs = [_prompt_and_solution(row) for row in rows]
    if not pairs:
        raise ValueError("no held-out rows")
    prompts, solutions = [p for p, _ in pairs], [s for _, s in pairs]
    generation = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
    sampled = generate_completions(
        model, tokenizer, prompts, samples_per_row, temperature=temperature, top_p=top_p, **generation
    )
    report = evaluate_completions(sampled, solutions)
    greedy = generate_completions(model, tokenizer, prompts, 1, temperature=0.0, **generation)
    greedy_report = evaluate_completions(greedy, solutions)
    flat_prompts = [p for p, group in zip(prompts, sampled) for _ in group]
    flat_completions = [text for group in sampled for text in group]
    return {
        "accuracy": float(report[f"avg@{samples_per_row}"]),
        "entropy": _mean_completion_entropy(model, tokenizer, flat_prompts, flat_completions),
        "greedy_accuracy": float(greedy_report["avg@1"]),
    }


def write_rows(rows: Sequence[dict], path: str | os.PathLike) -> str:
    """Write ``{"problem", "answer"}`` rows as JSON lines (a data set for `cegppo-eval --datasets`)."""
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"problem": row["problem"], "answer": row["answer"]}) + "\n")
    return path


def save_demo_model(model, tokenizer, path: str | os.PathLike, *, max_new_tokens: int = 20) -> str:
    """Save a demo model with its prompt format and held-out sampling settings (`save_eval_settings`), so that
    `cegppo-eval path` prompts and samples it as the demo does."""
    save_tiny(model, tokenizer, path)
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
    return os.fspath(path)


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
    """Build the tiny model + tokenizer and SFT it on arithmetic so that it solves some of the problems.

    Returns ``(model, tokenizer, info)``; `info` has the SFT statistics (``sft``), the held-out ``accuracy`` (sampled,
    temperature 1), ``greedy_accuracy`` and ``entropy`` (see `evaluate_policy`; left out with ``evaluate=False``),
    ``seconds``, ``num_parameters`` and ``cached``.

    `train_rows` / `eval_rows` default to the rows of ``builtin:arithmetic`` / ``builtin:arithmetic_eval`` (`load_rows`);
    `sft_steps` to `DEFAULT_SFT_STEPS`. With `cache_dir`, the
    model, tokenizer and info are saved there, and a later call with the same arguments loads them instead of
    training again; `load_tiny(cache_dir)` gives the same weights to start every RL run from.
    """
    train_rows = list(train_rows) if train_rows is not None else load_rows("builtin:arithmetic")
    eval_rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    examples = arithmetic_sft_examples(train_rows)
    model_kwargs = dict(model_kwargs or {})
    key = {
        "seed": seed,
        "sft_steps": sft_steps,
        "batch_size": batch_size,
        "lr": lr,
        "model_kwargs": model_kwargs,
        "evaluate": evaluate,
        "eval_samples": eval_samples,
        "examples": hashlib.sha256(json.dumps(examples).encode()).hexdigest(),
        "eval_rows": hashlib.sha256(json.dumps(eval_rows, sort_keys=True).encode()).hexdigest(),
    }
    tokenizer = build_tiny_tokenizer()
    key["tokenizer"] = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    info_path = os.path.join(os.fspath(cache_dir), _WARM_START_FILE) if cache_dir is not None else None
    if info_path is not None and os.path.isfile(info_path):
        with open(info_path) as f:
            saved = json.load(f)
        if saved.get("key") == key:
            model, tokenizer = load_tiny(cache_dir)
            if not os.path.isfile(os.path.join(os.fspath(cache_dir), "cegppo_prompt.json")):  # older cache
                save_demo_model(model, tokenizer, cache_dir)
            return model, tokenizer, {**saved["info"], "cached": True, "path": os.fspath(cache_dir)}

    start = time.perf_counter()
    model = build_tiny_model(tokenizer, seed=seed, **model_kwargs)
    sft = sft_warmstart(
        model,
        tokenizer,
        examples,
        steps=sft_steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        progress=progress,
        num_threads=num_threads,
    )
    if evaluate:
        info = {"sft": sft, **evaluate_policy(model, tokenizer, eval_rows, seed=seed, samples_per_row=eval_samples)}
    else:
        info = {"sft": sft}
    info["seconds"] = time.perf_counter() - start
    info["num_parameters"] = sum(p.numel() for p in model.parameters())
    if info_path is not None:
        save_demo_model(model, tokenizer, cache_dir)
        with open(info_path, "w") as f:
            json.dump({"key": key, "info": info}, f, indent=2)
    return model, tokenizer, {**info, "cached": False, "path": None if cache_dir is None else os.fspath(cache_dir)}


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
    **config_overrides,
) -> dict[str, Any]:
    """Train `model` (in place) with `CEGPPOTrainer` at (beta1, beta2) for `max_steps` optimizer steps.

    `model` is a model object (trained in place; pass a fresh copy per run, e.g. from `load_tiny`) or a path.
    `train_dataset` defaults to `demo_train_dataset()` (``builtin:arithmetic`` in the tiny model's prompt format),
    `eval_rows` to ``builtin:arithmetic_eval`` (`eval_samples`
    sampled completions each), `reward_funcs` to ``[math_reward]`` (+1 correct / -1 otherwise). Every other
    keyword is a `CEGPPOConfig` field and replaces the value in `RL_DEFAULTS` (e.g. ``learning_rate=3e-4``,
    ``steps_per_generation=8, num_iterations=1``). beta1 = beta2 = 0 is GRPO (PPO-clip's gradient).

    Returns a dict: ``label``, ``beta1``, ``beta2``, ``seed``, ``max_steps``, ``seconds`` (training only),
    ``log_history`` (`trainer.state.log_history`), held-out ``start_accuracy`` / ``end_accuracy`` (sampled at
    temperature 1), ``start_entropy`` / ``end_entropy`` (nats, along those samples), ``start_greedy_accuracy`` /
    ``end_greedy_accuracy``, and ``start_reward`` / ``end_reward`` (mean training reward over the first / last 10%
    of the logs), ``final_dir``. ``trainer_state.json`` is saved in `output_dir` and, with `save_final`, the trained
    model in ``output_dir/final`` (`save_demo_model`: with its prompt format and held-out sampling settings, so that
    ``cegppo-eval output_dir/final`` evaluates it as this function does; None without `save_final`).
    """
    from .config import CEGPPOConfig
    from .rewards import math_reward
    from .trainer import CEGPPOTrainer

    if isinstance(model, (str, os.PathLike)):
        model, loaded_tokenizer = load_tiny(model)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    eval_rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    train_dataset = train_dataset if train_dataset is not None else demo_train_dataset()
    label = label or f"beta1={beta1:g}, beta2={beta2:g}"
    values = {
        **RL_DEFAULTS,
        "logging_steps": max(1, max_steps // 50),
        **config_overrides,
        "output_dir": os.fspath(output_dir),
        "seed": seed,
        "max_steps": max_steps,
        "cegppo_beta1": beta1,
        "cegppo_beta2": beta2,
    }
    args = CEGPPOConfig(**values)
    max_new_tokens = args.max_completion_length

    evaluate = dict(seed=seed, max_new_tokens=max_new_tokens, samples_per_row=eval_samples)
    start_eval = evaluate_policy(model, tokenizer, eval_rows, **evaluate)
    trainer = CEGPPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs) if reward_funcs is not None else [math_reward],
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)  # it would print every log dict
    trainer.remove_callback(ProgressCallback)
    if progress:
        trainer.add_callback(_progress_callback(label))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_state()
    final_dir = None
    if save_final:
        final_dir = save_demo_model(
            trainer.model, tokenizer, os.path.join(os.fspath(output_dir), "final"), max_new_tokens=max_new_tokens
        )
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
        "beta1_token_frac": _window_mean(history, "cegppo/beta1_token_frac", first=True, fraction=1.0),
        "beta2_token_frac": _window_mean(history, "cegppo/beta2_token_frac", first=True, fraction=1.0),
    }


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


def format_table(results: Sequence[dict], warm: dict | None = None) -> str:
    """A Markdown table of the runs: reward, held-out sampled accuracy and entropy, start -> end."""

    def arrow(a: float, b: float, fmt: str = "{:.3f}") -> str:
        return f"{fmt.format(a)} -> {fmt.format(b)}"

    header = (
        "| run | train reward (first -> last 10% of steps) | held-out accuracy, sampled T=1 (start -> end) "
        "| entropy, nats (start -> end) | clipped tokens beta1 / beta2 set | train time |"
    )
    lines = [header, "|" + "---|" * 6]
    for r in results:
        lines.append(
            f"| {r['label']} | {arrow(r['start_reward'], r['end_reward'], '{:+.3f}')} "
            f"| {arrow(r['start_accuracy'], r['end_accuracy'])} | {arrow(r['start_entropy'], r['end_entropy'])} "
            f"| {100 * r['beta1_token_frac']:.2f}% / {100 * r['beta2_token_frac']:.2f}% | {r['seconds']:.0f} s |"
        )
    if warm is not None:
        lines.append("")
        lines.append(
            f"Warm start: {warm['sft']['steps']} SFT steps, held-out accuracy {warm['accuracy']:.3f} sampled "
            f"(T=1) / {warm['greedy_accuracy']:.3f} greedy, entropy {warm['entropy']:.3f} nats."
        )
    return "\n".join(lines)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _stay_offline() -> None:
    """The demo builds everything locally: make any Hub access fail fast and send no telemetry."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    constants.HF_HUB_DISABLE_TELEMETRY = True


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

QUICK = {
    "sft_steps": 150,
    "steps": 16,
    "prompts_per_step": 8,
    "num_generations": 4,
    "eval_size": 64,
    "eval_samples": 1,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cegppo-demo",
        description="CE-GPPO vs GRPO on a tiny arithmetic model: CPU only, nothing downloaded, < 10 minutes.",
    )
    parser.add_argument("--output-dir", default="cegppo-demo-output", help="where results, plot and runs go")
    parser.add_argument(
        "--steps", type=int, default=None, help=f"RL optimizer steps per run (default {DEFAULT_RL_STEPS})"
    )
    parser.add_argument(
        "--sft-steps", type=int, default=None, help=f"SFT warm-start steps (default {DEFAULT_SFT_STEPS})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, SFT and both RL runs")
    parser.add_argument("--beta1", type=float, default=0.5, help="CE-GPPO beta1 (paper, 1.5B: 0.5)")
    parser.add_argument("--beta2", type=float, default=1.0, help="CE-GPPO beta2 (paper: 1)")
    parser.add_argument("--learning-rate", type=float, default=RL_DEFAULTS["learning_rate"], help="RL learning rate")
    parser.add_argument("--prompts-per-step", type=int, default=None, help="prompts per optimizer step (default 16)")
    parser.add_argument("--num-generations", type=int, default=None, help="completions per prompt (default 8)")
    parser.add_argument(
        "--problems",
        choices=sorted(PROBLEM_SETS),
        default=DEFAULT_PROBLEMS,
        help="built-in problems to train and evaluate on: 'sums' (What is a+b?) or 'all' (also a-b, word problems)",
    )
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems evaluated (default: all)")
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        help=f"sampled completions per held-out problem (default {DEFAULT_EVAL_SAMPLES})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a reduced run for smoke tests (defaults become {QUICK}); explicit flags still win",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (default 0: torch's default, one per core; on an idle 2-core machine two threads "
        "ran SFT 1.5x faster than one. On a machine busy with other jobs, 1 can be several times faster)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def run_demo(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo with command-line arguments `argv`; return the summary (also written to ``results.json``)."""
    args = build_parser().parse_args(argv)
    _stay_offline()
    base = {
        "sft_steps": DEFAULT_SFT_STEPS,
        "steps": DEFAULT_RL_STEPS,
        "prompts_per_step": 16,
        "num_generations": 8,
        "eval_size": None,
        "eval_samples": DEFAULT_EVAL_SAMPLES,
    }
    if args.quick:
        base.update(QUICK)
    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    from transformers.utils import logging as hf_logging

    previous_threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars; ours stay
    try:
        return _run(args, sizes)
    finally:
        torch.set_num_threads(previous_threads)
        if bars:
            hf_logging.enable_progress_bar()


def _run(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    progress = not args.no_progress
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    eval_rows = load_rows("builtin:arithmetic_eval", sizes["eval_size"], problems=args.problems)
    train_rows = load_rows("builtin:arithmetic", problems=args.problems)

    t0 = time.perf_counter()
    print(f"[cegppo-demo] output directory: {out}", flush=True)
    heldout = write_rows(eval_rows, os.path.join(out, HELDOUT_FILE))  # the held-out set, for cegppo-eval
    warm_dir = os.path.join(out, "warm_start")
    _, _, warm = warm_start(
        seed=args.seed,
        sft_steps=sizes["sft_steps"],
        progress=progress,
        cache_dir=warm_dir,
        train_rows=train_rows,
        eval_rows=eval_rows,
        eval_samples=sizes["eval_samples"],
    )
    when = "cached" if warm["cached"] else f"{warm['seconds']:.0f} s"
    print(
        f"[cegppo-demo] warm start ({when}): held-out accuracy "
        f"{warm['accuracy']:.3f} sampled / {warm['greedy_accuracy']:.3f} greedy, entropy {warm['entropy']:.3f}",
        flush=True,
    )

    runs = [
        ("cegppo", f"CE-GPPO (beta1={args.beta1:g}, beta2={args.beta2:g})", args.beta1, args.beta2),
        ("grpo", "GRPO (beta1=beta2=0)", 0.0, 0.0),
    ]
    completions_per_step = sizes["prompts_per_step"] * sizes["num_generations"]
    train_dataset = demo_train_dataset(args.problems)
    results = []
    for name, label, beta1, beta2 in runs:
        model, tokenizer = load_tiny(warm_dir)  # identical starting weights for both runs
        results.append(
            run_rl(
                model,
                tokenizer,
                beta1=beta1,
                beta2=beta2,
                seed=args.seed,
                max_steps=sizes["steps"],
                output_dir=os.path.join(out, "runs", name),
                train_dataset=train_dataset,
                eval_rows=eval_rows,
                eval_samples=sizes["eval_samples"],
                progress=progress,
                label=label,
                learning_rate=args.learning_rate,
                per_device_train_batch_size=completions_per_step,
                num_generations=sizes["num_generations"],
            )
        )

    from .plotting import plot_log_histories

    png = plot_log_histories(
        {r["label"]: r["log_history"] for r in results},
        os.path.join(out, "cegppo_vs_grpo.png"),
        metrics=PLOT_METRICS,
        title=(
            f"Tiny model on built-in arithmetic ({args.problems}), {sizes['prompts_per_step']} prompts x "
            f"{sizes['num_generations']} completions per step, seed {args.seed}"
        ),
    )
    table = format_table(results, warm)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")
    summary = {
        "wall_seconds": wall,
        "sizes": sizes,
        "problems": args.problems,
        "seed": args.seed,
        "warm_start": warm,
        "runs": [{k: v for k, v in r.items() if k != "log_history"} for r in results],
        "plot": png,
    }
    # The commands that evaluate the saved models again, with the paths as the user gave them.
    shown = args.output_dir.rstrip(os.sep) or out
    commands = {
        "warm_start": eval_command(
            os.path.join(shown, "warm_start"), os.path.join(shown, HELDOUT_FILE), sizes["eval_samples"], args.seed
        ),
        **{
            name: eval_command(
                os.path.join(shown, "runs", name, "final"),
                os.path.join(shown, HELDOUT_FILE),
                sizes["eval_samples"],
                args.seed,
            )
            for name, *_ in runs
        },
    }
    summary["heldout"] = heldout
    summary["eval_commands"] = commands
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(_json_safe(summary), f, indent=2)
    print()
    print(table)
    print(f"\n[cegppo-demo] plot: {png}\n[cegppo-demo] table: {os.path.join(out, 'results.md')}")
    print(
        "[cegppo-demo] saved models (each with its prompt format and sampling settings): "
        f"{os.path.join(shown, 'warm_start')}, " + ", ".join(os.path.join(shown, "runs", n, "final") for n, *_ in runs)
    )
    print(
        "[cegppo-demo] held-out accuracy again with cegppo-eval (same prompts, samples and grader: the same figures):"
    )
    for command in commands.values():
        print(f"  {command}")
    print(f"[cegppo-demo] wall time {wall:.0f} s", flush=True)
    return {**summary, "table": table, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point `cegppo-demo`."""
    run_demo(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
