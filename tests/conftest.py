"""Shared fixtures: a tiny model and tokenizer built locally (nothing from the Hub), and CPU trainer configs."""

import copy
import os
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated.*")


@pytest.fixture
def one_torch_thread():
    """One torch thread for in-process runs of the tiny model (the demo's own setting): on a shared 2-core machine one
    thread is faster, and the demo's figures are defined with it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from cegppo_trl.demo.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def _tiny_base_model(tiny_tokenizer):
    from cegppo_trl.demo.tiny import build_tiny_model

    # Smaller than the demo's model: the tests exercise logic, not learning.
    return build_tiny_model(tiny_tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)


@pytest.fixture
def tiny_model(_tiny_base_model):
    """A fresh copy of the same randomly initialised weights for every test."""
    return copy.deepcopy(_tiny_base_model)


@pytest.fixture(scope="session")
def arithmetic_dataset():
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a}+{b}? Put the final answer in \\boxed{{}}."}],
            "solution": str(a + b),
        }
        for a in range(10)
        for b in range(10)
    ]
    return Dataset.from_list(rows)


def contains_answer_reward(completions, solution, **kwargs):
    """+1 if the completion contains the answer's last digit or its character-code sum is even, else -1: a cheap
    reward that a random tiny model earns about half the time, so groups have non-zero advantages."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if s[-1] in t or sum(map(ord, t)) % 2 == 0 else -1.0 for t, s in zip(texts, solution)]


def cpu_config(cls, output_dir, **overrides):
    """A small CPU config: 8 prompts x 4 completions per step, short completions, off-policy by default."""
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        gradient_accumulation_steps=1,
        steps_per_generation=4,
        max_steps=4,
        learning_rate=5e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        temperature=1.0,
    )
    values.update(overrides)
    return cls(**values)


@pytest.fixture
def make_config():
    return cpu_config


@pytest.fixture
def reward_fn():
    return contains_answer_reward


def make_loss_batch(tokenizer, batch_size=6, prompt_len=5, completion_len=7, seed=0, dtype=torch.float32):
    """A hand-built training batch with ragged completions and random advantages (old log-probs added later)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    prompt_ids = torch.randint(3, vocab, (batch_size, prompt_len), generator=gen)
    completion_ids = torch.randint(3, vocab, (batch_size, completion_len), generator=gen)
    lengths = torch.randint(1, completion_len + 1, (batch_size,), generator=gen)
    lengths[0] = completion_len
    completion_mask = (torch.arange(completion_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    advantages = torch.randn(batch_size, generator=gen, dtype=dtype)
    advantages[-1] = 0.0  # a zero-advantage completion
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }


# The docs name Hub ids; tests run them on local stand-ins (tests/test_docs.py, tests/test_wheel.py).
HUB_MODELS = ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")
HUB_TRAIN_SETS = ("Kwai-Klear/KlearReasoner-MathSub-30K",)
HUB_EVAL_SETS = ("HuggingFaceH4/MATH-500", "math-ai/aime24", "math-ai/aime25", "math-ai/amc23")
PLACEHOLDER_MODELS = ("MODEL", "CHECKPOINT")  # placeholders the docs use in commands


@pytest.fixture(scope="session")
def tiny_checkpoint(_tiny_base_model, tiny_tokenizer, tmp_path_factory) -> Path:
    """The tests' tiny model + tokenizer saved to a folder: the stand-in for every Hub model id in the docs."""
    from cegppo_trl.demo.tiny import save_tiny

    path = tmp_path_factory.mktemp("doc-model") / "tiny"
    save_tiny(_tiny_base_model, tiny_tokenizer, path)
    return path


@pytest.fixture(scope="session")
def stand_ins(tiny_checkpoint) -> dict[str, str]:
    values = {name: str(tiny_checkpoint) for name in (*HUB_MODELS, *PLACEHOLDER_MODELS)}
    values.update(dict.fromkeys(HUB_TRAIN_SETS, "builtin:arithmetic"))
    values.update(dict.fromkeys(HUB_EVAL_SETS, "builtin:arithmetic_eval"))
    return values
