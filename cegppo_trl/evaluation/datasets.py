"""The data sets of an evaluation: one ``--datasets`` entry parsed (``ID``, ``ID:SPLIT``, a local file, a built-in
set), and every entry loaded and checked before any model code runs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .settings import EvalSettings


__all__ = ["DatasetSpec", "load_eval_datasets", "parse_dataset_spec"]


@dataclass(frozen=True)
class DatasetSpec:
    """One ``--datasets`` entry: `name` as given (the report's key), the `source` for `load_math_dataset`, and its
    `split` (Hub sets; `explicit` when written as ``ID:SPLIT``)."""

    name: str
    source: str
    split: str
    explicit: bool = False


def parse_dataset_spec(text: str, default_split: str = "test") -> DatasetSpec:
    """``ID``, ``ID:SPLIT`` (a Hub data set and its split, e.g. ``HuggingFaceH4/aime_2024:train``), a local file, or
    a built-in set. A split applies to Hub sets only: a file is one split."""
    from ..data import BUILTIN_DATASETS

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a data set name.")
    if text in BUILTIN_DATASETS or os.path.exists(os.path.expanduser(text)):
        return DatasetSpec(text, text, default_split)
    prefix = "builtin:" if text.startswith("builtin:") else ""
    source, colon, split = text[len(prefix) :].partition(":")
    source = prefix + source
    if colon and not split:
        raise ValueError("empty split after ':'; write ID:SPLIT, e.g. math-ai/aime25:test.")
    if source in BUILTIN_DATASETS or os.path.exists(os.path.expanduser(source)):
        if colon:
            raise ValueError(
                f"a split applies to Hub data sets; {source} is a local file (one split). "
                f"Write {source} without ':{split}'."
            )
        return DatasetSpec(text, source, default_split)
    return DatasetSpec(text, source, split or default_split, explicit=bool(colon))


def load_eval_datasets(names: Sequence[str], settings: EvalSettings) -> tuple[list[DatasetSpec], dict[str, Any]]:
    """The specs of the ``--datasets`` entries and ``{name: datasets.Dataset}``, each loaded with `load_math_dataset`
    (its own split) and cut to `max_problems`. Raises one ValueError that lists every entry that fails, with its
    reason, so that one run of the command shows every mistake."""
    from ..data import load_math_dataset

    specs, loaded, failures = [], {}, []
    for name in names:
        if name in loaded:
            failures.append(f"  {name}: given twice")
            continue
        try:
            spec = parse_dataset_spec(name, settings.split)
            data = load_math_dataset(
                spec.source,
                split=spec.split,
                problem_column=settings.problem_column,
                answer_column=settings.answer_column,
                system_prompt=settings.system_prompt or None,
                instruction=settings.instruction or None,
            )
        except Exception as error:  # noqa: BLE001 - a user's data set: report every failure, with its reason
            failures.append(f"  {name}: {type(error).__name__}: {error}")
            continue
        if settings.max_problems is not None:
            data = data.select(range(min(settings.max_problems, len(data))))
        specs.append(spec)
        loaded[name] = data
    if not names:
        failures.append("  no data set given")
    if failures:
        raise ValueError(
            f"--datasets: {len(failures)} of {len(names)} data sets cannot be used (nothing was evaluated; fix or "
            "drop them; a Hub set's split is given as ID:SPLIT):\n" + "\n".join(failures)
        )
    return specs, loaded
