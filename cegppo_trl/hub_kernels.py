"""Hub kernels on a machine without the Hub: one line with the fix instead of a traceback from inside `kernels`.

transformers >= 5.25 loads kernels from the Hub by default on CUDA (`use_kernels=None` means on, unless the environment
variable `USE_HUB_KERNELS` is 0 / no / false / off). On a GPU machine without Hub access, with the kernel not in the
local cache, `from_pretrained` raises `ValueError: Version 2 of 'kernels-community/rotary' is not available in the
local cache and Hugging Face Hub is in offline mode` about 20 frames down. CPU runs never load Hub kernels.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator


# The message of `kernels` (0.19) when a kernel version is neither cached nor downloadable.
_NOT_CACHED = re.compile(r"Version \S+ of '(?P<kernel>[^']+)' is not available in the local cache")


class HubKernelUnavailableError(RuntimeError):
    """A Hub kernel that transformers wants to load is not cached and the Hub cannot be reached."""


def uncached_hub_kernel(error: BaseException) -> str | None:
    """The Hub id of the kernel that `error` (or an exception it was raised from) says is missing, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        match = _NOT_CACHED.search(str(error))
        if match:
            return match["kernel"]
        error = error.__cause__ or error.__context__
    return None


def uncached_hub_kernel_message(kernel: str, flag_fix: str = "use_kernels: false in model_init_kwargs") -> str:
    """One line: which kernel is missing and the two ways to load the model without Hub kernels."""
    return (
        f"transformers tried to load the Hub kernel '{kernel}', which is not in the local cache, and the Hub cannot "
        f"be reached. Set USE_HUB_KERNELS=0 in the environment (or {flag_fix}) to load the model without Hub "
        "kernels, or run once with Hub access to cache the kernel."
    )


@contextlib.contextmanager
def explain_uncached_hub_kernels(flag_fix: str = "use_kernels: false in model_init_kwargs") -> Iterator[None]:
    """Turn the `kernels` error for an uncached kernel into `HubKernelUnavailableError` with the fix; others pass."""
    try:
        yield
    except ValueError as error:
        kernel = uncached_hub_kernel(error)
        if kernel is None:
            raise
        raise HubKernelUnavailableError(uncached_hub_kernel_message(kernel, flag_fix)) from None
