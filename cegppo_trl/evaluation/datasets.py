"""The data sets of an evaluation: one ``--datasets`` entry parsed (``ID``, ``ID:SPLIT``, a local file, a built-in
set), and every entry loaded and checked before any model code runs."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .settings import EvalSettings


@dataclass(frozen=True)
class DatasetSpec:
    """One ``--datasets`` entry: `name` (the report's key: the entry without its ``@K``), the `source` for
    `load_math_dataset`, its `split` (Hub sets) and its own samples per problem `k` (``ENTRY@K``; None: ``--k``)."""

    name: str
    source: str
    split: str
    k: int | None = None


_OWN_K_RE = re.compile(r"@(\d+)$")


def is_local(name: str) -> bool:
    """A built-in set or an existing local file (not a Hub id)."""
    from ..data import BUILTIN_DATASETS

    return name in BUILTIN_DATASETS or os.path.exists(os.path.expanduser(name))


def parse_dataset_spec(text: str, default_split: str = "test") -> DatasetSpec:
    """``ID``, ``ID:SPLIT`` (a Hub data set and its split, e.g. ``HuggingFaceH4/aime_2024:train``), a local file, or
    a built-in set, each optionally followed by ``@K``, its own samples per problem (the paper: ``@32``, MATH500
    ``@4``). A split applies to Hub sets only: a file is one split."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a data set name.")
    own_k = None if is_local(text) else _OWN_K_RE.search(text)
    k = None
    if own_k:
        text, k = text[: own_k.start()], int(own_k[1])
        if k < 1:
            raise ValueError(f"{text}@{k}: the samples per problem after '@' must be >= 1.")
    if is_local(text):
        return DatasetSpec(text, text, default_split, k=k)
    prefix = "builtin:" if text.startswith("builtin:") else ""
    source, colon, split = text[len(prefix) :].partition(":")
    source = prefix + source
    if colon and not split:
        raise ValueError("empty split after ':'; write ID:SPLIT, e.g. math-ai/aime25:test.")
    if is_local(source):  # (`text` itself is not: it has a colon)
        raise ValueError(
            f"a split applies to Hub data sets; {source} is a local file (one split). Write {source} without ':{split}'."
        )
    return DatasetSpec(text, source, split or default_split, k=k)


def set_settings(spec: DatasetSpec, settings: EvalSettings) -> EvalSettings:
    """The settings of one set: `settings` with the set's own ``@K`` (checked again, e.g. ``--pass-k`` <= K)."""
    return settings if spec.k is None else replace(settings, k=spec.k)


def load_eval_datasets(names: Sequence[str], settings: EvalSettings) -> tuple[list[DatasetSpec], dict[str, Any]]:
    """The specs of the ``--datasets`` entries and ``{spec.name: datasets.Dataset}``, each loaded with
    `load_math_dataset` (its own split) and cut to `max_problems`. Raises one ValueError that lists every entry that
    fails, with its reason, so that one run of the command shows every mistake."""
    from ..data import load_math_dataset

    specs, loaded, failures = [], {}, []
    for name in names:
        try:
            spec = parse_dataset_spec(name, settings.split)
            if spec.name in loaded:
                failures.append(f"  {name}: given twice")
                continue
            set_settings(spec, settings)  # its own @K against --pass-k
            data = load_math_dataset(
                spec.source,
                split=spec.split,
                problem_column=settings.problem_column,
                answer_column=settings.answer_column,
                system_prompt=settings.system_prompt or None,
                instruction=settings.instruction or None,
                example=None
                if settings.example_problem is None
                else (settings.example_problem, settings.example_answer),
            )
        except Exception as error:  # noqa: BLE001 - a user's data set: report every failure, with its reason
            failures.append(f"  {name}: {type(error).__name__}: {error}")
            continue
        if settings.max_problems is not None:
            data = data.select(range(min(settings.max_problems, len(data))))
        specs.append(spec)
        loaded[spec.name] = data
    if not names:
        failures.append("  no data set given")
    if failures:
        raise ValueError(
            f"--datasets: {len(failures)} of {len(names)} data sets cannot be used (nothing was evaluated; fix or "
            "drop them; a Hub set's split is given as ID:SPLIT):\n" + "\n".join(failures)
        )
    return specs, loaded


#: The paper's evaluation (its Table: AIME24, AIME25, HMMT25 and AMC23 avg@32, MATH500 avg@4, temperature 0.6, top_p
#: 0.95, up to 32k new tokens), graded and prompted as the authors' code does (`--protocol authors`), on the Hub sets
#: of docs/evaluation.md. `cegppo-eval MODEL --preset paper`; in Python `evaluate_model(MODEL, **PRESETS["paper"])`.
#: Values, not commands: the preset gives the defaults, any flag (or `--config` key) overrides them.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "datasets": [
            "HuggingFaceH4/aime_2024:train@32",
            "math-ai/aime25:test@32",
            "MathArena/hmmt_feb_2025:train@32",
            "HuggingFaceH4/MATH-500:test@4",
            "math-ai/amc23:test@32",
        ],
        "protocol": "authors",
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 0,
        "max_new_tokens": 32768,
    }
}
