"""Tests for cegppo_trl.data: column conventions, prompt format, clear errors, and the built-in arithmetic set."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from cegppo_trl.data import (
    BUILTIN_DATASETS,
    DEFAULT_INSTRUCTION,
    DatasetFormatError,
    _builtin_arithmetic,
    build_prompt,
    load_math_dataset,
    make_arithmetic_rows,
    resolve_instruction,
    write_jsonl,
)
from cegppo_trl.rewards import math_reward


def _user(problem: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{problem}\n{DEFAULT_INSTRUCTION}"}]


def _read_rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_builtin_files_match_the_generator_are_small_and_disjoint():
    expected = _builtin_arithmetic()
    for name, path in BUILTIN_DATASETS.items():
        assert _read_rows(path) == expected[name], f"{path} is stale: run `python -m cegppo_trl.data`"
        assert path.stat().st_size < 300_000
    train, held_out = expected["builtin:arithmetic"], expected["builtin:arithmetic_eval"]
    assert len(train) >= 2000 and len(held_out) >= 200
    assert not {row["problem"] for row in train} & {row["problem"] for row in held_out}


def _solve(problem: str) -> int:
    m = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", problem)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return a + b if op == "+" else a - b
    m = re.fullmatch(r"(\w+) has (\d+) (\w+) and gets (\d+) more\. How many \3 does \1 have now\?", problem)
    if m:
        return int(m.group(2)) + int(m.group(4))
    m = re.fullmatch(r"\w+ has (\d+) (\w+) and gives away (\d+)\. How many \2 are left\?", problem)
    assert m, f"unexpected problem shape: {problem!r}"
    return int(m.group(1)) - int(m.group(3))


def test_make_arithmetic_rows_is_deterministic_distinct_short_correct_and_respects_exclude_and_bad_n():
    rows = make_arithmetic_rows(500, seed=3)
    assert rows == make_arithmetic_rows(500, seed=3)
    assert rows != make_arithmetic_rows(500, seed=4)
    assert len({row["problem"] for row in rows}) == 500
    kinds = {"+": 0, "-": 0, "word": 0}
    for row in rows:
        assert set(row) == {"problem", "answer"}
        assert len(row["problem"]) <= 80
        assert row["answer"] == str(_solve(row["problem"]))
        assert all(int(n) < 50 for n in re.findall(r"\d+", row["problem"]))
        kinds["word" if " has " in row["problem"] else "+" if "+" in row["problem"] else "-"] += 1
    assert all(count > 50 for count in kinds.values())
    first = make_arithmetic_rows(100, seed=0)
    other = make_arithmetic_rows(100, seed=0, exclude={row["problem"] for row in first})
    assert not {row["problem"] for row in first} & {row["problem"] for row in other}
    with pytest.raises(ValueError, match="non-negative"):
        make_arithmetic_rows(-1)


def test_load_builtin_arithmetic_prompt_format_and_reward():
    ds = load_math_dataset("builtin:arithmetic")
    assert ds.column_names == ["prompt", "solution"]
    assert len(ds) == 3000
    first = _read_rows(BUILTIN_DATASETS["builtin:arithmetic"])[0]
    assert ds[0]["prompt"] == _user(first["problem"])
    assert ds[0]["solution"] == first["answer"]
    held_out = load_math_dataset("builtin:arithmetic_eval", instruction=None)
    assert held_out[0]["prompt"] == [{"role": "user", "content": held_out[0]["prompt"][0]["content"]}]
    assert "boxed" not in held_out[0]["prompt"][0]["content"]
    # The reward accepts every shipped answer written as the model should write it, and rejects off-by-one.
    solutions = held_out["solution"]
    assert math_reward([f"\\boxed{{{s}}}" for s in solutions], solutions) == [1.0] * len(solutions)
    assert set(math_reward([f"\\boxed{{{int(s) + 1}}}" for s in solutions], solutions)) == {-1.0}
    with pytest.raises(ValueError, match="builtin:arithmetic"):
        load_math_dataset("builtin:nope")


@pytest.mark.parametrize(
    "row, expected_answer",
    [
        ({"problem": "P", "answer": "1"}, "1"),
        ({"question": "P", "solution": "1"}, "1"),
        ({"prompt": "P", "ground_truth": "1"}, "1"),
        ({"question": "P", "reference": "1"}, "1"),
        ({"problem": "P", "solution": "worked solution, so $\\boxed{1}$", "answer": "1"}, "1"),  # MATH-500 layout
        ({"problem_idx": 3, "problem": "P", "answer": 1}, "1"),  # MathArena stores AIME answers as int64
        ({"question": "P", "answer": 27.0}, "27"),  # some AMC23 mirrors store answers as float64
        ({"question": "P", "answer": 0.5}, "0.5"),
        ({"prompt": [{"role": "user", "content": "P"}], "reward_model": {"ground_truth": "1", "style": "rule"}}, "1"),
    ],
)
def test_column_conventions(tmp_path, row, expected_answer):
    ds = load_math_dataset(write_jsonl([row] * 2, tmp_path / "d.jsonl"))
    assert ds.column_names == ["prompt", "solution"]
    assert ds[0] == {"prompt": _user("P"), "solution": expected_answer}


def test_verl_json_lines_with_json_suffix_and_keep_columns(tmp_path):
    """KlearReasoner-MathSub-30K / the CE-GPPO benchmark files are JSON lines named *.json, in verl's layout."""
    row = {
        "data_source": "math_longcot_math_verify",
        "prompt": [{"content": "Find $2+2$.", "role": "user"}],
        "ability": "math",
        "reward_model": {"ground_truth": "4", "style": "rule"},
        "__index_level_0__": "0",
    }
    path = write_jsonl([row, row], tmp_path / "train_math_30K.json")
    ds = load_math_dataset(str(path), keep_columns=True)
    assert ds[0]["prompt"] == _user("Find $2+2$.")
    assert ds[0]["solution"] == "4"
    assert ds[0]["original_prompt"] == row["prompt"]
    assert ds[0]["data_source"] == "math_longcot_math_verify"


def test_json_list_columnar_csv_and_parquet(tmp_path):
    rows = [{"problem": "A", "answer": "007"}, {"problem": "B", "answer": "0.50"}]
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "cols.json").write_text(json.dumps({"problem": ["A", "B"], "answer": ["007", "0.50"]}))
    (tmp_path / "d.csv").write_text("problem,answer\nA,007\nB,0.50\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("list.json", "cols.json", "d.csv", "d.parquet"):
        ds = load_math_dataset(str(tmp_path / name), instruction=None)
        assert ds["solution"] == ["007", "0.50"], name  # CSV cells stay strings: no "7" or "0.5"
        assert ds["prompt"] == [[{"role": "user", "content": "A"}], [{"role": "user", "content": "B"}]]


def test_explicit_columns_nested_key_system_prompt_and_template_and_build_prompt(tmp_path):
    path = write_jsonl([{"q": " What is 1+1? ", "meta": {"gold": 2}}], tmp_path / "d.jsonl")
    ds = load_math_dataset(
        str(path),
        problem_column="q",
        answer_column="meta.gold",
        system_prompt="You are a careful mathematician.",
        instruction="Solve: {problem} Put the answer in \\boxed{}.",
    )
    assert ds[0]["prompt"] == [
        {"role": "system", "content": "You are a careful mathematician."},
        {"role": "user", "content": "Solve: What is 1+1? Put the answer in \\boxed{}."},
    ]
    assert ds[0]["solution"] == "2"
    assert build_prompt("P") == _user("P")
    assert build_prompt("P", instruction=None) == [{"role": "user", "content": "P"}]
    assert build_prompt("P", "S", "I")[0] == {"role": "system", "content": "S"}


@pytest.mark.parametrize(
    ("word", "meaning"),
    [
        (None, None),
        ("", None),
        ("none", None),
        (" None ", None),
        ("default", DEFAULT_INSTRUCTION),
        ("DEFAULT", DEFAULT_INSTRUCTION),
        ("Q: {problem}\nA:", "Q: {problem}\nA:"),
        ("Answer in \\boxed{answer}.", "Answer in \\boxed{answer}."),  # LaTeX braces are not placeholders
        ("Think first.", "Think first."),
    ],
)
def test_resolve_instruction_is_the_one_vocabulary(word, meaning):
    assert resolve_instruction(word) == meaning
    if meaning is not None and meaning != DEFAULT_INSTRUCTION:
        assert build_prompt("P", instruction=resolve_instruction(word))[-1]["content"] in ("P\n" + meaning, "Q: P\nA:")


def test_an_unknown_placeholder_is_named_with_the_fix_by_the_words_and_by_the_loader():
    with pytest.raises(ValueError, match=r"\{question\}.*only placeholder is \{problem\}.*write \{problem\}"):
        resolve_instruction("{question} Please reason step by step.")
    with pytest.raises(ValueError, match=r"\{question\}.*only placeholder is \{problem\}"):  # a Python user's call
        load_math_dataset("builtin:arithmetic", instruction="{question} Please reason step by step.")


def test_missing_columns_name_found_expected_and_the_argument(tmp_path):
    path = write_jsonl([{"text": "P", "label": "1"}], tmp_path / "d.jsonl")
    with pytest.raises(DatasetFormatError) as err:
        load_math_dataset(str(path))
    message = str(err.value)
    assert "['label', 'text']" in message and "'problem'" in message and "problem_column=" in message
    with pytest.raises(DatasetFormatError) as err:
        load_math_dataset(str(path), problem_column="text")
    assert "['label', 'text']" in str(err.value) and "answer_column=" in str(err.value)
    with pytest.raises(DatasetFormatError, match="answer_column='nope' is not a column"):
        load_math_dataset(str(path), problem_column="text", answer_column="nope")
    assert load_math_dataset(str(path), problem_column="text", answer_column="label")["solution"] == ["1"]


BAD_ROWS = [
    {"problem": "ok", "answer": "1"},
    {"problem": "   ", "answer": "1"},
    {"problem": "ok", "answer": None},
    {"problem": "ok", "answer": [1, 2]},
    {"problem": "ok", "answer": ""},
    {"problem": None, "answer": "1"},
    {"problem": "ok", "answer": True},
    {"problem": "ok", "answer": float("nan")},
    {"problem": "ok"},
    {"problem": 5, "answer": "1"},
    {"problem": "ok", "answer": "2"},
]


def test_unusable_rows_are_reported_with_indices_or_dropped_with_a_warning(tmp_path):
    path = write_jsonl(BAD_ROWS, tmp_path / "d.jsonl")  # json.dumps writes NaN as NaN
    with pytest.raises(DatasetFormatError) as err:
        load_math_dataset(str(path))
    message = str(err.value)
    for fragment in (
        "9 of 11 rows are unusable",
        "problem is empty in rows [1]",
        "answer is missing (None) in rows [2, 8]",
        "answer is not a string or number (got list) in rows [3]",
        "answer is empty in rows [4]",
        "problem is missing (None) in rows [5]",
        "answer is a bool in rows [6]",
        "answer is nan in rows [7]",
        "problem is not a string (got int) in rows [9]",
        "drop_invalid=True",
        # what a command-line user can do: no CLI has drop_invalid
        "--problem_column",
        "--answer-column",
        "command-line tools have no option to skip bad rows",
        "cleaned copy",
    ):
        assert fragment in message, (fragment, message)
    many = write_jsonl([{"problem": "p", "answer": None}] * 30, tmp_path / "many.jsonl")
    with pytest.raises(DatasetFormatError, match=r"\(30 in total\)"):  # summarised
        load_math_dataset(str(many))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_math_dataset(str(path), drop_invalid=True)
    assert ds["solution"] == ["1", "2"]
    assert len(caught) == 1 and "rows [1]" in str(caught[0].message) and "dropped" in str(caught[0].message)
    only_bad = write_jsonl([{"problem": "", "answer": "1"}], tmp_path / "bad.jsonl")
    with pytest.raises(DatasetFormatError, match="no usable rows"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_math_dataset(str(only_bad), drop_invalid=True)


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_math_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.txt").write_text("problem,answer\n")
    with pytest.raises(DatasetFormatError, match="unsupported file type"):
        load_math_dataset(str(tmp_path / "d.txt"))
    (tmp_path / "broken.jsonl").write_text('{"problem": "a", "answer": "1"}\n{"problem": \n')
    with pytest.raises(DatasetFormatError, match="line 2 is not valid JSON"):
        load_math_dataset(str(tmp_path / "broken.jsonl"))
    (tmp_path / "scalars.jsonl").write_text("1\n2\n")
    with pytest.raises(DatasetFormatError, match=r"rows \[0, 1\] are not objects"):
        load_math_dataset(str(tmp_path / "scalars.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetFormatError, match="no rows"):
        load_math_dataset(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="directory"):
        load_math_dataset(str(tmp_path))


@pytest.mark.parametrize(
    "suffix, text",
    [
        (".jsonl", '{"problem": "1+1", "answer": "2"}\n{"problem": "caf\u00e9", "answer": "1"}\n'),
        (".json", '[{"problem": "1+1", "answer": "2"},\n {"problem": "caf\u00e9", "answer": "1"}]\n'),
        (".csv", "problem,answer\nWhat is caf\u00e9+1?,2\n"),
    ],
)
def test_a_file_that_is_not_utf8_is_named_with_its_line_and_the_fix(tmp_path, suffix, text):
    """A Latin-1 byte on line 2 is reported as such (not as a bare UnicodeDecodeError): the file, the line, the byte,
    and how to re-save the file as UTF-8."""
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(DatasetFormatError) as err:
        load_math_dataset(str(path))
    message = str(err.value)
    assert isinstance(err.value, ValueError) and not isinstance(err.value, UnicodeDecodeError)
    for fragment in (str(path), "line 2 is not UTF-8", "byte 0xe9", "re-save the file as UTF-8", "iconv"):
        assert fragment in message, (fragment, message)
    assert err.value.__cause__ is None and err.value.__suppress_context__  # the message is the whole story


GOOD_HINT = "Did you mean 'data/good.jsonl'?"
NO_FOLDER = "The folder 'a/b' does not exist either."
HUB = "the Hub"


@pytest.mark.parametrize(
    "name, hint",
    [
        ("data/good.json1", GOOD_HINT),
        ("data/good.jsonl.gz", GOOD_HINT),
        ("data/god.jsonl", GOOD_HINT),
        ("data/good.cvs", GOOD_HINT),
        ("data/other.parq", None),
        ("a/b/c.jsonl", NO_FOLDER),
        ("a/b/c", NO_FOLDER),
    ]
    + [(name, HUB) for name in ("HuggingFaceH4/MATH-500", "gsm8k", "org/data.v2", "bigcode/the-stack-v1.2")],
)
def test_a_missing_local_file_is_not_looked_up_on_the_hub_and_a_hub_id_is(name, hint, tmp_path, monkeypatch):
    """A name with a data file's extension (typo'd or not), or one the Hub cannot hold (two folders), is a missing
    local file: said so, with the closest existing file, and never sent to the Hub (where it gave a ConnectionError).
    Names huggingface_hub accepts as repo ids, with no data-file extension, are passed to `datasets.load_dataset`."""
    import datasets

    calls = []

    def fake_load_dataset(path, config_name=None, split=None):
        calls.append(path)
        return datasets.Dataset.from_dict({"problem": ["1+1"], "answer": ["2"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.chdir(tmp_path)
    if hint == HUB:
        assert load_math_dataset(name)["solution"] == ["2"] and calls == [name]
        return
    write_jsonl([{"problem": "1+1", "answer": "2"}], tmp_path / "data" / "good.jsonl")
    with pytest.raises(FileNotFoundError) as err:
        load_math_dataset(name)
    assert calls == [], "looked up on the Hub"
    message = str(err.value)
    assert f"no such file: {name!r}" in message and "not looked up on the Hub" in message, message
    if hint is None:
        assert "Did you mean" not in message and "does not exist either" not in message, message
    else:
        assert hint in message, message
