"""Each `CEGPPOConfig` field that must be a finite number >= 0 is refused with a message that names that field and
that field's own fix (not the betas' advice for every field)."""

import pytest
from shared import cpu_config

from cegppo_trl import CEGPPOConfig


CONTROLLER = {"cegppo_entropy_target": 0.5}  # the controller's fields are checked only when it is on

# field -> (overrides that turn its check on, words of its own fix)
FIELDS = {
    "cegppo_beta1": ({}, ["paper's 0.5", "beta1 set"]),
    "cegppo_beta2": ({}, ["paper's 1.0", "beta2 set"]),
    "cegppo_sft_coef": ({}, ["NLL (SFT) term", "0.0 to disable", "0.1"]),
    "cegppo_entropy_kp": (CONTROLLER, ["proportional gain", "1.0"]),
    "cegppo_entropy_ki": (CONTROLLER, ["integral gain", "0.05"]),
    "cegppo_beta1_min": (CONTROLLER, ["lower bound of beta1", "cegppo_beta1"]),
    "cegppo_beta2_min": (CONTROLLER, ["lower bound of beta2", "cegppo_beta2"]),
}


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_bad_non_negative_field_names_itself_and_its_fix(field, value, tmp_path):
    overrides, fix_words = FIELDS[field]
    with pytest.raises(ValueError) as err:
        cpu_config(CEGPPOConfig, tmp_path, **overrides, **{field: value})
    message = str(err.value)
    assert message.startswith(f"`{field}` must be a finite number >= 0, got {value!r}."), message
    for words in fix_words:
        assert words in message, (field, words, message)
    if field not in ("cegppo_beta1", "cegppo_beta2"):
        assert "beta1=0.5, beta2=1.0" not in message and "that set's gradient" not in message, message


def test_every_checked_field_has_its_own_fix():
    """The fixes are distinct: no two fields share one message."""
    from cegppo_trl.config import _NON_NEGATIVE_FIXES

    assert set(_NON_NEGATIVE_FIXES) == set(FIELDS)
    assert len(set(_NON_NEGATIVE_FIXES.values())) == len(_NON_NEGATIVE_FIXES)


DYNAMIC = {"cegppo_exclude_zero_advantage_groups": True}


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            {"cegppo_oversampling": 0.5, **DYNAMIC},
            ["`cegppo_oversampling` must be a finite number >= 1, got 0.5", "2.0"],
        ),
        ({"cegppo_oversampling": float("nan"), **DYNAMIC}, ["`cegppo_oversampling` must be a finite number >= 1"]),
        ({"cegppo_oversampling": 2.0}, ["`cegppo_oversampling=2.0` needs cegppo_exclude_zero_advantage_groups=True"]),
        # 8 rows x 4 steps per process, groups of 4: 1.1 gives 8.8 prompts and 35.2 rows.
        ({"cegppo_oversampling": 1.1, **DYNAMIC}, ["8.8 prompts per generation batch and 35.2 rows", "whole"]),
    ],
)
def test_a_bad_oversampling_names_the_field_and_the_fix(overrides, words, tmp_path):
    with pytest.raises(ValueError) as err:
        cpu_config(CEGPPOConfig, tmp_path, **overrides)
    for expected in words:
        assert expected in str(err.value), (expected, str(err.value))
    assert "\n" not in str(err.value)


def test_oversampling_accepts_the_authors_setting(tmp_path):
    config = cpu_config(CEGPPOConfig, tmp_path, cegppo_oversampling=2.0, **DYNAMIC)
    assert config.cegppo_oversampling == 2.0
    assert cpu_config(CEGPPOConfig, tmp_path).cegppo_oversampling == 1.0  # default: the training batch only
