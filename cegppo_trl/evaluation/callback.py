"""`AvgAtKCallback`: avg@k / pass@k of the policy on a held-out set during training, split across processes and
logged through the trainer (so `report_to` integrations and other callbacks see it)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from transformers import Trainer, TrainerCallback

from .generation import generate_completions
from .metrics import evaluate_completions, summarize_counts
from .settings import DEFAULT_BATCH_SIZE, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, EvalSettings


class AvgAtKCallback(TrainerCallback):
    """Log avg@k / pass@k of the policy on a held-out set every `eval_steps` optimizer steps, through the trainer's
    `log` (so `state.log_history`, every `report_to` integration and every callback's `on_log` get it)::

        trainer.add_callback(AvgAtKCallback(trainer, load_math_dataset("builtin:arithmetic_eval"), k=4))

    On several processes the work is split as TRL's callbacks split it (`split_between_processes`, then
    `gather_object`): the held-out problems are cut into fixed chunks of at most `batch_size` sequences, each sampled
    with its own seed (`seed + chunk index`), so the figure is the same on any number of processes. The trainer's RNG
    is untouched, and the same seeds are used every time.

    Args:
        trainer: the trainer it is added to (its `accelerator`, model and tokenizer are used, and it logs).
        eval_dataset: rows with ``prompt`` and ``solution`` (e.g. `load_math_dataset`); default: the trainer's.
        k, pass_ks, temperature, top_p, top_k, batch_size, seed, max_problems, timeout_s: as in `cegppo-eval`
            (sampling defaults: the paper's validation, 0.6 and 0.95). max_new_tokens: default: the trainer's
            `max_completion_length`, else 1024.
        eval_steps: evaluate when `global_step % eval_steps == 0`; eval_on_start: also at step 0; eval_on_end: also
            after the last step. metric_prefix: of the logged names (``heldout/avg@4``).
    """

    def __init__(
        self,
        trainer: Trainer,
        eval_dataset=None,
        k: int = 4,
        eval_steps: int = 50,
        *,
        pass_ks: Sequence[int] | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        top_k: int = 0,
        max_new_tokens: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        seed: int = 0,
        max_problems: int | None = None,
        eval_on_start: bool = False,
        eval_on_end: bool = True,
        metric_prefix: str = "heldout/",
        timeout_s: float | None = None,
    ):
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"AvgAtKCallback(trainer, ...) needs the trainer it is added to (it logs through it), got "
                f"{type(trainer).__name__}: trainer.add_callback(AvgAtKCallback(trainer, eval_dataset, ...))."
            )
        if max_new_tokens is None:
            max_new_tokens = getattr(trainer.args, "max_completion_length", None) or 1024
        self.settings = EvalSettings(
            k=k, pass_ks=None if pass_ks is None else list(pass_ks), temperature=temperature, top_p=top_p,
            top_k=top_k, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, max_problems=max_problems,
            timeout_s=timeout_s,
        )  # fmt: skip  # the same checks (and messages) as cegppo-eval's
        if not isinstance(eval_steps, int) or eval_steps < 1:
            raise ValueError(f"eval_steps must be an integer >= 1, got {eval_steps!r}.")
        if eval_dataset is None:
            eval_dataset = trainer.eval_dataset
        if eval_dataset is None:
            raise ValueError(
                "AvgAtKCallback needs held-out rows: pass eval_dataset= (e.g. load_math_dataset(...)) or give the "
                "trainer an eval_dataset."
            )
        rows = list(eval_dataset)
        if max_problems is not None:
            rows = rows[:max_problems]
        if not rows or any("prompt" not in r or "solution" not in r for r in rows):
            raise ValueError(
                "eval_dataset must be non-empty rows with 'prompt' and 'solution' (load it with "
                "cegppo_trl.load_math_dataset)."
            )
        self.trainer = trainer
        self.prompts = [r["prompt"] for r in rows]
        self.solutions = [r["solution"] for r in rows]
        self.eval_steps, self.eval_on_start, self.eval_on_end = eval_steps, eval_on_start, eval_on_end
        self.metric_prefix = metric_prefix
        self.history: list[dict[str, float]] = []
        self.last_share: list[int] = []  # the problems this process generated in the last evaluation
        self._last_step: int | None = None

    def chunks(self) -> list[list[int]]:
        """The fixed chunks of problem indices (at most `batch_size` sequences each, at least one problem)."""
        per_chunk = max(1, self.settings.batch_size // self.settings.k)
        n = len(self.prompts)
        return [list(range(start, min(start + per_chunk, n))) for start in range(0, n, per_chunk)]

    def evaluate(self) -> dict[str, float]:
        """avg@k / pass@j of the trainer's current model on the held-out set, with the prefixed metric names. Every
        process must call it (it gathers)."""
        from accelerate.utils import gather_object
        from trl.models.utils import unwrap_model_for_generation

        start, s = time.perf_counter(), self.settings
        accelerator = self.trainer.accelerator
        tokenizer = self.trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps the tokenizer
        chunks = self.chunks()
        counts: list[tuple[int, int, bool]] = []  # (problem index, correct samples, unparseable gold)
        share: list[int] = []
        with (
            accelerator.split_between_processes(list(range(len(chunks)))) as mine,
            unwrap_model_for_generation(
                self.trainer.model_wrapped,
                accelerator,
                gradient_checkpointing_kwargs=getattr(self.trainer.args, "gradient_checkpointing_kwargs", None),
            ) as model,
        ):
            for c in mine:
                indices = chunks[c]
                completions = generate_completions(
                    model, tokenizer, [self.prompts[i] for i in indices], s.k, temperature=s.temperature,
                    top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens, batch_size=s.batch_size,
                    seed=s.seed + c,
                )  # fmt: skip
                graded = evaluate_completions(
                    completions, [self.solutions[i] for i in indices], s.pass_ks, timeout_s=s.timeout_s
                )
                for i, correct, statuses in zip(indices, graded["num_correct"], graded["statuses"]):
                    counts.append((i, correct, "bad_gold" in statuses))
                share.extend(indices)
        counts = sorted(gather_object(counts))
        self.last_share = share
        result = summarize_counts([c for _, c, _ in counts], s.k, s.pass_ks, [skip for _, _, skip in counts])
        metrics = {
            f"{self.metric_prefix}{key}": float(value)
            for key, value in result.items()
            if key.startswith(("avg@", "pass@"))
        }
        metrics[f"{self.metric_prefix}eval_seconds"] = time.perf_counter() - start
        return metrics

    def _run(self, state, control) -> None:
        metrics = self.evaluate()
        # Through the trainer, so that every report_to integration and callback gets it. `transformers.Trainer.log`
        # itself, not the subclass's: TRL 1.16's GRPOTrainer.log folds the training metrics it has buffered since
        # its last log into whatever is logged, clears them and prints completion tables, which would take them out
        # of the trainer's own next log entry. And transformers' CallbackHandler.on_log clears `control.should_log`,
        # which would cancel the trainer's own log of this step: it is restored. tests/test_evaluation.py checks
        # that the trainer's entries are the same with and without this callback.
        should_log = control.should_log
        Trainer.log(self.trainer, dict(metrics))
        control.should_log = should_log
        self.history.append(dict(state.log_history[-1]))
        self._last_step = state.global_step

    def on_train_begin(self, args, state, control, **kwargs):
        if self.eval_on_start and self._last_step != state.global_step:
            self._run(state, control)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.eval_steps == 0 and self._last_step != state.global_step:
            self._run(state, control)

    def on_train_end(self, args, state, control, **kwargs):
        if self.eval_on_end and self._last_step != state.global_step:
            self._run(state, control)
