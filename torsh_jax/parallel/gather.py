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

from torsh_jax.compress import compressed_all_gather, init_feedback
from torsh_jax.compress.factory import length_unit
from torsh_jax.parallel.compressed import AxisRoute, scatter_bucket
from torsh_jax.parallel.reduce_scatter import as_rows, from_row
from torsh_jax.parallel.zero_layout import FSDP
from torsh_jax.plan.spec import CompressorSpec

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
        deferred_axes: axes the backward pass leaves unreduced (the caller
            reduces them, compressed); the shard arrives varying over them and
            the ``post`` factor is the caller's too.
        weights: compressor of the forward all-gather over ``fsdp`` (ZeRO-3 weights).
        gradients: compressor of the backward reduce-scatter over ``fsdp``
            (no error feedback: a backward pass cannot carry state).
    """

    compute_dtype: str
    reduce_dtype: str
    param_dtype: str
    pre: float
    post: float
    reduce_axes: tuple[str, ...]
    replicated_axes: tuple[str, ...]
    deferred_axes: tuple[str, ...] = ()
    weights: CompressorSpec | None = None
    gradients: AxisRoute | None = None


def _scale(x: jax.Array, factor: float) -> jax.Array:
    return x if factor == 1.0 else x * jnp.asarray(factor, x.dtype)


def _compressed_gather(shard: jax.Array, dim: int, spec: CompressorSpec) -> jax.Array:
    """All-gather ``shard`` along ``dim`` over ``fsdp`` with a compressed payload."""
    size = jax.lax.axis_size(FSDP)
    row = jnp.moveaxis(shard, dim, 0).reshape(-1).astype(jnp.float32)
    m, unit = row.shape[0], length_unit(spec)
    padded = jnp.pad(row, (0, -(-m // unit) * unit - m))
    rows = compressed_all_gather(padded, spec=spec, axis_name=FSDP, axis_size=size).reshape(size, -1)
    full = rows[:, :m].reshape(size * shard.shape[dim], *jnp.moveaxis(shard, dim, 0).shape[1:])
    return jnp.moveaxis(full, 0, dim)


def _compressed_scatter(grad: jax.Array, dim: int, route: AxisRoute) -> jax.Array:
    """Reduce-scatter ``grad`` along ``dim`` over ``fsdp`` with compression, no feedback."""
    rows = as_rows(grad, dim=dim, size=route.size)
    length = route.padded(rows.size)
    feedback = init_feedback(route.spec, length=length, axis_size=route.size)
    row, _ = scatter_bucket(rows, feedback, route=route, key=None, index=0)
    return from_row(row, grad.shape, dim=dim, size=route.size).astype(grad.dtype)


def _vary(full: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.pcast(full, axes, to="varying") if axes else full


def make_gather(dim: int | None, config: GatherConfig) -> Callable[[jax.Array], jax.Array]:
    """The gather-on-use function for a parameter sharded along ``dim`` (``None``: replicated)."""
    deferred = config.deferred_axes
    other_axes = tuple(a for a in config.reduce_axes if (a != FSDP or dim is None) and a not in deferred)

    def forward(shard: jax.Array) -> jax.Array:
        full = shard.astype(config.compute_dtype)
        if dim is None:
            return _vary(full, tuple(a for a in config.reduce_axes if a not in deferred))
        vary = tuple(a for a in config.replicated_axes if a not in deferred)
        if config.weights is not None:  # the compressed gather is typed as replicated over fsdp
            gathered = _compressed_gather(shard, dim, config.weights).astype(config.compute_dtype)
            return _vary(gathered, (*vary, FSDP))
        return _vary(jax.lax.all_gather(full, FSDP, axis=dim, tiled=True), vary)

    def backward(grad: jax.Array) -> jax.Array:
        grad = _scale(grad.astype(config.reduce_dtype), config.pre)
        if dim is not None and config.gradients is not None:
            grad = _compressed_scatter(grad, dim, config.gradients)
        elif dim is not None:
            grad = jax.lax.psum_scatter(grad, FSDP, scatter_dimension=dim, tiled=True)
        if other_axes:
            grad = jax.lax.psum(grad, other_axes)
        post = 1.0 if deferred else config.post
        return _scale(grad, post).astype(config.param_dtype)

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
