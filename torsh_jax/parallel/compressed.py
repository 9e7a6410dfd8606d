"""Compressed gradient reductions of the train step: routes per mesh axis and per-bucket feedback.

``grads[bucket] --(plain psum over the uncompressed axes)--> compressed all-reduce
over the compressed axis (error feedback per device) -> grads``

A plan's ``compression`` sections name, per mesh axis, the compressor of the
gradient reductions over that axis. :func:`gradient_routes` resolves them
against the mesh (an axis of size 1 sends nothing and is dropped); the
strategies call :func:`reduce_bucket` on flat float32 buckets, padded here to
:func:`~torsh_jax.compress.padded_length`. Feedback lives in
``TrainState.feedback`` as a tuple with one entry per bucket, each a dict
``{axis: FeedbackState}``; every leaf has a per-device leading dim and is
sharded over all data-parallel axes.

Example:
    >>> from torsh_jax.plan import CompressorSpec
    >>> route = AxisRoute(axis="data", size=8, spec=CompressorSpec(method="int8"))
    >>> route.padded(5000)
    6144
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from torsh_jax.compress import (
    FeedbackState,
    compressed_all_reduce,
    compressed_reduce_scatter,
    init_feedback,
    needs_key,
)
from torsh_jax.compress.factory import length_unit
from torsh_jax.parallel.buckets import bucket_layout, pack, unpack
from torsh_jax.plan.spec import CompressorSpec, ParallelPlan

__all__ = [
    "AxisRoute",
    "gradient_routes",
    "step_key",
    "reduce_bucket",
    "scatter_bucket",
    "bucket_feedback",
    "feedback_specs",
    "tree_feedback",
    "reduce_tree",
]

PyTree = Any
#: Seed of the stochastic-rounding keys (folded with the step, bucket and device index).
_ROUNDING_SEED = 0x7A11


class AxisRoute(NamedTuple):
    """Gradient compression over one mesh axis of size ``size``."""

    axis: str
    size: int
    spec: CompressorSpec

    def padded(self, n: int) -> int:
        """Buffer length >= ``n`` that this axis' collective accepts: whole blocks (chunks) per device.

        The reference implementation needs no kernel row tiles, so this is
        at most ``size * block`` longer than ``n`` (unlike ``padded_length``).
        """
        unit = self.size * length_unit(self.spec)
        return max(1, -(-n // unit)) * unit

    def init(self, length: int) -> FeedbackState:
        """Zero feedback of one device for a buffer of ``length`` (already padded)."""
        return init_feedback(self.spec, length=length, axis_size=self.size)


def gradient_routes(plan: ParallelPlan, mesh_shape) -> dict[str, AxisRoute]:
    """The compressed gradient axes of ``plan`` on a mesh of ``mesh_shape`` (size-1 axes dropped)."""
    routes = {}
    for section in plan.compression:
        size = int(mesh_shape[section.axis])
        if section.gradients is not None and section.gradients.method != "none" and size > 1:
            routes[section.axis] = AxisRoute(section.axis, size, section.gradients)
    return routes


def step_key(step: jax.Array, routes: dict[str, AxisRoute]) -> jax.Array | None:
    """The stochastic-rounding key of ``step`` (same on every device), or ``None`` if unused."""
    if not any(needs_key(r.spec) for r in routes.values()):
        return None
    return jax.random.fold_in(jax.random.key(_ROUNDING_SEED), step)


def _bucket_key(key: jax.Array | None, index: int, route: AxisRoute) -> jax.Array | None:
    return None if key is None or not needs_key(route.spec) else jax.random.fold_in(key, index)


def _pad(flat: jax.Array, length: int) -> jax.Array:
    flat = flat.astype(jnp.float32)
    return flat if flat.shape[0] == length else jnp.pad(flat, (0, length - flat.shape[0]))


def reduce_bucket(
    flat: jax.Array,
    feedback: FeedbackState,
    /,
    *,
    route: AxisRoute,
    key: jax.Array | None,
    index: int,
) -> tuple[jax.Array, FeedbackState]:
    """Sum ``flat[n]`` over ``route.axis`` with compression; returns float32 ``[n]`` and new feedback."""
    n = flat.shape[0]
    out, feedback = compressed_all_reduce(
        _pad(flat, route.padded(n)),
        feedback,
        spec=route.spec,
        axis_name=route.axis,
        axis_size=route.size,
        key=_bucket_key(key, index, route),
        mean=False,
    )
    return out[:n], feedback


def scatter_bucket(
    rows: jax.Array,
    feedback: FeedbackState,
    /,
    *,
    route: AxisRoute,
    key: jax.Array | None,
    index: int,
) -> tuple[jax.Array, FeedbackState]:
    """Reduce-scatter ``rows[size, m]`` over ``route.axis``: this device's summed row ``[m]``.

    Each row is padded to ``row_length(m)`` so the flat buffer splits into whole blocks.
    """
    m = rows.shape[1]
    padded = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, row_length(route, m) - m)))
    shard, feedback = compressed_reduce_scatter(
        padded.reshape(-1),
        feedback,
        spec=route.spec,
        axis_name=route.axis,
        axis_size=route.size,
        key=_bucket_key(key, index, route),
        mean=False,
    )
    return shard[:m], feedback


def row_length(route: AxisRoute, m: int) -> int:
    """Padded row length of a ``[size, m]`` reduce-scatter over ``route``."""
    return route.padded(route.size * m) // route.size


def bucket_feedback(routes: dict[str, AxisRoute], lengths: dict[str, int], copies: int) -> dict:
    """Global zero feedback of one bucket: ``{axis: FeedbackState}``, ``copies`` devices stacked on dim 0."""
    return {
        axis: jax.tree.map(lambda a: jnp.concatenate([a] * copies), routes[axis].init(lengths[axis]))
        for axis in sorted(lengths)
    }


def feedback_specs(feedback: PyTree, axes: tuple[str, ...]) -> PyTree:
    """``PartitionSpec(axes)`` on every leaf: each device holds its own residuals."""
    return jax.tree.map(lambda _: P(axes), feedback)


def tree_feedback(
    leaves_like, /, *, route: AxisRoute, bucket_bytes: int, itemsize: int, copies: int
) -> tuple:
    """Zero feedback for every bucket :func:`reduce_tree` forms from leaves shaped like ``leaves_like``."""
    layout = bucket_layout(list(leaves_like), bucket_bytes=bucket_bytes, itemsize=itemsize)
    return tuple(
        bucket_feedback({route.axis: route}, {route.axis: route.padded(b.size)}, copies) for b in layout
    )


def reduce_tree(
    tree: PyTree,
    feedback: tuple,
    /,
    *,
    route: AxisRoute,
    plain_axes: tuple[str, ...],
    factors: tuple[float, float],
    bucket_bytes: int,
    key: jax.Array | None,
) -> tuple[PyTree, tuple]:
    """Bucketed sum of ``tree`` over ``plain_axes`` (plain ``psum``) then ``route.axis`` (compressed).

    Each bucket is multiplied by ``factors[0]`` before and ``factors[1]`` after
    the sum; buckets keep their leaves' dtype. Returns the reduced tree and
    every bucket's new feedback.
    """
    pre, post = factors
    leaves, treedef = jax.tree.flatten(tree)
    itemsize = jnp.dtype(leaves[0].dtype).itemsize
    layout = bucket_layout(leaves, bucket_bytes=bucket_bytes, itemsize=itemsize)
    reduced, new_feedback = [], []
    for index, (flat, bucket_fb) in enumerate(zip(pack(leaves, layout), feedback)):
        dtype = flat.dtype
        flat = flat.astype(jnp.float32)
        if pre != 1.0:
            flat = flat * jnp.float32(pre)
        if plain_axes:
            flat = jax.lax.psum(flat, plain_axes)
        flat, fb = reduce_bucket(flat, bucket_fb[route.axis], route=route, key=key, index=index)
        reduced.append((flat if post == 1.0 else flat * jnp.float32(post)).astype(dtype))
        new_feedback.append({route.axis: fb})
    return jax.tree.unflatten(treedef, unpack(reduced, layout, leaves)), tuple(new_feedback)
