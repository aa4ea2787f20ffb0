"""The GPU check's host-sync part: how many synchronizing calls one micro-batch's loss + backward makes, CE-GPPO next
to TRL's GRPO (dapo), on the same model and batch (2 layers of Qwen2-1.5B's shape, 1024 tokens; `--smoke`: tiny).

On CUDA every call that makes the host wait for the GPU is counted with `torch.cuda.set_sync_debug_mode("warn")` (the
method of the 2026-12-04 H200 run). On CPU nothing waits, so `--smoke` counts the host reads that would be syncs on a
GPU and that Python code makes (`Tensor.item`, `tolist`, `cpu`, `numpy`, `bool` / `int` / `float` of a tensor): the
same code path and the same comparison, but not the same totals (reads made inside torch's C++ are not seen there).
Each call is counted on the second loss + backward (the first warms up).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch


# CE-GPPO variants compared with GRPO: the paper's loss, with the entropy controller, with the SFT term.
SYNC_VARIANTS = {
    "cegppo": {},
    "cegppo_entropy": {"cegppo_entropy_target": 0.5},
    "cegppo_sft": {"cegppo_sft_coef": 0.1},
}
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
_THIS = str(Path(__file__).resolve())


def _where(filename: str, lineno: int) -> str:
    """A short location: the path from site-packages/ or from the package folder on."""
    for marker in ("site-packages/", "cegppo_trl/"):
        if marker in filename:
            tail = filename.split(marker)[-1]
            return f"{'' if marker == 'site-packages/' else marker}{tail}:{lineno}"
    return f"{Path(filename).name}:{lineno}"


@contextlib.contextmanager
def _cuda_syncs(found: Counter):
    """Count CUDA's synchronizing-call warnings by where they come from."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            found[_where(w.filename, w.lineno)] += 1


@contextlib.contextmanager
def _host_reads(found: Counter):
    """Count Python-level host reads of tensors (`HOST_READS`) by their caller, by wrapping those Tensor methods."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            frame = sys._getframe(1)
            found[_where(frame.f_code.co_filename, frame.f_lineno)] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in HOST_READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def count_syncs(trainer, model, batch, device) -> Counter:
    """Synchronizing calls (CUDA) or host reads (CPU) of one loss + backward of `trainer` and the gradient norm the
    Trainer takes before `optimizer.step()` (`_get_grad_norm`: CE-GPPO's step check, issue 35), by location."""
    counter = _cuda_syncs if device.type == "cuda" else _host_reads
    for _ in range(2):  # the first call warms up; count the second
        found = Counter()
        model.zero_grad(set_to_none=True)
        with counter(found):
            loss = trainer._compute_loss(model, batch)
            loss.backward()
            trainer._get_grad_norm(model)
    model.zero_grad(set_to_none=True)
    return found


def sync_part(harness, device, dtype, smoke: bool) -> bool:
    """Build the model and trainers, count per variant, print one `RESULT sync:` line (and where the extra ones are)."""
    shape = harness.TINY if smoke else harness.QWEN2_1_5B
    completion_len = 32 if smoke else 1024
    model = harness.build_model(shape, 2, device, dtype)
    trainers = harness.make_trainers(model, device, completion_len, variants=SYNC_VARIANTS)
    batch = harness.make_batch(trainers["grpo"], shape["vocab_size"], 2, completion_len, device)
    counts = {name: count_syncs(trainer, model, batch, device) for name, trainer in trainers.items()}
    base = counts["grpo"]
    total = {name: sum(found.values()) for name, found in counts.items()}
    method = "cuda_sync_debug" if device.type == "cuda" else "python_host_reads (CPU: no device syncs)"
    parts = [f"grpo={total['grpo']}"]
    for name in SYNC_VARIANTS:
        parts.append(f"{name}={total[name]} ({total[name] - total['grpo']:+d})")
    ok = total["grpo"] > 0 and all(total[name] >= total["grpo"] for name in SYNC_VARIANTS)
    print(
        f"RESULT sync: {'ok' if ok else 'FAILED'} per step of one micro-batch (loss+backward+grad norm): "
        f"{' '.join(parts)} | "
        f"method={method} T={completion_len} B=2 layers=2 dtype={dtype}",
        flush=True,
    )
    for name in SYNC_VARIANTS:
        extra = counts[name] - base
        print(f"# sync {name} beyond grpo at: {dict(extra) or 'nowhere'}", flush=True)
    del trainers, model, batch
    return ok
