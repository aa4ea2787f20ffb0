"""Hub kernels on a machine without the Hub: one line with the fix instead of a traceback from inside `kernels`.

transformers >= 5.25 loads kernels from the Hub by default on CUDA (unless `USE_HUB_KERNELS` is 0 / no / false / off).
Offline, with the kernel not cached, `from_pretrained` raises `ValueError: Version 2 of 'kernels-community/rotary' is
not available in the local cache and Hugging Face Hub is in offline mode` about 20 frames down. CPU runs never do.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator


# The message of `kernels` (0.19) when a kernel version is neither cached nor downloadable.
_NOT_CACHED = re.compile(r"Version \S+ of '(?P<kernel>[^']+)' is not available in the local cache")


class HubKernelUnavailableError(RuntimeError):
    """A Hub kernel that transformers wants to load is not cached and the Hub cannot be reached."""


@contextlib.contextmanager
def explain_uncached_hub_kernels(flag_fix: str = "use_kernels: false in model_init_kwargs") -> Iterator[None]:
    """Turn the `kernels` error for an uncached kernel into `HubKernelUnavailableError` with the fix; others pass."""
    try:
        yield
    except ValueError as error:
        match = _NOT_CACHED.search(str(error))
        if match is None:
            raise
        raise HubKernelUnavailableError(
            f"transformers tried to load the Hub kernel '{match['kernel']}', which is not in the local cache, and the "
            f"Hub cannot be reached. Set USE_HUB_KERNELS=0 in the environment (or {flag_fix}) to load the model "
            "without Hub kernels, or run once with Hub access to cache the kernel."
        ) from None
