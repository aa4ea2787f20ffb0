"""The one harness of the benchmarks and the GPU check: shapes, a random-init Qwen2, TRL's GRPOTrainer beside
CEGPPOTrainer variants on the same model, an off-policy batch, side-by-side timing and memory, gradient checks."""

from __future__ import annotations

import functools
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the one reference loss: tests/oracles.py

# Qwen2-1.5B (config.json of Qwen/Qwen2-1.5B), Qwen2-7B and a tiny shape, each Qwen2-1.5B's with the differences
# written out. Layers are set per use.
QWEN2_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
QWEN2_7B = dict(QWEN2_1_5B, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28)
QWEN2_7B.update(num_key_value_heads=4, tie_word_embeddings=False)
TINY = dict(QWEN2_1_5B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4)
TINY.update(rope_theta=10000.0, max_position_embeddings=8192)  # Qwen2Config's default rope_theta
NUM_GENERATIONS = 4
STEPS_PER_GENERATION = 4  # > gradient_accumulation_steps (1): off-policy, as CE-GPPO needs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_tokenizer():
    """A tiny local word-level tokenizer: the trainers need a processing class; the batch is made of token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_model(shape: dict, num_layers: int, device, dtype=torch.float32, seed: int = 0):
    """Random-init `Qwen2ForCausalLM` of `shape` with `num_layers` layers, built directly on `device` in `dtype`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, num_hidden_layers=num_layers, initializer_range=0.02, use_cache=False)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 0
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype)


def make_dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"w{i} w{i + 1}", "solution": "0"} for i in range(16)])


def reward(completions, **kwargs):
    return [1.0 if len(c) % 2 else -1.0 for c in completions]


def make_config(cls, output_dir, completion_len, device, **overrides):
    values = dict(
        output_dir=output_dir,
        use_cpu=device.type != "cuda",
        bf16=False,  # the model is built in the dtype wanted; no autocast
        per_device_train_batch_size=NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        max_completion_length=completion_len,
        gradient_accumulation_steps=1,
        steps_per_generation=STEPS_PER_GENERATION,
        max_steps=1,
        learning_rate=1e-8,
        report_to="none",
        save_strategy="no",
        seed=0,
        loss_type="dapo",
        beta=0.0,
    )
    values.update(overrides)
    return cls(**values)


def make_trainers(model, device, completion_len, variants=None, tokenizer=None, dataset=None):
    """TRL's GRPOTrainer (dapo) under "grpo" and one CEGPPOTrainer per entry of `variants` (name -> CEGPPOConfig
    overrides; default: {"cegppo": {}}), all wrapping the same `model` with otherwise identical settings."""
    from trl import GRPOConfig, GRPOTrainer

    from cegppo_trl import CEGPPOConfig, CEGPPOTrainer

    tokenizer = tokenizer or build_tokenizer()
    dataset = dataset or make_dataset()
    variants = {"cegppo": {}} if variants is None else variants
    tmp = tempfile.mkdtemp(prefix="bench_scaling_")
    kinds = {"grpo": (GRPOTrainer, GRPOConfig, {})}
    kinds.update({name: (CEGPPOTrainer, CEGPPOConfig, overrides) for name, overrides in variants.items()})
    trainers = {}
    for name, (trainer_cls, config_cls, overrides) in kinds.items():
        cfg = make_config(config_cls, f"{tmp}/{'g' if name == 'grpo' else name}", completion_len, device, **overrides)
        trainers[name] = trainer_cls(model, reward, cfg, dataset, processing_class=tokenizer)
    for t in trainers.values():
        t.model.train()
        t.current_gradient_accumulation_steps = 1
    return trainers


def make_batch(
    trainer, vocab_size, batch, completion_len, device, prompt_len=16, seed=0, noise=0.3, entropy_noise=0.05
):
    """Off-policy batch: old log-probs = current log-probs + N(0, noise^2), old entropies = current ones times
    exp(N(0, entropy_noise^2)) (for `cegppo_entropy_ratio_clip`; other trainers ignore them), lengths in [T/2, T]."""
    gen = torch.Generator().manual_seed(seed)
    b, p, c = batch, prompt_len, completion_len
    lengths = torch.randint(c // 2, c + 1, (b,), generator=gen)
    lengths[0] = c  # the longest completion fills the micro-batch
    out = {
        "prompt_ids": torch.randint(3, vocab_size, (b, p), generator=gen),
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab_size, (b, c), generator=gen),
        "completion_mask": (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).long(),
        "advantages": torch.randn(b, generator=gen),
    }
    out["advantages"][0] = 1.0  # at b >= 2 both advantage signs (both clipped sets) are present
    if b > 1:
        out["advantages"][1] = -1.0
    # TRL's dapo normaliser: num_items_in_batch spans the generation batch (steps_per_generation micro-batches).
    out["num_items_in_batch"] = out["completion_mask"].sum() * STEPS_PER_GENERATION
    # The authors' SFT term: half of the completions (the positive-advantage ones) get the NLL term.
    sft = (out["advantages"] > 0).float()
    out["cegppo_sft_mask"] = sft
    out["cegppo_num_sft_tokens"] = (out["completion_mask"] * sft.unsqueeze(1)).sum() * STEPS_PER_GENERATION
    out = {k: v.to(device) for k, v in out.items()}
    with torch.no_grad():
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, c, compute_entropy=True
        )
    old = logps.float().cpu() + noise * torch.randn(logps.shape, generator=gen)
    out["old_per_token_logps"] = old.to(device)
    old_entropies = entropies.float().cpu() * torch.exp(entropy_noise * torch.randn(logps.shape, generator=gen))
    out["cegppo_old_entropies"] = old_entropies.to(device)
    return out


def loss_backward(trainer, batch):
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss


def timed_step(trainer, batch, optimizer, device):
    """(loss+backward seconds, full step seconds) of zero_grad + loss + backward + optimizer step."""
    sync(device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss_backward(trainer, batch)
    sync(device)
    mid = time.perf_counter()
    optimizer.step()
    sync(device)
    return mid - start, time.perf_counter() - start


def peak_bytes(run, device) -> float:
    """Peak bytes of `run()` above the level before it: `max_memory_allocated` on CUDA (the result held until
    measured, as a batch holds it); on CPU the profiler's allocation events (allocations minus frees of each op
    itself), replayed in start-time order."""
    gc.collect()
    if device.type != "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        level = peak = 0
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            level += e.self_cpu_memory_usage
            peak = max(peak, level)
        return float(peak)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    kept = run()
    sync(device)
    del kept
    return float(torch.cuda.max_memory_allocated(device) - base)


def interleaved(runs: dict, rounds: int) -> dict[str, list]:
    """Each of `runs` (name -> callable) once per round, in an order rotated from round to round and reversed every
    len(runs) rounds, so that machine noise hits all alike: name -> what its calls returned."""
    names, out = list(runs), {name: [] for name in runs}
    for rep in range(rounds):
        k = rep % len(names)
        order = names[k:] + names[:k]
        for name in order[::-1] if (rep // len(names)) % 2 else order:
            out[name].append(runs[name]())
    return out


def compare(trainers, batch, optimizer, device, repeats, memory=True, warmup=0):
    """Time `trainers` ("grpo" plus one or more CE-GPPO variants) on one batch in `interleaved` rounds, so machine noise
    hits all alike. The warm-up round is also the memory round (profiled loss + backward, then the optimizer step),
    after `warmup` untimed rounds. Returns, per CE-GPPO variant, medians and ratios against GRPO, and the variant's
    clipped-token fraction."""
    names = list(trainers)
    for _ in range(warmup):
        for name in names:
            timed_step(trainers[name], batch, optimizer, device)
    mem = {}
    for name in names:  # warm-up and memory; gradients freed first, so both pay for them alike
        optimizer.zero_grad(set_to_none=True)
        if memory:
            mem[name] = peak_bytes(functools.partial(loss_backward, trainers[name], batch), device)
        else:
            loss_backward(trainers[name], batch)
        optimizer.step()
    steps = {n: functools.partial(timed_step, trainers[n], batch, optimizer, device) for n in names}
    timed = interleaved(steps, repeats)
    lb, step = ({n: [t[i] for t in v] for n, v in timed.items()} for i in (0, 1))
    optimizer.zero_grad(set_to_none=True)
    med_lb = {n: statistics.median(v) for n, v in lb.items()}
    med_step = {n: statistics.median(v) for n, v in step.items()}
    results = {}
    for name in names:
        if name == "grpo":
            continue
        trainers[name]._device_metrics.flush("train", trainers[name]._metrics["train"])
        metrics = trainers[name]._metrics["train"]
        pair = sorted(c / g for c, g in zip(lb[name], lb["grpo"]))
        # Spread of the round-wise ratios (how noisy the machine was): inter-quartile range.
        iqr = pair[(3 * len(pair)) // 4] - pair[len(pair) // 4] if len(pair) >= 4 else float("nan")
        out = {
            "grpo_lb_ms": med_lb["grpo"] * 1e3,
            "cegppo_lb_ms": med_lb[name] * 1e3,
            "lb_ratio": med_lb[name] / med_lb["grpo"],
            "lb_pair_iqr": iqr,
            "grpo_step_ms": med_step["grpo"] * 1e3,
            "cegppo_step_ms": med_step[name] * 1e3,
            "step_ratio": med_step[name] / med_step["grpo"],
            "extra_ms": (med_lb[name] - med_lb["grpo"]) * 1e3,
            "clipped_frac": metrics["cegppo/beta1_token_frac"][-1] + metrics["cegppo/beta2_token_frac"][-1],
        }
        if memory:
            out.update(
                grpo_mem_mib=mem["grpo"] / 2**20,
                cegppo_mem_mib=mem[name] / 2**20,
                mem_ratio=mem[name] / mem["grpo"] if mem["grpo"] > 0 else float("nan"),
                extra_mib=(mem[name] - mem["grpo"]) / 2**20,
            )
        results[name] = out
    return results


class DeltaTimer:
    """Wraps `trainer._cegppo_loss_delta` (CE-GPPO's own loss code) and times each call: CUDA events on the GPU
    (no extra host sync; read after the step's synchronize), `perf_counter` on CPU."""

    def __init__(self, trainer, device):
        self.device, self.pending, self.ms = device, [], []
        inner = trainer._cegppo_loss_delta

        def wrapped(*args, **kwargs):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = inner(*args, **kwargs)
                end.record()
                self.pending.append((start, end))
            else:
                t0 = time.perf_counter()
                out = inner(*args, **kwargs)
                self.ms.append((time.perf_counter() - t0) * 1e3)
            return out

        trainer._cegppo_loss_delta = wrapped

    def median_ms(self) -> float:
        if self.pending:
            torch.cuda.synchronize()
            self.ms.extend(s.elapsed_time(e) for s, e in self.pending)
            self.pending = []
        return statistics.median(self.ms) if self.ms else float("nan")


def old_pass_cost(trainer, batch, device, repeats: int) -> dict:
    """The old-log-prob pass as TRL 1.16 runs it (no grad, `_get_per_token_logps_and_entropies`) with the entropies
    dropped (ERC off) and kept (ERC on), interleaved: median seconds and profiled peak bytes of each, and the ratios."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    length = batch["completion_ids"].size(1)

    def run(keep):
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, length, compute_entropy=keep)

    def timed(keep):
        sync(device)
        t0 = time.perf_counter()
        run(keep)
        sync(device)
        return time.perf_counter() - t0

    mem = {keep: peak_bytes(functools.partial(run, keep), device) for keep in (False, True)}  # also the warm-up
    times = interleaved({keep: functools.partial(timed, keep) for keep in (False, True)}, max(repeats, 1) * 2)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return dict(off_ms=off * 1e3, on_ms=on * 1e3, time_ratio=on / off, off_mib=mem[False] / 2**20,
                on_mib=mem[True] / 2**20, mem_ratio=mem[True] / mem[False] if mem[False] > 0 else float("nan"))  # fmt: skip


def erc_vs_base(results: list[dict], t_len: int, b: int) -> dict | None:
    """ERC on vs off from one point's interleaved rounds: the `erc` variant over `base` (same batch, same rounds)."""
    rows = {r["variant"]: r for r in results if (r["T"], r["B"]) == (t_len, b)}
    if "erc" not in rows or "base" not in rows:
        return None
    erc, base = rows["erc"], rows["base"]
    return dict(lb_ratio=erc["cegppo_lb_ms"] / base["cegppo_lb_ms"], step_ratio=erc["cegppo_step_ms"] / base["cegppo_step_ms"],
                mem_ratio=erc["cegppo_mem_mib"] / base["cegppo_mem_mib"], extra_ms=erc["cegppo_lb_ms"] - base["cegppo_lb_ms"],
                extra_mib=erc["cegppo_mem_mib"] - base["cegppo_mem_mib"])  # fmt: skip


def format_erc(erc: dict, t_len: int, b: int) -> str:
    old = erc["old_pass"]
    return (
        f"# erc/base T={t_len} B={b}: lb {erc['lb_ratio']:.3f} step {erc['step_ratio']:.3f} mem {erc['mem_ratio']:.3f} "
        f"({erc['extra_ms']:+.1f} ms, {erc['extra_mib']:+.1f} MiB) | old pass entropies kept/dropped: time "
        f"{old['time_ratio']:.3f} ({old['off_ms']:.1f} -> {old['on_ms']:.1f} ms) mem {old['mem_ratio']:.3f} "
        f"({old['off_mib']:.1f} -> {old['on_mib']:.1f} MiB)"
    )


def grads(params) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            for p in params]  # fmt: skip


def reference_gradient_check(trainers, model, params, batch, checked: str, control: str, band=None) -> dict:
    """`trainers[checked]`'s loss and gradient (all trainable parameters) against `tests/oracles.py`'s Eq. 8 (with the
    trainer's betas; with `band`, entropy-ratio clipping on the batch's old entropies), token mean, on `batch`, and
    `trainers[control]`'s gradient, a control that must not match. `marked`: the share of tokens in the clipped sets
    (or outside the band)."""
    from oracles import gppo_erc_per_token_loss

    trainer, params_ = trainers[checked], trainers[checked].clip_params
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    model.zero_grad(set_to_none=True)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        model, ids, attn, batch["completion_ids"].size(1), compute_entropy=band is not None
    )
    old_logps, old_entropies = batch["old_per_token_logps"], batch.get("cegppo_old_entropies")
    a = batch["advantages"].unsqueeze(1).expand_as(logps)
    loss = gppo_erc_per_token_loss(logps, old_logps, a, entropies, old_entropies, params_, band)
    mask = batch["completion_mask"].double()
    if band is None:
        r = torch.exp(logps.detach().double() - old_logps.double())
        marked = ((r < 1 - params_.epsilon_low) & (a < 0)) | ((r > 1 + params_.epsilon_high) & (a > 0))
    else:
        rho = (entropies.double() + 1e-8) / (old_entropies.double() + 1e-8)
        marked = (rho <= band[0]) | (rho >= band[1])
    ref_loss, marked = (loss * mask).sum() / mask.sum(), (marked.double() * mask).sum() / mask.sum()
    ref_loss.backward()
    reference = grads(params)
    found = {}
    for name in (checked, control):
        model.zero_grad(set_to_none=True)
        loss = trainers[name]._compute_loss(model, batch)
        loss.backward()
        g = grads(params)
        dot = sum(float((a * b).sum()) for a, b in zip(g, reference))
        norms = sum(float((a * a).sum()) for a in g) * sum(float((b * b).sum()) for b in reference)
        diff = sum(float(((a - b) ** 2).sum()) for a, b in zip(g, reference))
        rel = (diff / max(sum(float((b * b).sum()) for b in reference), 1e-30)) ** 0.5
        found[name] = (float(loss), rel, dot / max(norms**0.5, 1e-30))
    model.zero_grad(set_to_none=True)
    (loss, rel, cos), (_, control_rel, control_cos) = found[checked], found[control]
    ref = float(ref_loss)
    loss_err = abs(loss - ref) / max(abs(ref), 1e-3)
    return dict(loss=loss, ref=ref, loss_err=loss_err, rel=rel, cos=cos, control_rel=control_rel,
                control_cos=control_cos, marked=float(marked))  # fmt: skip
