"""The GPU check as one command: on one CUDA GPU (target: one H200, bf16), in about 6 minutes, CE-GPPO's cost next
to TRL's GRPO at real shapes, Eq. 8 exactness, entropy-ratio clipping, host syncs, and the DeepSeek recipes launched
as a user launches them, then `cegppo-eval` on their outputs.

    python benchmarks/gpu_check            # one CUDA GPU; refuses (exit 2) without one
    python benchmarks/gpu_check --smoke    # every part on CPU at tiny shapes (tests/test_gpu_check.py runs it)

Parts (`--parts`, default all), each printing its lines as it finishes: `loss` (`RESULT <case>:` per case, then
`EQ8`), `erc` (`RESULT erc:`, `ERC`), `sync` (`RESULT sync:`), `lora` and `paper` (`RECIPE
<name>:`, `EVAL <name>:`, gpu_check/recipes.py), `compare` (`COMPARE:`: `cegppo-compare` of GRPO and CE-GPPO on the LoRA
recipe through the accelerate launcher, measured by `cegppo-eval`). docs/scaling.md ("GPU check") says what each line's fields are. Ends
with `GPU_CHECK DONE ok: ...`; exit status 0 only if every part ran and passed (EQ8 PASS, ERC PASS, every recipe
trained every step and saved, every evaluation read its model), 1 otherwise, 2 when there is no GPU (refused).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness

import harness as bs  # noqa: E402
import torch  # noqa: E402

from . import recipes as rc  # noqa: E402


REFUSAL = (
    "gpu_check: REFUSED: no CUDA GPU is visible (torch.cuda.is_available() is False, torch {version}). This check "
    "needs one NVIDIA GPU (target: one H200, bf16). Use `--smoke` to run the same code on CPU at tiny shapes."
)
# (name, shape, layers, LoRA?) -- the real models' depth: both Qwen2-1.5B and Qwen2-7B have 28 layers.
FULL_CASES = [("qwen2-1.5b", bs.QWEN2_1_5B, 28, False), ("qwen2-1.5b-lora", bs.QWEN2_1_5B, 28, True)]
FULL_CASES.append(("qwen2-7b", bs.QWEN2_7B, 28, False))
SMOKE_CASES = [(name, bs.TINY, 2, lora) for name, _, _, lora in FULL_CASES]
LORA = dict(r=32, lora_alpha=64, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
ERC_VARIANT = {"cegppo_entropy_ratio_clip": [0.95, 1.05]}  # the authors' released band
# The sync part's CE-GPPO variants next to GRPO: the paper's loss, with the entropy controller, with the SFT term.
SYNC_VARIANTS = {
    "cegppo": {},
    "cegppo_entropy": {"cegppo_entropy_target": 0.5},
    "cegppo_sft": {"cegppo_sft_coef": 0.1},
}
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
PARTS = ("loss", "erc", "sync", "lora", "paper", "compare")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, same code path")
    p.add_argument("--force-no-cuda", action="store_true", help="behave as if no GPU were present (tests)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    p.add_argument("--cases", nargs="+", help="loss cases, a subset of: " + " ".join(c[0] for c in FULL_CASES))
    p.add_argument("--completion-len", type=int, help="loss benchmark tokens (default 4096; smoke: 32)")
    p.add_argument("--batch", type=int, help="completions per micro-batch (default 1; smoke: 2)")
    p.add_argument("--repeats", type=int, help="interleaved rounds per case (default 5; smoke: 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--deadline-s", type=float, help="skip the loss cases left after this many seconds (GPU: 150)")
    p.add_argument("--workdir", help="recipe runs' model, outputs, logs, reports (kept; default: a temp folder)")
    p.add_argument("--recipe-completion-len", type=int, help="recipes' max_completion_length (default 256; smoke: 16)")
    p.add_argument("--generation", default="auto", choices=rc.GENERATION, help="recipes' generation: auto = vLLM "
                   "(the recipes' setting) where installed, else HF generate; continuous_batching = TRL's "
                   "use_transformers_continuous_batching")  # fmt: skip
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply the recipe and eval time limits")
    return p.parse_args(argv)


def eq8_check(trainers, model, shape, device, batch_size, completion_len):
    """Trainer loss and gradient vs the Eq. 8 reference on the same batch; GRPO's gradient as a negative control."""
    batch = bs.make_batch(trainers["grpo"], shape["vocab_size"], batch_size, completion_len, device, seed=1)
    batch["advantages"][batch_size // 2 :] = -batch["advantages"][batch_size // 2 :].abs()
    batch["advantages"][: batch_size // 2] = batch["advantages"][: batch_size // 2].abs()
    params = [p for p in model.parameters() if p.requires_grad]
    c = bs.reference_gradient_check(trainers, model, params, batch, "cegppo", "grpo")  # the betas in force
    ok = c["loss_err"] <= 2e-2 and c["cos"] >= 0.999 and c["rel"] <= 5e-2
    ok = ok and c["control_rel"] > 10 * max(c["rel"], 1e-3)
    print(
        f"EQ8 {'PASS' if ok else 'FAIL'}: dtype={next(model.parameters()).dtype} B={batch_size} T={completion_len} "
        f"clipped={c['marked']:.3f} loss={c['loss']:.6f} ref={c['ref']:.6f} loss_rel_err={c['loss_err']:.2e} "
        f"grad_cos={c['cos']:.6f} grad_rel_err={c['rel']:.2e} | control GRPO vs Eq.8: grad_cos={c['control_cos']:.4f} "
        f"grad_rel_err={c['control_rel']:.2e} (must be >> the trainer's)",
        flush=True,
    )
    return ok


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


def loss_sizes(args) -> tuple[int, int, int]:
    """The loss and erc parts' completion length, batch and interleaved rounds."""
    if args.smoke:
        return args.completion_len or 32, args.batch or 2, args.repeats or 1
    return args.completion_len or 4096, args.batch or 1, args.repeats or 5


def checkpointed_setup(shape, layers, device, dtype, completion_len, batch_size, variants=None, lora=False):
    """A random-init model with gradient checkpointing (and LoRA), its AdamW, the trainers and an off-policy batch."""
    model = bs.build_model(shape, layers, device, dtype)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-8, fused=device.type == "cuda")
    trainers = bs.make_trainers(model, device, completion_len, variants)
    batch = bs.make_batch(trainers["grpo"], shape["vocab_size"], batch_size, completion_len, device)
    return model, params, optimizer, trainers, batch


def run_case(name, shape, layers, lora, device, dtype, completion_len, batch_size, repeats, do_eq8):
    model, params, optimizer, trainers, batch = checkpointed_setup(
        shape, layers, device, dtype, completion_len, batch_size, lora=lora
    )
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in params)
    timer = bs.DeltaTimer(trainers["cegppo"], device)
    n_tokens = int(batch["completion_mask"].sum())

    r = bs.compare(trainers, batch, optimizer, device, repeats, warmup=1)["cegppo"]
    delta_ms = timer.median_ms()
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    tok_per_s = n_tokens / (r["cegppo_step_ms"] / 1e3)
    print(  # diff_frac, unlike delta_frac, also counts the correction's backward
        f"RESULT {name}: params={n_params / 1e9:.2f}B trainable={n_train / 1e6:.1f}M dtype={dtype} "
        f"T={completion_len} B={batch_size} grad_ckpt=1 clipped={r['clipped_frac']:.3f} | "
        f"step_ratio={r['step_ratio']:.3f} lb_ratio={r['lb_ratio']:.3f} mem_ratio={r['mem_ratio']:.3f} | "
        f"grpo_step_ms={r['grpo_step_ms']:.1f} cegppo_step_ms={r['cegppo_step_ms']:.1f} extra_ms={r['extra_ms']:.2f} "
        f"extra_mib={r['extra_mib']:.1f} lb_peak_mib={r['cegppo_mem_mib']:.0f} peak_gib={peak_gib:.1f} | "
        f"tok_per_s={tok_per_s:.0f} delta_ms={delta_ms:.2f} delta_frac={delta_ms / r['cegppo_step_ms']:.4f} "
        f"diff_frac={(r['cegppo_step_ms'] - r['grpo_step_ms']) / r['cegppo_step_ms']:.4f}",
        flush=True,
    )
    ok = True
    if do_eq8:
        ok = eq8_check(trainers, model, shape, device, batch_size=4, completion_len=min(512, completion_len))
    del trainers, optimizer, batch, model, params
    free_device_memory(device)
    return ok


def free_device_memory(device):
    """Release what the last part held, so that the next one (or a launched run) has the device to itself."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def versions_line(args, device) -> str | None:
    """The `GPU_CHECK start:` line (packages and settings), or None with a message when a package is missing."""
    packages = ("transformers", "trl", "peft", "datasets", "cegppo_trl")
    try:
        versions = " ".join(f"{name}={importlib.import_module(name).__version__}" for name in packages)
    except ImportError as e:  # pragma: no cover - depends on the machine
        print(
            f"gpu_check: missing package ({e}). Bring the wheels listed in docs/scaling.md "
            "('Running the check on an offline GPU machine') and put their --target folder on PYTHONPATH.",
            file=sys.stderr,
        )
        return None
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)"
    settings = f"dtype={args.dtype} parts={','.join(args.parts)}"
    return f"GPU_CHECK start: device={gpu} torch={torch.__version__} {versions} {settings}"


def loss_part(args, device, dtype, start) -> tuple[bool, int, int]:
    """The loss benchmark at real shapes (one RESULT line per case) with EQ8 on the first: (ok, cases run, cases)."""
    completion_len, batch_size, repeats = loss_sizes(args)
    cases = SMOKE_CASES if args.smoke else FULL_CASES
    if args.cases:
        cases = [c for c in cases if c[0] in args.cases]
    deadline = args.deadline_s if args.deadline_s is not None else (float("inf") if args.smoke else 150.0)
    print(f"# loss benchmark: T={completion_len} B={batch_size} repeats={repeats}", flush=True)
    ok, ran = True, 0
    for i, (name, shape, layers, lora) in enumerate(cases):
        elapsed = time.perf_counter() - start
        if elapsed > deadline:
            print(f"SKIPPED {name}: {elapsed:.0f} s elapsed > --deadline-s {deadline:.0f}", flush=True)
            ok = False
            continue
        case_ok = run_case(name, shape, layers, lora, device, dtype, completion_len, batch_size, repeats, i == 0)
        ok, ran = ok and case_ok, ran + 1
        print(f"# {name} done at {time.perf_counter() - start:.0f} s", flush=True)
    return ok, ran, len(cases)


def erc_part(args, device, dtype) -> bool:
    """Entropy-ratio clipping at the first loss case's shape: one `RESULT erc:` line (ERC on / off: loss + backward,
    step and memory ratios, the old pass with entropies kept / dropped) and one `ERC` line (the gradient check)."""
    _, shape, layers, _ = (SMOKE_CASES if args.smoke else FULL_CASES)[0]
    completion_len, batch_size, repeats = loss_sizes(args)
    model, params, optimizer, trainers, batch = checkpointed_setup(
        shape, layers, device, dtype, completion_len, batch_size, {"base": {}, "erc": ERC_VARIANT}
    )
    results = bs.compare(trainers, batch, optimizer, device, repeats, warmup=1)
    rows = [dict(r, T=completion_len, B=batch_size, variant=v) for v, r in results.items()]
    erc = bs.erc_vs_base(rows, completion_len, batch_size)
    old = bs.old_pass_cost(trainers["erc"], batch, device, repeats)
    trainers["erc"]._device_metrics.flush("train", trainers["erc"]._metrics["train"])
    metrics = trainers["erc"]._metrics["train"]
    out_frac = metrics["cegppo/erc_low_frac"][-1] + metrics["cegppo/erc_high_frac"][-1]
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


def recipes_part(args) -> tuple[bool, str]:
    """The LoRA and paper recipes end to end, then `cegppo-eval` on each output: (ok, summary)."""
    names = [name for name in ("lora", "paper") if name in args.parts]
    sizes = rc.Sizes.for_mode(args.smoke, args.recipe_completion_len, args.timeout_scale)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    compared = None
    try:
        trained, evaluated = rc.run_recipes(names, workdir, sizes, args.generation)
        if "compare" in args.parts:
            model_dir = workdir / ("tiny-random" if sizes.smoke else "r1-distill-1.5b-shape-random")
            compared = rc.run_compare(model_dir, workdir, sizes, rc.generation_backend(sizes.smoke, args.generation))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    ok = trained == evaluated == len(names) and compared is not False
    text = f"recipes {trained}/{len(names)}, evals {evaluated}/{len(names)}"
    return ok, text + ("" if compared is None else f", compare {'ok' if compared else 'FAILED'}")


# The sync part: how many synchronizing calls one micro-batch's loss + backward makes, CE-GPPO next to TRL's GRPO
# (dapo), on the same model and batch. On CUDA, every call that makes the host wait, via
# `torch.cuda.set_sync_debug_mode("warn")` (the method of the 2026-12-04 H200 run). On CPU nothing waits, so `--smoke`
# counts the Python-level host reads that would be syncs on a GPU (`HOST_READS`): the same code path and comparison,
# not the same totals (reads inside torch's C++ are not seen). Each call is counted on the second loss + backward.


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
    Trainer takes before `optimizer.step()` (`_get_grad_norm`: the divergence guard's step check), by location."""
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


def sync_part(device, dtype, smoke: bool) -> bool:
    """Build the model and trainers, count per variant, print one `RESULT sync:` line (and where the extra ones are)."""
    shape = bs.TINY if smoke else bs.QWEN2_1_5B
    completion_len = 32 if smoke else 1024
    model = bs.build_model(shape, 2, device, dtype)
    trainers = bs.make_trainers(model, device, completion_len, variants=SYNC_VARIANTS)
    batch = bs.make_batch(trainers["grpo"], shape["vocab_size"], 2, completion_len, device)
    counts = {name: count_syncs(trainer, model, batch, device) for name, trainer in trainers.items()}
    total = {name: sum(found.values()) for name, found in counts.items()}
    method = "cuda_sync_debug" if device.type == "cuda" else "python_host_reads (CPU: no device syncs)"
    parts = [f"grpo={total['grpo']}", *(f"{n}={total[n]} ({total[n] - total['grpo']:+d})" for n in SYNC_VARIANTS)]
    ok = total["grpo"] > 0 and all(total[name] >= total["grpo"] for name in SYNC_VARIANTS)
    print(
        f"RESULT sync: {'ok' if ok else 'FAILED'} per step of one micro-batch (loss+backward+grad norm): "
        f"{' '.join(parts)} | method={method} T={completion_len} B=2 layers=2 dtype={dtype}",
        flush=True,
    )
    for name in SYNC_VARIANTS:
        print(f"# sync {name} beyond grpo at: {dict(counts[name] - counts['grpo']) or 'nowhere'}", flush=True)
    del trainers, model, batch
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and (args.force_no_cuda or not torch.cuda.is_available()):
        print(REFUSAL.format(version=torch.__version__), file=sys.stderr, flush=True)
        return 2
    unknown = set(args.cases or ()) - {c[0] for c in FULL_CASES}
    if unknown:
        print(f"gpu_check: unknown case(s) {sorted(unknown)}; known: {[c[0] for c in FULL_CASES]}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    header = versions_line(args, device)
    if header is None:
        return 3
    print(header, flush=True)
    ok, summary = True, []
    if "loss" in args.parts:
        loss_ok, ran, total = loss_part(args, device, dtype, start)
        ok = ok and loss_ok
        summary.append(f"loss {ran}/{total} case(s)")
    if "erc" in args.parts:
        erc_ok = erc_part(args, device, dtype)
        ok = ok and erc_ok
        summary.append(f"erc {'PASS' if erc_ok else 'FAIL'}")
        free_device_memory(device)
    if "sync" in args.parts:
        ok = sync_part(device, dtype, args.smoke) and ok
        summary.append("sync")
        free_device_memory(device)
    if {"lora", "paper", "compare"} & set(args.parts):
        recipes_ok, text = recipes_part(args)
        ok = ok and recipes_ok
        summary.append(text)
    status = "DONE ok" if ok else "DONE with failures"
    print(f"GPU_CHECK {status}: {', '.join(summary)} in {time.perf_counter() - start:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
