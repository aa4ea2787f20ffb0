"""`cegppo-train` on a real pretrained chat model: SmolLM2-135M-Instruct (built from the package index), with its own
ChatML chat template and EOS token (`<|im_end|>`), dynamic sampling with 2x over-generation, off-policy updates,
full-parameter and LoRA, on one process and on two gloo processes (`tests/real_model/smollm2_cpu.yaml`; only sizes
are shrunk: 64 problems, 48-token completions, 4 steps). What each run must show is in the `check_*` functions."""

import json
import math
from pathlib import Path

import pytest
from launching import assert_trained_full_model, logged_steps
from real_runs import train


pytestmark = pytest.mark.real_model

MAX_STEPS = 4  # smollm2_cpu.yaml
MAX_COMPLETION_LENGTH = 48
IM_END = 2  # <|im_end|>: the tokenizer's eos_token and the model's eos_token_id
INSTRUCTION = "{problem} Put the final answer in \\boxed{}."


def _defined(value) -> bool:
    return value is not None and math.isfinite(value)


def check_logs(out: Path, clipping: bool) -> list[dict]:
    """Finite losses and the CE-GPPO metrics at every step; with `clipping`, some off-policy step clipped tokens."""
    steps = logged_steps(out, MAX_STEPS)
    for entry in steps:
        assert _defined(entry["loss"]) and _defined(entry["grad_norm"]), entry
        assert (entry["cegppo/beta1"], entry["cegppo/beta2"]) == (0.5, 1.0)
        # A token share is undefined (None) only at a step that trained no group (dynamic sampling kept none).
        shares = [v for k, v in entry.items() if k.startswith("cegppo/") and k.endswith("_frac")]
        assert all(_defined(v) for v in shares) or entry["cegppo/groups_trained"] == 0, entry
    assert any(e["cegppo/groups_trained"] > 0 for e in steps), "no step trained a group"
    # Each generation batch feeds 2 optimizer steps; the first of each is on-policy: nothing outside the band.
    for entry in steps[::2]:
        assert entry["cegppo/beta1_token_frac"] in (0.0, None) and entry["cegppo/beta2_token_frac"] in (0.0, None)
        # Dynamic sampling: the generation steps report the informative share of the 2x over-generated groups.
        assert 0.0 <= entry["cegppo/informative_group_frac"] <= 1.0
        assert _defined(entry["reward"]) and _defined(entry["rewards/math_reward/mean"])
    if clipping:
        outside = [e["cegppo/beta1_token_frac"] + e["cegppo/beta2_token_frac"] for e in steps[1::2]
                   if e["cegppo/groups_trained"] > 0]  # fmt: skip
        assert any(v > 0 for v in outside), f"the off-policy steps clipped nothing: {outside}"
    return steps


def check_prompt_settings(out: Path) -> None:
    """What `cegppo-eval OUT` reads: the prompt format and the sampling the model was trained with."""
    prompt = json.loads((out / "cegppo_prompt.json").read_text())
    assert prompt["instruction"] == INSTRUCTION and prompt["system_prompt"] is None
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["do_sample"] is True and generation["temperature"] == 1.0
    assert generation["max_new_tokens"] == MAX_COMPLETION_LENGTH
    # The tokenizer saved with it keeps the model's ChatML template and EOS.
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def check_completions(run, tokenizer) -> list[dict]:
    """The trainer generated from chat messages and stopped at `<|im_end|>`, on every process."""
    files = sorted(run.completions.glob("rank-*.jsonl"))
    assert [f.name for f in files] == [f"rank-{r}.jsonl" for r in range(run.processes)]
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    # 2 generation batches of 2x over-generated prompts (4 per process) x 4 completions each, per process.
    assert len(rows) == 2 * 16 * run.processes
    ended = 0
    for row in rows:
        # A conversation: TRL renders it with the tokenizer's chat template (`<|im_start|>user ...`).
        assert [m["role"] for m in row["prompt"]] == ["user"]
        assert row["prompt"][0]["content"].endswith(" Put the final answer in \\boxed{}.")
        ids = row["ids"]
        assert 0 < len(ids) <= MAX_COMPLETION_LENGTH
        # The completion is cut at its first <|im_end|>, or runs to the length limit without one.
        assert IM_END not in ids[:-1] and (ids[-1] == IM_END or len(ids) == MAX_COMPLETION_LENGTH), ids
        ended += ids[-1] == IM_END
        text = row["completion"][0]["content"]
        assert text == tokenizer.decode(ids, skip_special_tokens=True) and "<|im_end|>" not in text
    assert ended > 0, "no completion ended with <|im_end|>"
    return rows


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _assert_adapter_trained(out: Path) -> None:
    from safetensors.torch import load_file

    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    lora_b = [t for name, t in load_file(out / "adapter_model.safetensors").items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b), "LoRA B matrices are still zero: nothing was trained"


# The session's shared runs (conftest.py; test_real_model_eval.py evaluates what they saved); the others run here.
SHARED_RUNS = {(1, False): "full_run", (2, True): "lora_run"}


@pytest.mark.parametrize(
    "processes, lora", [(1, False), (2, True), (2, False), (1, True)], ids=["full-1", "lora-2", "full-2", "lora-1"]
)
def test_training_full_and_lora_on_one_and_two_processes(processes, lora, smollm2_dir, tmp_path, tokenizer, request):
    name = SHARED_RUNS.get((processes, lora))
    run = request.getfixturevalue(name) if name else train(smollm2_dir, tmp_path / "r", processes=processes, lora=lora)
    check_logs(run.out, clipping=not lora)
    check_prompt_settings(run.out)
    check_completions(run, tokenizer)
    _assert_adapter_trained(run.out) if lora else assert_trained_full_model(run.out, smollm2_dir)
    print(f"{'LoRA' if lora else 'full'}, {processes} process(es): {run.seconds:.0f} s")
