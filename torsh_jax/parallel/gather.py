"""Gather-on-use for ZeRO-3: all-gather a parameter shard forward, reduce-scatter its gradient backward.

``In: W_shard[..., D/fsdp, ...] -> W[..., D, ...] (compute dtype)``;
backward: ``dW -> psum_scatter over fsdp -> psum over data -> dW_shard``.

The forward all-gather runs in the compute dtype and the backward
reduction in the reduction dtype, both chosen explicitly here rather than by
autodiff. A replicated parameter (no shard dim) passes through forward and
has its gradient all-reduced backward.

Example (inside ``shard_map`` over a mesh with an ``fsdp`` axis):
    >>> import jax.numpy as jnp
    >>> gather = make_gather(0, GatherConfig("float32", "float32", "float32", 1.0, 0.125, ("fsdp",), ()))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from torsh_jax.parallel.zero_layout import FSDP

__all__ = ["GatherConfig", "make_gather", "gather_tree", "GATHERED"]

#: Name given to gathered parameters, for remat policies.
GATHERED = "torsh_gathered_param"
PyTree = Any


class GatherConfig(NamedTuple):
    """Dtypes and reduction factors of the gather / reduce-scatter pair.

    Args:
        compute_dtype: dtype of the all-gather and of the gathered parameter.
        reduce_dtype: dtype of the gradient reduction.
        param_dtype: dtype of the returned shard gradient.
        pre, post: multipliers before and after the gradient sum.
        reduce_axes: all data-parallel axes (gradients are summed over them).
        replicated_axes: data-parallel axes the shard is replicated over
            (``data`` in HSDP); the gathered value is marked varying over them.
    """

    compute_dtype: str
    reduce_dtype: str
    param_dtype: str
    pre: float
    post: float
    reduce_axes: tuple[str, ...]
    replicated_axes: tuple[str, ...]


def _scale(x: jax.Array, factor: float) -> jax.Array:
    return x if factor == 1.0 else x * jnp.asarray(factor, x.dtype)


def make_gather(dim: int | None, config: GatherConfig) -> Callable[[jax.Array], jax.Array]:
    """The gather-on-use function for a parameter sharded along ``dim`` (``None``: replicated)."""
    other_axes = tuple(a for a in config.reduce_axes if a != FSDP or dim is None)

    def forward(shard: jax.Array) -> jax.Array:
        full = shard.astype(config.compute_dtype)
        if dim is not None:
            full = jax.lax.all_gather(full, FSDP, axis=dim, tiled=True)
        vary = config.replicated_axes if dim is not None else config.reduce_axes
        return jax.lax.pcast(full, vary, to="varying") if vary else full

    def backward(grad: jax.Array) -> jax.Array:
        grad = _scale(grad.astype(config.reduce_dtype), config.pre)
        if dim is not None:
            grad = jax.lax.psum_scatter(grad, FSDP, scatter_dimension=dim, tiled=True)
        if other_axes:
            grad = jax.lax.psum(grad, other_axes)
        return _scale(grad, config.post).astype(config.param_dtype)

    @jax.custom_vjp
    def gather(shard):
        return forward(shard)

    gather.defvjp(lambda shard: (forward(shard), None), lambda _, g: (backward(g),))
    return gather


def gather_tree(shards: PyTree, dims: PyTree, config: GatherConfig) -> PyTree:
    """Gather every leaf of ``shards`` (dims from :func:`~torsh_jax.parallel.zero_layout.shard_dims`)."""

    def one(shard, dim):
        return checkpoint_name(make_gather(dim, config)(shard), GATHERED)

    return jax.tree.map(one, shards, dims, is_leaf=lambda x: x is None)
