"""What the trainer tests share (not a test module): the one builder of a trainer on the tiny model, CE-GPPO's or
TRL's own for parity, and the helpers that score a hand-built micro-batch (`conftest.make_loss_batch`): old
log-probs off the current policy, the forward pass, the logged metrics, loss and gradient, row selection."""

import json
import sys
import warnings
from pathlib import Path

import torch
from launching import launcher, run_launched
from shared import contains_answer_reward, cpu_config, make_loss_batch
from trl import GRPOConfig, GRPOTrainer

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer


# TRL's options that change the PPO-clip term, each a variant of the parity and entropy-ratio-clipping tests.
TRL_OPTIONS = {
    "plain": {},
    "sequence": {"importance_sampling_level": "sequence"},
    "delta": {"delta": 1.5},
    "off_policy_mask": {"off_policy_mask_threshold": 0.02},
    "entropy_mask": {"top_entropy_quantile": 0.5},
}


def build_trainer(model, tokenizer, dataset, args, cls=CEGPPOTrainer, reward_funcs=contains_answer_reward, **kwargs):
    """`cls` (`CEGPPOTrainer`, or TRL's `GRPOTrainer` for parity) on `model` with the config `args`."""
    return cls(
        model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset, processing_class=tokenizer, **kwargs
    )


def build(model, tokenizer, dataset, tmp_path, cls=CEGPPOTrainer, reward_funcs=contains_answer_reward,
          trainer_kwargs=None, config_cls=None, **overrides):  # fmt: skip
    """`build_trainer` with `conftest.cpu_config` (plus `overrides`) of `config_cls` (default: the trainer's own config
    class); `trainer_kwargs` (`peft_config`, `eval_dataset`, ...) go to the trainer."""
    config_cls = config_cls or (GRPOConfig if cls is GRPOTrainer else CEGPPOConfig)
    args = cpu_config(config_cls, tmp_path, **overrides)
    return build_trainer(model, tokenizer, dataset, args, cls, reward_funcs, **(trainer_kwargs or {}))


def ready_for_loss(*trainers, accumulation=None):
    """Train mode and the accumulation TRL's loop sets, for `_compute_loss` calls on hand-built micro-batches."""
    for trainer in trainers:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = accumulation or trainer.args.gradient_accumulation_steps
    return trainers[0] if len(trainers) == 1 else trainers


def loss_ready(tiny_trainer, *args, **overrides):
    """`tiny_trainer(*args, **overrides)` (the conftest fixture) with its configuration warnings silenced, ready for
    `_compute_loss`; off-policy (gradient accumulation 2 of 4 steps per generation) unless told otherwise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(*args, **{"gradient_accumulation_steps": 2, "steps_per_generation": 4, **overrides})
    return ready_for_loss(trainer)


def current_logps(trainer, inputs):
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True
    )
    return logps, entropies


def noisy(logps, seed, scale=0.3):
    """`logps` + `scale` x standard normal noise from a generator seeded with `seed`."""
    return logps + scale * torch.randn(logps.shape, generator=torch.Generator().manual_seed(seed))


def add_off_policy(trainer, inputs, seed=0, scale=0.4):
    """Old log-probs = current ones + noise, so ratios spread over both clip edges."""
    return dict(inputs, old_per_token_logps=noisy(current_logps(trainer, inputs)[0].detach(), seed, scale))


def batch_with_dropped_rows(trainer, tokenizer, seed, kept=None):
    """An off-policy micro-batch of 8 rows with reference log-probs and SFT rows, as `_select_training_rows` hands it
    to the loss when only the rows `kept` are trained on (`None`: no selection): the others keep an empty loss mask,
    and the token counts (of a generation batch 3 times this micro-batch) cover the kept rows only. Returns it and the
    micro-batch before the selection."""
    inputs = add_off_policy(trainer, make_loss_batch(tokenizer, batch_size=8, seed=seed))
    inputs["ref_per_token_logps"] = noisy(inputs["old_per_token_logps"], seed=seed + 100)
    keep = torch.ones(8) if kept is None else torch.zeros(8).index_fill_(0, torch.tensor(kept, dtype=torch.long), 1.0)
    mask = inputs["completion_mask"]
    inputs["num_items_in_batch"] = (mask * keep.unsqueeze(1)).sum() * 3
    inputs["cegppo_sft_mask"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]) * keep
    inputs["cegppo_num_sft_tokens"] = (mask * inputs["cegppo_sft_mask"].unsqueeze(1)).sum() * 3
    if kept is None:
        return inputs, inputs
    return dict(inputs, completion_mask=mask * keep.unsqueeze(1).to(mask.dtype), cegppo_keep=keep), inputs


def logged(trainer, mode="train"):
    """The trainer's per-micro-batch metric lists as `log` would average them (CE-GPPO's own wait on the device)."""
    trainer._device_metrics.flush(mode, trainer._metrics[mode])
    return trainer._metrics[mode]


def history(trainer, key) -> dict:
    """`key`'s logged values by step."""
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def loss_and_grad(trainer, inputs, compute=None):
    trainer.model.zero_grad()
    loss = (compute or trainer._compute_loss)(trainer.model, inputs)
    loss.backward()
    return loss.detach(), grads(trainer.model).clone()


def select_rows(inputs, rows):
    """The batch with only `rows` kept: what 'physically removed' means for one micro-batch."""
    index = torch.tensor(rows)
    n = inputs["completion_ids"].size(0)
    return {
        k: v[index] if isinstance(v, torch.Tensor) and v.ndim > 0 and v.size(0) == n else v for k, v in inputs.items()
    }


def launched_runs(world, scenarios, model_dir, out_dir, config=None, timeout=1800) -> dict[str, list[dict]]:
    """`training_worker.py` over `scenarios` on one process, or on `world` (DDP, or the shipped accelerate `config`):
    each scenario's records, one per process, by name."""
    scenarios_file = out_dir / "scenarios.json"
    scenarios_file.write_text(json.dumps(scenarios))
    worker = [str(Path(__file__).with_name("training_worker.py")), str(model_dir), str(out_dir), str(scenarios_file)]
    run_launched([*([sys.executable] if world == 1 else launcher(world, config)), *worker], timeout=timeout)
    return {
        s["name"]: [torch.load(out_dir / f"{s['name']}.rank{r}.pt", weights_only=False) for r in range(world)]
        for s in scenarios
    }


def update_error(run_final, initial, reference_final) -> float:
    """The run's parameter update against the reference's, relative to the reference's (which must be non-zero)."""
    run = torch.cat([(run_final[n] - initial[n]).flatten() for n in reference_final])
    reference = torch.cat([(reference_final[n].detach() - initial[n]).flatten() for n in reference_final])
    assert reference.norm() > 0
    return ((run - reference).norm() / reference.norm()).item()


def tiny_moe(tokenizer):
    """A one-layer Mixtral with router logits on, so TRL adds the MoE aux loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return MixtralForCausalLM(config)
