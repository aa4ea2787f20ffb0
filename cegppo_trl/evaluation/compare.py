"""What makes two evaluation reports comparable, written into every report and checked by ``cegppo-eval --compare``.

A figure depends on how the samples were graded (the protocol, and the math-verify and latex2sympy2_extended
versions: math-verify 0.8 and 0.9 grade percentages differently) and how they were drawn (temperature, top_p, top_k,
the token budget, the prompt). Reports that differ in any of these are compared with a warning naming the difference;
the seed and the backend change which samples are drawn, not their distribution, and are shown, not warned about.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version
from typing import Any


GRADING_PACKAGES = ("math-verify", "latex2sympy2_extended")
SAMPLING = ("temperature", "top_p", "top_k", "max_new_tokens", "k", "seed", "backend")
# Differences that change the distribution of the samples (warned about); the rest of SAMPLING only changes the draw.
_DISTRIBUTION = ("temperature", "top_p", "top_k", "max_new_tokens")
_PROMPT = ("instruction", "system_prompt")


def grading_and_sampling(settings) -> dict[str, Any]:
    """The report's ``protocol``, ``math_verify`` (the versions of math-verify and latex2sympy2_extended that graded
    it) and ``sampling`` (temperature, top_p, top_k, max_new_tokens, k (``--k``; a set's own ``@K`` is in its
    entry), seed, backend) of resolved `EvalSettings`."""
    return {
        "protocol": settings.protocol,
        "math_verify": {package: version(package) for package in GRADING_PACKAGES},
        "sampling": {name: getattr(settings, name) for name in SAMPLING},
    }


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """A report written by ``cegppo-eval``; OSError / ValueError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"--compare {path}: not a JSON report ({error}).") from None
    except OSError as error:
        raise OSError(
            f"--compare {path}: {error.strerror}; pass two reports written by cegppo-eval --output."
        ) from None
    if not isinstance(report, dict) or not isinstance(report.get("datasets"), dict):
        raise ValueError(f"--compare {path}: no 'datasets' entry; pass a report written by cegppo-eval --output.")
    return report


def _minor(text: str | None) -> str | None:
    return None if text is None else ".".join(text.split(".")[:2])


def _differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(warnings: differences that make the figures not comparable, notes: differences in the draw only)."""
    warnings, notes = [], []
    protocol_a, protocol_b = a.get("protocol", "not recorded"), b.get("protocol", "not recorded")
    if protocol_a != protocol_b:
        warnings.append(f"graded by different protocols: A {protocol_a}, B {protocol_b}")
    for package in GRADING_PACKAGES:
        version_a, version_b = (r.get("math_verify", {}).get(package, "not recorded") for r in (a, b))
        if _minor(version_a) != _minor(version_b):
            warnings.append(f"graded with {package} {version_a} (A) and {version_b} (B)")
    sampling_a, sampling_b = a.get("sampling", {}), b.get("sampling", {})
    settings_a, settings_b = a.get("settings", {}), b.get("settings", {})
    for name in _DISTRIBUTION:
        if sampling_a.get(name) != sampling_b.get(name):
            warnings.append(f"sampled with {name} {sampling_a.get(name)} (A) and {sampling_b.get(name)} (B)")
    for name in _PROMPT:
        if settings_a.get(name) != settings_b.get(name):
            warnings.append(f"prompted with {name} {settings_a.get(name)!r} (A) and {settings_b.get(name)!r} (B)")
    for name in ("seed", "backend"):
        if sampling_a.get(name) != sampling_b.get(name):
            notes.append(f"{name} {sampling_a.get(name)} (A) and {sampling_b.get(name)} (B): other samples, same law")
    return warnings, notes


def _figure(metrics: dict[str, Any] | None) -> str:
    if metrics is None:
        return "-"
    k = metrics["k"]
    return f"avg@{k} {100 * metrics[f'avg@{k}']:.1f}%"


def compare_reports(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> list[str]:
    """Lines for the reader: each set's avg@k in both reports, then one ``warning:`` line per difference that makes
    the two not comparable (protocol, math-verify or latex2sympy2_extended minor version, sampling, prompt) and one
    ``note:`` line per difference in the draw only (seed, backend)."""
    sets = list(dict.fromkeys([*a["datasets"], *b["datasets"]]))
    width = max([len(name) for name in sets] + [3])
    lines = [f"A = {names[0]}", f"B = {names[1]}", f"{'set':<{width}}  {'A':>16}  {'B':>16}"]
    for name in sets:
        lines.append(
            f"{name:<{width}}  {_figure(a['datasets'].get(name)):>16}  {_figure(b['datasets'].get(name)):>16}"
        )
    warnings, notes = _differences(a, b)
    lines += [f"warning: {text}; the figures are not comparable." for text in warnings]
    lines += [f"note: {text}" for text in notes]
    return lines
