"""Sampling completions: Hugging Face `generate` (batched, seeded, optionally with the policy's entropy), the model
loader of `cegppo-eval` (full models and LoRA adapters), the adapter merge, and one vLLM engine for all data sets."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from ..model_source import ModelSource, explain_unreadable_weights
from .settings import DEFAULT_BATCH_SIZE, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P


__all__ = [
    "HFGenerator",
    "VLLMGenerator",
    "generate_completions",
    "generate_with_entropy",
    "load_model",
    "merge_adapter",
    "prompt_token_ids",
]

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prompt_token_ids(tokenizer, prompt: Any) -> list[int]:
    """Token ids of a prompt exactly as TRL's GRPOTrainer builds them: mirrors `GRPOTrainer._tokenize_prompts` of
    TRL 1.16 for text-only prompts without tools (the chat template with the generation prompt for conversational
    prompts, the tokenizer on the text otherwise); tests/test_evaluation.py compares the two."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def _sampling_kwargs(temperature: float, top_p: float, top_k: int) -> dict[str, Any]:
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k)}


def _eos_id(model, tokenizer) -> int | list[int]:
    eos_id = model.generation_config.eos_token_id
    return tokenizer.eos_token_id if eos_id is None else eos_id


def _completion_entropy(logits: Sequence[torch.Tensor], new_tokens: torch.Tensor, eos_ids: torch.Tensor):
    """(summed entropy, token count) of a batch's completions: TRL's `entropy_from_logits` of the unprocessed
    next-token distribution, over every generated token up to and including the first eos, as TRL's `entropy` metric
    counts completion tokens."""
    from trl.trainer.utils import entropy_from_logits

    entropy = entropy_from_logits(torch.stack(list(logits), dim=1).float())
    is_eos = torch.isin(new_tokens, eos_ids)
    in_completion = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # up to the first eos
    return float(entropy[in_completion].sum()), int(in_completion.sum())


def _generate_batch(model, tokenizer, ids: list[list[int]], sampling: dict[str, Any], with_entropy: bool):
    """(texts, summed entropy, token count) of one left-padded batch of prompts."""
    device = next(model.parameters()).device
    eos_id = _eos_id(model, tokenizer)
    batch = tokenizer.pad({"input_ids": ids}, padding_side="left", return_tensors="pt").to(device)
    generated = model.generate(
        **batch, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id, use_cache=True,
        return_dict_in_generate=True, output_logits=with_entropy, **sampling,
    )  # fmt: skip
    new_tokens = generated.sequences[:, batch["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    if not with_entropy:
        return texts, 0.0, 0
    eos_ids = torch.tensor(eos_id if isinstance(eos_id, list) else [eos_id], device=device)
    return (texts, *_completion_entropy(generated.logits, new_tokens, eos_ids))


def _progress_bar(progress: bool | str, total: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    description = progress if isinstance(progress, str) else "generating"
    return tqdm(total=total, desc=description, unit="sample", dynamic_ncols=True)


@torch.no_grad()
def _generate(
    model, tokenizer, prompts, k, *, temperature, top_p, top_k, max_new_tokens, batch_size, seed, progress,
    with_entropy,
) -> tuple[list[list[str]], float, int]:  # fmt: skip
    """(completions, summed entropy, completion tokens): the one generation loop of `generate_completions` and
    `generate_with_entropy` (the entropy: `_completion_entropy`)."""
    from .settings import EvalSettings

    # Constructing the settings checks the values (a bad one is named by its cegppo-eval flag).
    EvalSettings(k=k, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                 batch_size=batch_size)  # fmt: skip
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; set one first (e.g. tokenizer.pad_token = tokenizer.eos_token)."
        )
    sampling = {"max_new_tokens": max_new_tokens, **_sampling_kwargs(temperature, top_p, top_k)}
    encoded = [prompt_token_ids(tokenizer, p) for p in prompts]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(k)]
    # Longest prompts first, so each batch pads little and the first batch shows the worst-case memory.
    jobs.sort(key=lambda job: -len(encoded[job[0]]))
    out: list[list[str | None]] = [[None] * k for _ in prompts]
    entropy_sum, token_count = 0.0, 0
    bar = _progress_bar(progress, len(jobs))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    fork_devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(seed)
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start : start + batch_size]
                texts, entropy, tokens = _generate_batch(
                    model, tokenizer, [encoded[i] for i, _ in chunk], sampling, with_entropy
                )
                for (i, j), text in zip(chunk, texts):
                    out[i][j] = text
                entropy_sum, token_count = entropy_sum + entropy, token_count + tokens
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
    top_k: int = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    progress: bool | str = False,
) -> list[list[str]]:
    """`k` sampled completions (decoded text) for each prompt, with Hugging Face `generate`.

    `prompts` are conversational (lists of messages; rendered with the tokenizer's chat template and generation
    prompt) or plain strings. `batch_size` counts sequences per `generate` call (left-padded with `tokenizer.pad`).
    Sampling uses `temperature`, `top_p` and `top_k` (0: no cut; `temperature=0`: greedy). The global RNG is left as
    it was: sampling runs under `torch.random.fork_rng`, seeded with `seed`. `progress`: a tqdm bar (a string gives
    its description).
    """
    settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)
    return _generate(
        model, tokenizer, prompts, k, **settings, batch_size=batch_size, seed=seed, progress=progress,
        with_entropy=False,
    )[0]  # fmt: skip


def generate_with_entropy(
    model, tokenizer, prompts: Sequence[Any], k: int, **settings: Any
) -> tuple[list[list[str]], float]:
    """`generate_completions` (same arguments, the same samples) plus the token-mean entropy, in nats, of the policy
    along those completions (each token up to and including eos)."""
    settings = {
        "temperature": DEFAULT_TEMPERATURE,
        "top_p": DEFAULT_TOP_P,
        "top_k": 0,
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
        "batch_size": DEFAULT_BATCH_SIZE,
        "seed": 0,
        "progress": False,
        **settings,
    }
    completions, entropy_sum, tokens = _generate(model, tokenizer, prompts, k, **settings, with_entropy=True)
    return completions, entropy_sum / max(tokens, 1)


# ----------------------------------------------------------------------------------------------------------------
# Loading: full models and LoRA adapters
# ----------------------------------------------------------------------------------------------------------------


def _load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(source: ModelSource, dtype: str = "auto", device: str = "cpu", use_kernels: bool | None = None):
    """(model, tokenizer) of `source` on `device`: the full model, or the base with the LoRA adapter merged into it
    (peft's `PeftModel.from_pretrained(...).merge_and_unload()`, the same code as `merge_adapter`). `use_kernels`:
    transformers' Hub kernels (None: transformers' default). A truncated weights file (`UnreadableWeightsError`) and a
    Hub kernel neither cached nor downloadable (`HubKernelUnavailableError`) are one message naming the file or fix."""
    from transformers import AutoModelForCausalLM

    from ..hub_kernels import explain_uncached_hub_kernels

    options = {"dtype": _DTYPES[dtype]}
    if use_kernels is not None:  # None: transformers' default (on, unless USE_HUB_KERNELS says no)
        options["use_kernels"] = use_kernels
    try:
        with (
            explain_unreadable_weights(source.path),
            explain_uncached_hub_kernels(flag_fix="--use_kernels false in cegppo-eval"),
        ):
            model = AutoModelForCausalLM.from_pretrained(source.path, **options)
    except (OSError, ValueError) as error:
        if os.path.isdir(source.path):
            raise
        raise OSError(f"{source.path!r} could not be loaded as a Hugging Face Hub model: {error}") from error
    if source.adapter is not None:
        try:
            from peft import PeftModel
        except ImportError as error:
            raise RuntimeError(
                f"{source.given} is a LoRA adapter; loading it needs peft: pip install 'cegppo-trl[peft]'."
            ) from error
        with explain_unreadable_weights(source.adapter):
            model = PeftModel.from_pretrained(model, source.adapter).merge_and_unload()
    return model.to(device), _load_tokenizer(source)


def merge_adapter(source: ModelSource, output_dir: str | os.PathLike, dtype: str = "auto") -> str:
    """Write the LoRA adapter of `source` merged into its base as a full model (weights + tokenizer) in `output_dir`,
    on the CPU; returns `output_dir`. What vLLM loads; docs/evaluation.md shows the same steps with peft."""
    if source.adapter is None:
        raise ValueError(f"{source.given} is a full model, not a LoRA adapter; there is nothing to merge.")
    model, tokenizer = load_model(source, dtype=dtype, device="cpu")
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return os.fspath(output_dir)


def _device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


class HFGenerator:
    """Hugging Face `generate` on one loaded model, for every data set of a run (`k` samples per problem: each set's
    own)."""

    def __init__(self, source: ModelSource, settings):
        self.settings = settings
        self.model, self.tokenizer = load_model(source, settings.dtype, _device(settings.device), settings.use_kernels)

    def __call__(self, prompts: Sequence[Any], k: int, progress: bool | str = False) -> list[list[str]]:
        s = self.settings
        return generate_completions(
            self.model, self.tokenizer, prompts, k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_new_tokens=s.max_new_tokens, batch_size=s.batch_size, seed=s.seed, progress=progress,
        )  # fmt: skip

    def close(self) -> None:
        self.model = None


class VLLMGenerator:
    """One `vllm.LLM` engine for every data set of a run (built once: a second engine on the same GPU would not
    fit). A LoRA adapter is merged into its base first (`merge_adapter`, into `settings.merge_dir` or a temporary
    directory removed by `close`). Prompts go in as token ids built like TRL's (`prompt_token_ids`), so the chat
    template is applied once, exactly as in training."""

    def __init__(self, source: ModelSource, settings):
        try:
            from vllm import LLM
        except ImportError as error:
            raise RuntimeError(
                "--backend vllm needs vLLM (pip install 'cegppo-trl[vllm]'); it is not installed. Use --backend hf."
            ) from error
        from ..vllm_support import warn_if_untested_vllm

        warn_if_untested_vllm("--backend vllm")
        self.settings = settings
        self.tokenizer = _load_tokenizer(source)
        self._temporary = None
        path = source.path
        if source.adapter is not None:
            if settings.merge_dir is None:
                self._temporary = tempfile.mkdtemp(prefix="cegppo-eval-merged-")
            path = merge_adapter(source, settings.merge_dir or self._temporary, dtype=settings.dtype)
        engine = dict(
            model=path,
            seed=settings.seed,
            dtype=settings.dtype,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
        )
        if settings.max_model_len is not None:
            engine["max_model_len"] = settings.max_model_len
        self.llm = LLM(**engine)

    def __call__(self, prompts: Sequence[Any], k: int, progress: bool | str = False) -> list[list[str]]:
        from vllm import SamplingParams

        s = self.settings
        params = SamplingParams(
            n=k,
            temperature=s.temperature,
            top_p=s.top_p if s.temperature > 0 else 1.0,
            top_k=s.top_k,  # 0: no cut, as TRL 1.16 passes GRPOConfig.top_k to vLLM
            max_tokens=s.max_new_tokens,
            seed=s.seed,
        )
        inputs = [{"prompt_token_ids": prompt_token_ids(self.tokenizer, p)} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=bool(progress))
        return [[choice.text for choice in output.outputs] for output in outputs]

    def close(self) -> None:
        self.llm = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
