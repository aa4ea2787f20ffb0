"""Entropy-ratio clipping's cost (`cegppo_entropy_ratio_clip`), on vs off, side by side: the loss side (the `erc`
variant against `base` in the same interleaved rounds of benchmarks/bench_scaling.py) and the old-log-prob pass
(entropies kept vs dropped). Used by bench_scaling.py (`erc/base` lines) and by benchmarks/gpu_check.py (its
`RESULT erc:` line)."""

from __future__ import annotations

import gc
import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def old_pass_cost(trainer, batch, device, repeats: int) -> dict:
    """The old-log-prob pass as TRL 1.16 runs it (no grad, `_get_per_token_logps_and_entropies`) with the entropies
    dropped (ERC off) and kept (ERC on), interleaved: median seconds and profiled peak bytes of each, and the ratios."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    length = batch["completion_ids"].size(1)

    def run(keep):
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, length, compute_entropy=keep)

    def peak(keep):
        if device.type == "cuda":
            gc.collect()
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            kept = run(keep)  # held until measured, as the batch holds it
            sync(device)
            del kept
            return float(torch.cuda.max_memory_allocated(device) - base)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            kept = run(keep)
        del kept
        level = top = 0
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            level += e.self_cpu_memory_usage
            top = max(top, level)
        return float(top)

    mem = {keep: peak(keep) for keep in (False, True)}  # also the warm-up
    times = {False: [], True: []}
    for rep in range(max(repeats, 1) * 2):
        for keep in (False, True) if rep % 2 == 0 else (True, False):
            sync(device)
            t0 = time.perf_counter()
            run(keep)
            sync(device)
            times[keep].append(time.perf_counter() - t0)
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


ERC_VARIANT = {"cegppo_entropy_ratio_clip": [0.95, 1.05]}  # the authors' released band


def erc_reference_loss(logps, old_logps, entropies, old_entropies, advantages, mask, trainer, band):
    """Eq. 8 (the trainer's clip range and betas, no dual clip) with entropy-ratio clipping written out: tokens whose
    `(H + 1e-8) / (H_old + 1e-8)` leaves the open band keep the value and lose the gradient; token mean over `mask`."""
    low, high = band
    p = trainer.clip_params
    r = torch.exp(logps.float() - old_logps.float())
    r_over_sg = r / r.detach()
    a = advantages.float().unsqueeze(1).expand_as(r)
    beta1_set = (r < 1 - p.epsilon_low) & (a < 0)
    beta2_set = (r > 1 + p.epsilon_high) & (a > 0)
    l_t = torch.where(
        beta1_set,
        p.beta1 * (1 - p.epsilon_low) * r_over_sg * a,
        torch.where(beta2_set, p.beta2 * (1 + p.epsilon_high) * r_over_sg * a, r * a),
    )
    rho = (entropies.float() + 1e-8) / (old_entropies.float() + 1e-8)
    keep = (rho > low) & (rho < high)
    l_t = torch.where(keep, l_t, l_t.detach())
    mask = mask.float()
    return -(l_t * mask).sum() / mask.sum(), (~keep).float().mul(mask).sum() / mask.sum()


def _grads(params):
    return [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            for p in params]  # fmt: skip


def _relative_error(grads, reference) -> float:
    diff = sum(float(((g - r) ** 2).sum()) for g, r in zip(grads, reference))
    return (diff / max(sum(float((r * r).sum()) for r in reference), 1e-30)) ** 0.5


def erc_gradient_check(trainers, model, params, batch, band=None) -> tuple[bool, str]:
    """The ERC trainer's gradient (all parameters) against `erc_reference_loss` on the same batch; the ERC-off
    trainer's gradient as a control that must not match. `band`: the reference's (default: the ERC trainer's own;
    another one must fail). Returns (passed, text)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    erc = trainers["erc"]
    model.zero_grad(set_to_none=True)
    logps, entropies, _ = erc._get_per_token_logps_and_entropies(
        model, ids, attn, batch["completion_ids"].size(1), compute_entropy=True
    )
    ref_loss, outside = erc_reference_loss(
        logps, batch["old_per_token_logps"], entropies, batch["cegppo_old_entropies"], batch["advantages"],
        batch["completion_mask"], erc, band or erc.args.cegppo_entropy_ratio_clip,
    )  # fmt: skip
    ref_loss.backward()
    reference = _grads(params)
    found = {}
    for name in ("erc", "base"):
        model.zero_grad(set_to_none=True)
        loss = trainers[name]._compute_loss(model, batch)
        loss.backward()
        found[name] = (float(loss), _relative_error(_grads(params), reference))
    model.zero_grad(set_to_none=True)
    loss_err = abs(found["erc"][0] - float(ref_loss)) / max(abs(float(ref_loss)), 1e-3)
    rel, control = found["erc"][1], found["base"][1]
    ok = loss_err <= 2e-2 and rel <= 5e-2 and float(outside) > 0 and control > 10 * max(rel, 1e-3)
    text = (
        f"ERC {'PASS' if ok else 'FAIL'}: outside_band={float(outside):.3f} loss_rel_err={loss_err:.2e} "
        f"grad_rel_err={rel:.2e} | control ERC off vs reference: grad_rel_err={control:.2e} (must be >> the trainer's)"
    )
    return ok, text


def erc_part(bs, shape, layers, device, dtype, completion_len, batch_size, repeats) -> bool:
    """One `RESULT erc:` line (ERC on / off: loss + backward, step and memory ratios, the old pass with entropies
    kept / dropped) and one `ERC` line (the gradient check), at the first loss case's shape. True when it passed."""
    model = bs.build_model(shape, layers, device, dtype)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-8, fused=device.type == "cuda")
    trainers = bs.make_trainers(model, device, completion_len, {"base": {}, "erc": ERC_VARIANT})
    batch = bs.make_batch(trainers["grpo"], shape["vocab_size"], batch_size, completion_len, device)
    results = bs.compare(trainers, batch, optimizer, device, repeats, warmup=1)
    rows = [dict(r, T=completion_len, B=batch_size, variant=v) for v, r in results.items()]
    erc = erc_vs_base(rows, completion_len, batch_size)
    erc["old_pass"] = old_pass_cost(trainers["erc"], batch, device, repeats)
    trainers["erc"]._device_metrics.flush("train", trainers["erc"]._metrics["train"])
    metrics = trainers["erc"]._metrics["train"]
    out_frac = metrics["cegppo/erc_low_frac"][-1] + metrics["cegppo/erc_high_frac"][-1]
    old = erc["old_pass"]
    print(
        f"RESULT erc: dtype={dtype} T={completion_len} B={batch_size} band=0.95,1.05 out_frac={out_frac:.3f} | "
        f"lb_ratio={erc['lb_ratio']:.3f} step_ratio={erc['step_ratio']:.3f} mem_ratio={erc['mem_ratio']:.3f} "
        f"extra_ms={erc['extra_ms']:.2f} extra_mib={erc['extra_mib']:.1f} (ERC on / off) | "
        f"old_pass_time_ratio={old['time_ratio']:.3f} old_pass_mem_ratio={old['mem_ratio']:.3f} "
        f"old_pass_extra_mib={old['on_mib'] - old['off_mib']:.2f} (entropies kept / dropped)",
        flush=True,
    )
    small = bs.make_batch(trainers["grpo"], shape["vocab_size"], 4, min(512, completion_len), device, seed=1)
    ok, text = erc_gradient_check(trainers, model, params, small)
    print(text, flush=True)
    del trainers, optimizer, batch, small, model, params
    return ok
