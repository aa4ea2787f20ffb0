"""The GPU check's `erc` part: entropy-ratio clipping (`cegppo_entropy_ratio_clip`) on vs off at a real shape (the
harness's interleaved rounds and old-pass cost), and the ERC trainer's gradient against `tests/oracles.py`."""

from __future__ import annotations

import harness as bs
import torch


ERC_VARIANT = {"cegppo_entropy_ratio_clip": [0.95, 1.05]}  # the authors' released band


def erc_gradient_check(trainers, model, params, batch, band=None) -> tuple[bool, str]:
    """The ERC trainer's gradient against the harness's reference with entropy-ratio clipping; the ERC-off trainer's
    gradient as a control that must not match. `band`: the reference's (default: the ERC trainer's own; another one
    must fail). Returns (passed, text)."""
    band = band or trainers["erc"].args.cegppo_entropy_ratio_clip
    c = bs.reference_gradient_check(trainers, model, params, batch, "erc", "base", band)
    ok = c["loss_err"] <= 2e-2 and c["rel"] <= 5e-2 and c["marked"] > 0 and c["control_rel"] > 10 * max(c["rel"], 1e-3)
    text = (
        f"ERC {'PASS' if ok else 'FAIL'}: outside_band={c['marked']:.3f} loss_rel_err={c['loss_err']:.2e} "
        f"grad_rel_err={c['rel']:.2e} | control ERC off vs reference: grad_rel_err={c['control_rel']:.2e} (must be >> "
        "the trainer's)"
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
    erc = bs.erc_vs_base(rows, completion_len, batch_size)
    erc["old_pass"] = bs.old_pass_cost(trainers["erc"], batch, device, repeats)
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
