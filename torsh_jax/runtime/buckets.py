"""Fuse many gradient leaves into a few flat buckets, and view sharded leaves as rows.

A plan's ``communication.bucket_mb`` bounds a bucket's size; leaves are
packed in reverse order (the order their gradients become ready in the
backward pass), a leaf larger than a bucket travels alone. Packing is
static: it depends only on shapes and dtypes, so it is computed once at
trace time. A leaf sharded along dim ``d`` over ``k`` devices is viewed as
``[k, n / k]`` (row i = device i's shard, flattened), so the rows of several
leaves concatenate into one ``[k, bucket]`` reduce-scatter operand.

Example:
    >>> import jax.numpy as jnp
    >>> layout = bucket_layout([jnp.zeros(3), jnp.zeros(5)], bucket_bytes=16)
    >>> [b.leaf_ids for b in layout]
    [(1,), (0,)]
    >>> rows = as_rows(jnp.arange(8.0).reshape(2, 4), dim=1, size=2)
    >>> rows.tolist()
    [[0.0, 4.0, 1.0, 5.0], [2.0, 6.0, 3.0, 7.0]]
    >>> from_row(rows[1], (2, 4), dim=1, size=2).tolist()
    [[2.0, 3.0], [6.0, 7.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Bucket", "bucket_layout", "as_rows", "from_row"]


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


def as_rows(x: jax.Array, *, dim: int, size: int) -> jax.Array:
    """``x`` as ``[size, n / size]``: row i is shard i along ``dim``, flattened."""
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(size, -1)


def from_row(row: jax.Array, shape: tuple[int, ...], *, dim: int, size: int) -> jax.Array:
    """Inverse of one row of :func:`as_rows`: the shard of a ``shape`` array."""
    moved_shape = (shape[dim] // size, *shape[:dim], *shape[dim + 1 :])
    return jnp.moveaxis(row.reshape(moved_shape), 0, dim)
