"""Lazy re-exports for package ``__init__`` modules (so importing a package does not import JAX).

Example:
    >>> getattr_, dir_ = lazy_exports("pkg", {"sqrt": "math"}, {})
    >>> getattr_("sqrt")(9.0)
    3.0
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: dict[str, str], namespace: dict
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to its module;
    a resolved name is cached in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
