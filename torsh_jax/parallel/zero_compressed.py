"""Compressed gradient reductions of ZeRO and HSDP (run inside ``shard_map``).

Stage 1/2: ``rows[fsdp, m] -> (compressed) reduce-scatter over fsdp -> (compressed) all-reduce over data``
Stage 3:   ``dW_shard (summed over fsdp in the gather's backward) -> compressed all-reduce over data``

Every sharded bucket's rows are padded to :func:`shard_row_length`, so that
both collectives split them into whole blocks. The feedback of a bucket is
``{axis: FeedbackState}`` for its compressed axes (worker residual over the
full rows for ``fsdp``, over this device's shard for ``data``).

Example:
    >>> from torsh_jax.plan import CompressorSpec
    >>> from torsh_jax.parallel.compressed import AxisRoute
    >>> routes = {"fsdp": AxisRoute("fsdp", 4, CompressorSpec(method="int8")),
    ...           "data": AxisRoute("data", 2, CompressorSpec(method="int8"))}
    >>> shard_row_length(routes, 300)
    512
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torsh_jax.compress import compressed_all_reduce, compressed_reduce_scatter
from torsh_jax.compress.factory import length_unit
from torsh_jax.parallel.compressed import AxisRoute, bucket_feedback
from torsh_jax.parallel.reduce_scatter import sharded_buckets
from torsh_jax.parallel.zero_layout import FSDP

__all__ = ["shard_row_length", "zero12_feedback", "make_compressed_scatter", "local_shard_shapes"]

PyTree = Any
DATA = "data"


def shard_row_length(routes: dict[str, AxisRoute], m: int) -> int:
    """Row length >= ``m`` that whole blocks tile for the fsdp scatter and the data all-reduce."""
    unit = 1
    if FSDP in routes:
        unit = math.lcm(unit, length_unit(routes[FSDP].spec))
    if DATA in routes:
        unit = math.lcm(unit, routes[DATA].size * length_unit(routes[DATA].spec))
    return max(1, -(-m // unit)) * unit


def _bucket_lengths(routes: dict[str, AxisRoute], m: int, fsdp_size: int) -> dict[str, int]:
    length = shard_row_length(routes, m)
    return {axis: length * (fsdp_size if axis == FSDP else 1) for axis in routes}


def zero12_feedback(
    params_like: PyTree, dims: PyTree, /, *, routes: dict[str, AxisRoute], fsdp_size: int, bucket_bytes: int,
    itemsize: int, copies: int,
) -> tuple:  # fmt: skip
    """Zero feedback of every sharded gradient bucket of ZeRO-1/2 (``copies`` devices on dim 0)."""
    leaves, treedef = jax.tree.flatten(params_like)
    leaf_dims = treedef.flatten_up_to(dims)
    buckets = sharded_buckets(leaves, leaf_dims, bucket_bytes=bucket_bytes, itemsize=itemsize)
    sizes = [sum(int(np.prod(leaves[i].shape)) for i in ids) // fsdp_size for ids in buckets]
    return tuple(bucket_feedback(routes, _bucket_lengths(routes, m, fsdp_size), copies) for m in sizes)


def _scatter_rows(rows, feedback, route, key, index):
    if route is None:
        return jax.lax.psum_scatter(rows, FSDP, scatter_dimension=0, tiled=True)[0], feedback
    fold = None if key is None else jax.random.fold_in(key, 2 * index)
    flat = rows.reshape(-1)
    return compressed_reduce_scatter(
        flat, feedback, spec=route.spec, axis_name=FSDP, axis_size=route.size, key=fold, mean=False
    )


def _all_reduce_shard(shard, feedback, route, other, key, index):
    if route is None:
        return (jax.lax.psum(shard, other) if other else shard), feedback
    fold = None if key is None else jax.random.fold_in(key, 2 * index + 1)
    return compressed_all_reduce(
        shard, feedback, spec=route.spec, axis_name=DATA, axis_size=route.size, key=fold, mean=False
    )


def make_compressed_scatter(
    feedback: tuple,
    /,
    *,
    routes: dict[str, AxisRoute],
    other_axes: tuple[str, ...],
    factors: tuple[float, float],
    key: jax.Array | None,
):
    """``(scatter, new_feedback)``: ``scatter(rows[fsdp, m], index) -> [1, m]`` for
    :func:`~torsh_jax.parallel.reduce_scatter.reduce_scatter_in_buckets`, writing each
    bucket's new feedback into the ``new_feedback`` list as it is traced."""
    pre, post = factors
    new_feedback: list[dict | None] = [None] * len(feedback)

    def scatter(rows: jax.Array, index: int) -> jax.Array:
        m = rows.shape[1]
        padded = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, shard_row_length(routes, m) - m)))
        if pre != 1.0:
            padded = padded * jnp.float32(pre)
        fb = dict(feedback[index])
        shard, fb_f = _scatter_rows(padded, fb.get(FSDP), routes.get(FSDP), key, index)
        shard, fb_d = _all_reduce_shard(shard, fb.get(DATA), routes.get(DATA), other_axes, key, index)
        fb.update({a: v for a, v in ((FSDP, fb_f), (DATA, fb_d)) if a in routes})
        new_feedback[index] = fb
        shard = shard[:m] if post == 1.0 else shard[:m] * jnp.float32(post)
        return shard.astype(rows.dtype)[None]

    return scatter, new_feedback


def local_shard_shapes(params_like: PyTree, dims: PyTree, fsdp_size: int) -> list[jax.ShapeDtypeStruct]:
    """Per-device shapes of the ZeRO-3 parameter shards (flattened leaf order)."""
    leaves, treedef = jax.tree.flatten(params_like)
    out = []
    for leaf, dim in zip(leaves, treedef.flatten_up_to(dims)):
        shape = list(leaf.shape)
        if dim is not None:
            shape[dim] //= fsdp_size
        out.append(jax.ShapeDtypeStruct(tuple(shape), leaf.dtype))
    return out
