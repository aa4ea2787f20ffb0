"""What the figures and reports of the library's commands share (matplotlib's headless Agg backend): a grid of
panels, their style, the saved PNG, and the machine a measurement ran on."""

from __future__ import annotations

import math
import os


def panels(count: int, ncols: int = 3, width: float = 4.3, height: float = 3.1):
    """A figure with `count` panels in rows of `ncols` (matplotlib's headless Agg backend): `(fig, axes)`."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ncols = min(ncols, count)
    fig, axes = plt.subplots(math.ceil(count / ncols), ncols, figsize=(width * ncols, height * math.ceil(count / ncols)),
                             squeeze=False)  # fmt: skip
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat)[:count]


def style_panel(ax, title: str, xlabel: str = "step") -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def save_figure(fig, path, title: str | None) -> str:
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, y=1.02, fontsize=11)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def machine_description(threads: int | None = None) -> str:
    """The CPU model, the cores this process may use, torch's version and its threads: this process's, or `threads`
    where the work ran in other processes with their own setting."""
    import torch

    threads = torch.get_num_threads() if threads is None else threads

    with open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else open(os.devnull) as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores, torch {torch.__version__} with {threads} thread{'s' * (threads != 1)}"
