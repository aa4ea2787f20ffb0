"""`cegppo-eval`: avg@k and pass@k of a model on math data sets, graded with the paper's math-verify reward.

The paper reports avg@32 (MATH500: avg@4): sample `k` completions per problem (temperature 0.6, top_p 0.95), grade
each with math-verify against the reference answer, and average the accuracy over all `k x N` completions. pass@j
(for `j <= k`) uses the unbiased estimator of Chen et al. (2021), `1 - C(k - c, j) / C(k, j)` per problem with `c`
correct samples, averaged over problems.

Command line::

    cegppo-eval MODEL --datasets builtin:arithmetic_eval [PATH_OR_HUB_ID ...] --k 32 \\
        [--temperature 0.6] [--top-p 0.95] [--max-new-tokens 1024] [--batch-size 64] [--backend hf|vllm] \\
        [--output eval_report.json]

`MODEL` is a local directory (a saved model or a Trainer checkpoint) or a Hub id; a local path that does not exist,
or a directory that holds no model, is an error that names it. Each data set goes through
`cegppo_trl.data.load_math_dataset` (so `--split`, `--problem-column`, `--answer-column`, `--instruction` apply to all
of them). The command prints one summary line per data set and writes a JSON report with the settings, the metrics
and per-problem correct counts (`--save-completions` adds the completions).

**Settings that travel with a checkpoint.** A model directory with a ``cegppo_prompt.json`` (written by
`save_eval_settings`, e.g. by ``cegppo-demo`` for every model it saves) declares how it is prompted and sampled: the
instruction template (and system prompt) it was trained on, in that file, and the sampling of its held-out evaluation
(``temperature``, ``top_p``, ``max_new_tokens``) in the standard ``generation_config.json``. `cegppo-eval` then uses
them for every setting not given on the command line and says so; explicit flags win. Without that file (Hub models,
other checkpoints) the defaults are the paper's: the boxed-answer instruction of `load_math_dataset`, temperature 0.6,
top_p 0.95, 1024 new tokens. Samples depend on `--seed` and on `--batch-size` (how sequences share a batch).

In training, `AvgAtKCallback` logs the same metrics on a held-out set every N optimizer steps into the trainer's
`log_history` (and so into `trainer_state.json` and `cegppo-plot`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback


__all__ = [
    "AvgAtKCallback",
    "evaluate_completions",
    "evaluate_model",
    "format_summary",
    "generate_completions",
    "generate_with_entropy",
    "load_eval_settings",
    "main",
    "pass_at_k",
    "resolve_eval_settings",
    "save_eval_settings",
]

DEFAULT_TEMPERATURE = 0.6  # paper's validation sampling
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_NEW_TOKENS = 1024
DEFAULT_BATCH_SIZE = 64
#: The file in a model directory that declares its prompt format (see the module docstring).
PROMPT_FILE = "cegppo_prompt.json"


# ----------------------------------------------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: `1 - C(n - c, k) / C(n, k)`.

    Computed as a product (`1 - prod_{i=n-c+1}^{n} (1 - k / i)`) so that large `n` does not overflow.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def evaluate_completions(
    completions: Sequence[Sequence[str]],
    solutions: Sequence[Any],
    pass_ks: Sequence[int] | None = None,
    *,
    timeout_s: float | None = None,
    num_workers: int | None = None,
) -> dict[str, Any]:
    """Grade `completions[i]` (the `k` samples of problem `i`) against `solutions[i]` with the math reward.

    Returns ``{"num_problems", "k", "avg@k", "pass@j" for j in pass_ks (default: 1 and k), "num_correct": [c_i],
    "status_counts": {status: count}, "statuses": [[...]]}``. Problems whose gold answer cannot be parsed
    (status ``bad_gold``, reward None in training) are excluded from the averages and counted in
    ``num_skipped``.
    """
    from .rewards import DEFAULT_TIMEOUT_S, grade_completions

    if len(completions) != len(solutions):
        raise ValueError(f"got completions for {len(completions)} problems but {len(solutions)} solutions.")
    ks = {len(c) for c in completions}
    if len(ks) != 1 or 0 in ks:
        raise ValueError(f"every problem needs the same number (>= 1) of completions, got {sorted(ks)}.")
    (k,) = ks
    pass_ks = sorted({1, k} if pass_ks is None else {int(j) for j in pass_ks})
    bad = [j for j in pass_ks if not 1 <= j <= k]
    if bad:
        raise ValueError(f"pass@j needs 1 <= j <= k = {k}; got j = {bad}.")

    flat = [text for group in completions for text in group]
    golds = [solution for solution in solutions for _ in range(k)]
    graded = grade_completions(
        flat, golds, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, num_workers=num_workers
    )
    statuses = [[g.status for g in graded[i * k : (i + 1) * k]] for i in range(len(completions))]
    num_correct = [sum(s == "correct" for s in row) for row in statuses]
    scored = [i for i, row in enumerate(statuses) if "bad_gold" not in row]
    report: dict[str, Any] = {"num_problems": len(completions), "num_skipped": len(completions) - len(scored), "k": k}
    if scored:
        report[f"avg@{k}"] = sum(num_correct[i] for i in scored) / (k * len(scored))
        for j in pass_ks:
            report[f"pass@{j}"] = sum(pass_at_k(k, num_correct[i], j) for i in scored) / len(scored)
    else:
        report[f"avg@{k}"] = float("nan")
        for j in pass_ks:
            report[f"pass@{j}"] = float("nan")
    report["status_counts"] = dict(Counter(g.status for g in graded))
    report["num_correct"] = num_correct
    report["statuses"] = statuses
    return report


# ----------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------


def prompt_token_ids(tokenizer, prompt: Any) -> list[int]:
    """Token ids of a prompt exactly as TRL's GRPOTrainer builds them (chat template for conversational prompts)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def _prompt_text(tokenizer, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)


def _sampling_kwargs(temperature: float, top_p: float) -> dict[str, Any]:
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": 0}


@torch.no_grad()
def _generate(
    model, tokenizer, prompts, k, *, temperature, top_p, max_new_tokens, batch_size, seed, progress, with_entropy
) -> tuple[list[list[str]], float, int]:
    """(completions, summed entropy, completion tokens): the one generation loop of `generate_completions` and
    `generate_with_entropy`. The entropy (nats, of the unprocessed next-token distribution) is summed over every
    generated token up to and including the first eos, as TRL's `entropy` metric counts completion tokens."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; set one first (e.g. tokenizer.pad_token = tokenizer.eos_token)."
        )
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    eos_id = model.generation_config.eos_token_id
    if eos_id is None:
        eos_id = tokenizer.eos_token_id
    eos_ids = torch.tensor(eos_id if isinstance(eos_id, list) else [eos_id], device=device)
    encoded = [prompt_token_ids(tokenizer, p) for p in prompts]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(k)]
    # Longest prompts first, so each batch pads little and the first batch shows the worst-case memory.
    jobs.sort(key=lambda job: -len(encoded[job[0]]))
    out: list[list[str | None]] = [[None] * k for _ in prompts]
    entropy_sum, token_count = 0.0, 0

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(jobs),
            desc=progress if isinstance(progress, str) else "generating",
            unit="sample",
            dynamic_ncols=True,
        )
    was_training = model.training
    model.eval()
    fork_devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(seed)
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start : start + batch_size]
                batch = tokenizer.pad(
                    {"input_ids": [encoded[i] for i, _ in chunk]}, padding_side="left", return_tensors="pt"
                ).to(device)
                width = batch["input_ids"].shape[1]
                generated = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos_id,
                    pad_token_id=pad_id,
                    use_cache=True,
                    return_dict_in_generate=True,
                    output_logits=with_entropy,
                    **_sampling_kwargs(temperature, top_p),
                )
                new_tokens = generated.sequences[:, width:]
                texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
                for (i, j), text in zip(chunk, texts):
                    out[i][j] = text
                if with_entropy:
                    logp = torch.log_softmax(torch.stack(generated.logits, dim=1).float(), dim=-1)
                    entropy = -(logp.exp() * logp).sum(-1)
                    is_eos = torch.isin(new_tokens, eos_ids)
                    in_completion = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # up to the first eos
                    entropy_sum += float(entropy[in_completion].sum())
                    token_count += int(in_completion.sum())
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    return out, entropy_sum, token_count  # type: ignore[return-value]


def generate_completions(
    model,
    tokenizer,
    prompts: Sequence[Any],
    k: int,
    *,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    progress: bool | str = False,
) -> list[list[str]]:
    """`k` sampled completions (decoded text) for each prompt, with Hugging Face `generate`.

    `prompts` are conversational (lists of messages; rendered with the tokenizer's chat template and generation
    prompt) or plain strings. `batch_size` counts sequences per `generate` call (left-padded with `tokenizer.pad`).
    Sampling uses `temperature` and `top_p` with no top-k cut (`temperature=0`: greedy). The global RNG is left as it
    was: sampling runs under `torch.random.fork_rng`, seeded with `seed`. `progress`: a tqdm bar (a string gives its
    description).
    """
    settings = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return _generate(model, tokenizer, prompts, k, **settings, seed=seed, progress=progress, with_entropy=False)[0]


def generate_with_entropy(
    model, tokenizer, prompts: Sequence[Any], k: int, **settings: Any
) -> tuple[list[list[str]], float]:
    """`generate_completions` (same arguments, the same samples) plus the token-mean entropy, in nats, of the policy
    along those completions (each token up to and including eos)."""
    settings = {
        "temperature": DEFAULT_TEMPERATURE,
        "top_p": DEFAULT_TOP_P,
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
        "batch_size": DEFAULT_BATCH_SIZE,
        "seed": 0,
        "progress": False,
        **settings,
    }
    completions, entropy_sum, tokens = _generate(model, tokenizer, prompts, k, **settings, with_entropy=True)
    return completions, entropy_sum / max(tokens, 1)


def _generate_vllm(model_path: str, tokenizer, prompts, k, *, temperature, top_p, max_new_tokens, seed, dtype):
    try:
        from vllm import LLM, SamplingParams
    except ImportError as error:
        raise RuntimeError(
            "--backend vllm needs vLLM (`pip install cegppo-trl[vllm]`); it is not installed. Use --backend hf."
        ) from error
    llm = LLM(model=model_path, seed=seed, dtype=dtype or "auto")
    params = SamplingParams(
        n=k, temperature=temperature, top_p=top_p if temperature > 0 else 1.0, max_tokens=max_new_tokens, seed=seed
    )
    texts = [_prompt_text(tokenizer, p) for p in prompts]
    outputs = llm.generate(texts, params)
    return [[choice.text for choice in output.outputs] for output in outputs]


# ----------------------------------------------------------------------------------------------------------------
# Settings that travel with a checkpoint
# ----------------------------------------------------------------------------------------------------------------


def save_eval_settings(
    model_dir: str | os.PathLike,
    *,
    instruction: str | None,
    temperature: float,
    top_p: float = 1.0,
    max_new_tokens: int,
    system_prompt: str | None = None,
    note: str | None = None,
) -> str:
    """Record in a saved model directory how it is prompted and sampled, so that `cegppo-eval` uses it by default.

    The prompt (`instruction`, a `load_math_dataset` instruction or ``{problem}`` template, and `system_prompt`) goes
    to ``cegppo_prompt.json``; the sampling (``do_sample``, ``temperature``, ``top_p``, ``top_k=0``,
    ``max_new_tokens``; `temperature` 0 = greedy) to the directory's ``generation_config.json``, the standard place,
    which `model.generate()` and vLLM also read. Returns the path of ``cegppo_prompt.json``.
    """
    from transformers import GenerationConfig

    model_dir = os.fspath(model_dir)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir!r} holds no saved model (no config.json); save the model first.")
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 1; got {temperature}, {top_p}, "
                         f"{max_new_tokens}.")  # fmt: skip
    try:
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:
        generation = GenerationConfig()
    generation.max_new_tokens = int(max_new_tokens)
    if temperature > 0:
        generation.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
    else:
        generation.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    generation.save_pretrained(model_dir)
    path = os.path.join(model_dir, PROMPT_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "instruction": instruction,
                "system_prompt": system_prompt,
                "note": note
                or "Prompt format this model was trained on; cegppo-eval uses it, and the sampling in "
                "generation_config.json, unless --instruction / --system-prompt / --temperature / --top-p / "
                "--max-new-tokens are given.",
            },
            f,
            indent=2,
        )
        f.write("\n")
    return path


def load_eval_settings(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The settings `save_eval_settings` recorded in `model_dir`, or None if it has no ``cegppo_prompt.json``.

    Returns ``{"instruction", "system_prompt"}`` plus whichever of ``temperature`` (0 when ``do_sample`` is false),
    ``top_p`` and ``max_new_tokens`` its ``generation_config.json`` sets.
    """
    model_dir = os.path.expanduser(os.fspath(model_dir))
    path = os.path.join(model_dir, PROMPT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        prompt = json.load(f)
    settings: dict[str, Any] = {
        "instruction": prompt.get("instruction"),
        "system_prompt": prompt.get("system_prompt"),
    }
    generation_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_path):
        with open(generation_path, encoding="utf-8") as f:
            generation = json.load(f)
        if generation.get("max_new_tokens") is not None:
            settings["max_new_tokens"] = int(generation["max_new_tokens"])
        if generation.get("do_sample") is False:
            settings["temperature"] = 0.0
        else:
            if generation.get("temperature") is not None:
                settings["temperature"] = float(generation["temperature"])
            if generation.get("top_p") is not None:
                settings["top_p"] = float(generation["top_p"])
    return settings


_AUTO = "auto"


def resolve_eval_settings(
    model_name_or_path: str,
    *,
    instruction: str | None = _AUTO,
    system_prompt: str | None = _AUTO,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The prompt and sampling settings to evaluate with: explicit values win, then the checkpoint's
    (`load_eval_settings`), then the paper's defaults. ``instruction="auto"`` / ``system_prompt="auto"`` and None
    for the numbers mean "not given" (``instruction="default"`` is `load_math_dataset`'s instruction, None none).

    Returns ``(settings, from_checkpoint)``: the resolved ``instruction``, ``system_prompt``, ``temperature``,
    ``top_p``, ``max_new_tokens``, and the names of those taken from the checkpoint.
    """
    from .data import DEFAULT_INSTRUCTION

    saved = load_eval_settings(model_name_or_path) if os.path.isdir(os.path.expanduser(model_name_or_path)) else None
    saved = saved or {}
    given = {
        "instruction": None if instruction == _AUTO else instruction,
        "system_prompt": None if system_prompt == _AUTO else system_prompt,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
    }
    is_given = {
        "instruction": instruction != _AUTO,
        "system_prompt": system_prompt != _AUTO,
        "temperature": temperature is not None,
        "top_p": top_p is not None,
        "max_new_tokens": max_new_tokens is not None,
    }
    defaults = {
        "instruction": DEFAULT_INSTRUCTION,
        "system_prompt": None,
        "temperature": DEFAULT_TEMPERATURE,
        "top_p": DEFAULT_TOP_P,
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
    }
    settings, from_checkpoint = {}, []
    for key, default in defaults.items():
        if is_given[key]:
            settings[key] = given[key]
        elif key in saved:
            settings[key], _ = saved[key], from_checkpoint.append(key)
        else:
            settings[key] = default
    if settings["instruction"] == "default":
        settings["instruction"] = DEFAULT_INSTRUCTION
    return settings, from_checkpoint


# A Hub model id: "name" or "org/name", letters, digits, '-', '_', '.', at most 96 characters.
_HUB_ID_RE = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")


def _check_model_source(model_name_or_path: str) -> None:
    """Fail with a message naming the path when `model_name_or_path` is meant as a local path but holds no model;
    a name that is not a local path must at least look like a Hub id."""
    path = os.path.expanduser(model_name_or_path)
    where = os.path.abspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return
        inside = sorted(
            name
            for name in os.listdir(path)
            if os.path.isfile(os.path.join(path, name, "config.json"))
            and (name == "final" or name.startswith("checkpoint-"))
        )
        hint = (
            f" It contains saved models: {', '.join(os.path.join(model_name_or_path, n) for n in inside)}."
            if inside
            else ""
        )
        raise FileNotFoundError(
            f"model directory {model_name_or_path!r} ({where}) holds no saved model (no config.json).{hint} "
            "Pass a directory written by save_pretrained / Trainer.save_model, or a Trainer checkpoint-N directory."
        )
    if os.path.exists(path):
        raise FileNotFoundError(f"model path {model_name_or_path!r} is a file; pass a model directory or a Hub id.")
    parent = os.path.dirname(where.rstrip(os.sep))
    looks_local = (
        model_name_or_path.startswith((".", "/", "~"))
        or (os.sep in model_name_or_path.rstrip(os.sep) and os.path.isdir(os.path.dirname(path.rstrip(os.sep)) or "."))
        or not _HUB_ID_RE.match(model_name_or_path)
    )
    if looks_local:
        raise FileNotFoundError(
            f"model path {model_name_or_path!r} does not exist ({where}"
            + ("" if os.path.isdir(parent) else f"; its parent {parent} does not exist either")
            + "). Pass a saved model directory (e.g. cegppo-demo-output/warm_start) or a Hugging Face Hub id "
            "('org/name')."
        )


# ----------------------------------------------------------------------------------------------------------------
# Whole-model evaluation (the CLI)
# ----------------------------------------------------------------------------------------------------------------


def _load_model(model_name_or_path: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    local = os.path.expanduser(model_name_or_path)
    source = local if os.path.isdir(local) else model_name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError) as error:
        if source is local:
            raise
        raise OSError(
            f"{model_name_or_path!r} is not a local directory ({os.path.abspath(local)} does not exist) and could "
            f"not be loaded as a Hugging Face Hub id: {error}"
        ) from error
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def evaluate_model(
    model_name_or_path: str,
    datasets: Sequence[str],
    *,
    k: int = 4,
    pass_ks: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    backend: str = "hf",
    seed: int = 0,
    max_problems: int | None = None,
    split: str = "test",
    problem_column: str | None = None,
    answer_column: str | None = None,
    instruction: str | None = _AUTO,
    system_prompt: str | None = _AUTO,
    dtype: str = "auto",
    device: str = "auto",
    timeout_s: float | None = None,
    save_completions: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate one model on several data sets; returns the JSON report (see the module docstring).

    `instruction`, `system_prompt`, `temperature`, `top_p`, `max_new_tokens` left at ``"auto"`` / None come from the
    checkpoint's ``cegppo_prompt.json`` and ``generation_config.json`` when it has the former, else from the paper's
    defaults (`resolve_eval_settings`; ``report["settings"]["from_checkpoint"]`` lists those taken from the
    checkpoint). `instruction="default"` is `load_math_dataset`'s default instruction; None appends none.
    """
    from .data import _problem_text, load_math_dataset

    if backend not in ("hf", "vllm"):
        raise ValueError(f"backend must be 'hf' or 'vllm', got {backend!r}.")
    _check_model_source(model_name_or_path)
    resolved, from_checkpoint = resolve_eval_settings(
        model_name_or_path,
        instruction=instruction,
        system_prompt=system_prompt,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
    )
    temperature, top_p, max_new_tokens = resolved["temperature"], resolved["top_p"], resolved["max_new_tokens"]
    instruction_text, system_prompt = resolved["instruction"], resolved["system_prompt"]
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}.")
    if temperature == 0 and k > 1:
        raise ValueError("temperature 0 is greedy decoding: all k samples would be equal; use --k 1.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    start_all = time.perf_counter()
    if backend == "hf":
        model, tokenizer = _load_model(model_name_or_path, dtype, device)
    else:
        from transformers import AutoTokenizer

        model, tokenizer = None, AutoTokenizer.from_pretrained(model_name_or_path)

    report: dict[str, Any] = {
        "model": model_name_or_path,
        "settings": {
            "k": k,
            "pass_ks": sorted({1, k} if pass_ks is None else set(pass_ks)),
            "temperature": temperature,
            "top_p": top_p,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "backend": backend,
            "seed": seed,
            "max_problems": max_problems,
            "split": split,
            "instruction": instruction_text,
            "system_prompt": system_prompt,
            "dtype": dtype,
            "from_checkpoint": from_checkpoint,
        },
        "datasets": {},
    }
    for name in datasets:
        start = time.perf_counter()
        data = load_math_dataset(
            name,
            split=split,
            problem_column=problem_column,
            answer_column=answer_column,
            system_prompt=system_prompt,
            instruction=instruction_text,
        )
        if max_problems is not None:
            data = data.select(range(min(max_problems, len(data))))
        prompts, solutions = list(data["prompt"]), list(data["solution"])
        if backend == "hf":
            completions = generate_completions(
                model,
                tokenizer,
                prompts,
                k,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                seed=seed,
                progress=name if progress else False,
            )
        else:
            completions = _generate_vllm(
                model_name_or_path,
                tokenizer,
                prompts,
                k,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new_tokens,
                seed=seed,
                dtype=None if dtype == "auto" else dtype,
            )
        result = evaluate_completions(completions, solutions, pass_ks, timeout_s=timeout_s)
        problems = []
        for i, (prompt, solution) in enumerate(zip(prompts, solutions)):
            entry = {
                "index": i,
                "problem": _problem_text(prompt)[0],
                "solution": solution,
                "num_correct": result["num_correct"][i],
            }
            if save_completions:
                entry["completions"] = completions[i]
                entry["statuses"] = result["statuses"][i]
            problems.append(entry)
        metrics = {key: value for key, value in result.items() if key not in ("num_correct", "statuses")}
        metrics["seconds"] = time.perf_counter() - start
        metrics["problems"] = problems
        report["datasets"][name] = metrics
    report["seconds"] = time.perf_counter() - start_all
    return report


def format_summary(name: str, metrics: dict[str, Any]) -> str:
    """One line: ``name: avg@k = xx.x% | pass@1 = ... | pass@k = ... (N problems x k samples, T s)``."""
    k = metrics["k"]
    parts = [f"avg@{k} = {100 * metrics[f'avg@{k}']:.1f}%"]
    parts += [f"{key} = {100 * value:.1f}%" for key, value in metrics.items() if key.startswith("pass@")]
    skipped = f", {metrics['num_skipped']} skipped (unparseable gold)" if metrics.get("num_skipped") else ""
    seconds = f", {metrics['seconds']:.1f} s" if "seconds" in metrics else ""
    return f"{name}: " + " | ".join(parts) + f" ({metrics['num_problems']} problems x {k} samples{skipped}{seconds})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cegppo-eval",
        description="avg@k and pass@k of a model or checkpoint on math data sets, graded with math-verify "
        "(+1 correct / -1 otherwise, as in CE-GPPO). The paper reports avg@32 (MATH500: avg@4) at temperature 0.6, "
        f"top_p 0.95. A model directory with a {PROMPT_FILE} (every model cegppo-demo saves) brings its own prompt "
        "format and sampling settings (generation_config.json): they are the defaults of --instruction, "
        "--system-prompt, --temperature, --top-p and --max-new-tokens.",
    )
    parser.add_argument("model", help="local model / checkpoint directory or Hugging Face Hub id")
    parser.add_argument(
        "--datasets",
        nargs="+",
        required=True,
        help="data sets for load_math_dataset: local files, Hub ids or builtin:arithmetic_eval",
    )
    parser.add_argument("--k", type=int, default=4, help="samples per problem (paper: 32; MATH500: 4)")
    parser.add_argument(
        "--pass-k", type=int, nargs="+", default=None, help="pass@j values to report, each <= k (default: 1 and k)"
    )
    checkpoint = f"default: the model's own ({PROMPT_FILE} + generation_config.json) if it has {PROMPT_FILE}, else"
    parser.add_argument(
        "--temperature", type=float, default=None, help=f"sampling temperature, 0 = greedy ({checkpoint} 0.6)"
    )
    parser.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling top_p ({checkpoint} 0.95)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help=f"maximum completion length ({checkpoint} 1024)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"sequences per generate call, hf backend (default {DEFAULT_BATCH_SIZE}); it changes which samples are "
        "drawn, not their distribution",
    )
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="generation backend (default hf)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-problems", type=int, default=None, help="evaluate only the first N problems")
    parser.add_argument("--split", default="test", help="split of Hub data sets (default test)")
    parser.add_argument("--problem-column", default=None)
    parser.add_argument("--answer-column", default=None)
    parser.add_argument(
        "--instruction",
        default=None,
        help="text appended to each problem ('default': load_math_dataset's boxed-answer instruction, 'Please "
        "reason step by step, ...'; 'none': nothing; a text with {problem} is a template; "
        f"{checkpoint} 'default')",
    )
    parser.add_argument("--system-prompt", default=None, help=f"system message ({checkpoint} none)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--device", default="auto", help="hf backend device (auto: cuda if available)")
    parser.add_argument("--timeout-s", type=float, default=None, help="grading time limit per completion")
    parser.add_argument("--output", default="eval_report.json", help="JSON report path (default eval_report.json)")
    parser.add_argument("--save-completions", action="store_true", help="store the completions in the report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.k < 1 or args.batch_size < 1 or (args.max_new_tokens is not None and args.max_new_tokens < 1):
        parser.error("--k, --batch-size and --max-new-tokens must be >= 1.")
    if args.pass_k is not None and any(not 1 <= j <= args.k for j in args.pass_k):
        parser.error(f"every --pass-k value must be between 1 and --k = {args.k}.")
    if args.instruction is None:
        instruction = _AUTO
    else:
        instruction = None if args.instruction.lower() == "none" else args.instruction
    system_prompt = _AUTO if args.system_prompt is None else args.system_prompt
    try:
        _check_model_source(args.model)
        settings, from_checkpoint = resolve_eval_settings(
            args.model,
            instruction=instruction,
            system_prompt=system_prompt,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
        )
        if from_checkpoint:
            shown = ", ".join(
                f"{key} '{settings[key]}'" if isinstance(settings[key], str) else f"{key} {settings[key]}"
                for key in from_checkpoint
            )
            print(
                f"cegppo-eval: {args.model} declares its evaluation settings ({PROMPT_FILE}, generation_config.json); "
                f"using {shown}. Flags override them.",
                file=sys.stderr,
                flush=True,
            )
        report = evaluate_model(
            args.model,
            args.datasets,
            k=args.k,
            pass_ks=args.pass_k,
            batch_size=args.batch_size,
            backend=args.backend,
            seed=args.seed,
            max_problems=args.max_problems,
            split=args.split,
            problem_column=args.problem_column,
            answer_column=args.answer_column,
            dtype=args.dtype,
            device=args.device,
            timeout_s=args.timeout_s,
            save_completions=args.save_completions,
            progress=not args.no_progress,
            **settings,
        )
        report["settings"]["from_checkpoint"] = from_checkpoint
    except (ValueError, RuntimeError, OSError) as error:
        parser.exit(2, f"cegppo-eval: error: {error}\n")
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    for name, metrics in report["datasets"].items():
        print(format_summary(name, metrics))
    print(f"report: {args.output}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# In-training evaluation
# ----------------------------------------------------------------------------------------------------------------


class AvgAtKCallback(TrainerCallback):
    """Log avg@k / pass@k of the policy on a held-out set every `eval_steps` optimizer steps.

    Works with any `transformers.Trainer` that passes `model` and `processing_class` to callbacks (GRPOTrainer,
    CEGPPOTrainer). Each evaluation appends one entry ``{"<prefix>avg@k", "<prefix>pass@j" ..., "step", "epoch"}``
    to `state.log_history` (so it is saved in `trainer_state.json` and plotted by `cegppo-plot`; the trainer's own
    logging callbacks such as wandb do not see it).

    Args:
        eval_dataset: rows with ``prompt`` (conversational or text) and ``solution``, e.g. from
            `load_math_dataset` (a `datasets.Dataset` or a list of dicts).
        k: samples per problem. pass_ks: pass@j values (default: 1 and k).
        eval_steps: evaluate when `global_step % eval_steps == 0`. eval_on_start: also at step 0.
            eval_on_end: also after the last step if it was not an evaluation step.
        temperature, top_p, max_new_tokens, batch_size, seed: generation (see `generate_completions`; the same
            seed every time, so successive evaluations differ only by the weights). The trainer's RNG is untouched.
        max_problems: use only the first N rows.
        metric_prefix: prefix of the logged names (default ``"heldout/"``: ``heldout/avg@4``).

    Every process evaluates the whole set (under DeepSpeed ZeRO-3 all ranks must run `generate` together); keep the
    held-out set small.
    """

    def __init__(
        self,
        eval_dataset,
        k: int = 4,
        eval_steps: int = 50,
        *,
        pass_ks: Sequence[int] | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        batch_size: int = DEFAULT_BATCH_SIZE,
        seed: int = 0,
        max_problems: int | None = None,
        eval_on_start: bool = False,
        eval_on_end: bool = True,
        metric_prefix: str = "heldout/",
        timeout_s: float | None = None,
    ):
        if eval_steps < 1 or k < 1:
            raise ValueError(f"eval_steps and k must be >= 1, got {eval_steps}, {k}.")
        rows = list(eval_dataset)
        if max_problems is not None:
            rows = rows[:max_problems]
        if not rows or any("prompt" not in r or "solution" not in r for r in rows):
            raise ValueError(
                "eval_dataset must be non-empty rows with 'prompt' and 'solution' (load it with "
                "cegppo_trl.load_math_dataset)."
            )
        self.prompts = [r["prompt"] for r in rows]
        self.solutions = [r["solution"] for r in rows]
        self.k = k
        self.pass_ks = pass_ks
        self.eval_steps = eval_steps
        self.generation = dict(
            temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed
        )
        self.eval_on_start = eval_on_start
        self.eval_on_end = eval_on_end
        self.metric_prefix = metric_prefix
        self.timeout_s = timeout_s
        self.history: list[dict[str, float]] = []
        self._last_step: int | None = None

    def evaluate(self, model, tokenizer) -> dict[str, float]:
        """avg@k / pass@j of `model` on the held-out set, with the prefixed metric names."""
        start = time.perf_counter()
        completions = generate_completions(model, tokenizer, self.prompts, self.k, **self.generation)
        result = evaluate_completions(completions, self.solutions, self.pass_ks, timeout_s=self.timeout_s)
        metrics = {
            f"{self.metric_prefix}{key}": float(value)
            for key, value in result.items()
            if key.startswith(("avg@", "pass@"))
        }
        metrics[f"{self.metric_prefix}eval_seconds"] = time.perf_counter() - start
        return metrics

    def _run(self, state, kwargs) -> None:
        model, tokenizer = kwargs.get("model"), kwargs.get("processing_class")
        if model is None or tokenizer is None:
            raise RuntimeError(
                "AvgAtKCallback needs the trainer to pass `model` and `processing_class` to callbacks "
                "(pass processing_class=tokenizer to the trainer)."
            )
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps the tokenizer
        metrics = self.evaluate(model, tokenizer)
        entry = {**metrics, "step": state.global_step}
        if state.epoch is not None:
            entry["epoch"] = state.epoch
        state.log_history.append(entry)
        self.history.append(entry)
        self._last_step = state.global_step

    def on_train_begin(self, args, state, control, **kwargs):
        if self.eval_on_start and self._last_step != state.global_step:
            self._run(state, kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.eval_steps == 0 and self._last_step != state.global_step:
            self._run(state, kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        if self.eval_on_end and self._last_step != state.global_step:
            self._run(state, kwargs)


if __name__ == "__main__":
    raise SystemExit(main())
