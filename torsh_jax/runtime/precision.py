"""Dtype casts of a precision policy.

Example:
    >>> import jax.numpy as jnp
    >>> cast_tree({"w": jnp.ones(2)}, "bfloat16")["w"].dtype
    dtype(bfloat16)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["cast_tree", "dtype_of"]


def dtype_of(name: str) -> jnp.dtype:
    """``jnp.dtype`` for a plan dtype name (``float32``, ``bfloat16``, ``float16``)."""
    return jnp.dtype(name)


def cast_tree(tree: Any, dtype: str | jnp.dtype) -> Any:
    """Cast every floating leaf of ``tree`` to ``dtype``; other leaves unchanged."""
    target = jnp.dtype(dtype)

    def cast(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != target:
            return x.astype(target)
        return x

    return jax.tree.map(cast, tree)
