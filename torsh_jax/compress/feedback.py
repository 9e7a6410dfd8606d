"""Error-feedback state kept in the train state (sharded like optimizer state).

One :class:`FeedbackState` per compressed buffer and device:

* ``worker``: what this device's compression lost, added to its next
  gradient (``[length]``);
* ``server``: what the re-quantisation of this device's reduced shard lost
  in a two-phase all-reduce (``[length // axis_size]``);
* ``warm_start``: PowerSGD's ``Q`` from the previous step;
* ``step``: steps taken, for ``warmup_steps`` (``int32 [1]``).

Every leaf is this device's own and has a leading dim, so the global
state is the per-device states concatenated along dim 0 and shards with
``PartitionSpec(axis)`` on every leaf (like optimizer state under ZeRO).

Unused fields are empty arrays, so the pytree structure depends only on the
spec. With ``E_t`` the worker residual and ``C`` the compressor, every step
sends ``C(g_t + E_t)`` and keeps ``E_{t+1} = g_t + E_t - C(g_t + E_t)``,
hence ``sum_t C(...) = sum_t g_t - E_T``.

Example:
    >>> from torsh_jax.plan import CompressorSpec
    >>> state = init_feedback(CompressorSpec(method="int8"), length=4096, axis_size=8)
    >>> state.worker.shape, state.server.shape, state.warm_start.shape
    ((4096,), (512,), (0, 0))
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from torsh_jax.compress import powersgd
from torsh_jax.compress.factory import length_unit
from torsh_jax.errors import CompressionError
from torsh_jax.plan.compressors import METHODS
from torsh_jax.plan.spec import CompressorSpec

__all__ = ["FeedbackState", "feedback_shapes", "init_feedback", "two_phase"]


class FeedbackState(NamedTuple):
    """Error-feedback residuals and compressor state of one buffer (see module docstring)."""

    worker: jax.Array
    server: jax.Array
    warm_start: jax.Array
    step: jax.Array


def two_phase(spec: CompressorSpec) -> bool:
    """True when the all-reduce quantises twice (before the all-to-all and before the all-gather)."""
    method = METHODS.get(spec.method)
    return method is not None and method.all_reduce == "two_phase"


def _empty(*shape: int) -> jax.Array:
    return jnp.zeros(shape, jnp.float32)


def init_feedback(spec: CompressorSpec, /, *, length: int, axis_size: int) -> FeedbackState:
    """Zero residuals for a per-device buffer of ``length`` reduced over ``axis_size`` devices.

    Raises:
        CompressionError: ``length`` is not a multiple of ``axis_size`` times
            the block (chunk) size, or ``spec.method == "none"``.
    """
    if spec.method == "none":
        raise CompressionError(
            "method 'none' keeps no feedback", key="compression.method", fix="use the plain collective"
        )
    unit = axis_size * length_unit(spec)
    if length % unit:
        raise CompressionError(
            f"length {length} is not a multiple of axis_size * block = {unit}",
            key="length",
            fix="pad the buffer to compress.padded_length(n, axis_size=..., spec=...)",
        )
    shapes = feedback_shapes(spec, length=length, axis_size=axis_size)
    low_rank = METHODS[spec.method].all_reduce == "low_rank"
    warm = powersgd.initial_q(length, rank=spec.rank) if low_rank else _empty(*shapes.warm_start)
    return FeedbackState(
        _empty(*shapes.worker), _empty(*shapes.server), warm, jnp.zeros(shapes.step, jnp.int32)
    )


def feedback_shapes(spec: CompressorSpec, /, *, length: int, axis_size: int) -> FeedbackState:
    """The shapes (tuples) of :func:`init_feedback`'s state for a buffer of ``length`` reduced
    over ``axis_size`` devices, nothing allocated (the planner counts them).

    Example:
        >>> from torsh_jax.plan import CompressorSpec
        >>> feedback_shapes(CompressorSpec(method="int8"), length=4096, axis_size=8)
        FeedbackState(worker=(4096,), server=(512,), warm_start=(0, 0), step=(1,))
    """
    feedback, low_rank = spec.error_feedback, METHODS[spec.method].all_reduce == "low_rank"
    return FeedbackState(
        worker=(length,) if feedback else (0,),
        server=(length // axis_size,) if feedback and two_phase(spec) else (0,),
        warm_start=powersgd.q_shape(length, rank=spec.rank) if low_rank else (0, 0),
        step=(1,),
    )
