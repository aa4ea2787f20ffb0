"""Math datasets in TRL's conversational prompt format, with a ``solution`` column for :func:`cegppo_trl.math_reward`:
:func:`load_math_dataset` (a local jsonl / json / parquet / csv file, a Hub id, or ``builtin:arithmetic`` /
``builtin:arithmetic_eval``), the prompt convention (:func:`build_prompt`, :func:`resolve_instruction`: the words both
commands accept), and the generator of the built-in arithmetic set (:func:`make_arithmetic_rows`; regenerate the
shipped files with ``python -m cegppo_trl.data``).
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import numbers
import os
import random
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .model_source import can_be_hub_id  # the one Hub-id check of the package
from .rewards.extract import normalize_gold


DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to every problem (the DeepSeek-R1 / CE-GPPO convention: final answer in ``\\boxed{}``)."""

PROBLEM_COLUMNS = ("problem", "question", "prompt", "query", "input")
"""Problem columns tried in this order when ``problem_column`` is not given."""

ANSWER_COLUMNS = (
    "answer", "final_answer", "ground_truth", "reference", "gold", "target", "reward_model.ground_truth", "solution",
)  # fmt: skip
"""Answer columns tried in this order when ``answer_column`` is not given. ``solution`` comes last because in MATH
style data sets it holds the worked solution while ``answer`` holds the final answer; ``reward_model.ground_truth``
is the nested verl layout of KlearReasoner-MathSub-30K."""

_DATA_DIR = Path(__file__).resolve().parent / "builtin_data"
BUILTIN_DATASETS = {
    "builtin:arithmetic": _DATA_DIR / "arithmetic.jsonl",
    "builtin:arithmetic_eval": _DATA_DIR / "arithmetic_eval.jsonl",
}
"""Names accepted by :func:`load_math_dataset` for the data shipped with the package."""

_LOCAL_FORMATS = (".jsonl", ".json", ".parquet", ".csv")


class DatasetFormatError(ValueError):
    """The data cannot be turned into ``prompt`` / ``solution`` rows; the message says what and how to fix it."""


# A format-style placeholder: `{name}` not right after a letter, so LaTeX such as `\\boxed{answer}` is not one.
_PLACEHOLDER_RE = re.compile(r"(?<![A-Za-z])\{([A-Za-z_]\w*)\}")


def resolve_instruction(value: str | None) -> str | None:
    """The instruction a command-line word means, one vocabulary for ``cegppo-train`` and ``cegppo-eval``.

    ``"none"`` or ``""`` -> None (the problem alone); ``"default"`` -> :data:`DEFAULT_INSTRUCTION`; a text whose only
    placeholder is ``{problem}`` -> itself (a template); any other text -> itself (appended to the problem). None
    stays None (the caller's own default applies).

    Raises:
        ValueError: the text has a placeholder other than ``{problem}`` (e.g. ``{question}``), which would otherwise
            reach every prompt literally.
    """
    if value is None:
        return None
    word = value.strip().lower()
    if word in ("", "none"):
        return None
    if word == "default":
        return DEFAULT_INSTRUCTION
    return _check_placeholders(value)


def _check_placeholders(instruction: str) -> str:
    unknown = sorted({name for name in _PLACEHOLDER_RE.findall(instruction) if name != "problem"})
    if unknown:
        raise ValueError(
            f"--instruction has the placeholder {{{unknown[0]}}}, but the only placeholder is {{problem}} (the "
            f"problem text): write {{problem}} where the problem goes, or leave out the braces to append plain text."
        )
    return instruction


def build_prompt(
    problem: str,
    system_prompt: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    example: Sequence[str] | None = None,
) -> list[dict[str, str]]:
    """The conversational prompt for one problem: an optional system message, an optional worked example (`example`:
    a problem, prompted the same way, and its answer as an assistant turn), then one user message.

    The user message is ``problem + "\\n" + instruction``; an ``instruction`` containing ``{problem}`` is used as a
    template instead, and ``instruction=None`` (or ``""``) leaves the problem unchanged.
    """
    if not instruction:
        content = problem
    elif "{problem}" in instruction:
        content = instruction.replace("{problem}", problem)  # not str.format: "\boxed{}" has braces
    else:
        content = f"{problem}\n{instruction}"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if example:
        messages += build_prompt(example[0], None, instruction) + [{"role": "assistant", "content": example[1]}]
    messages.append({"role": "user", "content": content})
    return messages


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; a byte that is not UTF-8 is reported with its line and the fix."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DatasetFormatError(
            f"{path}: line {line} is not UTF-8 (byte 0x{data[e.start]:02x} at column {column}: {e.reason}). Data files "
            "are read as UTF-8: re-save the file as UTF-8 (for a Latin-1 / Windows-1252 file: "
            f"`iconv -f WINDOWS-1252 -t UTF-8 {path.name} > fixed{path.suffix}`)."
        ) from None


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DatasetFormatError(f"{path}: line {line_number} is not valid JSON ({e.msg}).") from None
    return rows


def _read_json(path: Path) -> list[Any]:
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several JSON documents: JSON lines with a .json name (as in verl data sets)
            return _read_jsonl(path)
        raise DatasetFormatError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}).") from None
    if isinstance(data, dict):
        for key in ("data", "rows", "examples", "train"):
            if isinstance(data.get(key), list):
                return data[key]
        lengths = {len(v) for v in data.values() if isinstance(v, list)}
        if data and len(lengths) == 1 and all(isinstance(v, list) for v in data.values()):
            return [dict(zip(data, values, strict=True)) for values in zip(*data.values(), strict=True)]  # columns
        raise DatasetFormatError(
            f"{path} holds a JSON object with keys {sorted(data)[:10]}; expected a list of row objects, "
            "an object of equal-length column lists, or JSON lines."
        )
    if not isinstance(data, list):
        raise DatasetFormatError(f"{path} holds a JSON {type(data).__name__}; expected a list of row objects.")
    return data


def _read_local(path: Path) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".csv":
        # csv keeps every cell a string, so answers like "007" or "0.50" reach the reward exactly as written.
        return list(csv.DictReader(io.StringIO(_read_text(path), newline="")))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DatasetFormatError(
        f"{path}: unsupported file type {suffix!r}; use one of {', '.join(_LOCAL_FORMATS)}, a Hub data set id, "
        f"or one of {', '.join(BUILTIN_DATASETS)}."
    )


def _rows_to_columns(rows: Sequence[Any], source: str) -> dict[str, list]:
    bad = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
    if bad:
        raise DatasetFormatError(
            f"{source}: rows {_index_list(bad)} are not objects (got {type(rows[bad[0]]).__name__}); "
            "each row must map column names to values."
        )
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return {name: [row.get(name) for row in rows] for name in names}


# The stem of a data file's extension, as a typo keeps it: `.json1`, `.jsonl.gz`, `.cvs`, `.parq`, `.txt`.
_FILE_EXTENSION_RE = re.compile(r"\.(jsonl?|ndjson|csv|cvs|tsv|txt|parq\w*|pq|arrow|gz|zip|xz|bz2|zst)\w*$", re.I)


def _looks_like_path(path_or_id: str) -> bool:
    """A name that cannot be a Hub id, or that ends in a data file's extension (even a typo'd one), names a file."""
    return (
        path_or_id.startswith((".", "/", "~"))
        or bool(_FILE_EXTENSION_RE.search(path_or_id))
        or not can_be_hub_id(path_or_id)
    )


def did_you_mean(word: str, known: Iterable[str], n: int = 1, cutoff: float = 0.6, show=repr) -> str:
    """The sentence ' Did you mean A or B?' for the (at most `n`) entries of `known` closest to `word` (difflib), or "": the one
    "did you mean" of the package (file names here, flags in cegppo-eval)."""
    close = difflib.get_close_matches(word, list(known), n=n, cutoff=cutoff)
    return " Did you mean " + " or ".join(show(name) for name in close) + "?" if close else ""


def _missing_file_message(path_or_id: str, local: Path) -> str:
    folder = local.parent
    hint = ""
    if folder.is_dir():
        names = [p.name for p in folder.iterdir() if p.is_file()]
        hint = did_you_mean(local.name, names, n=3, show=lambda name: repr(str(folder / name)))
    else:
        hint = f" The folder {str(folder)!r} does not exist either."
    return (
        f"no such file: {path_or_id!r}.{hint} It names a local file (a Hub data set id has no file extension or "
        f"folders: 'namespace/name'), so it was not looked up on the Hub. Pass an existing "
        f"{'/'.join(_LOCAL_FORMATS)} file, a Hub data set id such as 'HuggingFaceH4/MATH-500', or one of "
        f"{', '.join(BUILTIN_DATASETS)}."
    )


def load_builtin_rows(name: str) -> list[dict[str, str]]:
    """The ``{"problem", "answer"}`` rows of a built-in data set (a key of :data:`BUILTIN_DATASETS`), in file order."""
    if name not in BUILTIN_DATASETS:
        raise ValueError(f"unknown built-in data set {name!r}; available: {', '.join(BUILTIN_DATASETS)}.")
    return _read_jsonl(BUILTIN_DATASETS[name])


def _load_columns(path_or_id: str, split: str | None, name: str | None) -> tuple[dict[str, list], str]:
    if path_or_id.startswith("builtin:"):
        return _rows_to_columns(load_builtin_rows(path_or_id), path_or_id), path_or_id
    local = Path(path_or_id).expanduser()
    if local.is_file():
        return _rows_to_columns(_read_local(local), str(local)), str(local)
    if local.is_dir():
        raise ValueError(f"{path_or_id} is a directory; pass the data file itself ({', '.join(_LOCAL_FORMATS)}).")
    if _looks_like_path(path_or_id):
        raise FileNotFoundError(_missing_file_message(path_or_id, local))
    import datasets

    loaded = datasets.load_dataset(path_or_id, name, split=split)
    if not isinstance(loaded, datasets.Dataset):
        raise ValueError(f"{path_or_id!r} gave {type(loaded).__name__}; pass a single split, e.g. split='train'.")
    return loaded.to_dict(), f"{path_or_id} (split {split!r})"


def _index_list(indices: Sequence[int]) -> str:
    """The first 20 indices, and the total when there are more."""
    more = f", ... ({len(indices)} in total)" if len(indices) > 20 else ""
    return f"[{', '.join(map(str, indices[:20]))}{more}]"


def _column_values(columns: dict[str, list], column: str) -> list | None:
    """Values of ``column``; ``"a.b"`` reads key ``b`` of dict column ``a`` (verl's ``reward_model.ground_truth``)."""
    if column in columns:
        return columns[column]
    head, _, key = column.partition(".")
    if key and head in columns:
        values = columns[head]
        if any(isinstance(v, dict) and key in v for v in values):
            return [v.get(key) if isinstance(v, dict) else None for v in values]
    return None


def _pick_column(columns: dict[str, list], given: str | None, candidates: Sequence[str], what: str, arg: str) -> str:
    found = sorted(columns)
    if given is not None:
        if _column_values(columns, given) is None:
            raise DatasetFormatError(
                f"{arg}={given!r} is not a column of this data set; found columns {found}. "
                f"Pass {arg}= one of them (nested dict keys as 'column.key')."
            )
        return given
    for candidate in candidates:
        if _column_values(columns, candidate) is not None:
            return candidate
    raise DatasetFormatError(
        f"no {what} column found: the data set has columns {found}, expected one of {list(candidates)}. "
        f"Pass {arg}='<column name>'."
    )


def problem_text(value: Any) -> tuple[str | None, str]:
    """(problem, error reason); a conversational prompt contributes the content of its last user message."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        users = [m for m in value if m.get("role") == "user"]
        content = (users or list(value))[-1].get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        value = content
    if value is None:
        return None, "problem is missing (None)"
    if not isinstance(value, str):
        return None, f"problem is not a string (got {type(value).__name__})"
    if not value.strip():
        return None, "problem is empty"
    return value.strip(), ""


def _answer_text(value: Any) -> tuple[str | None, str]:
    """(answer, error reason). Integers and finite floats become strings; None, bools, lists, dicts are errors."""
    if value is None:
        return None, "answer is missing (None)"
    if isinstance(value, bool):
        return None, "answer is a bool"
    if isinstance(value, numbers.Real):  # as the reward reads a number gold: 27.0 -> "27"
        text = normalize_gold(value)
        return (text, "") if text is not None else (None, f"answer is {float(value)}")
    if not isinstance(value, str):
        return None, f"answer is not a string or number (got {type(value).__name__})"
    if not value.strip():
        return None, "answer is empty"
    return value.strip(), ""


def load_math_dataset(
    path_or_id: str,
    split: str = "train",
    problem_column: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    *,
    name: str | None = None,
    drop_invalid: bool = False,
    keep_columns: bool = False,
    example: Sequence[str] | None = None,
):
    """Load math problems as a ``datasets.Dataset`` with TRL's conversational ``prompt`` and a ``solution`` column
    (the gold answer as a string; integer and float answers are converted, ``27.0`` -> ``"27"``).

    Args:
        path_or_id: a local ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a key of :data:`BUILTIN_DATASETS`,
            or a Hub data set id (``datasets.load_dataset(path_or_id, name, split=split)``; `split` is ignored for a
            local or built-in file, which is one split).
        problem_column / answer_column: the columns to read; default: the first present of :data:`PROBLEM_COLUMNS` /
            :data:`ANSWER_COLUMNS`. A conversational problem gives its last user message; ``"a.b"`` reads key ``b``
            of a dict column ``a``.
        system_prompt, instruction, example: as in :func:`build_prompt`.
        drop_invalid: drop unusable rows with a warning listing their indices, instead of raising.
        keep_columns: keep the other source columns (a replaced ``prompt`` / ``solution`` as ``original_prompt`` /
            ``original_solution``).

    Raises:
        DatasetFormatError: a missing column (the message lists the columns found and the argument to pass), no rows,
            or unusable rows (empty or missing problem or answer, wrong types) listed by 0-based index.
        ValueError: `instruction` has a placeholder other than ``{problem}``.
    """
    import datasets

    if instruction:
        _check_placeholders(instruction)  # before the data loads
    columns, source = _load_columns(path_or_id, split, name)
    if not columns:
        raise DatasetFormatError(f"{source} has no rows.")
    p_col = _pick_column(columns, problem_column, PROBLEM_COLUMNS, "problem", "problem_column")
    a_candidates = [c for c in ANSWER_COLUMNS if c != p_col]
    a_col = _pick_column(columns, answer_column, a_candidates, "answer", "answer_column")
    if a_col == p_col:
        raise DatasetFormatError(f"problem_column and answer_column are both {p_col!r}; they must differ.")
    raw_problems, raw_answers = _column_values(columns, p_col), _column_values(columns, a_col)

    problems, answers, errors = [], [], {}
    for i, (raw_problem, raw_answer) in enumerate(zip(raw_problems, raw_answers, strict=True)):  # type: ignore
        (problem, problem_error), (answer, answer_error) = problem_text(raw_problem), _answer_text(raw_answer)
        for reason in filter(None, (problem_error, answer_error)):
            errors.setdefault(reason, []).append(i)
        problems.append(problem)
        answers.append(answer)

    keep = [i for i in range(len(problems)) if problems[i] is not None and answers[i] is not None]
    if errors:
        details = "; ".join(f"{reason} in rows {_index_list(rows)}" for reason, rows in errors.items())
        message = (
            f"{source}: {len(problems) - len(keep)} of {len(problems)} rows are unusable "
            f"(problem column {p_col!r}, answer column {a_col!r}; 0-based row indices): {details}."
        )
        if not drop_invalid:
            raise DatasetFormatError(
                message + " Fix the data: complete or remove these rows, or name the right columns (problem_column= "
                "/ answer_column=; `--problem_column` / `--answer_column`, or `--problem-column` / `--answer-column`, in "
                "cegppo-train and cegppo-eval alike). The command-line tools have no option to "
                "skip bad rows: write a cleaned copy of the file and pass that. From Python, "
                "load_math_dataset(..., drop_invalid=True) drops these rows with a warning."
            )
        warnings.warn(message + " They were dropped (drop_invalid=True).", stacklevel=2)
    if not keep:
        raise DatasetFormatError(f"{source}: no usable rows remain.")

    out: dict[str, list] = {
        "prompt": [build_prompt(problems[i], system_prompt, instruction, example) for i in keep],  # type: ignore[arg-type]
        "solution": [answers[i] for i in keep],
    }
    if keep_columns:
        for column, values in columns.items():
            target = f"original_{column}" if column in out else column
            out[target] = [values[i] for i in keep]
    try:
        return datasets.Dataset.from_dict(out)
    except Exception as e:  # noqa: BLE001 - pyarrow type errors only come from extra columns
        if not keep_columns:
            raise
        raise DatasetFormatError(
            f"{source}: the extra columns kept by keep_columns=True have mixed types ({e}); pass keep_columns=False."
        ) from e


_NAMES = ("Ann", "Ben", "Sam", "Mia", "Tom", "Zoe")
_ITEMS = ("apples", "pens", "cards", "coins", "books", "eggs")


def make_arithmetic_rows(n: int, seed: int = 0, exclude: Iterable[str] = ()) -> list[dict[str, str]]:
    """``n`` distinct short arithmetic problems, deterministic in ``seed``, as ``{"problem", "answer"}`` rows.

    Operands are 1..49 so a tiny model can learn them: 55% "What is a+b?", 25% "What is a-b?" (a >= b), 20% one-line
    word problems ("Ann has 12 apples and gets 7 more. How many apples does Ann have now?"). Answers are decimal
    strings. Problems in ``exclude`` are never produced (used to keep the eval file disjoint from train).
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}.")
    rng = random.Random(seed)
    seen = set(exclude)
    rows: list[dict[str, str]] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise ValueError(f"could not make {n} distinct problems; ask for fewer rows or exclude fewer.")
        kind = rng.random()
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        if kind < 0.55:
            problem, answer = f"What is {a}+{b}?", a + b
        elif kind < 0.80:
            a, b = max(a, b), min(a, b)
            problem, answer = f"What is {a}-{b}?", a - b
        else:
            who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            if rng.random() < 0.5:
                problem = f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?"
                answer = a + b
            else:
                a, b = max(a, b), min(a, b)
                problem = f"{who} has {a} {item} and gives away {b}. How many {item} are left?"
                answer = a - b
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"problem": problem, "answer": str(answer)})
    return rows


def _builtin_arithmetic() -> dict[str, list[dict[str, str]]]:
    """The exact contents of the shipped files: 3000 train rows (seed 0), 300 held-out rows (seed 1) excluding them."""
    train = make_arithmetic_rows(3000, seed=0)
    held_out = make_arithmetic_rows(300, seed=1, exclude={row["problem"] for row in train})
    return {"builtin:arithmetic": train, "builtin:arithmetic_eval": held_out}


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> str:
    """Write rows as JSON lines (UTF-8, `\\n` line ends): the format `load_math_dataset` and `cegppo-eval` read."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


if __name__ == "__main__":  # regenerate the shipped files
    for builtin, rows in _builtin_arithmetic().items():
        print(f"wrote {len(rows)} rows to {write_jsonl(rows, BUILTIN_DATASETS[builtin])}")
