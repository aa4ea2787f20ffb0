"""benchmarks/gpu_check.py (refusal without a GPU, `--smoke` on CPU) and bench_scaling.py's smallest setting."""

import math
import os
import sys

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_scaling  # noqa: E402
import gpu_check  # noqa: E402


def test_gpu_check_refuses_without_cuda_flag(capsys):
    assert gpu_check.main(["--force-no-cuda"]) == 2
    err = capsys.readouterr().err
    assert "REFUSED" in err and "no CUDA GPU" in err and "--smoke" in err


def test_gpu_check_refuses_when_cuda_is_absent(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "REFUSED" in capsys.readouterr().err


def test_gpu_check_refusal_as_a_command():
    import subprocess

    script = os.path.join(os.path.dirname(bench_scaling.__file__), "gpu_check.py")
    proc = subprocess.run([sys.executable, script, "--force-no-cuda"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "REFUSED" in proc.stderr


def test_gpu_check_smoke_runs_every_case_and_eq8(capsys):
    rc = gpu_check.main(["--smoke", "--repeats", "1", "--completion-len", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for case in ("qwen2-1.5b", "qwen2-1.5b-lora", "qwen2-7b"):
        line = next(line for line in out.splitlines() if line.startswith(f"RESULT {case}:"))
        for field in ("step_ratio=", "lb_ratio=", "mem_ratio=", "tok_per_s=", "delta_frac=", "grad_ckpt=1"):
            assert field in line, (field, line)
    eq8 = next(line for line in out.splitlines() if line.startswith("EQ8 "))
    assert eq8.startswith("EQ8 PASS"), eq8
    assert "GPU_CHECK DONE ok: 3 case(s)" in out


def test_eq8_reference_matches_core():
    """The script's independent Eq. 8 agrees with the package's token-mean loss (values and gradients)."""
    from cegppo_trl.core import ClipParams, cegppo_per_token_loss

    gen = torch.Generator().manual_seed(0)
    logps = (-2 + torch.randn(3, 7, generator=gen)).requires_grad_()
    old = logps.detach() + 0.4 * torch.randn(3, 7, generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 7)
    mask[2, 4:] = 0
    ref, clipped = gpu_check.eq8_reference_loss(logps, old, adv, mask, 0.2, 0.28, 0.5, 1.0)
    (g_ref,) = torch.autograd.grad(ref, logps)
    core = cegppo_per_token_loss(logps - old, adv.unsqueeze(1), ClipParams(0.2, 0.28, 0.5, 1.0)).per_token_loss
    loss = (core * mask).sum() / mask.sum()
    (g_core,) = torch.autograd.grad(loss, logps)
    assert 0 < float(clipped) < 1
    torch.testing.assert_close(ref, loss)
    torch.testing.assert_close(g_ref, g_core)


def test_bench_scaling_smallest_setting(capsys):
    results = bench_scaling.main(
        [
            "--tiny",
            "--points",
            "16x2",
            "--variants",
            "base",
            "sft",
            "entropy",
            "--repeats",
            "1",
            "--overhead-points",
            "16x2",
        ]
    )
    out = capsys.readouterr().out
    assert [r["variant"] for r in results] == ["base", "sft", "entropy"]
    for r in results:
        for key in ("lb_ratio", "step_ratio", "mem_ratio", "extra_ms", "extra_mib"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["variant"], key, r[key])  # not NaN, not inf
        for key in ("lb_ratio", "step_ratio", "mem_ratio"):
            assert r[key] > 0, (r["variant"], key, r[key])  # a CE-GPPO / GRPO ratio of two positive costs
        assert r["clipped_frac"] > 0  # the batch is off-policy: CE-GPPO has clipped tokens to act on
    assert "# worst:" in out and "variant" in out
    assert "correction backward=" in out
