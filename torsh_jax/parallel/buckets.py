"""Fuse many gradient leaves into a few flat buckets for the reduction.

A plan's ``communication.bucket_mb`` bounds a bucket's size; leaves are
packed in reverse order (the order their gradients become ready in the
backward pass), a leaf larger than a bucket travels alone. Packing is
static: it depends only on shapes and dtypes, so it is computed once at
trace time.

Example:
    >>> import jax.numpy as jnp
    >>> layout = bucket_layout([jnp.zeros(3), jnp.zeros(5)], bucket_bytes=16)
    >>> [b.leaf_ids for b in layout]
    [(1,), (0,)]
    >>> flat = pack([jnp.ones(3), 2 * jnp.ones(5)], layout)
    >>> [x.shape for x in flat]
    [(5,), (3,)]
    >>> [x.tolist() for x in unpack(flat, layout, [jnp.zeros(3), jnp.zeros(5)])]
    [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Bucket", "bucket_layout", "pack", "unpack", "reduce_in_buckets"]


class Bucket(NamedTuple):
    """Leaves ``leaf_ids`` (indices into the flat leaf list) packed end to end."""

    leaf_ids: tuple[int, ...]
    size: int


def bucket_layout(leaves: Sequence[jax.Array], *, bucket_bytes: int, itemsize: int = 4) -> list[Bucket]:
    """Group leaves (in reverse order) into buckets of at most ``bucket_bytes``.

    ``bucket_bytes <= 0`` gives one bucket per leaf.
    """
    buckets: list[Bucket] = []
    ids: list[int] = []
    size = 0
    for i in reversed(range(len(leaves))):
        n = int(np.prod(leaves[i].shape))
        if ids and (bucket_bytes <= 0 or (size + n) * itemsize > bucket_bytes):
            buckets.append(Bucket(tuple(ids), size))
            ids, size = [], 0
        ids.append(i)
        size += n
    if ids:
        buckets.append(Bucket(tuple(ids), size))
    return buckets


def pack(leaves: Sequence[jax.Array], layout: Sequence[Bucket], dtype=None) -> list[jax.Array]:
    """Flatten and concatenate leaves into one 1-D array per bucket."""
    out = []
    for bucket in layout:
        parts = [jnp.ravel(leaves[i]) for i in bucket.leaf_ids]
        flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        out.append(flat if dtype is None else flat.astype(dtype))
    return out


def unpack(
    flats: Sequence[jax.Array], layout: Sequence[Bucket], like: Sequence[jax.Array]
) -> list[jax.Array]:
    """Inverse of :func:`pack`: leaves shaped (and typed) like ``like``."""
    leaves: list[jax.Array | None] = [None] * len(like)
    for flat, bucket in zip(flats, layout):
        offset = 0
        for i in bucket.leaf_ids:
            n = int(np.prod(like[i].shape))
            leaves[i] = flat[offset : offset + n].reshape(like[i].shape).astype(like[i].dtype)
            offset += n
    return leaves


def reduce_in_buckets(tree, /, *, bucket_bytes: int, reduce: Callable[[jax.Array], jax.Array], dtype=None):
    """Apply the collective ``reduce`` to ``tree`` in fused flat buckets.

    Args:
        tree: gradient pytree (per-device values inside ``shard_map``).
        bucket_bytes: bucket size bound in bytes.
        reduce: collective applied to each 1-D bucket, e.g.
            ``lambda x: lax.psum(x, ("data", "fsdp"))``.
        dtype: dtype the buckets cross the wire in (default: leaves' dtype).
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    itemsize = jnp.dtype(dtype or leaves[0].dtype).itemsize
    layout = bucket_layout(leaves, bucket_bytes=bucket_bytes, itemsize=itemsize)
    reduced = [reduce(flat) for flat in pack(leaves, layout, dtype)]
    return jax.tree.unflatten(treedef, unpack(reduced, layout, leaves))
