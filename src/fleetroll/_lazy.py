"""Package attributes imported on first use (a module ``__getattr__``, PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, namespace: MutableMapping[str, Any], where: Mapping[str, str]
) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` that imports each name of ``where`` (name →
    module) on first use and keeps it in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # once: later lookups do not come here
        return value

    return __getattr__
