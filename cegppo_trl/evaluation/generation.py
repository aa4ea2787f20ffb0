"""Sampling completions: Hugging Face `generate` (batched, seeded, optionally with the policy's entropy), the model
loader of `cegppo-eval` (full models, LoRA adapters merged with peft), and the generator of a run: one loaded model
or one vLLM engine for every data set."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from ..model_source import ModelSource, explain_unreadable_weights
from ..prompt_settings import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from ..trl_mirror import completion_token_mask, prompt_token_ids  # re-exported: `cegppo_trl.evaluation` API
from .settings import DEFAULT_BATCH_SIZE, EvalSettings


def _completion_entropy(logits: Sequence[torch.Tensor], new_tokens: torch.Tensor, eos_ids: torch.Tensor):
    """(summed entropy, token count) of a batch's completions: TRL's `entropy_from_logits` of the unprocessed
    next-token distribution, over every generated token up to and including the first eos, as TRL's `entropy` metric
    counts completion tokens."""
    from trl.trainer.utils import entropy_from_logits

    entropy = entropy_from_logits(torch.stack(list(logits), dim=1).float())
    in_completion = completion_token_mask(new_tokens, eos_ids)
    return float(entropy[in_completion].sum()), int(in_completion.sum())


def _generate_batch(model, tokenizer, ids: list[list[int]], sampling: dict[str, Any], with_entropy: bool):
    """(texts, summed entropy, token count) of one left-padded batch of prompts."""
    eos_id = model.generation_config.eos_token_id
    eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
    batch = tokenizer.pad({"input_ids": ids}, padding_side="left", return_tensors="pt").to(model.device)
    generated = model.generate(
        **batch, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id, use_cache=True,
        return_dict_in_generate=True, output_logits=with_entropy, **sampling,
    )  # fmt: skip
    new_tokens = generated.sequences[:, batch["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    if not with_entropy:
        return texts, 0.0, 0
    eos_ids = torch.tensor(eos_id if isinstance(eos_id, list) else [eos_id], device=model.device)
    return (texts, *_completion_entropy(generated.logits, new_tokens, eos_ids))


@torch.no_grad()
def _generate(
    model, tokenizer, prompts, k, *, temperature=DEFAULT_TEMPERATURE, top_p=DEFAULT_TOP_P, top_k=0,
    max_new_tokens=DEFAULT_MAX_NEW_TOKENS, batch_size=DEFAULT_BATCH_SIZE, seed=0, progress=False, with_entropy=False,
) -> tuple[list[list[str]], float, int]:  # fmt: skip
    """(completions, summed entropy, completion tokens): the one generation loop of `generate_completions` and
    `generate_with_entropy` (the entropy: `_completion_entropy`)."""
    from tqdm.auto import tqdm

    # Constructing the settings checks the values (a bad one is named by its cegppo-eval flag).
    EvalSettings(k=k, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                 batch_size=batch_size)  # fmt: skip
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; set one first (e.g. tokenizer.pad_token = tokenizer.eos_token)."
        )
    sampling = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        sampling.update(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    encoded = [prompt_token_ids(tokenizer, p) for p in prompts]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(k)]
    # Longest prompts first, so each batch pads little and the first batch shows the worst-case memory.
    jobs.sort(key=lambda job: -len(encoded[job[0]]))
    out: list[list[str | None]] = [[None] * k for _ in prompts]
    entropy_sum, token_count = 0.0, 0
    description = progress if isinstance(progress, str) else "generating"
    bar = tqdm(total=len(jobs), desc=description, unit="sample", dynamic_ncols=True, disable=not progress)
    was_training = model.training
    model.eval()
    device = model.device
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start : start + batch_size]
                texts, entropy, tokens = _generate_batch(
                    model, tokenizer, [encoded[i] for i, _ in chunk], sampling, with_entropy
                )
                for (i, j), text in zip(chunk, texts):
                    out[i][j] = text
                entropy_sum, token_count = entropy_sum + entropy, token_count + tokens
                bar.update(len(chunk))
    finally:
        model.train(was_training)
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
    return _generate(model, tokenizer, prompts, k, **settings, batch_size=batch_size, seed=seed, progress=progress)[0]


def generate_with_entropy(
    model, tokenizer, prompts: Sequence[Any], k: int, **settings: Any
) -> tuple[list[list[str]], float]:
    """`generate_completions` (same arguments, the same samples) plus the token-mean entropy, in nats, of the policy
    along those completions (each token up to and including eos)."""
    completions, entropy_sum, tokens = _generate(model, tokenizer, prompts, k, **settings, with_entropy=True)
    return completions, entropy_sum / max(tokens, 1)


def _load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(source: ModelSource, dtype: str = "auto", device: str = "cpu", use_kernels: bool | None = None):
    """(model, tokenizer) of `source` on `device`: the full model, or the base with the LoRA adapter merged into it
    (peft's `PeftModel.from_pretrained(...).merge_and_unload()`). `use_kernels`: transformers' Hub kernels (None:
    transformers' default). A truncated weights file (`UnreadableWeightsError`) and a Hub kernel neither cached nor
    downloadable (`HubKernelUnavailableError`) are one message naming the file or the fix."""
    from transformers import AutoModelForCausalLM

    from ..hub_kernels import explain_uncached_hub_kernels

    options = {"dtype": dtype} if use_kernels is None else {"dtype": dtype, "use_kernels": use_kernels}
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
        from peft import PeftModel

        with explain_unreadable_weights(source.adapter):
            model = PeftModel.from_pretrained(model, source.adapter).merge_and_unload()
    return model.to(device), _load_tokenizer(source)


@contextlib.contextmanager
def _hf_generator(source: ModelSource, settings: EvalSettings):
    device = ("cuda" if torch.cuda.is_available() else "cpu") if settings.device == "auto" else settings.device
    model, tokenizer = load_model(source, settings.dtype, device, settings.use_kernels)
    names = ("temperature", "top_p", "top_k", "max_new_tokens", "batch_size", "seed")
    sampling = {name: getattr(settings, name) for name in names}

    def generate(prompts: Sequence[Any], k: int, progress: bool | str = False) -> list[list[str]]:
        return generate_completions(model, tokenizer, prompts, k, **sampling, progress=progress)

    yield generate


@contextlib.contextmanager
def _vllm_generator(source: ModelSource, settings: EvalSettings):
    from ..run_checks import missing_extra

    if problem := missing_extra("vllm", "vllm", "--backend vllm"):
        raise RuntimeError(f"{problem} Or use --backend hf.")
    from vllm import LLM, SamplingParams

    from ..vllm_support import warn_if_untested_vllm

    warn_if_untested_vllm("--backend vllm")
    tokenizer = _load_tokenizer(source)
    with tempfile.TemporaryDirectory(prefix="cegppo-eval-merged-") as temporary:
        path = source.path
        if source.adapter is not None:  # vLLM loads the adapter merged into its base, as a full model
            path = settings.merge_dir or temporary
            model, _ = load_model(source, dtype=settings.dtype, device="cpu")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            del model
        engine = dict(
            model=path,
            seed=settings.seed,
            dtype=settings.dtype,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
        )
        if settings.max_model_len is not None:
            engine["max_model_len"] = settings.max_model_len
        llm = LLM(**engine)

        def generate(prompts: Sequence[Any], k: int, progress: bool | str = False) -> list[list[str]]:
            s = settings
            params = SamplingParams(
                n=k,
                temperature=s.temperature,
                top_p=s.top_p if s.temperature > 0 else 1.0,
                top_k=s.top_k,  # 0: no cut, as TRL 1.16 passes GRPOConfig.top_k to vLLM
                max_tokens=s.max_new_tokens,
                seed=s.seed,
            )
            inputs = [{"prompt_token_ids": prompt_token_ids(tokenizer, p)} for p in prompts]
            outputs = llm.generate(inputs, params, use_tqdm=bool(progress))
            return [[choice.text for choice in output.outputs] for output in outputs]

        yield generate


def open_generator(source: ModelSource, settings: EvalSettings):
    """A context manager giving ``generate(prompts, k, progress)`` for every data set of a run: one model loaded
    (``hf``: `generate_completions`) or one `vllm.LLM` engine built (a second on the same GPU would not fit; a LoRA
    adapter merged into its base first, in ``merge_dir`` or a temporary directory removed at the end). Prompts go to
    vLLM as TRL's token ids (`prompt_token_ids`), so the chat template is applied once, as in training."""
    from ..run_checks import missing_extra

    if source.adapter is not None and (problem := missing_extra("peft", "peft", f"{source.given} (a LoRA adapter)")):
        raise RuntimeError(problem)  # before the base model loads, which can take minutes
    return (_vllm_generator if settings.backend == "vllm" else _hf_generator)(source, settings)
