"""The tiny LM in one process, for the experiments (experiments/entropy_toy_and_tiny_lm.py, docs/tuning.md): the SFT
warm start, one `CEGPPOTrainer` run, and the held-out figures with the policy's entropy. (`cegppo-demo` and
`cegppo-compare` run the tiny LM through `cegppo-train` and `cegppo-eval` instead.)

Every model is saved with its prompt format and sampling settings, and the held-out figures are `cegppo-eval`'s code,
so ``cegppo-eval MODEL_DIR --datasets heldout.jsonl --k K --seed S`` (`eval_command`) gives them again.
"""

from __future__ import annotations

import math
import os
import shlex
import time
from typing import Any

from transformers import PrinterCallback, ProgressCallback

from cegppo_trl.data import build_prompt, load_builtin_rows, load_math_dataset
from cegppo_trl.evaluation import evaluate_completions, generate_with_entropy
from cegppo_trl.prompt_settings import save_eval_settings
from cegppo_trl.tiny_model import DEFAULT_PROBLEMS, PROMPT_INSTRUCTION, load_rows, load_tiny, save_tiny, warm_tiny


#: The user message the tiny model is SFT-trained on: "What is 3+4? Put the final answer in \boxed{}."
DEMO_INSTRUCTION = "{problem} " + PROMPT_INSTRUCTION
HELDOUT_FILE = "heldout.jsonl"  # the held-out rows of a demo run, for `cegppo-eval --datasets`
DEFAULT_SFT_STEPS, DEFAULT_RL_STEPS, DEFAULT_EVAL_SAMPLES = 200, 32, 8  # why: docs/entropy_results.md, section 4
CLIPPED_SETS = tuple(f"cegppo/{k}" for k in ("beta1_token_frac", "beta2_token_frac", "beta1_grad_share",
                                               "beta2_grad_share"))  # fmt: skip
MAX_NEW_TOKENS = 20  # the warm-started answer "49+27=76. \boxed{76}" + eos is 16 tokens

#: CEGPPOConfig values of every demo run; `run_rl(**config_overrides)` replaces any of them. Off-policy as in the
#: paper: one generation batch feeds 8 mini-batches of 16 prompts x 8 completions, each used once, so the ratio leaves
#: 1 on 7 of every 8 steps (why not 4 x 2 re-use: docs/entropy_results.md). The learning rate warms up over the first
#: generation batch: Adam's first steps from a fresh state move every weight by ~lr whatever the gradient's size, and
#: at 1e-4 from the first step they cut the training reward (docs/entropy_results.md, section 3). No KL term (paper);
#: bf16 fails on a CPU.
RL_DEFAULTS: dict[str, Any] = dict(
    use_cpu=True, bf16=False, per_device_train_batch_size=128, num_generations=8, gradient_accumulation_steps=1,
    steps_per_generation=8, num_iterations=1, max_completion_length=MAX_NEW_TOKENS, temperature=1.0,
    learning_rate=1e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=8, weight_decay=0.0, max_grad_norm=1.0,
    beta=0.0, epsilon=0.2, loss_type="dapo", activation_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True,
)  # fmt: skip


def demo_train_dataset(problems: str = DEFAULT_PROBLEMS):
    """``builtin:arithmetic`` restricted to `problems`, as a TRL data set with the warm start's user message."""
    wanted = {row["problem"] for row in load_rows("builtin:arithmetic", problems=problems)}
    keep = [i for i, row in enumerate(load_builtin_rows("builtin:arithmetic")) if row["problem"] in wanted]
    return load_math_dataset("builtin:arithmetic", instruction=DEMO_INSTRUCTION).select(keep)


def evaluate_policy(model, tokenizer, rows, *, seed: int = 0, samples_per_row: int = 1) -> dict[str, float]:
    """On ``{"problem", "answer"}`` rows: ``accuracy`` (avg@`samples_per_row`, sampling at temperature 1 as RL
    does) and ``entropy`` (token mean, nats, along those samples, eos included as TRL's metric). `cegppo-eval`'s code
    path, so `eval_command` gives the same accuracy again."""
    if not rows:
        raise ValueError("no held-out rows")
    prompts = [build_prompt(str(row["problem"]).strip(), instruction=DEMO_INSTRUCTION) for row in rows]
    solutions = [str(row["answer"]).strip() for row in rows]
    sampled, entropy = generate_with_entropy(  # RL's sampling: T=1, no top-p / top-k cut
        model,
        tokenizer,
        prompts,
        samples_per_row,
        temperature=1.0,
        max_new_tokens=MAX_NEW_TOKENS,
        top_p=1.0,
        seed=seed,
    )
    return {"accuracy": float(evaluate_completions(sampled, solutions)[f"avg@{samples_per_row}"]), "entropy": entropy}


def save_settings(path: str | os.PathLike) -> None:
    """Record the warm start's prompt and the held-out sampling in a saved model, for `cegppo-eval`."""
    note = "cegppo-demo: trained on '<problem> Put the final answer in \\boxed{}.', evaluated sampling at T=1."
    save_eval_settings(
        path, instruction=DEMO_INSTRUCTION, temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS, note=note
    )


def eval_command(model_dir: str, data_path: str, samples_per_row: int, seed: int = 0) -> str:
    """The `cegppo-eval` command that gives `evaluate_policy`'s accuracy of a model the demo saved."""
    return shlex.join(
        ["cegppo-eval", model_dir, "--datasets", data_path, "--k", str(samples_per_row), "--seed", str(seed)]
    )


def warm_start(seed=0, sft_steps=DEFAULT_SFT_STEPS, progress=True, *, cache_dir=None, train_rows=None, eval_rows=None,
               eval_samples=DEFAULT_EVAL_SAMPLES):  # fmt: skip
    """`tiny_model.warm_tiny` (build, SFT with TRL's SFTTrainer; cached in `cache_dir`, saved there with its prompt
    format) plus its held-out figures (`evaluate_policy` on `eval_rows`, default the held-out sums). Returns
    ``(model, tokenizer, info)``: ``sft``, ``cached``, ``seconds`` and the figures."""
    start = time.perf_counter()
    model, tokenizer, build = warm_tiny(seed, sft_steps, train_rows=train_rows, cache_dir=cache_dir, progress=progress)
    if cache_dir is not None:
        save_settings(cache_dir)
    rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    info = {k: build[k] for k in ("sft", "cached", "num_parameters")}
    info.update(evaluate_policy(model, tokenizer, rows, seed=seed, samples_per_row=eval_samples))
    return model, tokenizer, {**info, "seconds": time.perf_counter() - start}


class _Progress(ProgressCallback):
    """transformers' bar named after the run; postfix: reward, entropy and the clipped sets' token fractions
    (clip_lo / clip_hi) instead of a printed dict per log."""

    def __init__(self, desc: str):
        super().__init__()
        self.desc = desc

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.training_bar.set_description(self.desc)

    def on_log(self, args, state, control, logs=None, **kwargs):
        names = {"reward": "reward", "entropy": "entropy", "clip_lo": CLIPPED_SETS[0], "clip_hi": CLIPPED_SETS[1]}
        shown = {k: (logs or {}).get(v) for k, v in names.items()}
        self.training_bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if isinstance(v, (int, float))})


def _mean(history, metric: str, last: float = 1.0) -> float | None:
    """Mean of `metric` over the last `last` fraction (at least one) of the log entries that have it."""
    values = [e[metric] for e in history if isinstance(e.get(metric), (int, float)) and math.isfinite(e[metric])]
    tail = values[-max(1, round(last * len(values))) :]
    return sum(tail) / len(tail) if tail else None


def run_rl(model, tokenizer, *, beta1, beta2, seed, max_steps, output_dir, train_dataset=None, eval_rows=None,
           progress=True, label=None, eval_samples=DEFAULT_EVAL_SAMPLES, save_final=True, start_eval=None,
           **config_overrides) -> dict[str, Any]:  # fmt: skip
    """Train `model` (a model, trained in place, or a saved model's path) with `CEGPPOTrainer` at (beta1, beta2) for
    `max_steps` steps; beta1 = beta2 = 0 is GRPO's gradient. Every other keyword is a `CEGPPOConfig` field replacing
    `RL_DEFAULTS`. `start_eval` (the start's `evaluate_policy` figures) saves evaluating the start again.

    Returns ``label``, the arguments, ``seconds``, ``log_history``, held-out ``start_*`` / ``end_*`` accuracy and
    entropy, the training reward over the last 10% of the logs (``end_reward``), the clipped sets' mean
    token fractions and gradient shares, ``output_dir`` (with ``trainer_state.json``) and ``final_dir`` (with
    `save_final`: the model with its prompt format in ``output_dir/final``, else None).
    """
    from cegppo_trl.config import CEGPPOConfig
    from cegppo_trl.rewards import math_reward
    from cegppo_trl.trainer import CEGPPOTrainer

    if isinstance(model, (str, os.PathLike)):
        model, tokenizer = load_tiny(model)
    eval_rows = list(eval_rows) if eval_rows is not None else load_rows("builtin:arithmetic_eval")
    values = {**RL_DEFAULTS, "logging_steps": max(1, max_steps // 50), **config_overrides}
    values.update(output_dir=os.fspath(output_dir), seed=seed, max_steps=max_steps)
    args = CEGPPOConfig(**values, cegppo_beta1=beta1, cegppo_beta2=beta2)
    evaluate = dict(seed=seed, samples_per_row=eval_samples)
    start_eval = start_eval or evaluate_policy(model, tokenizer, eval_rows, **evaluate)
    dataset = train_dataset if train_dataset is not None else demo_train_dataset()
    trainer = CEGPPOTrainer(model=model, reward_funcs=[math_reward], args=args, train_dataset=dataset,
                            processing_class=tokenizer)  # fmt: skip
    label = label or f"beta1={beta1:g}, beta2={beta2:g}"
    trainer.remove_callback(PrinterCallback)
    if progress:
        trainer.add_callback(_Progress(label))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_state()
    final_dir = None
    if save_final:
        final_dir = os.path.join(os.fspath(output_dir), "final")
        save_tiny(trainer.model, tokenizer, final_dir)
        save_settings(final_dir)
    end_eval = evaluate_policy(trainer.model, tokenizer, eval_rows, **evaluate)
    history = list(trainer.state.log_history)
    return {
        "label": label, "beta1": beta1, "beta2": beta2, "seed": seed, "max_steps": max_steps, "seconds": seconds,
        "output_dir": os.fspath(output_dir), "final_dir": final_dir, "log_history": history,
        **{f"start_{k}": v for k, v in start_eval.items()}, **{f"end_{k}": v for k, v in end_eval.items()},
        "end_reward": _mean(history, "reward", last=0.1),
        **{name.split("/")[1]: _mean(history, name) for name in CLIPPED_SETS},
    }  # fmt: skip
