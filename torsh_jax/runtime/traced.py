"""A function traced once and replayed: its program is built from one trace, and its outputs' shapes
come from the same trace (``jax.eval_shape`` then a second trace for the program would run the
model's Python twice).

Example:
    >>> import jax.numpy as jnp
    >>> run, shapes = traced_once(lambda x, y: {"sum": x + y}, jnp.ones(2), jnp.ones(2))
    >>> shapes["sum"].shape, run(jnp.ones(2), jnp.full(2, 2.0))["sum"].tolist()
    ((2,), [3.0, 3.0])
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend.core import jaxpr_as_fun

from torsh_jax.typing import PyTree

__all__ = ["traced_once"]


def traced_once(fn: Callable, *example) -> tuple[Callable, PyTree]:
    """``(run, shapes)``: ``run(*args)`` computes ``fn(*args)`` for arguments of ``example``'s types
    by replaying ``fn``'s one trace; ``shapes``, ``fn``'s outputs as ``jax.ShapeDtypeStruct``."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*example)
    program, outputs = jaxpr_as_fun(closed), jax.tree.structure(shapes)
    return lambda *args: jax.tree.unflatten(outputs, program(*jax.tree.leaves(args))), shapes
