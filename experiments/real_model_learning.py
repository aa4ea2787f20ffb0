"""Does RL make a real chat model better? SmolLM2-135M-Instruct on the built-in 2-term sums, on a CPU: CE-GPPO (the
paper's betas, off-policy) and GRPO (the same run with both betas at 0), several seeds each, every model measured on
the same held-out problems with the same grading, prompt and sampling before and after.

    python experiments/real_model_learning.py --out build/real-model/learning     # the committed run's sizes

1. builds SmolLM2-135M-Instruct as the real-model tier does (tests/real_model/build_smollm2.py, cached);
2. measures the built model on the first `--eval_problems` problems of ``builtin:arithmetic_eval`` (never trained
   on): avg@k with its standard error, the share of samples with a ``\\boxed{}`` answer, with any answer, and the
   accuracy among answered samples (what is format and what is arithmetic), and the policy's token entropy;
3. trains CE-GPPO and GRPO for each seed with `CEGPPOTrainer` (LoRA, HF generation) on ``builtin:arithmetic`` and
   measures each trained model the same way;
4. writes ``results.json`` and ``results.md`` (start, each arm and seed, the paired difference to the start and
   CE-GPPO - GRPO with standard errors, the mean and spread over seeds) and ``learning_curves.png`` (training reward,
   held-out accuracy, entropy and CE-GPPO's clipped-token shares over steps), and prints where the time went.

Jobs (the start's measurement, one per arm and seed) run in `--jobs` processes of one torch thread each (on a shared
2-core machine two one-thread processes went faster than one two-thread process). Results and choices: docs/real_model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
#: The prompt, fixed before the recorded run (the third configuration of docs/real_model.md) and the same for the
#: start and every trained model: one worked example (a sum in neither data set) before the problem, so the model
#: writes the equation and boxes its result from the first sample (the format is not what RL has to find).
EXAMPLE = [
    {"role": "user", "content": "What is 12+30?"},
    {"role": "assistant", "content": "12 + 30 = 42. \\boxed{42}"},
]
TEMPERATURE = 0.7  # at 1.0 every group of SmolLM2's sums had zero reward variance (docs/real_model.md)
MAX_NEW_TOKENS = 28  # the equation and its box fit; at 16 most boxes were cut
ARMS = {"cegppo": (0.5, 1.0), "grpo": (0.0, 0.0)}  # (beta1, beta2): the paper's 1.5B betas; both 0 is GRPO
CLIPPED = ("cegppo/beta1_token_frac", "cegppo/beta2_token_frac")
#: Where a training run's time goes: TRL 1.16 GRPOTrainer methods (private names, pinned by
#: tests/test_learning_command.py) timed by wrapping them on the trainer instance.
TIMED_METHODS = ("_generate_and_score_completions", "_generate", "_calculate_rewards",
                 "_get_per_token_logps_and_entropies")  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "real-model" / "learning")
    parser.add_argument("--model", type=Path, default=None, help="a built SmolLM2 directory (default: build it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--max_steps", type=int, default=24, help="optimizer steps per run")
    parser.add_argument("--eval_problems", type=int, default=200, help="held-out problems (first N of the set)")
    parser.add_argument("--eval_k", type=int, default=4, help="samples per held-out problem")
    parser.add_argument("--eval_every", type=int, default=0, help="also measure every N steps during training (0: no)")
    parser.add_argument("--prompts_per_generation", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--steps_per_generation", type=int, default=4, help="optimizer steps per generation batch")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument(
        "--rewards",
        nargs="+",
        default=["math"],
        choices=["math", "format"],
        help="training rewards (the format reward was gamed in the first recorded configuration: docs/real_model.md)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="processes (one torch thread each)")
    parser.add_argument(
        "--summarize_only",
        action="store_true",
        help="train nothing: rebuild the table and figure from start.json and the runs' json in --out",
    )
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------- measurement
def load_rows(name: str):
    """`name`'s problems as conversational prompts: the worked `EXAMPLE`, then the problem as the user's message."""
    from cegppo_trl.data import load_math_dataset

    rows = load_math_dataset(name, instruction=None)
    return rows.map(lambda row: {"prompt": EXAMPLE + row["prompt"]})


def load_eval_rows(n: int):
    rows = load_rows("builtin:arithmetic_eval")
    if n > len(rows):
        raise SystemExit(f"--eval_problems {n}: builtin:arithmetic_eval has {len(rows)} problems; pass at most that.")
    return rows.select(range(n))


def measure(model, tokenizer, n: int, k: int) -> dict:
    """The held-out figures of `model`: per-problem correct counts (for paired standard errors), avg@k, the answer
    format breakdown and the token entropy along the samples. The sampling seed is fixed: every model sees the same
    problems with the same seed."""
    from cegppo_trl.evaluation import evaluate_completions, generate_with_entropy
    from cegppo_trl.rewards.extract import has_boxed_answer

    rows = load_eval_rows(n)
    start = time.perf_counter()
    completions, entropy = generate_with_entropy(model, tokenizer, list(rows["prompt"]), k, temperature=TEMPERATURE,
                                                 top_p=1.0, max_new_tokens=MAX_NEW_TOKENS, batch_size=64, seed=1234)  # fmt: skip
    graded = evaluate_completions(completions, list(rows["solution"]))
    statuses = [s for row in graded["statuses"] for s in row]
    answered = sum(s in ("correct", "wrong") for s in statuses)
    flat = [c for row in completions for c in row]
    return {
        "num_correct": graded["num_correct"], "k": k, "num_problems": n, "accuracy": graded[f"avg@{k}"],
        "accuracy_se": problem_se([c / k for c in graded["num_correct"]]), "entropy": entropy,
        "boxed_rate": sum(map(has_boxed_answer, flat)) / len(flat), "answered_rate": answered / len(statuses),
        "accuracy_among_answered": sum(s == "correct" for s in statuses) / max(answered, 1),
        "status_counts": graded["status_counts"], "examples": [row[0] for row in completions[:5]],
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


def problem_se(values) -> float:
    """Standard error of the mean over problems (the k samples of a problem are not independent)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


# --------------------------------------------------------------------------------------------------- jobs
def _one_thread():
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def job_start_eval(model_dir: str, n: int, k: int) -> dict:
    _one_thread()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {"name": "start", **measure(model, tokenizer, n, k), **_measured_with(model_dir)}


def _measured_with(model_dir: str) -> dict:
    return {"model": str(Path(model_dir).resolve()), "example": EXAMPLE, "temperature": TEMPERATURE,
            "max_new_tokens": MAX_NEW_TOKENS}  # fmt: skip


def reusable_start(path: Path, model_dir: str, n: int, k: int) -> dict | None:
    """The start's measurement saved in `path` by an earlier run of this command with the same model, held-out size
    and prompt and sampling (a run stopped after it resumes without measuring the start again), else None."""
    if not path.is_file():
        return None
    start = json.loads(path.read_text())
    same = {key: start.get(key) for key in _measured_with(model_dir)} == _measured_with(model_dir)
    return start if same and (start.get("num_problems"), start.get("k")) == (n, k) else None


class _Timer:
    """Seconds spent in the trainer's generation, reward, old-log-prob pass and everything else of a step (the
    optimizer step: the loss's forward, backward and update), by wrapping `TIMED_METHODS` on the instance."""

    def __init__(self, trainer):
        self.seconds = {"generation": 0.0, "reward": 0.0, "old_logprob_pass": 0.0, "scoring_total": 0.0}
        self.in_scoring = False
        originals = {name: getattr(trainer, name) for name in TIMED_METHODS}

        def timed(name, key):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return originals[name](*args, **kwargs)
                finally:
                    if key is not None:
                        self.seconds[key] += time.perf_counter() - start

            return wrapper

        def scoring(*args, **kwargs):
            self.in_scoring = True
            start = time.perf_counter()
            try:
                return originals["_generate_and_score_completions"](*args, **kwargs)
            finally:
                self.in_scoring = False
                self.seconds["scoring_total"] += time.perf_counter() - start

        def logps(*args, **kwargs):  # inside scoring: the old policy's pass; otherwise the loss's forward
            start = time.perf_counter()
            try:
                return originals["_get_per_token_logps_and_entropies"](*args, **kwargs)
            finally:
                if self.in_scoring:
                    self.seconds["old_logprob_pass"] += time.perf_counter() - start

        trainer._generate_and_score_completions = scoring
        trainer._generate = timed("_generate", "generation")
        trainer._calculate_rewards = timed("_calculate_rewards", "reward")
        trainer._get_per_token_logps_and_entropies = logps

    def split(self, train_seconds: float, eval_seconds: float) -> dict:
        s = self.seconds
        other_scoring = s["scoring_total"] - s["generation"] - s["reward"] - s["old_logprob_pass"]
        return {"generation": s["generation"], "reward": s["reward"], "old_logprob_pass": s["old_logprob_pass"],
                "other_scoring": max(other_scoring, 0.0),
                "optimizer_step": max(train_seconds - s["scoring_total"] - eval_seconds, 0.0)}  # fmt: skip


def job_train(model_dir: str, arm: str, seed: int, options: dict) -> dict:
    _one_thread()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    from cegppo_trl import CEGPPOConfig, CEGPPOTrainer
    from cegppo_trl.rewards import format_reward, math_reward

    beta1, beta2 = ARMS[arm]
    n, k = options["eval_problems"], options["eval_k"]
    out = Path(options["out"]) / f"{arm}-seed{seed}"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = options["prompts_per_generation"] * options["num_generations"]
    per_step = batch // options["steps_per_generation"]
    config = dict(
        output_dir=str(out), seed=seed, max_steps=options["max_steps"], cegppo_beta1=beta1, cegppo_beta2=beta2,
        use_cpu=True, bf16=False, per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
        steps_per_generation=options["steps_per_generation"], num_generations=options["num_generations"],
        max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0,
        learning_rate=options["learning_rate"], lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, activation_checkpointing=False,
    )  # fmt: skip
    args = CEGPPOConfig(**config)
    from peft import LoraConfig

    lora = LoraConfig(r=options["lora_r"], lora_alpha=2 * options["lora_r"], target_modules="all-linear",
                      task_type="CAUSAL_LM")  # fmt: skip
    train = load_rows("builtin:arithmetic")
    rewards = [{"math": math_reward, "format": format_reward}[name] for name in options["rewards"]]
    trainer = CEGPPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=train,
                            processing_class=tokenizer, peft_config=lora)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    timer = _Timer(trainer)
    curve = []  # (step, held-out figures) measured during training
    eval_seconds = [0.0]

    class HeldOut(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            every = options["eval_every"]
            if every and state.global_step % every == 0 and state.global_step < a.max_steps:
                start = time.perf_counter()
                figures = measure(trainer.model, tokenizer, n, k)
                eval_seconds[0] += time.perf_counter() - start
                curve.append({"step": state.global_step, **_curve_point(figures)})

    class Progress(TrainerCallback):  # one line per step: a long run on a loaded CPU shows where it is
        def on_log(self, a, state, control, logs=None, **kwargs):
            shown = {key: logs[key] for key in ("reward", "entropy", *CLIPPED) if _finite((logs or {}).get(key))}
            if shown:
                print(
                    f"[learning] {arm}-seed{seed} step {state.global_step}: "
                    + ", ".join(f"{key} {value:.3g}" for key, value in shown.items()),
                    flush=True,
                )

    trainer.add_callback(HeldOut())
    trainer.add_callback(Progress())
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    end = measure(trainer.model, tokenizer, n, k)
    curve.append({"step": trainer.state.global_step, **_curve_point(end)})
    return {
        "name": f"{arm}-seed{seed}", "arm": arm, "seed": seed, "beta1": beta1, "beta2": beta2, "end": end,
        "curve": curve, "log_history": trainer.state.log_history, "train_seconds": train_seconds,
        "time": timer.split(train_seconds, eval_seconds[0]), "config": {**config, "lora_r": options["lora_r"]},
    }  # fmt: skip


def _curve_point(figures: dict) -> dict:
    return {key: figures[key] for key in ("accuracy", "accuracy_se", "entropy", "boxed_rate", "answered_rate")}


# --------------------------------------------------------------------------------------------------- summary
def paired(after: list[int], before: list[int], k: int) -> tuple[float, float]:
    """(mean, standard error) of the per-problem accuracy difference `after - before` (the same problems)."""
    diffs = [(a - b) / k for a, b in zip(after, before)]
    return sum(diffs) / len(diffs), problem_se(diffs)


def summarize(start: dict, runs: list[dict]) -> dict:
    k = start["k"]
    per_run = {}
    for r in runs:
        if "num_correct" in start:
            diff, se = paired(r["end"]["num_correct"], start["num_correct"], k)
        else:  # a start recorded by its figures only (see --summarize_only): unpaired
            diff = r["end"]["accuracy"] - start["accuracy"]
            se = math.hypot(r["end"]["accuracy_se"], start["accuracy_se"])
        per_run[r["name"]] = {"arm": r["arm"], "seed": r["seed"], "diff_vs_start": diff, "diff_se": se,
                              "z": diff / se if se > 0 else float("nan")}  # fmt: skip
    arms = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        diffs = [per_run[r["name"]]["diff_vs_start"] for r in mine]
        arms[arm] = {
            "seeds": [r["seed"] for r in mine], "accuracy": [r["end"]["accuracy"] for r in mine],
            "diff_mean": statistics.fmean(diffs), "diff_spread": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "diff_min": min(diffs), "diff_max": max(diffs),
            "all_seeds_above_3se": all(per_run[r["name"]]["z"] >= 3 for r in mine),
            "entropy": [r["end"]["entropy"] for r in mine],
        }  # fmt: skip
    versus = []
    if {"cegppo", "grpo"} <= set(arms):
        for seed in sorted({r["seed"] for r in runs}):
            pair = {r["arm"]: r for r in runs if r["seed"] == seed}
            if {"cegppo", "grpo"} <= set(pair):
                diff, se = paired(pair["cegppo"]["end"]["num_correct"], pair["grpo"]["end"]["num_correct"], k)
                entropy = pair["cegppo"]["end"]["entropy"] - pair["grpo"]["end"]["entropy"]
                versus.append({"seed": seed, "accuracy_diff": diff, "accuracy_diff_se": se, "entropy_diff": entropy})
    return {"per_run": per_run, "arms": arms, "cegppo_minus_grpo": versus}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def markdown_table(start: dict, runs: list[dict], summary: dict) -> str:
    lines = [
        f"Held-out: first {start['num_problems']} problems of `builtin:arithmetic_eval`, avg@{start['k']}, "
        f"temperature {TEMPERATURE}, {MAX_NEW_TOKENS} new tokens; +- one standard error over problems; the difference "
        "to the start is paired per problem.",
        "",
        "| model | accuracy % | diff vs start (pp) | diff / SE | boxed % | answered % | acc. among answered % "
        "| entropy (nats) |",
        "|---|---|---|---|---|---|---|---|",
        f"| start (built model) | {_pct(start['accuracy'])} +- {_pct(start['accuracy_se'])} | | | "
        f"{_pct(start['boxed_rate'])} | {_pct(start['answered_rate'])} | {_pct(start['accuracy_among_answered'])} | "
        f"{start['entropy']:.3f} |",
    ]
    for r in runs:
        e, p = r["end"], summary["per_run"][r["name"]]
        lines.append(
            f"| {r['arm']} seed {r['seed']} | {_pct(e['accuracy'])} +- {_pct(e['accuracy_se'])} | "
            f"{100 * p['diff_vs_start']:+.1f} +- {_pct(p['diff_se'])} | {p['z']:.1f} | {_pct(e['boxed_rate'])} | "
            f"{_pct(e['answered_rate'])} | {_pct(e['accuracy_among_answered'])} | {e['entropy']:.3f} |"
        )
    lines += ["", "| arm | diff vs start, mean over seeds (pp) | spread (std over seeds) | min .. max | "
              "every seed >= 3 SE |", "|---|---|---|---|---|"]  # fmt: skip
    for arm, a in summary["arms"].items():
        lines.append(
            f"| {arm} | {100 * a['diff_mean']:+.1f} | {100 * a['diff_spread']:.1f} | {100 * a['diff_min']:+.1f} .. "
            f"{100 * a['diff_max']:+.1f} | {'yes' if a['all_seeds_above_3se'] else 'no'} |"
        )
    if summary["cegppo_minus_grpo"]:
        lines += ["", "| seed | CE-GPPO - GRPO accuracy (pp) | entropy (nats) |", "|---|---|---|"]
        for v in summary["cegppo_minus_grpo"]:
            lines.append(
                f"| {v['seed']} | {100 * v['accuracy_diff']:+.1f} +- {_pct(v['accuracy_diff_se'])} | "
                f"{v['entropy_diff']:+.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(start: dict, runs: list[dict], path: Path) -> str:
    from cegppo_trl.demo.plotting import RUN_COLORS, panels, save_figure, style_panel

    names = (
        "training reward (sum of the rewards)",
        "held-out accuracy (avg@k)",
        "training entropy (nats)",
        "CE-GPPO clipped-token share",
    )
    fig, axes = panels(4, ncols=4, width=4.0, height=3.1)
    for r in runs:
        color, style = RUN_COLORS[r["arm"]], "-" if r["seed"] == runs[0]["seed"] else "--"
        label = f"{'CE-GPPO' if r['arm'] == 'cegppo' else 'GRPO'} seed {r['seed']}"
        history = r["log_history"]
        for ax, metric in ((axes[0], "reward"), (axes[2], "entropy")):
            points = [(e["step"], e[metric]) for e in history if _finite(e.get(metric))]
            ax.plot(
                *zip(*points), color=color, linestyle=style, marker=".", linewidth=1.2, label=label
            ) if points else None
        curve = [(0, start["accuracy"], start["accuracy_se"])]
        curve += [(c["step"], c["accuracy"], c["accuracy_se"]) for c in r["curve"]]
        steps, acc, se = zip(*curve)
        axes[1].errorbar(steps, acc, yerr=se, color=color, linestyle=style, marker="o", capsize=3, label=label)
        if r["arm"] == "cegppo":
            for metric, marker in zip(CLIPPED, ("v", "^")):
                points = [(e["step"], e[metric]) for e in history if _finite(e.get(metric))]
                if points:
                    axes[3].plot(*zip(*points), color=color, linestyle=style, marker=marker, markersize=3,
                                 label=f"{metric.split('/')[1].split('_')[0]} seed {r['seed']}")  # fmt: skip
    for ax, name in zip(axes, names):
        style_panel(ax, name)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, path, "SmolLM2-135M-Instruct on 2-term sums: CE-GPPO vs GRPO (LoRA, CPU)")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def time_report(start: dict, runs: list[dict], total: float) -> str:
    keys = ("generation", "reward", "old_logprob_pass", "optimizer_step", "other_scoring")
    sums = {key: sum(r["time"][key] for r in runs) for key in keys}
    evals = start["seconds"] + sum(r["end"]["seconds"] for r in runs)
    train = sum(r["train_seconds"] for r in runs)
    parts = ", ".join(f"{key} {sums[key]:.0f} s" for key in keys)
    return (f"time (process seconds, summed over {len(runs)} runs): training {train:.0f} s ({parts}); held-out "
            f"measurements {evals:.0f} s; wall total " + ("not recorded" if total is None else f"{total:.0f} s"))  # fmt: skip


def write_results(out: Path, start: dict, runs: list[dict], total: float | None, options: dict) -> None:
    summary = summarize(start, runs)
    table = markdown_table(start, runs, summary)
    timing = time_report(start, runs, total)
    result = {"settings": {"example": EXAMPLE, "temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS,
                           **options}, "start": start, "summary": summary, "seconds": total, "time": timing,
              "runs": [{k: v for k, v in r.items() if k != "log_history"} for r in runs]}  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(table + "\n" + timing + "\n")
    figure = plot(start, runs, out / "learning_curves.png")
    print(table)
    print(timing)
    print(f"[learning] wrote {out / 'results.json'}, {out / 'results.md'}, {figure}")


def summarize_only(out: Path) -> int:
    """The table and figure of the runs saved in `out` so far (a run cut short keeps its finished jobs)."""
    if not (out / "start.json").is_file():
        raise SystemExit(f"--summarize_only: {out / 'start.json'} is missing; run the command without it first.")
    start = json.loads((out / "start.json").read_text())
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*-seed*.json"))]
    if not runs:
        raise SystemExit(f"--summarize_only: no finished run (<arm>-seed<N>.json) in {out}.")
    runs.sort(key=lambda r: (r["seed"], list(ARMS).index(r["arm"])))
    write_results(out, start, runs, None, {"runs_found": [r["name"] for r in runs]})
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    wall = time.perf_counter()
    if args.summarize_only:
        return summarize_only(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests" / "real_model"))
        from build_smollm2 import BuildError, build

        try:
            args.model = build()
        except BuildError as error:
            raise SystemExit(f"real_model_learning: {error}") from None
    model_dir = str(args.model)
    options = {k: v for k, v in vars(args).items() if k not in ("model", "out")} | {"out": str(args.out)}
    load_eval_rows(args.eval_problems)  # a bad size fails before anything runs
    print(f"[learning] model {model_dir}; {len(args.arms)} arms x seeds {args.seeds}, {args.max_steps} steps each; "
          f"held-out {args.eval_problems} problems x {args.eval_k}; {args.jobs} processes", flush=True)  # fmt: skip
    start = reusable_start(args.out / "start.json", model_dir, args.eval_problems, args.eval_k)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        if start is None:
            start_future = pool.submit(job_start_eval, model_dir, args.eval_problems, args.eval_k)
        futures = [pool.submit(job_train, model_dir, arm, seed, options) for seed in args.seeds for arm in args.arms]
        if start is None:
            start = start_future.result()
            (args.out / "start.json").write_text(json.dumps(start, indent=1) + "\n")
        else:
            print(f"[learning] start: reusing {args.out / 'start.json'} (same model, problems, k and sampling)")
        print(f"[learning] start: accuracy {start['accuracy']:.3f} +- {start['accuracy_se']:.3f}", flush=True)
        runs = []
        for future in futures:
            runs.append(future.result())
            r = runs[-1]
            print(f"[learning] {r['name']}: accuracy {r['end']['accuracy']:.3f} +- {r['end']['accuracy_se']:.3f} "
                  f"(train {r['train_seconds']:.0f} s)", flush=True)  # fmt: skip
            (args.out / f"{r['name']}.json").write_text(json.dumps(r, indent=1) + "\n")
    write_results(args.out, start, runs, time.perf_counter() - wall, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
