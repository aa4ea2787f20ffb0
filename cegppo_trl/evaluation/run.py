"""`evaluate_model`: one model on several data sets, as `cegppo-eval` runs it, in an order where a mistake costs
seconds and a late failure loses nothing: the settings, the report's path, the model source and every data set are
checked first (all failures together), then the model is loaded (or the vLLM engine built) once, and the report is
rewritten atomically after each finished set (``"pending"``: the others).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from ..model_source import resolve_model_source
from .compare import grading_and_sampling
from .datasets import DatasetSpec, is_local, load_eval_datasets, set_settings
from .metrics import evaluate_completions
from .settings import EvalSettings


def write_report(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Write `report` as JSON to `path` atomically (a temporary file, then `os.replace`)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(temporary, path)


def _set_metrics(spec: DatasetSpec, rows, completions, settings: EvalSettings, save_completions: bool):
    """One set's entry of the report: its figures, where it came from, and per problem its correct count (and, with
    `save_completions`, its completions and their grading statuses)."""
    from ..data import problem_text

    prompts, solutions = list(rows["prompt"]), list(rows["solution"])
    result = evaluate_completions(
        completions, solutions, settings.pass_ks, protocol=settings.protocol, timeout_s=settings.timeout_s
    )
    problems = []
    for i, (prompt, solution) in enumerate(zip(prompts, solutions)):
        entry = {"index": i, "problem": problem_text(prompt)[0], "solution": solution,
                 "num_correct": result["num_correct"][i]}  # fmt: skip
        if save_completions:
            entry["completions"] = completions[i]
            entry["statuses"] = result["statuses"][i]
        problems.append(entry)
    metrics = {key: value for key, value in result.items() if key not in ("num_correct", "statuses")}
    metrics.update(source=spec.source, split=None if is_local(spec.source) else spec.split)
    return metrics, problems


def evaluate_model(
    model_name_or_path: str,
    datasets: Sequence[str],
    settings: EvalSettings | None = None,
    *,
    output: str | os.PathLike | None = None,
    save_completions: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Evaluate one model (a saved directory, a LoRA adapter folder, a checkpoint or a Hub id) on several data sets.

    `settings` (an `EvalSettings`) and `overrides` (its field names, e.g. ``k=32, temperature=0.6``) say how; the
    prompt and sampling fields left at None come from the model (``cegppo_prompt.json``) or the paper
    (``report["settings"]["from_checkpoint"]`` lists those taken from the model); ``protocol`` names the grading.
    `datasets` are ``--datasets`` entries: local files, ``builtin:...`` sets, Hub ids, ``ID:SPLIT``, each optionally
    ``@K`` (its own samples per problem).

    Returns the report ``{"model", "source", "protocol", "math_verify", "sampling", "settings", "datasets": {name:
    metrics}, "pending", "seconds"}`` (`grading_and_sampling`: what makes two reports comparable); with
    `output` it is also written there after every finished set (`output` is checked to be writable first). `log`
    receives progress messages (the command prints them to stderr), `on_result(name, metrics)` each set's figures as
    soon as they are known.
    """
    settings = replace(settings or EvalSettings(), **overrides)  # checked by EvalSettings.__post_init__
    if output is not None:
        from ..run_checks import check_writable_path  # not at the top: it imports the config, and so torch

        check_writable_path(output, "--output", folder=False)
    log = log or (lambda message: None)
    source = resolve_model_source(model_name_or_path, settings.base_model)
    settings, from_checkpoint = settings.resolve(*source.settings_dirs)  # checked again by EvalSettings.__post_init__
    if from_checkpoint:
        shown = ", ".join(f"{name} {getattr(settings, name)!r}" for name in from_checkpoint)
        log(
            f"{model_name_or_path} declares its evaluation settings (cegppo_prompt.json, generation_config.json): "
            f"using {shown}. Flags override them."
        )
    specs, data = load_eval_datasets(list(datasets), settings)

    start_all = time.perf_counter()
    report: dict[str, Any] = {
        "model": model_name_or_path,
        "source": {"model": source.path, "adapter": source.adapter},
        **grading_and_sampling(settings),
        "settings": {**asdict(settings), "from_checkpoint": from_checkpoint},
        "datasets": {},
        "pending": [spec.name for spec in specs],
    }
    log(f"loading {source.path}" + (f" with the LoRA adapter {source.adapter}" if source.adapter else ""))
    from .generation import open_generator

    with open_generator(source, settings) as generate:
        for spec in specs:
            start = time.perf_counter()
            rows, own = data[spec.name], set_settings(spec, settings)
            completions = generate(list(rows["prompt"]), own.k, progress=spec.name if progress else False)
            metrics, problems = _set_metrics(spec, rows, completions, own, save_completions)
            metrics.update(seconds=time.perf_counter() - start, problems=problems)
            report["datasets"][spec.name] = metrics
            report["pending"].remove(spec.name)
            report["seconds"] = time.perf_counter() - start_all
            if output is not None:
                write_report(report, output)
            if on_result is not None:
                on_result(spec.name, metrics)
    return report
