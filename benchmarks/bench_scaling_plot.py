"""The figure of benchmarks/bench_scaling.py: CE-GPPO / GRPO ratios against tokens per micro-batch."""

from __future__ import annotations


def plot(results, path, variants, overhead=None):
    """Ratio vs tokens per micro-batch, one panel per measure, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=False)
    for ax, key, title in zip(
        axes,
        ("lb_ratio", "step_ratio", "mem_ratio"),
        ("loss + backward time", "training step time (+AdamW)", "loss + backward peak memory"),
    ):
        for variant, marker in zip(variants, "osDv"):
            rows = sorted((r for r in results if r["variant"] == variant), key=lambda r: (r["T"] * r["B"], r["B"]))
            if not rows:
                continue
            x = [r["T"] * r["B"] for r in rows]
            ax.plot(
                x,
                [r[key] for r in rows],
                marker=marker,
                linestyle="-" if variant == "base" else "none",
                label=f"CE-GPPO {variant}",
            )
            for r in rows:
                ax.annotate(
                    f"B={r['B']}", (r["T"] * r["B"], r[key]), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
        if key == "lb_ratio" and overhead:
            base = {(r["T"], r["B"]): r for r in results if r["variant"] == "base"}
            pts = []
            for o in overhead:
                # Bound from CE-GPPO's own cost over a GRPO step extrapolated linearly in tokens from measured points.
                ref = max(base.values(), key=lambda r: r["T"] * r["B"]) if base else None
                if ref is None:
                    continue
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
