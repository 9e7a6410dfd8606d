"""Dtype casts of a precision policy.

Example:
    >>> import jax.numpy as jnp
    >>> cast_tree({"w": jnp.ones(2)}, "bfloat16")["w"].dtype
    dtype(bfloat16)
    >>> state_params({"scale": jnp.asarray(2.0)}, "float32")["scale"].weak_type
    False
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["cast_tree", "dtype_of", "state_params"]


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


def state_params(tree: Any, dtype: str | jnp.dtype) -> Any:
    """Parameters as a train state holds them: :func:`cast_tree` to ``dtype``, and every leaf
    strongly typed. A jitted step returns strong leaves, so a weakly typed one in the state it is
    given (``jnp.asarray(2.0)``, a Python float's type) would trace and compile the step again on
    its second call."""

    def strong(x):
        return jax.lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x

    return jax.tree.map(strong, cast_tree(tree, dtype))
