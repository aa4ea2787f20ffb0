"""Scaling curve: CE-GPPO vs TRL's GRPO (dapo) side by side on Qwen2-1.5B shapes with few layers, random init.

    python benchmarks/bench_scaling.py                       # the default point set (~20 min on 2 CPU cores)
    python benchmarks/bench_scaling.py --points 256x1 1024x2 --variants base sft
    python benchmarks/bench_scaling.py --tiny --points 32x2  # seconds: tiny shapes, same code (tests use this)

One process, one shared model (both trainers wrap the *same* `Qwen2ForCausalLM`, so weights, caches and allocator
state are identical), one hand-made off-policy batch per point (`old_per_token_logps` = current log-probs + noise, so
~25% of tokens fall in a clipped set). Per point, repetitions are interleaved (GRPO/CE-GPPO, then CE-GPPO/GRPO, ...)
and the median is taken. Printed per point and variant, CE-GPPO / GRPO:

* `lb`   loss + backward time ratio (`trainer._compute_loss(...).backward()`),
* `step` full training-step time ratio: zero_grad + loss + backward + AdamW step on the same batch,
* `mem`  peak memory ratio of loss + backward above the level before it (CPU: torch profiler allocation events
  replayed in time order; CUDA: `max_memory_allocated`),
* CE-GPPO's absolute extra milliseconds (loss + backward) and MiB (peak).

Variants (each a CE-GPPO config compared with the same plain GRPO): `base` (paper defaults), `sft`
(`cegppo_sft_coef=0.1`, half of the completions get the NLL term), `entropy` (`cegppo_entropy_target=0.5`, the PI
controller updates beta1 / beta2 every micro-batch), `erc` (`cegppo_entropy_ratio_clip=[0.95, 1.05]`, entropy-ratio
clipping; the batch's old entropies are the current ones times exp(N(0, 0.05^2)), so ~30% of tokens leave the band).
CE-GPPO's quadrant metrics are always computed (no flag), so every variant includes them. Goal: every ratio <= 1.01.
Where `erc` and `base` run at the same point, an `erc/base` line gives ERC's own cost (on vs off, same rounds), and an
`old pass` line the cost of keeping the old entropies in the old-log-prob pass (`compute_entropy` True vs False).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_scaling_plot  # noqa: E402
import gpu_check_erc  # noqa: E402


warnings.filterwarnings("ignore")

# Qwen2-1.5B (config.json of Qwen/Qwen2-1.5B) and Qwen2-7B. Layers are set per use.
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
QWEN2_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=8192,
)
NUM_GENERATIONS = 4
STEPS_PER_GENERATION = 4  # > gradient_accumulation_steps (1): off-policy, as CE-GPPO needs
VARIANTS = {
    "base": {},
    "sft": {"cegppo_sft_coef": 0.1},
    "entropy": {"cegppo_entropy_target": 0.5},
    "erc": {"cegppo_entropy_ratio_clip": [0.95, 1.05]},
}
# Default point set: (completion_len, batch). Chosen to fit ~20 min on 2 shared CPU cores (see docs/scaling.md).
DEFAULT_POINTS = ["256x1", "256x2", "1024x1"]
DEFAULT_VARIANT_POINTS = ["256x1"]  # where sft / entropy also run


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers (also used by benchmarks/gpu_check.py)
# ----------------------------------------------------------------------------------------------------------------
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
    trainers = {
        "grpo": GRPOTrainer(
            model,
            reward,
            make_config(GRPOConfig, tmp + "/g", completion_len, device),
            dataset,
            processing_class=tokenizer,
        )
    }
    for name, overrides in variants.items():
        cfg = make_config(CEGPPOConfig, f"{tmp}/{name}", completion_len, device, **overrides)
        trainers[name] = CEGPPOTrainer(model, reward, cfg, dataset, processing_class=tokenizer)
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


def peak_memory(trainer, batch, optimizer, device) -> float:
    """Peak bytes above the level before loss + backward (gradients freed first, so both pay for them alike)."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        loss_backward(trainer, batch)
        sync(device)
        return float(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_backward(trainer, batch)
    level = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        level += e.self_cpu_memory_usage  # allocations minus frees of the op itself, in start-time order
        peak = max(peak, level)
    return float(peak)


def compare(trainers, batch, optimizer, device, repeats, memory=True, warmup=0):
    """Time `trainers` ("grpo" plus one or more CE-GPPO variants) on one batch, interleaved: each round runs every
    trainer once, in an order rotated from round to round, so machine noise hits all alike. The warm-up round is
    also the memory round (profiled loss + backward, then the optimizer step), after `warmup` untimed rounds. Returns, per CE-GPPO variant, medians
    and ratios against GRPO, and the variant's clipped-token fraction."""
    names = list(trainers)
    for _ in range(warmup):
        for name in names:
            timed_step(trainers[name], batch, optimizer, device)
    mem = {}
    for name in names:  # warm-up and memory
        optimizer.zero_grad(set_to_none=True)
        if memory:
            mem[name] = peak_memory(trainers[name], batch, optimizer, device)
        else:
            loss_backward(trainers[name], batch)
        optimizer.step()
    lb = {n: [] for n in names}
    step = {n: [] for n in names}
    for rep in range(repeats):
        k = rep % len(names)
        order = names[k:] + names[:k]
        if (rep // len(names)) % 2:
            order = order[::-1]
        for name in order:
            a, b = timed_step(trainers[name], batch, optimizer, device)
            lb[name].append(a)
            step[name].append(b)
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
        self.available = hasattr(trainer, "_cegppo_loss_delta")
        if not self.available:
            return
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


def overhead_only(points, variants, repeats=5):
    """CE-GPPO's own per-micro-batch cost at each point, without the noise of a full-vocabulary step: the time of
    `CEGPPOTrainer._cegppo_loss_delta` (correction + aggregation + SFT term + all `cegppo/` metrics + controller; it
    only touches (B, T) tensors, so it does not depend on hidden size, layers or vocabulary: a tiny model gives the
    same number) and the backward of the correction alone (`core.gradient_preserving_correction` on a (B, T) leaf)."""
    from cegppo_trl.core import ClipParams, gradient_preserving_correction

    device = torch.device("cpu")
    model = build_model(TINY, 1, device)
    tokenizer, dataset = build_tokenizer(), make_dataset()
    rows = []
    for t_len, b in points:
        trainers = make_trainers(model, device, t_len, {v: VARIANTS[v] for v in variants}, tokenizer, dataset)
        batch = make_batch(trainers["grpo"], TINY["vocab_size"], b, t_len, device)
        row = {"T": t_len, "B": b}
        for v in variants:
            timer = DeltaTimer(trainers[v], device)
            for _ in range(repeats + 1):
                model.zero_grad(set_to_none=True)
                loss_backward(trainers[v], batch)
            timer.ms = timer.ms[1:]
            row[f"delta_ms_{v}"] = timer.median_ms()
        log_ratio = (batch["old_per_token_logps"] * 0 + 0.3 * torch.randn(b, t_len)).requires_grad_()
        bwd = []
        for _ in range(repeats + 1):
            corr, _ = gradient_preserving_correction(
                log_ratio, batch["advantages"].unsqueeze(1), ClipParams(0.2, 0.2, 0.5, 1.0)
            )
            loss = corr.sum()
            t0 = time.perf_counter()
            loss.backward()
            bwd.append((time.perf_counter() - t0) * 1e3)
        row["corr_bwd_ms"] = statistics.median(bwd[1:])
        rows.append(row)
        print(
            f"{t_len:>5} {b:>2} {t_len * b:>6} "
            + " ".join(f"{v}={row[f'delta_ms_{v}']:7.2f}" for v in variants)
            + f"  correction backward={row['corr_bwd_ms']:6.2f}",
            flush=True,
        )
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------
def parse_point(text: str) -> tuple[int, int]:
    t, b = text.lower().split("x")
    return int(t), int(b)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--points", nargs="*", default=DEFAULT_POINTS, help="completion_len x batch, e.g. 1024x2 (none: overhead only)"
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument(
        "--variant-points",
        nargs="+",
        default=None,
        help="points where the non-base variants run (default: " + " ".join(DEFAULT_VARIANT_POINTS) + "; "
        "with --points given: all of them)",
    )
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per point (default: by size)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (hidden 64, vocab 1024): a smoke run")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument(
        "--overhead-points",
        nargs="*",
        default=["256x1", "256x2", "1024x1", "1024x4", "2048x1", "4096x1", "4096x2"],
        help="points where CE-GPPO's own cost is timed on a tiny model (cheap; covers the left-out long points)",
    )
    p.add_argument("--plot", default=None, help="write the ratio-vs-tokens figure here (PNG)")
    p.add_argument("--from-json", default=None, help="skip the runs: plot / print from a JSON written by --json")
    return p.parse_args(argv)


def default_repeats(tokens: int) -> int:
    """Timed rounds after the warm-up/memory round: a 1024-token full-vocabulary step is ~1-2 min on 2 shared cores."""
    return 2 if tokens <= 512 else 1


HEADER = (
    f"{'T':>5} {'B':>2} {'tokens':>6} {'variant':<8} {'clip':>5} {'GRPO lb ms':>10} {'lb':>6} {'(iqr)':>6} "
    f"{'step':>6} {'GRPO MiB':>9} {'mem':>6} {'+ms':>7} {'+MiB':>6}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['T']:>5} {r['B']:>2} {r['T'] * r['B']:>6} {r['variant']:<8} {r['clipped_frac']:>5.3f} "
        f"{r['grpo_lb_ms']:>10.1f} {r['lb_ratio']:>6.3f} {r['lb_pair_iqr']:>6.3f} {r['step_ratio']:>6.3f} "
        f"{r['grpo_mem_mib']:>9.1f} {r['mem_ratio']:>6.3f} {r['extra_ms']:>7.1f} {r['extra_mib']:>6.1f}"
    )


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        print(HEADER)
        for r in saved["results"]:
            print(format_row(r))
        if args.plot:
            bench_scaling_plot.plot(saved["results"], args.plot, VARIANTS, saved.get("overhead"))
        return saved["results"]
    device = torch.device("cpu")
    shape = TINY if args.tiny else QWEN2_1_5B
    points = [parse_point(p) for p in args.points]
    if args.variant_points is not None:
        variant_points = {parse_point(p) for p in args.variant_points}
    elif args.points != DEFAULT_POINTS:
        variant_points = set(points)
    else:
        variant_points = {parse_point(p) for p in DEFAULT_VARIANT_POINTS}

    model = build_model(shape, args.layers, device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-8)  # one optimizer, shared: same cost for both
    tokenizer, dataset = build_tokenizer(), make_dataset()
    print(
        f"# bench_scaling: Qwen2{'(tiny)' if args.tiny else '-1.5B'} shape hidden={shape['hidden_size']} "
        f"heads={shape['num_attention_heads']}/{shape['num_key_value_heads']} vocab={shape['vocab_size']} "
        f"layers={args.layers} params={n_params / 1e6:.1f}M fp32 device=cpu threads={torch.get_num_threads()} "
        f"torch={torch.__version__}",
        flush=True,
    )
    print("# ratios are CE-GPPO / GRPO(dapo); lb = loss+backward, step = +AdamW step, mem = loss+backward peak")
    print(HEADER, flush=True)
    results, erc_rows = [], []
    start = time.perf_counter()
    trainers_by_len = {}
    for t_len, b in points:
        variants = [v for v in args.variants if v == "base" or (t_len, b) in variant_points]
        if t_len not in trainers_by_len:  # max_completion_length is part of the config
            trainers_by_len[t_len] = make_trainers(
                model, device, t_len, {v: VARIANTS[v] for v in args.variants}, tokenizer, dataset
            )
        trainers = {n: t for n, t in trainers_by_len[t_len].items() if n == "grpo" or n in variants}
        batch = make_batch(trainers["grpo"], shape["vocab_size"], b, t_len, device)
        repeats = args.repeats or default_repeats(t_len * b)
        for variant, r in compare(trainers, batch, optimizer, device, repeats).items():
            r.update(T=t_len, B=b, variant=variant, repeats=repeats)
            results.append(r)
            print(format_row(r), flush=True)
        erc = gpu_check_erc.erc_vs_base(results, t_len, b)
        if erc is not None:
            erc["old_pass"] = gpu_check_erc.old_pass_cost(trainers["erc"], batch, device, repeats)
            erc_rows.append(dict(erc, T=t_len, B=b))
            print(gpu_check_erc.format_erc(erc, t_len, b), flush=True)
        del batch
        gc.collect()
    worst = {k: max((r[k] for r in results), default=float("nan")) for k in ("lb_ratio", "step_ratio", "mem_ratio")}
    print(
        f"# worst: lb {worst['lb_ratio']:.3f}  step {worst['step_ratio']:.3f}  mem {worst['mem_ratio']:.3f}  "
        f"(goal <= 1.01); total {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    overhead = None
    if args.overhead_points:
        print(
            "# CE-GPPO's own cost per micro-batch, ms (tiny model: it does not depend on H, V or layers):", flush=True
        )
        overhead = overhead_only([parse_point(p) for p in args.overhead_points], args.variants)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"params": n_params, "layers": args.layers, "results": results, "erc": erc_rows, "overhead": overhead},
                f,
                indent=1,
            )
    if args.plot:
        bench_scaling_plot.plot(results, args.plot, VARIANTS, overhead)
    return results


if __name__ == "__main__":
    main()
