"""Type aliases the package shares (standard library only, so any layer may import them).

Example:
    >>> from torsh_jax.typing import PyTree
    >>> def leaves(tree: PyTree) -> int: ...
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["PyTree"]

#: A nested structure of arrays (dicts, lists, tuples, NamedTuples, dataclasses registered with
#: JAX) as ``jax.tree`` reads it; ``Any`` because JAX's pytrees have no static type.
PyTree: TypeAlias = Any
