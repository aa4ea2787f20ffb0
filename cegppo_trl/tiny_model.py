"""The built-in tiny model (``builtin:tiny``, also the tests', demo's and benchmarks' model): a local byte-level BPE
tokenizer and a ~1M-parameter Qwen2-style causal LM, its SFT warm start on the built-in arithmetic problems, and
`materialize_tiny`, which builds it for `cegppo-train`. Nothing here touches the Hub. The tokenizer is Qwen2's pipeline
(NFC, Qwen2's split regex, byte-level BPE) with ChatML, so it round-trips through `AutoTokenizer`; digits are single
tokens; ``<|endoftext|>`` is pad / bos (never added), ``<|im_end|>`` eos (ends the assistant turn).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    PrinterCallback,
    ProgressCallback,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from .data import load_builtin_rows


#: Instruction appended (after one space) to every arithmetic problem in the user message.
PROMPT_INSTRUCTION = "Put the final answer in \\boxed{}."
PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen2's pre-tokenisation regex (transformers/models/qwen2/tokenization_qwen2.py). transformers rebuilds a qwen2
# tokenizer's pre-tokenizer from its own definition on load, so any other regex would not survive the round trip.
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


def format_user_message(problem: str) -> str:
    """The user message for an arithmetic problem: the problem, one space, then `PROMPT_INSTRUCTION`."""
    return f"{problem.strip()} {PROMPT_INSTRUCTION}"


def _default_corpus(seed: int = 0) -> list[str]:
    """Chat-formatted arithmetic dialogues ("What is a+b?" with +, -, *, operands up to 3 digits; "Ann has 3 apples
    and gets 4 more. ..." word problems) plus a little scaffolding text."""
    rng = random.Random(seed)

    def dialogue(problem: str, answer: str) -> str:
        return f"{IM_START}user\n{format_user_message(problem)}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"

    texts = []
    for _ in range(2000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        res = {"+": a + b, "-": a - b, "*": a * b}[op]
        answer = f"{a}{op}{b}={res}. \\boxed{{{res}}}" if rng.random() < 0.5 else f"\\boxed{{{res}}}"
        texts.append(dialogue(f"What is {a}{op}{b}?", answer))
    names = ["Ann", "Sam", "Mia", "Tom", "Zoe", "Ben", "Eva", "Leo", "Max", "Ada"]
    items = ["apples", "cards", "books", "eggs", "pens", "coins", "marbles", "stickers", "cookies", "stamps"]
    for _ in range(600):  # simple word problems
        name, item = rng.choice(names), rng.choice(items)
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if rng.random() < 0.5:
            problem, res = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
        else:
            problem, res = f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
        texts.append(dialogue(problem, f"\\boxed{{{res}}}"))
    return texts + [
        f"{IM_START}system\nYou are a helpful assistant. Solve the problem step by step.{IM_END}\n",
        "The answer is \\boxed{42}. Compute the sum, difference or product of the numbers.",
        "Question: Calculate 7 times 6. Answer: 42. Let me think about it.",
    ]


def build_tiny_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer (Qwen2 pipeline, ChatML template) on `corpus`.

    `corpus` defaults to chat-formatted arithmetic dialogues. All 256 byte symbols are in the vocabulary, so any
    text encodes; digits are always single tokens. Deterministic: the same corpus gives the same vocabulary.
    """
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else _default_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=PAD_TOKEN,
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
    config = Qwen2Config(
        **{
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 4 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-6,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **overrides,
        }
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).to(torch.float32)


def save_tiny(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: str | os.PathLike) -> str:
    """`save_pretrained` of both into `path`: it reloads offline with the Auto classes (`load_tiny`) and can be
    passed to `GRPOTrainer(model=path)`."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return os.fspath(path)


def load_tiny(path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Reload a directory written by `save_tiny` through the Auto classes (local files only)."""
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


#: The built-in problems the tiny model is warm-started on (and the demo trains and evaluates on): "sums" ("What is
#: a+b?": short sequences) or "all" (also differences and one-line word problems).
PROBLEM_SETS = {"sums": r"What is \d+\+\d+\?", "all": r".*"}
DEFAULT_PROBLEMS = "sums"


def load_rows(
    name: str = "builtin:arithmetic_eval", n: int | None = None, problems: str = DEFAULT_PROBLEMS
) -> list[dict[str, str]]:
    """The ``{"problem", "answer"}`` rows of a built-in data set that belong to `problems` (a key of
    `PROBLEM_SETS`), the first `n` of them (or all)."""
    if problems not in PROBLEM_SETS:
        raise ValueError(f"problems must be one of {sorted(PROBLEM_SETS)}, got {problems!r}.")
    return [row for row in load_builtin_rows(name) if re.fullmatch(PROBLEM_SETS[problems], row["problem"])][:n]


_EXPR_RE = re.compile(r"what\s+is\s+(-?\d+)\s*([+\-*])\s*(-?\d+)\s*\?", re.IGNORECASE)
_INT_RE = re.compile(r"(?<!\d)(?<!\d\.)-?\d+(?!\d)(?!\.\d)")  # integers, not parts of decimals


def _equation(problem: str, answer: str) -> str | None:
    """``"a<op>b"`` for the problem: the expression of "What is a<op>b?", else the first of a+b, a-b, a*b (over the
    problem's two integers, in order) that equals the answer; None if there is no such expression."""
    m = _EXPR_RE.search(problem)
    if m:
        return "".join(m.groups())
    nums = _INT_RE.findall(problem)
    if len(nums) != 2 or not re.fullmatch(r"-?\d+", answer):
        return None
    a, b = int(nums[0]), int(nums[1])
    return next((f"{a}{op}{b}" for op, v in (("+", a + b), ("-", a - b), ("*", a * b)) if v == int(answer)), None)


def arithmetic_sft_examples(rows: Iterable[dict]) -> list[tuple[str, str]]:
    """Turn ``{"problem": "What is 23+41?", "answer": "64"}`` rows into (user message, completion) pairs.

    The user message is `format_user_message(problem)`; the completion the equation, then the box,
    ``"23+41=64. \\boxed{64}"``. For a word problem the equation is the first of a+b, a-b, a*b over its two integers
    that equals the answer, and just the box when none does (a box alone learns far more slowly:
    docs/entropy_results.md).
    """
    out = []
    for row in rows:
        problem, answer = str(row["problem"]), str(row["answer"]).strip()
        eq = _equation(problem, answer)
        out.append((format_user_message(problem), (f"{eq}={answer}. " if eq else "") + f"\\boxed{{{answer}}}"))
    return out


def sft_dataset(tokenizer, examples: Sequence[tuple[str, str]]):
    """`examples` as the prompt-completion data set TRL's `SFTTrainer` takes: the prompt the chat-templated user
    message, as TRL's GRPOTrainer builds it at RL time; SFTTrainer appends eos to the completion."""
    from datasets import Dataset

    if not examples or any(not (isinstance(e, (tuple, list)) and len(e) == 2) for e in examples):
        raise ValueError(f"examples are (user message, completion) pairs (arithmetic_sft_examples); got {examples!r}")
    prompts = [[{"role": "user", "content": prompt}] for prompt, _ in examples]
    return Dataset.from_dict(
        {
            "prompt": tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False),
            "completion": [completion for _, completion in examples],
        }
    )


def sft_warmstart(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[tuple[str, str]],
    steps: int = 800,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, float]:
    """Supervised fine-tune `model` in place on (user message, completion) pairs with TRL's `SFTTrainer`
    (completion-only loss over completion + eos, the prompt as at RL time: `sft_dataset`).

    AdamW (betas 0.9 / 0.98), linear warm-up then cosine decay to 10% of `lr` (transformers' ``cosine_with_min_lr``),
    `batch_size` examples per step in shuffled epochs. Deterministic for a given `seed`. Returns
    ``{"initial_loss" (first step), "final_loss" (the last logged, a mean over the last tenth of the steps),
    "seconds", "steps", "examples"}``.
    """
    import datasets
    from trl import SFTConfig, SFTTrainer

    dataset = sft_dataset(tokenizer, examples)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # SFTTrainer's preparation of a small in-memory data set
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            args = SFTConfig(
                output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
                lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
                warmup_steps=max(1, min(50, steps // 10)), adam_beta2=0.98, seed=seed, completion_only_loss=True,
                use_cpu=True, bf16=False, activation_checkpointing=False, logging_steps=max(1, steps // 10),
                logging_first_step=True, report_to="none", save_strategy="no", disable_tqdm=not progress,
            )  # fmt: skip
            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
            trainer.remove_callback(PrinterCallback)  # the losses are returned, not printed
            if trainer.pop_callback(ProgressCallback):
                trainer.add_callback(_BarOnly())
            start = time.perf_counter()
            trainer.train()
    finally:
        if bars:
            datasets.enable_progress_bars()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"initial_loss": losses[0], "final_loss": losses[-1], "seconds": time.perf_counter() - start,
            "steps": steps, "examples": len(dataset)}  # fmt: skip


class _BarOnly(ProgressCallback):
    """transformers' progress bar without its per-log print."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


BUILD_FILE = "tiny_build.json"


def warm_tiny(
    seed: int = 0,
    sft_steps: int = 0,
    *,
    train_rows: Sequence[dict] | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast, dict[str, Any]]:
    """Build the tokenizer and model and SFT the model for `sft_steps` steps on `train_rows` (default: the "sums" of
    ``builtin:arithmetic``). Returns ``(model, tokenizer, info)``; `info` has ``key`` (every input of the build),
    ``sft``, ``seconds``, ``num_parameters``, ``cached`` and ``path``.

    With `cache_dir` the result is saved there (`save_tiny` plus ``tiny_build.json``), and a later call with the
    same inputs loads it instead of training again. Calls that share `cache_dir` at the same time (the machines of a
    multi-node run sharing output_dir) build it once: the first takes a lock, the others wait and load its build;
    the build is written in a temporary folder and renamed into place. Deterministic in its inputs.
    """
    examples = arithmetic_sft_examples(train_rows if train_rows is not None else load_rows("builtin:arithmetic"))
    tokenizer = build_tiny_tokenizer()
    digest = {"examples": json.dumps(examples), "tokenizer": tokenizer.backend_tokenizer.to_str()}
    key = {
        "seed": seed,
        "sft_steps": sft_steps,
        **{k: hashlib.sha256(v.encode()).hexdigest() for k, v in digest.items()},
    }
    if cache_dir is None:
        return _build_tiny(tokenizer, examples, key, seed, sft_steps, progress, None)
    path = os.path.abspath(os.fspath(cache_dir))
    with _build_lock(path):  # several machines sharing output_dir: one builds, the others wait, then load its build
        cached = _cached_build(path, key)
        if cached is not None:
            return *load_tiny(path), {**cached, "key": key, "cached": True, "path": path}
        return _build_tiny(tokenizer, examples, key, seed, sft_steps, progress, path)


def _cached_build(path: str, key: dict) -> dict | None:
    """The saved build info of `path` if it holds the build of `key`, else None."""
    build_file = os.path.join(path, BUILD_FILE)
    if not os.path.isfile(build_file):
        return None
    with open(build_file) as f:
        saved = json.load(f)
    return saved["info"] if saved.get("key") == key else None


def _build_tiny(tokenizer, examples, key, seed, sft_steps, progress, path):
    """Build and warm-start the model; with `path`, save it in a temporary folder beside `path` and rename that into
    place, so that a reader never sees a half-written build (also where the lock is not honoured)."""
    start = time.perf_counter()
    model = build_tiny_model(tokenizer, seed=seed)
    sft = sft_warmstart(model, tokenizer, examples, steps=sft_steps, seed=seed, progress=progress)
    info = {"sft": sft, "seconds": time.perf_counter() - start, "num_parameters": model.num_parameters()}
    if path is not None:
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.building-", dir=parent)
        save_tiny(model, tokenizer, staging)
        with open(os.path.join(staging, BUILD_FILE), "w") as f:
            json.dump({"key": key, "info": info}, f, indent=2)
        if os.path.isdir(path):  # an older build of other inputs: out of the way first (a rename cannot replace it)
            stale = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.stale-", dir=parent)
            os.rename(path, os.path.join(stale, "old"))
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(staging, path)
    return model, tokenizer, {**info, "key": key, "cached": False, "path": path}


@contextlib.contextmanager
def _build_lock(path: str):
    """An exclusive `flock` on ``<path>.lock`` (the machines of a multi-node run share the file through their shared
    file system: NFS honours it; where the file system refuses it, the build goes on without, and the rename above
    still keeps readers from half-written files)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # e.g. Lustre mounted without -o flock: ENOSYS
            pass
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_UN)


def materialize_tiny(path: str | os.PathLike, seed: int = 0, sft_steps: int = 0, progress: bool = False) -> str:
    """``builtin:tiny`` as `cegppo-train` uses it: the tiny model and tokenizer in `path`, SFT-warm-started for
    `sft_steps` steps on the "sums" of ``builtin:arithmetic`` (0: random weights); a `path` that already holds the
    same build is reused."""
    warm_tiny(seed=seed, sft_steps=sft_steps, cache_dir=path, progress=progress)
    return os.fspath(path)


def materialize_tiny_in_job(path: str, seed: int, sft_steps: int) -> str:
    """`materialize_tiny` in a launched job: the first process of each node builds it, the others wait and load it."""
    from accelerate import PartialState

    state = PartialState()
    with state.local_main_process_first():
        if state.is_local_main_process and state.num_processes == 1:
            materialize_tiny(path, seed=seed, sft_steps=sft_steps)
        elif state.is_local_main_process:  # in a fresh Python: the SFTTrainer warm start must not join this job
            import subprocess
            import sys

            launch = "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT".split()
            drop = ("ACCELERATE_", "TORCHELASTIC_")
            env = {k: v for k, v in os.environ.items() if k not in launch and not k.startswith(drop)}
            code = "import sys, cegppo_trl.tiny_model as t; t.materialize_tiny(sys.argv[1], *map(int, sys.argv[2:]))"
            subprocess.run([sys.executable, "-c", code, path, str(seed), str(sft_steps)], env=env, check=True)
    return path
