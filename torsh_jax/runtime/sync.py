"""The one gradient synchronisation of every data-parallel mode (run inside ``shard_map``).

``leaves -> buckets [k, m] -> x pre -> reduce-scatter over the scatter axis (k rows -> 1)
-> psum over the plain axes -> compressed all-reduce over each compressed axis -> x post``

A bucket pads each leaf to whole blocks of the blockwise compressors it
passes through, so that no quantisation block holds two leaves. A bucket of
one float32 leaf that no compressor passes through is reduced in the leaf's
own shape (scattered along its shard dim): on a TPU, whose arrays are tiled, a
flat row is a copy of the gradient in another layout (a 32,000 x 1,024
embedding's reduce-scatter over 32 v5e chips held 250 MiB of temporaries that
way against 125 MiB, and compiled in 7.7 s against 1.2 s). A narrower leaf
keeps its row: XLA:CPU runs a bfloat16 collective in float32, and where the
cast to bfloat16 directly precedes it, the compiler drops the rounding
(excess precision allowed) and sends float32 (a ZeRO-3 step sent 1.06 times
its bfloat16 bytes so).
ZeRO-3's per-layer reductions (:func:`sync_leaf`) take the same two paths.
DDP all-reduces every bucket (no scatter axis); ZeRO-1/2 reduce-scatter the
buckets of sharded leaves over ``fsdp`` (``k`` = its size, row i = device i's
shard) and all-reduce those of replicated leaves; ZeRO-3's gather backward
synchronises one leaf at a time (no feedback) and HSDP's compressed ``data``
reduction of the shards runs here once per step. An axis with a compressor
(:class:`AxisRoute`) sends compressed payloads and keeps per-bucket error
feedback: ``feedback[bucket][axis]``, a :class:`~torsh_jax.compress.FeedbackState`.

Example:
    >>> import jax.numpy as jnp
    >>> spec = SyncSpec(axes=("data",), bucket_bytes=16)
    >>> [(b.leaf_ids, b.row_length) for b in plan_buckets([jnp.zeros(3), jnp.zeros(5)], [None, None], spec)]
    [((1,), 5), ((0,), 3)]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from torsh_jax.compress import (
    FeedbackState,
    compressed_all_reduce,
    compressed_reduce_scatter,
    init_feedback,
    needs_key,
)
from torsh_jax.compress.factory import leaf_unit, length_unit
from torsh_jax.plan.spec import CompressorSpec
from torsh_jax.runtime.buckets import as_rows, bucket_layout, from_row
from torsh_jax.typing import PyTree

__all__ = [
    "AxisRoute",
    "SyncSpec",
    "BucketPlan",
    "plan_buckets",
    "sync_gradients",
    "sync_leaf",
    "sync_feedback",
    "feedback_specs",
    "compressed_lengths",
]

#: Seed of the stochastic-rounding keys (folded with the step, bucket and axis).
_ROUNDING_SEED = 0x7A11


class AxisRoute(NamedTuple):
    """Gradient compression over one mesh axis of size ``size``; ``implementation`` runs the
    blockwise methods (``auto``, ``reference``, ``pallas``: :mod:`torsh_jax.compress.factory`)."""

    axis: str
    size: int
    spec: CompressorSpec
    implementation: str = "auto"

    def init(self, length: int) -> FeedbackState:
        """Zero feedback of one device for a buffer of ``length`` (already padded)."""
        return init_feedback(self.spec, length=length, axis_size=self.size)


class SyncSpec(NamedTuple):
    """How gradients are synchronised.

    Args:
        axes: every mesh axis the gradients are summed over.
        scatter_axis: leaves with a shard dim are reduce-scattered over this
            axis (``None``: all-reduce everything).
        scatter_size: size of ``scatter_axis``.
        routes: compressed axes (a subset of ``axes``).
        sharded_over: the axis gradients of sharded leaves already vary over
            (their parameter shards differ along it: ZeRO's ``fsdp``).
        factors: ``(pre, post)`` multipliers around the sum.
        bucket_bytes: bucket size bound (``<= 0``: one bucket per leaf).
        itemsize: bytes per element of the reduction dtype (sizes the buckets).
    """

    axes: tuple[str, ...]
    scatter_axis: str | None = None
    scatter_size: int = 1
    routes: Mapping[str, AxisRoute] = {}
    sharded_over: str | None = None
    factors: tuple[float, float] = (1.0, 1.0)
    bucket_bytes: int = 0
    itemsize: int = 4

    def reduce_axes(self, scattered: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(plain, compressed)`` all-reduce axes of a bucket, after any scatter."""
        rest = [a for a in self.axes if not (scattered and a == self.scatter_axis)]
        return tuple(a for a in rest if a not in self.routes), tuple(a for a in rest if a in self.routes)

    def key(self, step: jax.Array | None) -> jax.Array | None:
        """The stochastic-rounding key of ``step`` (same on every device), or ``None`` if unused."""
        if step is None or not any(needs_key(r.spec) for r in self.routes.values()):
            return None
        return jax.random.fold_in(jax.random.key(_ROUNDING_SEED), step)

    def feedback_axes(self, bucket: BucketPlan) -> dict[str, tuple[str, ...]]:
        """Per compressed axis of ``bucket``: the axes its feedback differs over.

        A compressor's input (and so its feedback) still varies over the axes
        not reduced before it: every axis for the reduce-scatter, and for the
        all-reduces the compressed axes from this one on, plus the shard axis
        of sharded leaves. It is the same on every device of the other axes.
        """
        _, compressed = self.reduce_axes(bucket.scattered)
        shard = (self.scatter_axis,) if bucket.scattered else ()
        shard += (self.sharded_over,) if bucket.sharded and self.sharded_over else ()
        shard += bucket.split_over
        out = {}
        if bucket.scattered and self.scatter_axis in self.routes:
            out[self.scatter_axis] = self._ordered(self.axes + shard)
        for k, axis in enumerate(compressed):
            out[axis] = self._ordered(compressed[k:] + shard)
        return out

    def _ordered(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        rank = {a: i for i, a in enumerate((*self.axes, self.scatter_axis, self.sharded_over))}
        return tuple(sorted(set(axes), key=lambda a: (rank.get(a, len(rank)), a)))


class BucketPlan(NamedTuple):
    """Leaves ``leaf_ids`` as ``rows`` rows of ``row_length`` (padded to ``padded_length``).

    ``sharded``: the leaves have a shard dim; ``scattered``: they are reduce-scattered;
    ``split_over``: other mesh axes the leaves are split over (``tensor``), so
    the bucket's values differ along them. ``segments``: per leaf, the elements
    its part of a row takes, padded to whole quantisation blocks (see
    :func:`~torsh_jax.compress.factory.leaf_unit`) so that no block holds two
    leaves; ``row_length`` is their sum.
    """

    leaf_ids: tuple[int, ...]
    sharded: bool
    scattered: bool
    rows: int
    row_length: int
    padded_length: int
    split_over: tuple[str, ...] = ()
    segments: tuple[int, ...] = ()


def _routes_of(spec: SyncSpec, scattered: bool) -> list[AxisRoute]:
    """The compressed routes a bucket passes through: its reduce-scatter's, then its all-reduces'."""
    routes = [spec.routes[spec.scatter_axis]] if scattered and spec.scatter_axis in spec.routes else []
    return routes + [spec.routes[axis] for axis in spec.reduce_axes(scattered)[1]]


def _padded(spec: SyncSpec, m: int, scattered: bool) -> int:
    unit = 1
    if scattered and spec.scatter_axis in spec.routes:
        unit = math.lcm(unit, length_unit(spec.routes[spec.scatter_axis].spec))
    for axis in spec.reduce_axes(scattered)[1]:
        route = spec.routes[axis]
        unit = math.lcm(unit, route.size * length_unit(route.spec))
    return m if unit == 1 else max(1, -(-m // unit)) * unit


def _segments(sizes: Sequence[int], spec: SyncSpec, scattered: bool) -> tuple[int, ...]:
    """Each leaf's row elements rounded up to whole blocks of every blockwise route of the bucket."""
    unit = math.lcm(1, *(leaf_unit(r.spec) for r in _routes_of(spec, scattered)))
    return tuple(-(-n // unit) * unit for n in sizes)


def plan_buckets(
    leaves: Sequence[Any],
    dims: Sequence[int | None],
    spec: SyncSpec,
    split_over: Sequence[tuple[str, ...]] | None = None,
) -> list[BucketPlan]:
    """The buckets of ``leaves`` (shapes suffice): sharded leaves first, then replicated ones.

    Sharded and replicated leaves never share a bucket (their values vary over
    different axes), nor do leaves split over different other axes
    (``split_over``, per leaf: a tensor-split weight and a replicated norm);
    sharded leaves are reduce-scattered when ``spec`` has a scatter axis, and
    otherwise (ZeRO-3's stored shards) all-reduced.
    """
    split_over = [()] * len(leaves) if split_over is None else [tuple(a) for a in split_over]
    out = []
    for has_dim, scattered in ((True, spec.scatter_axis is not None), (False, False)):
        k = spec.scatter_size if scattered else 1
        for over in dict.fromkeys(split_over):  # first-seen order
            ids = [i for i, d in enumerate(dims) if (d is not None) == has_dim and split_over[i] == over]
            leaves_of = [leaves[i] for i in ids]
            for bucket in bucket_layout(leaves_of, bucket_bytes=spec.bucket_bytes, itemsize=spec.itemsize):
                ids_of = tuple(ids[j] for j in bucket.leaf_ids)
                sizes = [math.prod(leaves[i].shape) // k for i in ids_of]
                segments = _segments(sizes, spec, scattered)
                m = sum(segments)
                padded = _padded(spec, m, scattered)
                out.append(BucketPlan(ids_of, has_dim, scattered, k, m, padded, over, segments))
    return out


def _fold(key: jax.Array | None, *data: int) -> jax.Array | None:
    for value in data if key is not None else ():
        key = jax.random.fold_in(key, value)
    return key


def _scale(x: jax.Array, factor: float) -> jax.Array:
    return x if factor == 1.0 else x * jnp.asarray(factor, x.dtype)


def _scatter(rows: jax.Array, feedback: dict, spec: SyncSpec, key) -> jax.Array:
    axis = spec.scatter_axis
    route = spec.routes.get(axis)
    if route is None:
        return jax.lax.psum_scatter(rows, axis, scatter_dimension=0, tiled=True)[0]
    out, feedback[axis] = compressed_reduce_scatter(
        rows.reshape(-1), feedback[axis], spec=route.spec, axis_name=axis, axis_size=route.size,
        key=_fold(key, 0), mean=False, implementation=route.implementation,
    )  # fmt: skip
    return out


def _sync_bucket(rows, feedback: dict, bucket: BucketPlan, spec: SyncSpec, key) -> tuple[jax.Array, dict]:
    """Reduce one ``[k, m]`` bucket to this device's ``[m]``; returns it and the bucket's new feedback."""
    plain, compressed = spec.reduce_axes(bucket.scattered)
    feedback = dict(feedback)
    dtype = rows.dtype
    if spec.routes and (compressed or bucket.scattered and spec.scatter_axis in spec.routes):
        rows = rows.astype(jnp.float32)
    pad = bucket.padded_length - bucket.row_length
    x = _scale(jnp.pad(rows, ((0, 0), (0, pad))) if pad else rows, spec.factors[0])
    x = _scatter(x, feedback, spec, key) if bucket.scattered else x[0]
    if plain:
        x = jax.lax.psum(x, plain)
    for n, axis in enumerate(compressed, start=1):
        route = spec.routes[axis]
        x, feedback[axis] = compressed_all_reduce(
            x,
            feedback[axis],
            spec=route.spec,
            axis_name=axis,
            axis_size=route.size,
            key=_fold(key, n),
            mean=False,
            implementation=route.implementation,
        )
    return _scale(x[: bucket.row_length], spec.factors[1]).astype(dtype), feedback


def _in_own_shape(bucket: BucketPlan, spec: SyncSpec, leaves: Sequence[Any]) -> bool:
    """Whether ``bucket`` is one float32 leaf that no compressor passes through (nothing to pack or
    pad; the module's docstring says why not a narrower one)."""
    if len(bucket.leaf_ids) != 1 or _routes_of(spec, bucket.scattered):
        return False
    return jnp.dtype(leaves[bucket.leaf_ids[0]].dtype).itemsize >= 4


def _sync_in_own_shape(leaf: jax.Array, dim: int | None, bucket: BucketPlan, spec: SyncSpec) -> jax.Array:
    """:func:`_sync_bucket` of a bucket that is ``leaf`` alone, uncompressed, in ``leaf``'s shape:
    reduce-scattered along ``dim`` (this device's shard, as :func:`~torsh_jax.runtime.buckets.from_row`
    of its row), then summed over the plain axes."""
    plain, _ = spec.reduce_axes(bucket.scattered)
    x = _scale(leaf, spec.factors[0])
    if bucket.scattered:
        x = jax.lax.psum_scatter(x, spec.scatter_axis, scatter_dimension=dim, tiled=True)
    if plain:
        x = jax.lax.psum(x, plain)
    return _scale(x, spec.factors[1])


def _bucket_rows(leaves, dims, bucket: BucketPlan) -> jax.Array:
    parts = []
    for i, segment in zip(bucket.leaf_ids, bucket.segments, strict=True):
        leaf = leaves[i]
        rows = as_rows(leaf, dim=dims[i], size=bucket.rows) if bucket.scattered else jnp.ravel(leaf)[None]
        pad = segment - rows.shape[1]
        parts.append(jnp.pad(rows, ((0, 0), (0, pad))) if pad else rows)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _split_row(row: jax.Array, leaves, dims, bucket: BucketPlan, out: list) -> None:
    offset = 0
    for i, segment in zip(bucket.leaf_ids, bucket.segments, strict=True):
        n = int(np.prod(leaves[i].shape)) // bucket.rows
        part = row[offset : offset + n]
        if bucket.scattered:
            out[i] = from_row(part, leaves[i].shape, dim=dims[i], size=bucket.rows)
        else:
            out[i] = part.reshape(leaves[i].shape)
        offset += segment


def sync_gradients(
    grads: PyTree,
    feedback: tuple,
    /,
    *,
    spec: SyncSpec,
    dims: PyTree = None,
    step: jax.Array | None = None,
    split_over: PyTree = None,
) -> tuple[PyTree, tuple]:
    """Synchronise per-device gradients: this device's shards (scattered leaves) or sums.

    Args:
        grads: per-device gradients (their dtype is the wire dtype of plain collectives).
        feedback: per-bucket feedback from :func:`sync_feedback` (``()`` without routes).
        spec: axes, scatter axis, compression, factors and bucket size.
        dims: shard dim per leaf (``None`` leaves, or ``dims=None``: all-reduced).
        step: optimizer step (seeds stochastic rounding).
        split_over: per leaf, the other mesh axes it is split over (tuples;
            ``None``: none). Leaves split differently never share a bucket.

    Returns:
        ``(synchronised gradients, new feedback)``.
    """
    leaves, treedef = jax.tree.flatten(grads)
    leaf_dims = [None] * len(leaves) if dims is None else treedef.flatten_up_to(dims)
    leaf_split = None if split_over is None else treedef.flatten_up_to(split_over)
    out: list[jax.Array | None] = [None] * len(leaves)
    new_feedback = []
    key = spec.key(step)
    for index, bucket in enumerate(plan_buckets(leaves, leaf_dims, spec, leaf_split)):
        bucket_fb = feedback[index] if spec.routes else {}
        if _in_own_shape(bucket, spec, leaves):
            [i] = bucket.leaf_ids
            out[i] = _sync_in_own_shape(leaves[i], leaf_dims[i], bucket, spec)
            new_feedback.append(bucket_fb)
            continue
        row, bucket_fb = _sync_bucket(
            _bucket_rows(leaves, leaf_dims, bucket), bucket_fb, bucket, spec, _fold(key, index)
        )
        _split_row(row, leaves, leaf_dims, bucket, out)
        new_feedback.append(bucket_fb)
    return jax.tree.unflatten(treedef, out), tuple(new_feedback) if spec.routes else feedback


def sync_leaf(grad: jax.Array, dim: int | None, spec: SyncSpec) -> jax.Array:
    """Synchronise one leaf with fresh (discarded) feedback: for a backward pass, which keeps no state.

    Like a bucket of one leaf in :func:`sync_gradients`: a float32 leaf no compressor passes
    through is reduced in its own shape, any other as its padded row."""
    bucket = plan_buckets([grad], [dim], spec)[0]
    if _in_own_shape(bucket, spec, [grad]):
        return _sync_in_own_shape(grad, dim, bucket, spec)
    feedback = _bucket_feedback(bucket, spec, copies=dict.fromkeys(spec.routes, 1))
    row, _ = _sync_bucket(_bucket_rows([grad], [dim], bucket), feedback, bucket, spec, None)
    out: list[jax.Array | None] = [None]
    _split_row(row, [grad], [dim], bucket, out)
    return out[0]


def _feedback_lengths(bucket: BucketPlan, spec: SyncSpec) -> dict[str, int]:
    lengths = {axis: bucket.padded_length for axis in spec.reduce_axes(bucket.scattered)[1]}
    if bucket.scattered and spec.scatter_axis in spec.routes:
        lengths[spec.scatter_axis] = bucket.rows * bucket.padded_length
    return dict(sorted(lengths.items()))


def _bucket_feedback(bucket: BucketPlan, spec: SyncSpec, *, copies: Mapping[str, int]) -> dict:
    def stacked(axis: str, length: int) -> FeedbackState:
        n = copies[axis]
        zeros = spec.routes[axis].init(length)
        return jax.tree.map(lambda a: a if n == 1 else jnp.concatenate([a] * n), zeros)

    return {axis: stacked(axis, n) for axis, n in _feedback_lengths(bucket, spec).items()}


def sync_feedback(
    leaves_like: Sequence[Any],
    dims: Sequence[int | None],
    spec: SyncSpec,
    *,
    axis_sizes: Mapping[str, int],
    split_over: Sequence[tuple[str, ...]] | None = None,
) -> tuple:
    """Global zero feedback of every bucket :func:`sync_gradients` forms.

    ``leaves_like`` are the per-device gradient shapes, in flattened leaf
    order; each feedback holds one copy per device of the axes it differs
    over (:meth:`SyncSpec.feedback_axes`), stacked on dim 0.
    """
    if not spec.routes:
        return ()
    out = []
    for bucket in plan_buckets(list(leaves_like), list(dims), spec, split_over):
        axes = spec.feedback_axes(bucket)
        copies = {axis: math.prod(axis_sizes[a] for a in over) for axis, over in axes.items()}
        out.append(_bucket_feedback(bucket, spec, copies=copies))
    return tuple(out)


def feedback_specs(
    leaves_like: Sequence[Any],
    dims: Sequence[int | None],
    spec: SyncSpec,
    split_over: Sequence[tuple[str, ...]] | None = None,
) -> tuple:
    """``PartitionSpec`` of each leaf of :func:`sync_feedback`: dim 0 over the axes it differs over."""
    if not spec.routes:
        return ()
    out = []
    for bucket in plan_buckets(list(leaves_like), list(dims), spec, split_over):
        lengths = _feedback_lengths(bucket, spec)
        axes = spec.feedback_axes(bucket)
        shapes = {axis: jax.eval_shape(partial(spec.routes[axis].init, n)) for axis, n in lengths.items()}
        out.append({axis: jax.tree.map(lambda _, a=axes[axis]: P(a), s) for axis, s in shapes.items()})
    return tuple(out)


def compressed_lengths(
    leaves_like: Sequence[Any],
    dims: Sequence[int | None],
    spec: SyncSpec,
    split_over: Sequence[tuple[str, ...]] | None = None,
) -> dict[str, int]:
    """Per compressed axis: elements one device compresses per synchronisation, over every bucket,
    the per-leaf block padding and the bucket's tail padding included (the all-reduce's buffer; the
    reduce-scatter's rows). The wire bytes theory of compressed gradients counts these.

    Example:
        >>> from torsh_jax.plan import CompressorSpec
        >>> route = AxisRoute("data", 8, CompressorSpec(method="int8"))
        >>> spec = SyncSpec(axes=("data",), routes={"data": route}, bucket_bytes=1 << 20)
        >>> compressed_lengths([jnp.zeros((37, 53)), jnp.zeros(53)], [None, None], spec)
        {'data': 4096}
    """
    out: dict[str, int] = {}
    for bucket in plan_buckets(list(leaves_like), list(dims), spec, split_over):
        for axis, length in _feedback_lengths(bucket, spec).items():
            out[axis] = out.get(axis, 0) + length
    return out
