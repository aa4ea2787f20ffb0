"""Scaling curve: CE-GPPO vs TRL's GRPO (dapo) side by side on Qwen2-1.5B shapes with few layers, random init.

    python benchmarks/bench_scaling.py                       # the default point set (~20 min on 2 CPU cores)
    python benchmarks/bench_scaling.py --points 256x1 1024x2 --variants base sft
    python benchmarks/bench_scaling.py --tiny --points 32x2  # seconds: tiny shapes, same code (tests use this)

Per point and variant (`VARIANTS`, each against the same plain GRPO): CE-GPPO / GRPO ratios `lb` (loss + backward),
`step` (+ AdamW) and `mem` (peak), extra ms and MiB; `erc/base` lines; CE-GPPO's own cost; with `--plot` the figure.
docs/scaling.md describes the method and quotes the figures. Goal: every ratio <= 1.01.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as bs  # noqa: E402


warnings.filterwarnings("ignore")

VARIANTS = {
    "base": {},
    "sft": {"cegppo_sft_coef": 0.1},
    "entropy": {"cegppo_entropy_target": 0.5},
    "erc": {"cegppo_entropy_ratio_clip": [0.95, 1.05]},
}
# Default point set: (completion_len, batch). Chosen to fit ~20 min on 2 shared CPU cores (see docs/scaling.md).
DEFAULT_POINTS = ["256x1", "256x2", "1024x1"]
DEFAULT_VARIANT_POINTS = ["256x1"]  # where sft / entropy also run


def overhead_only(points, variants, repeats=5):
    """CE-GPPO's own per-micro-batch cost at each point, without the noise of a full-vocabulary step: the time of
    `CEGPPOTrainer._cegppo_loss_delta` (correction + aggregation + SFT term + all `cegppo/` metrics + controller; it
    only touches (B, T) tensors, so it does not depend on hidden size, layers or vocabulary: a tiny model gives the
    same number) and the backward of the correction alone (`core.gradient_preserving_correction` on a (B, T) leaf)."""
    from cegppo_trl.core import ClipParams, gradient_preserving_correction

    device = torch.device("cpu")
    model = bs.build_model(bs.TINY, 1, device)
    tokenizer, dataset = bs.build_tokenizer(), bs.make_dataset()
    rows = []
    for t_len, b in points:
        trainers = bs.make_trainers(model, device, t_len, {v: VARIANTS[v] for v in variants}, tokenizer, dataset)
        batch = bs.make_batch(trainers["grpo"], bs.TINY["vocab_size"], b, t_len, device)
        row = {"T": t_len, "B": b}
        for v in variants:
            timer = bs.DeltaTimer(trainers[v], device)
            for _ in range(repeats + 1):
                model.zero_grad(set_to_none=True)
                bs.loss_backward(trainers[v], batch)
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
        deltas = " ".join(f"{v}={row[f'delta_ms_{v}']:7.2f}" for v in variants)
        print(f"{t_len:>5} {b:>2} {t_len * b:>6} {deltas}  correction backward={row['corr_bwd_ms']:6.2f}", flush=True)
    return rows


def parse_point(text: str) -> tuple[int, int]:
    t, b = text.lower().split("x")
    return int(t), int(b)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--points", nargs="*", default=DEFAULT_POINTS, help="completion_len x batch, e.g. 1024x2 (none: overhead only)"
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    default = " ".join(DEFAULT_VARIANT_POINTS)
    p.add_argument(
        "--variant-points", nargs="+", help=f"where non-base variants run (default {default}; --points: all)"
    )
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per point (default: by size)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (hidden 64, vocab 1024): a smoke run")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    overhead = ["256x1", "256x2", "1024x1", "1024x4", "2048x1", "4096x1", "4096x2"]  # cheap: covers the long points
    p.add_argument("--overhead-points", nargs="*", default=overhead, help="where CE-GPPO's own cost is timed (tiny)")
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
            plot(saved["results"], args.plot, saved.get("overhead"))
        return saved["results"]
    device = torch.device("cpu")
    shape = bs.TINY if args.tiny else bs.QWEN2_1_5B
    points = [parse_point(p) for p in args.points]
    chosen = args.variant_points or (args.points if args.points != DEFAULT_POINTS else DEFAULT_VARIANT_POINTS)
    variant_points = {parse_point(p) for p in chosen}

    model = bs.build_model(shape, args.layers, device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-8)  # one optimizer, shared: same cost for both
    tokenizer, dataset = bs.build_tokenizer(), bs.make_dataset()
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
            trainers_by_len[t_len] = bs.make_trainers(
                model, device, t_len, {v: VARIANTS[v] for v in args.variants}, tokenizer, dataset
            )
        trainers = {n: t for n, t in trainers_by_len[t_len].items() if n == "grpo" or n in variants}
        batch = bs.make_batch(trainers["grpo"], shape["vocab_size"], b, t_len, device)
        repeats = args.repeats or default_repeats(t_len * b)
        for variant, r in bs.compare(trainers, batch, optimizer, device, repeats).items():
            r.update(T=t_len, B=b, variant=variant, repeats=repeats)
            results.append(r)
            print(format_row(r), flush=True)
        erc = bs.erc_vs_base(results, t_len, b)
        if erc is not None:
            erc["old_pass"] = bs.old_pass_cost(trainers["erc"], batch, device, repeats)
            erc_rows.append(dict(erc, T=t_len, B=b))
            print(bs.format_erc(erc, t_len, b), flush=True)
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
        saved = {"params": n_params, "layers": args.layers, "results": results, "erc": erc_rows, "overhead": overhead}
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
    if args.plot:
        plot(results, args.plot, overhead)
    return results


def plot(results, path, overhead=None):
    """Ratio vs tokens per micro-batch, one panel per measure, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=False)
    titles = ("loss + backward time", "training step time (+AdamW)", "loss + backward peak memory")
    for ax, key, title in zip(axes, ("lb_ratio", "step_ratio", "mem_ratio"), titles):
        for variant, marker in zip(VARIANTS, "osDv"):
            rows = sorted((r for r in results if r["variant"] == variant), key=lambda r: (r["T"] * r["B"], r["B"]))
            if not rows:
                continue
            points = [(r["T"] * r["B"], r[key]) for r in rows]
            style = dict(marker=marker, linestyle="-" if variant == "base" else "none", label=f"CE-GPPO {variant}")
            ax.plot(*zip(*points), **style)
            for r, point in zip(rows, points):
                ax.annotate(f"B={r['B']}", point, fontsize=7, xytext=(3, 3), textcoords="offset points")
        if key == "lb_ratio" and overhead:
            # Bound from CE-GPPO's own cost over a GRPO step, extrapolated linearly in tokens from the largest base
            # point measured.
            ref = max((r for r in results if r["variant"] == "base"), key=lambda r: r["T"] * r["B"], default=None)
            pts = []
            for o in overhead if ref else []:
                grpo_ms = ref["grpo_lb_ms"] * (o["T"] * o["B"]) / (ref["T"] * ref["B"])
                pts.append((o["T"] * o["B"], 1 + (o["delta_ms_base"] + o["corr_bwd_ms"]) / grpo_ms))
            if pts:
                ax.plot(*zip(*sorted(pts)), "k--", lw=1, label="bound from CE-GPPO's own cost")
        ax.axhline(1.01, color="red", lw=0.8, ls=":", label="goal 1.01")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion tokens per micro-batch (B x T)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("CE-GPPO / GRPO")
    axes[0].legend(fontsize=7)
    fig.suptitle("CE-GPPO vs GRPO (dapo), Qwen2-1.5B shape (1 layer, vocab 151,936), CPU, fp32", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
