"""Compressed collectives, called inside ``shard_map`` on flat float32 buffers.

All-reduce ``x[n]`` over ``axis_size`` devices (two-phase methods):
compress ``x + worker residual`` -> all-to-all (device ``j`` receives every
device's ``j``-th slice) -> decompress and add in float32 in device order ->
(mean) -> compress ``shard + server residual`` -> all-gather -> decompress.
Payloads are integers on the wire (int8/uint8/uint16 plus float32 scales).
Top-k all-reduces by all-gathering the sparse payloads; PowerSGD all-reduces
its two small factors.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from torsh_jax.plan import CompressorSpec
    >>> spec = CompressorSpec(method="int8")
    >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> fb = init_feedback(spec, length=256, axis_size=1)
    >>> def step(x, fb):
    ...     return compressed_all_reduce(x, fb, spec=spec, axis_name="data", axis_size=1)
    >>> run = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
    >>> out, fb = run(jnp.ones(256), fb)
    >>> float(out[0])
    1.0
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from torsh_jax.compress import powersgd
from torsh_jax.compress.base import Compressor, check_flat
from torsh_jax.compress.factory import length_unit, make_compressor
from torsh_jax.compress.feedback import FeedbackState, init_feedback
from torsh_jax.errors import CompressionError
from torsh_jax.plan.compressors import METHODS, WEIGHT_METHODS
from torsh_jax.plan.spec import CompressorSpec

__all__ = [
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "compressed_all_gather",
    "init_feedback",
]

try:  # Varying -> invariant all-gather: the reduced buffer is typed as replicated.
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_replicated
except ImportError:  # pragma: no cover - older or newer JAX without it
    _all_gather_replicated = jax.lax.all_gather


def _device_key(key: jax.Array | None, axis_name: str, phase: int) -> jax.Array | None:
    if key is None:
        return None
    key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
    return jax.random.fold_in(key, phase)


def _check_input(x: jax.Array, spec: CompressorSpec, axis_size: int) -> None:
    if spec.method == "none":
        raise CompressionError(
            "method 'none' is not a compressed collective",
            key="compression.method",
            fix="call jax.lax.psum / psum_scatter / all_gather directly",
        )
    check_flat(x, multiple=axis_size * length_unit(spec), where="compression (buffer length)")


def _compress(compressor, spec, x, residual, key):
    """``(payload, new_residual)``; the residual is unchanged (empty) without feedback."""
    if spec.error_feedback:
        return compressor.compress_with_feedback(x, residual, key=key)
    payload, _ = compressor.compress(x, (), key=key)
    return payload, residual


def _all_to_all(payload, axis_name: str, axis_size: int):
    def exchange(leaf):
        split = leaf.reshape(axis_size, -1, *leaf.shape[1:])
        received = jax.lax.all_to_all(split, axis_name, 0, 0)
        return received.reshape(leaf.shape)

    return jax.tree.map(exchange, payload)


def _select(payload, index: int):
    return jax.tree.map(lambda leaf: leaf[index], payload)


def _sum_in_order(parts_Nxm: jax.Array) -> jax.Array:
    total = parts_Nxm[0]
    for part in parts_Nxm[1:]:
        total = total + part
    return total


def _finish(total: jax.Array, axis_size: int, mean: bool) -> jax.Array:
    return total / jnp.float32(axis_size) if mean else total


def _reduce_scatter_phase(compressor, spec, x, worker, *, axis_name, axis_size, key, mean):
    payload, worker = _compress(compressor, spec, x, worker, _device_key(key, axis_name, 1))
    received = compressor.decompress(_all_to_all(payload, axis_name, axis_size))
    shard = _finish(_sum_in_order(received.reshape(axis_size, -1)), axis_size, mean)
    return shard, worker


def _gather_sparse(compressor, spec, x, feedback, *, axis_name, axis_size, mean):
    payload, worker = _compress(compressor, spec, x, feedback.worker, None)
    gathered = jax.tree.map(lambda leaf: _all_gather_replicated(leaf, axis_name), payload)
    dense = jnp.stack(
        [compressor.decompress(jax.tree.map(lambda g, i=i: g[i], gathered)) for i in range(axis_size)]
    )
    return _finish(_sum_in_order(dense), axis_size, mean), feedback._replace(worker=worker)


def _powersgd_all_reduce(spec, x, feedback, *, axis_name, axis_size, mean):
    corrected = x + feedback.worker if spec.error_feedback else x
    m = corrected.reshape(powersgd.matrix_shape(x.shape[0]))
    p = powersgd.orthonormalise(jax.lax.psum(m @ feedback.warm_start, axis_name))
    q_local = m.T @ p
    q = _finish(jax.lax.psum(q_local, axis_name), axis_size, mean)
    worker = (m - p @ q_local.T).reshape(-1) if spec.error_feedback else feedback.worker
    # The warm start is per-device state (it is sharded like the residuals).
    warm_start = jax.lax.pcast(q, axis_name, to="varying")
    return (p @ q.T).reshape(-1), feedback._replace(worker=worker, warm_start=warm_start)


def _two_phase_all_reduce(compressor, spec, x, feedback, *, axis_name, axis_size, key, mean):
    shard, worker = _reduce_scatter_phase(
        compressor, spec, x, feedback.worker, axis_name=axis_name, axis_size=axis_size, key=key, mean=mean
    )
    payload, server = _compress(compressor, spec, shard, feedback.server, _device_key(key, axis_name, 2))
    gathered = jax.tree.map(lambda leaf: _all_gather_replicated(leaf, axis_name, tiled=True), payload)
    return compressor.decompress(gathered), feedback._replace(worker=worker, server=server)


def _with_warmup(spec, x, feedback, compressed, plain):
    """Run ``plain`` for the first ``warmup_steps`` steps, then ``compressed``; count the step."""
    if spec.warmup_steps == 0:
        out, feedback = compressed(x, feedback)
    else:
        out, feedback = jax.lax.cond(feedback.step[0] < spec.warmup_steps, plain, compressed, x, feedback)
    return out, feedback._replace(step=feedback.step + 1)


def _compressor(spec: CompressorSpec, implementation: str) -> Compressor:
    return make_compressor(spec, implementation=implementation)


def compressed_all_reduce(
    x: jax.Array,
    feedback: FeedbackState,
    /,
    *,
    spec: CompressorSpec,
    axis_name: str,
    axis_size: int,
    key: jax.Array | None = None,
    mean: bool = True,
    implementation: str = "auto",
) -> tuple[jax.Array, FeedbackState]:
    """All-reduce ``x[n]`` (sum, or mean when ``mean``) over ``axis_name`` with compression.

    Args:
        x: this device's flat float32 buffer; ``n`` a multiple of
            ``axis_size * block_size`` (see :func:`~torsh_jax.compress.padded_length`).
        feedback: this device's :class:`FeedbackState` from :func:`init_feedback`.
        spec: the compressor.
        axis_name, axis_size: the mesh axis reduced over and its size.
        key: PRNG key for stochastic rounding (the same on every device;
            folded with the device index).
        mean: divide the sum by ``axis_size``.
        implementation: ``auto``, ``reference``, ``pallas`` or ``pallas_interpret``
            (:mod:`~torsh_jax.compress.factory`): who runs the blockwise methods.

    Returns:
        ``(reduced x[n], new feedback)``; ``reduced`` is identical on every device.
    """
    _check_input(x, spec, axis_size)
    compressor = _compressor(spec, implementation)
    options = {"axis_name": axis_name, "axis_size": axis_size, "mean": mean}

    def compressed(x, feedback):
        reduction = METHODS[spec.method].all_reduce
        if reduction == "low_rank":
            return _powersgd_all_reduce(spec, x, feedback, **options)
        if reduction == "sparse_gather":
            return _gather_sparse(compressor, spec, x, feedback, **options)
        return _two_phase_all_reduce(compressor, spec, x, feedback, key=key, **options)

    def plain(x, feedback):
        reduced = jax.lax.psum(x, axis_name)
        return _finish(reduced, axis_size, mean), feedback

    return _with_warmup(spec, x, feedback, compressed, plain)


def compressed_reduce_scatter(
    x: jax.Array,
    feedback: FeedbackState,
    /,
    *,
    spec: CompressorSpec,
    axis_name: str,
    axis_size: int,
    key: jax.Array | None = None,
    mean: bool = True,
    implementation: str = "auto",
) -> tuple[jax.Array, FeedbackState]:
    """Reduce ``x[n]`` over ``axis_name`` and return this device's shard ``[n / axis_size]``.

    Shard ``i`` (on the device with axis index ``i``) is ``x[i*n/N:(i+1)*n/N]``
    of the reduction, as ``jax.lax.psum_scatter(..., tiled=True)`` returns.
    Uses only the worker residual; PowerSGD reduces in full and slices.

    Args: as :func:`compressed_all_reduce`.
    """
    _check_input(x, spec, axis_size)
    compressor = _compressor(spec, implementation)
    options = {"axis_name": axis_name, "axis_size": axis_size, "mean": mean}

    def compressed(x, feedback):
        if METHODS[spec.method].all_reduce == "low_rank":
            full, feedback = _powersgd_all_reduce(spec, x, feedback, **options)
            index = jax.lax.axis_index(axis_name)
            return full.reshape(axis_size, -1)[index], feedback
        shard, worker = _reduce_scatter_phase(compressor, spec, x, feedback.worker, key=key, **options)
        return shard, feedback._replace(worker=worker)

    def plain(x, feedback):
        shard = jax.lax.psum_scatter(x, axis_name, tiled=True)
        return _finish(shard, axis_size, mean), feedback

    return _with_warmup(spec, x, feedback, compressed, plain)


def compressed_all_gather(
    shard: jax.Array,
    /,
    *,
    spec: CompressorSpec,
    axis_name: str,
    axis_size: int,
    implementation: str = "auto",
) -> jax.Array:
    """All-gather ``shard[m]`` into ``[axis_size * m]`` with compressed payloads (ZeRO-3 weights).

    Nearest rounding, no feedback: every device decodes the same payloads,
    so the gathered weights are identical everywhere. ``implementation`` as
    in :func:`compressed_all_reduce`.

    Raises:
        CompressionError: a method not in :data:`~torsh_jax.plan.compressors.WEIGHT_METHODS`, or a
            shard length that is not a multiple of ``block_size``.
    """
    if spec.method not in WEIGHT_METHODS:
        raise CompressionError(
            f"method {spec.method!r} cannot compress weight all-gathers",
            key="compression.weights.method",
            fix=f"use one of {list(WEIGHT_METHODS)} for weights",
        )
    check_flat(shard, multiple=length_unit(spec), where="compression.weights (shard length)")
    compressor = _compressor(dataclasses.replace(spec, rounding="nearest"), implementation)
    payload, _ = compressor.compress(shard, ())
    gathered = jax.tree.map(lambda leaf: _all_gather_replicated(leaf, axis_name, tiled=True), payload)
    return compressor.decompress(gathered)
