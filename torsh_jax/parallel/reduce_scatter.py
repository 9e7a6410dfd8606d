"""Bucketed reduce-scatter of gradients over ``fsdp`` (ZeRO-2), and param all-gather (ZeRO-1/2).

Each leaf sharded along dim ``d`` is viewed as ``[fsdp, n / fsdp]`` (row i
= device i's shard, flattened); the rows of several leaves are concatenated
into one ``[fsdp, bucket]`` array, reduce-scattered along the rows in one
collective, then split back into shards. Replicated leaves are all-reduced.

Example:
    >>> import jax.numpy as jnp
    >>> rows = as_rows(jnp.arange(8.0).reshape(2, 4), dim=1, size=2)
    >>> rows.tolist()
    [[0.0, 4.0, 1.0, 5.0], [2.0, 6.0, 3.0, 7.0]]
    >>> from_row(rows[1], (2, 4), dim=1, size=2).tolist()
    [[2.0, 3.0], [6.0, 7.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torsh_jax.parallel.buckets import bucket_layout
from torsh_jax.parallel.zero_layout import FSDP

__all__ = ["as_rows", "from_row", "sharded_buckets", "reduce_scatter_in_buckets", "all_gather_params"]

PyTree = Any


def as_rows(x: jax.Array, *, dim: int, size: int) -> jax.Array:
    """``x`` as ``[size, n / size]``: row i is shard i along ``dim``, flattened."""
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(size, -1)


def from_row(row: jax.Array, shape: tuple[int, ...], *, dim: int, size: int) -> jax.Array:
    """Inverse of one row of :func:`as_rows`: the shard of a ``shape`` array."""
    moved_shape = (shape[dim] // size, *shape[:dim], *shape[dim + 1 :])
    return jnp.moveaxis(row.reshape(moved_shape), 0, dim)


def sharded_buckets(leaves, leaf_dims, /, *, bucket_bytes: int, itemsize: int) -> list[list[int]]:
    """Leaf indices of every bucket of sharded leaves (replicated leaves travel alone, unbucketed)."""
    sharded = [i for i, d in enumerate(leaf_dims) if d is not None]
    layout = bucket_layout([leaves[i] for i in sharded], bucket_bytes=bucket_bytes, itemsize=itemsize)
    return [[sharded[j] for j in bucket.leaf_ids] for bucket in layout]


def reduce_scatter_in_buckets(
    grads: PyTree,
    dims: PyTree,
    /,
    *,
    size: int,
    bucket_bytes: int,
    scatter: Callable[[jax.Array], jax.Array],
    all_reduce: Callable[[jax.Array], jax.Array],
) -> PyTree:
    """Reduce full local gradients to this device's shards.

    Args:
        grads: full per-device gradients.
        dims: shard dim per leaf (``None``: replicated).
        size: ``fsdp`` axis size.
        bucket_bytes: bucket size bound.
        scatter: ``(rows[size, m], bucket index) -> [1, m]`` reduce-scatter
            over rows (then any cross-slice all-reduce and scaling).
        all_reduce: reduction of replicated leaves (flat 1-D).
    """
    leaves, treedef = jax.tree.flatten(grads)
    leaf_dims = treedef.flatten_up_to(dims)
    out: list[jax.Array | None] = [None] * len(leaves)
    replicated = [i for i, d in enumerate(leaf_dims) if d is None]
    itemsize = jnp.dtype(leaves[0].dtype).itemsize if leaves else 4
    buckets = sharded_buckets(leaves, leaf_dims, bucket_bytes=bucket_bytes, itemsize=itemsize)
    for index, ids in enumerate(buckets):
        rows = jnp.concatenate([as_rows(leaves[i], dim=leaf_dims[i], size=size) for i in ids], axis=1)
        mine = scatter(rows, index)[0]
        offset = 0
        for i in ids:
            n = int(np.prod(leaves[i].shape)) // size
            out[i] = from_row(mine[offset : offset + n], leaves[i].shape, dim=leaf_dims[i], size=size)
            offset += n
    for i in replicated:
        out[i] = all_reduce(leaves[i].ravel()).reshape(leaves[i].shape)
    return jax.tree.unflatten(treedef, out)


def all_gather_params(shards: PyTree, dims: PyTree) -> PyTree:
    """All-gather every sharded leaf over ``fsdp`` along its shard dim."""

    def one(shard, dim):
        if dim is None:
            return shard
        return jax.lax.all_gather(shard, FSDP, axis=dim, tiled=True)

    return jax.tree.map(one, shards, dims, is_leaf=lambda x: x is None)
