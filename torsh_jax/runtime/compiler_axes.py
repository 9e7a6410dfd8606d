"""Mesh axes the compiler partitions: ``tensor`` for a model not written with tensor blocks.

A model written with :mod:`torsh_jax.tensor` blocks computes on local shards
and places its own tensor collectives. Any other model (flax linen or nnx,
with logical names on its parameters) computes on whole arrays: the step's
``shard_map`` is then manual over the data-parallel axes only, and XLA
partitions the model over ``tensor`` from the parameters' shardings. Our
collectives over ``data`` and ``fsdp`` run inside a nested ``shard_map``
that is manual over ``tensor`` as well, so each moves one tensor shard: left
to the compiler, the operands of an all-gather or reduce-scatter over a
manual axis are first replicated over the automatic ones (jax 0.10, seen in
the compiled HLO).

Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> without_axes(P(("fsdp", "tensor"), None), ("tensor",))
    P('fsdp', None)
    >>> only_axes(P(("fsdp", "tensor"), None), ("tensor",))
    P('tensor', None)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from torsh_jax.plan.roles import Roles
from torsh_jax.runtime.specs import entry_axes
from torsh_jax.tensor.axis import has_tensor_blocks
from torsh_jax.typing import PyTree

__all__ = ["compiler_axes", "without_axes", "only_axes", "tree_without", "tree_only", "manual_over"]

_is_spec = lambda x: isinstance(x, P)


def compiler_axes(loss: Any, roles: Roles) -> tuple[str, ...]:
    """``("tensor",)`` when the tensor axis is active and ``loss`` is not written with tensor blocks."""
    if roles.tensor_axis is None or has_tensor_blocks(loss):
        return ()
    return (roles.tensor_axis,)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def without_axes(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` with ``axes`` taken out of every entry."""
    return P(*(_entry(tuple(a for a in entry_axes(e) if a not in axes)) for e in spec))


def only_axes(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` keeping only ``axes`` in every entry."""
    return P(*(_entry(tuple(a for a in entry_axes(e) if a in axes)) for e in spec))


def tree_without(specs: PyTree, axes: tuple[str, ...]) -> PyTree:
    """:func:`without_axes` on every ``PartitionSpec`` of a pytree (unchanged when ``axes`` is empty)."""
    return specs if not axes else jax.tree.map(lambda s: without_axes(s, axes), specs, is_leaf=_is_spec)


def tree_only(specs: PyTree, axes: tuple[str, ...]) -> PyTree:
    """:func:`only_axes` on every ``PartitionSpec`` of a pytree."""
    return jax.tree.map(lambda s: only_axes(s, axes), specs, is_leaf=_is_spec)


def manual_over(fn: Callable, axes: tuple[str, ...], in_specs: Any, out_specs: Any) -> Callable:
    """``fn`` run per shard of ``axes`` too (inside the step's ``shard_map``); ``fn`` itself when none.

    ``in_specs`` / ``out_specs`` name only ``axes`` (see :func:`tree_only`).
    """
    if not axes:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes))
