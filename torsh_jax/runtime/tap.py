"""A layer scan whose backward adds each layer's parameter gradient into a running sum in place.

:func:`scan_into` applies a layer to every slice of stacked parameters, as
:func:`~torsh_jax.runtime.layered.scan_layers` does, reading each slice through a *tap* whose
backward writes that layer's gradient into one slice of a *sink*, a buffer the scan carries.
Differentiated with the running sum as the sink's cotangent, the backward returns the sum plus these
layers' gradients, added a layer at a time into the one buffer (XLA updates the slice in place, on
CPU and TPU alike): the whole stacked gradient is never made beside the sum, and the additions are
the plain sum's (bit for bit in the accumulation tests; XLA may add a layer's gradient before
rounding it to a 16-bit compute dtype, as its excess precision allows). Gradient accumulation
(:mod:`torsh_jax.runtime.sink`) and a pipeline stage's backward
(:mod:`torsh_jax.runtime.pipeline.branches`) sum this way.

Example:
    >>> import jax, jax.numpy as jnp
    >>> stacked, total = jnp.arange(1.0, 4.0), jnp.full(3, 10.0)  # 3 layers of one weight each
    >>> layer = lambda w, h: h * w
    >>> run = lambda sink, h: scan_into(layer, stacked, h, sink)
    >>> (out, _), pull = jax.vjp(run, total, jnp.float32(1.0))
    >>> summed, _ = pull((jnp.float32(1.0), total))  # the sum's cotangent: the running sum
    >>> float(out), summed.tolist()  # d out / d w_i = out / w_i, added to 10
    (6.0, [16.0, 13.0, 12.0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from torsh_jax.tensor.axis import vary_over, varying_axes
from torsh_jax.typing import PyTree

__all__ = ["at_leading", "scan_into", "zeros_varying"]


def scan_into(
    layer: Callable, stacked: PyTree, hidden: jax.Array, sink: PyTree, *, remat: bool = False, at: tuple = ()
) -> tuple[jax.Array, PyTree]:
    """``(hidden after every layer, sink)``: ``layer(params, hidden)`` over the slices of
    ``stacked``, the gradient of slice ``i`` sent into ``sink[*at, i]``.

    Differentiate with respect to ``sink`` (its cotangent: the running sum, in the sink's dtype)
    and ``hidden``, not ``stacked``, which gets no gradient.

    Args:
        layer: ``layer(one slice of stacked, hidden) -> hidden``.
        stacked: the layers' parameters, stacked on a leading axis.
        hidden: the first layer's input.
        sink: a tree like ``stacked``, with the leading indices ``at`` before the layers' axis.
        remat: recompute each layer in the backward pass (``jax.checkpoint``).
        at: leading indices of ``sink`` (integer scalars), e.g. a chunk's.
    """
    tap, body = _tap(_kinds(sink)), jax.checkpoint(layer) if remat else layer

    def step(carry, sliced):
        hidden, sink = carry
        one, index = sliced
        return (body(tap(one, sink, (*at, index)), hidden), _kept(sink)), None

    count = jax.tree.leaves(stacked)[0].shape[0]
    (hidden, sink), _ = jax.lax.scan(step, (hidden, sink), (stacked, jnp.arange(count, dtype=jnp.int32)))
    return hidden, sink


def zeros_varying(shape: tuple[int, ...], dtype, axes) -> jax.Array:
    """Zeros of ``shape`` in ``dtype``, varying over the manual ``axes``."""
    return vary_over(jnp.zeros(shape, dtype), sorted(axes))


@jax.custom_jvp
def _kept(sink: PyTree) -> PyTree:
    """``sink`` as it is; its tangent is made anew (times one), so JAX does not lift the scan's
    unchanged carry out of the loop, which would sum the layers' gradients apart from the sink."""
    return sink


@_kept.defjvp
def _kept_jvp(primals, tangents):
    (sink,), (tangent,) = primals, tangents
    return sink, jax.tree.map(lambda t: t * jnp.ones((), t.dtype), tangent)


def _tap(kinds: PyTree):
    """``tap(one layer's params, sink, at) -> the params``, whose backward sends the layer's
    gradient into ``sink[*at]`` (``kinds``: the sink's leaves' shape, dtype and varying axes)."""

    @jax.custom_vjp
    def tap(one, sink, at):
        return one

    def forward(one, sink, at):
        return one, at

    def backward(at, cotangent):
        return None, jax.tree.map(lambda k, g: _into_zeros(k, g, at), kinds, cotangent), None

    tap.defvjp(forward, backward)
    return tap


@dataclasses.dataclass(frozen=True)
class _Kind:
    """A sink leaf's type: shape, dtype and the manual axes it varies over (a pytree leaf)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: frozenset


def at_leading(at: tuple, value: jax.Array) -> tuple[tuple, jax.Array]:
    """``(start, row)``: where ``value`` goes at the leading indices ``at`` of a larger array (int32
    starts, whatever the indices' integer type), and ``value`` shaped as that one-row slice.

    Example:
        >>> import jax.numpy as jnp
        >>> start, row = at_leading((1, 2), jnp.ones(3))
        >>> [int(i) for i in start], row.shape
        ([1, 2, 0], (1, 1, 3))
    """
    start = (*(jnp.asarray(i, jnp.int32) for i in at), *(jnp.int32(0),) * value.ndim)
    return start, value.reshape((1,) * len(at) + value.shape)


def _into_zeros(kind: _Kind, gradient: jax.Array, at: tuple) -> jax.Array:
    """``gradient`` at ``at`` of zeros of ``kind`` (the scan's transpose adds it into the sink)."""
    start, row = at_leading(at, vary_over(gradient.astype(kind.dtype), sorted(kind.axes)))
    return jax.lax.dynamic_update_slice(zeros_varying(kind.shape, kind.dtype, kind.axes), row, start)


def _kinds(sink: PyTree) -> PyTree:
    """Each sink leaf's :class:`_Kind`, for the tap's backward (made where the sink is traced)."""
    return jax.tree.map(lambda s: _Kind(s.shape, s.dtype, varying_axes(s)), sink)
