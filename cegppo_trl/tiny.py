"""A tiny, fully local tokenizer + causal LM for CPU demos and tests.

Nothing here touches the Hugging Face Hub: the tokenizer is trained in about a second with the
`tokenizers` library and the model is randomly initialised from a `Qwen2Config`.

Typical use::

    from cegppo_trl.tiny import build_tiny_tokenizer, build_tiny_model, arithmetic_sft_examples, sft_warmstart

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    sft_warmstart(model, tokenizer, arithmetic_sft_examples(rows))  # 800 steps
    save_tiny(model, tokenizer, "outputs/tiny")  # == model.save_pretrained(p); tokenizer.save_pretrained(p)

    # later, offline (e.g. `GRPOTrainer(model="outputs/tiny", ...)`):
    AutoModelForCausalLM.from_pretrained("outputs/tiny"); AutoTokenizer.from_pretrained("outputs/tiny")

Design notes
------------
* The tokenizer uses exactly Qwen2's pipeline (NFC normaliser, Qwen2's split regex, byte-level BPE without
  prefix space, byte-level decoder). transformers 5 maps ``model_type="qwen2"`` to ``Qwen2Tokenizer`` and
  *rebuilds* the pre-tokenizer/normaliser from its own hard-coded definition on load; using the identical
  pipeline makes the save/load round trip lossless. Qwen2's regex splits numbers into single digits
  (``\\p{N}``), so every digit 0-9 is its own token.
* Special tokens: ``<|endoftext|>`` (id 0; pad and bos, never added automatically), ``<|im_start|>`` (id 1),
  ``<|im_end|>`` (id 2; eos, so generation stops at the end of the assistant turn). ``unk_token`` is None:
  byte-level BPE can encode any string.
* The chat template is ChatML without a default system prompt.
"""

from __future__ import annotations

import math
import os
import random
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


__all__ = [
    "PROMPT_INSTRUCTION",
    "PAD_TOKEN",
    "BOS_TOKEN",
    "IM_START",
    "IM_END",
    "CHAT_TEMPLATE",
    "format_user_message",
    "build_tiny_tokenizer",
    "build_tiny_model",
    "save_tiny",
    "load_tiny",
    "arithmetic_sft_examples",
    "sft_warmstart",
    "extract_boxed",
    "greedy_accuracy",
]

#: Instruction appended (after one space) to every arithmetic problem in the user message.
PROMPT_INSTRUCTION = "Put the final answer in \\boxed{}."

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = PAD_TOKEN
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Qwen2's pre-tokenisation regex (transformers/models/qwen2/tokenization_qwen2.py); it must stay identical,
# see the module docstring.
_QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

#: ChatML, no default system prompt. `add_generation_prompt` appends the assistant header.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_DEFAULT_VOCAB_SIZE = 400


def format_user_message(problem: str) -> str:
    """The user message for an arithmetic problem: the problem, one space, then `PROMPT_INSTRUCTION`."""
    return f"{problem.strip()} {PROMPT_INSTRUCTION}"


# --------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------


def _default_corpus(seed: int = 0) -> list[str]:
    """Chat-formatted arithmetic dialogues ("What is a+b?" with +, -, *, operands up to 3 digits; "Ann has 3 apples
    and gets 4 more. ..." word problems) plus a little scaffolding text."""
    rng = random.Random(seed)
    texts = []
    for _ in range(2000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        res = {"+": a + b, "-": a - b, "*": a * b}[op]
        expr = f"{a}{op}{b}"
        user = format_user_message(f"What is {expr}?")
        answer = f"{expr}={res}. \\boxed{{{res}}}" if rng.random() < 0.5 else f"\\boxed{{{res}}}"
        texts.append(f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n")
    names = ["Ann", "Sam", "Mia", "Tom", "Zoe", "Ben", "Eva", "Leo", "Max", "Ada"]
    items = ["apples", "cards", "books", "eggs", "pens", "coins", "marbles", "stickers", "cookies", "stamps"]
    for _ in range(600):  # simple word problems
        name, item = rng.choice(names), rng.choice(items)
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if rng.random() < 0.5:
            problem, res = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
        else:
            problem, res = f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
        user = format_user_message(problem)
        texts.append(f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n\\boxed{{{res}}}{IM_END}\n")
    texts += [
        f"{IM_START}system\nYou are a helpful assistant. Solve the problem step by step.{IM_END}\n",
        "The answer is \\boxed{42}. Compute the sum, difference or product of the numbers.",
        "Question: Calculate 7 times 6. Answer: 42. Let me think about it.",
    ]
    return texts


def _new_backend_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tiny_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = _DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer (Qwen2 pipeline, ChatML template) on `corpus`.

    `corpus` defaults to chat-formatted arithmetic dialogues. All 256 byte symbols are in the vocabulary, so any
    text encodes; digits are always single tokens. Deterministic: the same corpus gives the same vocabulary.
    """
    texts = list(corpus) if corpus is not None else _default_corpus()
    tok = _new_backend_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        padding_side="left",
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer


# --------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised Qwen2-style causal LM (~1.0M parameters at the defaults), float32, tied embeddings.

    `overrides` are passed to `Qwen2Config` (e.g. ``intermediate_size=256``). Same seed -> same weights.
    """
    cfg_kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg_kwargs.update(overrides)
    config = Qwen2Config(**cfg_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(torch.float32)
    gc = model.generation_config
    gc.bos_token_id = tokenizer.bos_token_id
    gc.eos_token_id = tokenizer.eos_token_id
    gc.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: str | os.PathLike) -> str:
    """Save model + tokenizer to `path` (just `save_pretrained` on both); the directory reloads offline with
    `AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained(path)` and can be passed to
    `GRPOTrainer(model=path)`."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tiny(path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Reload a directory written by `save_tiny` through the Auto classes (local files only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------------
# SFT warm start
# --------------------------------------------------------------------------------------------------------------

_EXPR_RE = re.compile(r"what\s+is\s+(-?\d+)\s*([+\-*])\s*(-?\d+)\s*\?", re.IGNORECASE)
_INT_RE = re.compile(r"(?<!\d)(?<!\d\.)-?\d+(?!\d)(?!\.\d)")  # integers, not parts of decimals


def _equation(problem: str, answer: str) -> str | None:
    """``"a<op>b"`` for the problem: the expression of "What is a<op>b?", else the first of a+b, a-b, a*b (over the
    problem's two integers, in order) that equals the answer; None if there is no such expression."""
    m = _EXPR_RE.search(problem)
    if m:
        return f"{m.group(1)}{m.group(2)}{m.group(3)}"
    nums = _INT_RE.findall(problem)
    try:
        target = int(answer)
    except ValueError:
        return None
    if len(nums) != 2:
        return None
    a, b = int(nums[0]), int(nums[1])
    for op, value in (("+", a + b), ("-", a - b), ("*", a * b)):
        if value == target:
            return f"{a}{op}{b}"
    return None


def arithmetic_sft_examples(rows: Iterable[dict], style: str = "equation") -> list[tuple[str, str]]:
    """Turn ``{"problem": "What is 23+41?", "answer": "64"}`` rows into (user message, completion) pairs.

    The user message is `format_user_message(problem)`. With ``style="equation"`` (default) the completion writes
    the equation first, ``"23+41=64. \\boxed{64}"`` (15 tokens + eos for two-digit numbers); for other problems
    (e.g. "Ann has 49 cards and gives away 27. ...") the equation is the first of a+b, a-b, a*b over the
    problem's two integers that equals the answer (``"49-27=22. \\boxed{22}"``), and just ``"\\boxed{22}"`` when
    none does. ``style="boxed"`` always gives only ``"\\boxed{64}"``; on the mixed shipped data set it does not
    learn within 800 SFT steps (held-out accuracy ~0.1), while the equation style does.
    """
    if style not in ("equation", "boxed"):
        raise ValueError(f"unknown style {style!r}")
    out = []
    for row in rows:
        problem, answer = str(row["problem"]), str(row["answer"]).strip()
        completion = f"\\boxed{{{answer}}}"
        eq = _equation(problem, answer) if style == "equation" else None
        if eq is not None:
            completion = f"{eq}={answer}. {completion}"
        out.append((format_user_message(problem), completion))
    return out


def _as_pair(example: Any) -> tuple[Any, str]:
    if isinstance(example, (tuple, list)) and len(example) == 2:
        return example[0], example[1]
    if isinstance(example, dict):
        if "prompt" in example and "completion" in example:
            return example["prompt"], example["completion"]
        if "problem" in example and "answer" in example:
            return arithmetic_sft_examples([example])[0]
    raise ValueError(
        "examples must be (user_text, completion_text) pairs or dicts with 'prompt'/'completion' "
        f"(or 'problem'/'answer'); got {example!r}"
    )


def _encode_example(tokenizer, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
    """Prompt ids exactly as TRL's GRPOTrainer builds them, completion ids + eos."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    if not isinstance(completion, str):  # conversational completion: [{"role": "assistant", "content": ...}]
        completion = "".join(m["content"] for m in completion)
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return list(prompt_ids), completion_ids


def _collate(tokenizer, encoded: Sequence[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels (-100 on prompt and padding)."""
    max_len = max(len(p) + len(c) for p, c in encoded)
    n = len(encoded)
    input_ids = torch.full((n, max_len), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, max_len), dtype=torch.long)
    labels = torch.full((n, max_len), -100, dtype=torch.long)
    for i, (p, c) in enumerate(encoded):
        ids = p + c
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        labels[i, len(p) : len(ids)] = torch.tensor(c)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def sft_warmstart(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[tuple[str, str]] | Sequence[dict],
    steps: int = 800,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
    warmup_steps: int | None = None,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    num_threads: int | None = None,
) -> dict[str, float]:
    """Supervised fine-tune `model` in place on (user prompt, completion) examples.

    Each example is formatted as TRL's GRPOTrainer does at RL time: the prompt is
    ``apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)`` (a prompt
    may also be a list of messages), the completion is the completion text followed by eos. The loss is the
    token-mean cross-entropy over completion + eos tokens only (prompt and padding are masked).
    Plain torch loop: AdamW, linear warmup then cosine decay to 10% of `lr`, batches drawn with replacement.

    The defaults give a model that solves some but not all problems, as the RL demo needs. Measured (seed 0) on
    the shipped arithmetic data (3000 train rows: "What is a+b?", "What is a-b?", word problems; 300 held-out)
    with `arithmetic_sft_examples`' equation style: 800 steps -> held-out accuracy 0.71 greedy / 0.63 sampled at
    temperature 1 (550 steps: 0.54 / 0.41). On "What is a+b?" alone (a, b < 50) 800 steps give ~0.98 / 0.98.
    Accuracy moves steeply with `steps`, `lr` and `batch_size`.

    `num_threads` sets torch's intra-op threads for the duration of the call (restored afterwards); None leaves
    them alone. On a busy 2-core machine ``num_threads=1`` can be several times faster than 2 (thread spinning).

    Returns ``{"initial_loss", "final_loss" (mean of the last 20 steps), "seconds", "steps", "examples"}``.
    """
    if not examples:
        raise ValueError("no examples")
    encoded = [_encode_example(tokenizer, *_as_pair(ex)) for ex in examples]
    data = _collate(tokenizer, encoded)
    n = data["input_ids"].shape[0]
    warmup = warmup_steps if warmup_steps is not None else max(1, min(50, steps // 10))

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))

    decay = [p for name, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for name, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.train()
    losses: list[float] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="SFT warm start", unit="step")
    prev_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    start = time.perf_counter()
    try:
        for step in range(steps):
            idx = torch.randint(0, n, (batch_size,), generator=gen)  # with replacement
            mask = data["attention_mask"][idx]
            width = int(mask.sum(1).max())
            input_ids = data["input_ids"][idx, :width]
            labels = data["labels"][idx, :width]
            # Right padding + causal attention: real tokens never attend to the padding after them, so no
            # attention mask is needed (padding carries no labels).
            logits = model(input_ids=input_ids, use_cache=False).logits
            # token-mean CE over completion tokens (shifted)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if bar is not None:
                bar.update(1)
                if step % 10 == 0 or step == steps - 1:
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
    finally:
        seconds = time.perf_counter() - start
        torch.set_num_threads(prev_threads)
        if bar is not None:
            bar.close()
        model.train(was_training)
    tail = losses[-20:] if losses else [float("nan")]
    return {
        "initial_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(tail) / len(tail),
        "seconds": seconds,
        "steps": steps,
        "examples": n,
    }


# --------------------------------------------------------------------------------------------------------------
# Quick accuracy check (exact string match of the last \boxed{...}); the real reward uses math-verify elsewhere.
# --------------------------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (no nested braces) in `text`, stripped; None if absent."""
    found = _BOXED_RE.findall(text)
    return found[-1].strip() if found else None


@torch.no_grad()
def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    rows: Sequence[dict],
    n: int | None = 200,
    temperature: float | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 128,
    seed: int = 0,
    return_samples: bool = False,
) -> float | tuple[float, list[dict]]:
    """Fraction of the first `n` rows (all if None) whose generated ``\\boxed{}`` equals ``str(row["answer"])``.

    `temperature=None` decodes greedily; otherwise samples at that temperature with top_k=0, top_p=1 (as TRL's
    GRPOTrainer does by default), seeded by `seed`. Prompts are formatted with `format_user_message`.
    With `return_samples=True` also returns ``[{"problem", "answer", "completion", "pred", "correct"}]``.
    """
    rows = list(rows)[: n if n is not None else None]
    if not rows:
        raise ValueError("no rows")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if temperature is None:
        gen_kwargs.update(do_sample=False)
    else:
        gen_kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    samples = []
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                prompt_ids = [_encode_example(tokenizer, format_user_message(str(r["problem"])), "")[0] for r in chunk]
                width = max(map(len, prompt_ids))
                input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
                attention_mask = torch.zeros_like(input_ids)
                for i, p in enumerate(prompt_ids):  # left padding
                    input_ids[i, width - len(p) :] = torch.tensor(p)
                    attention_mask[i, width - len(p) :] = 1
                out = model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **gen_kwargs
                )
                texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
                for r, text in zip(chunk, texts):
                    pred = extract_boxed(text)
                    answer = str(r["answer"]).strip()
                    samples.append(
                        {
                            "problem": r["problem"],
                            "answer": answer,
                            "completion": text,
                            "pred": pred,
                            "correct": pred == answer,
                        }
                    )
    finally:
        model.train(was_training)
    acc = sum(s["correct"] for s in samples) / len(samples)
    return (acc, samples) if return_samples else acc


def _make_arithmetic_rows(n: int, seed: int = 0, max_operand: int = 50, exclude: Iterable[str] = ()) -> list[dict]:
    """Private test/measurement helper: `n` distinct rows ``{"problem": "What is a+b?", "answer": "a+b"}`` with
    ``0 <= a, b < max_operand``, skipping problems in `exclude`. The shipped data set lives in
    `cegppo_trl.data`."""
    rng = random.Random(seed)
    skip = set(exclude)
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    rng.shuffle(pairs)
    rows = []
    for a, b in pairs:
        problem = f"What is {a}+{b}?"
        if problem in skip:
            continue
        rows.append({"problem": problem, "answer": str(a + b)})
        if len(rows) == n:
            break
    return rows
