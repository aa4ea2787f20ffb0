"""Names of a package loaded from their submodule on first use (PEP 562), so that light imports stay light."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, namespace: dict[str, Any], table: dict[str, str]) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package`, whose public `name` lives in submodule `table[name]`."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
