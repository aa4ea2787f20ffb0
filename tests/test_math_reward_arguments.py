"""`math_reward` (and `grade_completions`) refuse arguments they would mis-read: a string `solution` is read one
character per completion and silently mis-grades (`\\boxed{42}` would score -1 and `\\boxed{4}` +1), and `None`
completions used to fail with a bare TypeError. The message names the argument and the fix."""

import pytest

from cegppo_trl import grade_completions, make_math_reward, math_reward


def test_a_string_solution_is_refused_with_the_argument_named():
    with pytest.raises(TypeError, match=r"^solution must be a list of gold answers.*got the string '42'") as error:
        math_reward(["\\boxed{42}", "\\boxed{4}"], solution="42")
    assert "['42'] * len(completions)" in str(error.value)
    with pytest.raises(TypeError, match="^solution must be a list"):
        make_math_reward(correct=1.0, wrong=0.0)(["\\boxed{1}"], solution=b"1")
    with pytest.raises(TypeError, match="^solutions must be a list"):  # grade_completions names its own argument
        grade_completions(["\\boxed{4}", "\\boxed{2}"], "42")


@pytest.mark.parametrize("completions", [None, "\\boxed{42}", 42])
def test_completions_must_be_a_list(completions):
    with pytest.raises(TypeError, match="^completions must be a list of completions") as error:
        math_reward(completions, solution=["42"])
    assert repr(completions)[:10] in str(error.value) or "the string" in str(error.value)


def test_the_lists_trl_passes_still_grade():
    from datasets import Dataset

    column = Dataset.from_dict({"solution": ["42", "4"]})["solution"]  # a datasets Column, as a user may pass
    assert math_reward(["\\boxed{42}", "\\boxed{4}"], solution=column) == [1.0, 1.0]
    assert math_reward([[{"role": "assistant", "content": "\\boxed{42}"}]], solution=("41",)) == [-1.0]
    with pytest.raises(ValueError, match="needs the gold answers in a `solution` dataset column"):
        math_reward(["\\boxed{42}"])
