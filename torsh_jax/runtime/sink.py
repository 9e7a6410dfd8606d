"""Accumulation that adds each layer's gradient into the step's running sum in place.

Summing gradients over micro-steps the plain way makes each micro-step's whole stacked layer
gradient and then adds it to the sum: two gradient-sized buffers at the backward pass's peak. Here
the layer scan reads each layer's parameters through :func:`_tap`, whose backward writes that
layer's gradient into a *sink*, a buffer the scan carries. Differentiated with the running sum as
the sink's cotangent, the backward returns the sum plus this micro-step's layer gradients, added a
layer at a time into the one buffer (XLA updates the slice in place, on CPU and TPU alike).

The embedding's and head's gradients are made whole and added, as before; only the stacked layers
take the in-place way.

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.runtime.layered import LayeredModel, shared_keys, split_params
    >>> model = LayeredModel(embed=lambda p, b: b * p["in"], layer=lambda p, h: h * p["w"],
    ...                      head=lambda p, h, b: jnp.sum(h), embed_keys=("in",), head_keys=())
    >>> params = {"in": jnp.float32(1.0), "layers": {"w": jnp.ones(2)}}
    >>> grads, loss = accumulate_into(model, params, jnp.arange(4.0), steps=2, reduce="sum")
    >>> float(loss), grads["layers"]["w"].tolist()
    (3.0, [6.0, 6.0])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from torsh_jax.runtime.accumulate import from_step_sums, split_micro_batches
from torsh_jax.runtime.layered import LayeredModel, shared_keys, split_params
from torsh_jax.runtime.pipeline.varying import settled
from torsh_jax.tensor.axis import vary_over, varying_axes
from torsh_jax.typing import PyTree

__all__ = ["accumulate_into", "sinks_layers"]


def sinks_layers(model: LayeredModel, params: PyTree) -> bool:
    """Whether :func:`accumulate_into` serves ``model`` and ``params``: the model has stacked layers
    (not a plain loss, :func:`~torsh_jax.runtime.layered.as_model`) under a key that neither the
    embedding nor the head reads, and ``params`` is a plain ``dict`` (the sums are rebuilt as one).
    Any other step sums each micro-step's whole gradient (the same sum, one gradient more at the
    peak), though the planner costs every layered model's step as summed in place.

    Example:
        >>> from torsh_jax.runtime.layered import LayeredModel, as_model
        >>> model = LayeredModel(embed=None, layer=None, head=None)
        >>> sinks_layers(model, {"embed": 0, "layers": 0, "head": 0}), sinks_layers(as_model(len), {})
        (True, False)
    """
    layers_apart = model.head_keys is not None and model.layers_key not in shared_keys(model)
    return model.stacked and layers_apart and type(params) is dict


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
    """``tap(one layer's params, sink, index) -> the params``, whose backward sends the layer's
    gradient into ``sink[index]`` (``kinds``: the sink's leaves' shape, dtype and varying axes)."""

    @jax.custom_vjp
    def tap(one, sink, index):
        return one

    def forward(one, sink, index):
        return one, index

    def backward(index, cotangent):
        return None, jax.tree.map(lambda k, g: _into_zeros(k, g, index), kinds, cotangent), None

    tap.defvjp(forward, backward)
    return tap


@dataclasses.dataclass(frozen=True)
class _Kind:
    """A sink leaf's type: shape, dtype and the manual axes it varies over (a pytree leaf)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: frozenset


def _into_zeros(kind: _Kind, gradient: jax.Array, index: jax.Array) -> jax.Array:
    """``gradient`` at ``index`` of zeros of ``kind`` (the scan's transpose adds it into the sink)."""
    gradient = vary_over(gradient.astype(kind.dtype), sorted(kind.axes))
    return jax.lax.dynamic_update_index_in_dim(_zeros(kind.shape, kind.dtype, kind.axes), gradient, index, 0)


def _zeros(shape: tuple[int, ...], dtype, axes) -> jax.Array:
    """Zeros of ``shape`` in ``dtype``, varying over the manual ``axes``."""
    return vary_over(jnp.zeros(shape, dtype), sorted(axes))


def _kinds(sink: PyTree) -> PyTree:
    """Each sink leaf's :class:`_Kind`, for the tap's backward (made where the sink is traced)."""
    return jax.tree.map(lambda s: _Kind(s.shape, s.dtype, varying_axes(s)), sink)


def _sunk_loss(model: LayeredModel, stacked: PyTree):
    """``loss(rest, sink, batch) -> (loss, sink)``: the model's loss with its layers read from
    ``stacked`` through the sink (``rest``: every other parameter). Differentiate it with respect to
    ``rest`` and ``sink`` only: the layers' gradients go to the sink, and ``stacked`` gets none."""

    def loss(rest, sink, batch):
        tap, bound = _tap(_kinds(sink)), model.on(batch)
        body = jax.checkpoint(bound.layer) if model.remat else bound.layer

        def step(carry, layer):
            hidden, sink = carry
            one, index = layer
            return (body(tap(one, sink, index), hidden), _kept(sink)), None

        embed, _, head = split_params(model, {**rest, model.layers_key: stacked})
        count = jax.tree.leaves(stacked)[0].shape[0]
        layers = (stacked, jnp.arange(count, dtype=jnp.int32))
        (hidden, sink), _ = jax.lax.scan(step, (model.embed(embed, batch), sink), layers)
        return model.head(head, hidden, batch), sink

    return loss


def accumulate_into(
    model: LayeredModel,
    params: dict,
    batch: PyTree,
    /,
    *,
    steps: int,
    reduce: str = "mean",
    accum_dtype: Any = jnp.float32,
    loss_scale: jax.Array | None = None,
) -> tuple[PyTree, jax.Array]:
    """:func:`~torsh_jax.runtime.accumulate.local_gradients` of a layered model, each layer's
    gradient added into the running sum in place (no micro-step's whole layer gradient): the same
    additions in the same order, so the same sums bit for bit.

    Args:
        model: a model :func:`sinks_layers` serves.
        params: its parameters (a plain ``dict``) in compute dtype.
        batch: local batch, leading dim divisible by ``steps``.
        steps: accumulation micro-steps.
        reduce: ``mean`` or ``sum`` over micro-steps.
        accum_dtype: dtype of the sums.
        loss_scale: the loss's cotangent (the loss scale); default one.

    Returns:
        ``(grads in accum_dtype, mean unscaled loss)``.
    """
    key = model.layers_key
    stacked, rest = params[key], {k: v for k, v in params.items() if k != key}
    loss_of = _sunk_loss(model, stacked)

    def micro_step(carry, micro):
        sums, loss_sum = carry
        (loss, _), vjp = jax.vjp(lambda r, s: loss_of(r, s, micro), rest, sums[key])
        scale = jnp.ones_like(loss) if loss_scale is None else loss_scale.astype(loss.dtype)
        grads, layers = vjp((vary_over(scale, sorted(varying_axes(loss))), sums[key]))
        sums = {**jax.tree.map(lambda s, g: s + g.astype(accum_dtype), {k: sums[k] for k in rest}, grads),
                key: layers}  # fmt: skip
        return (sums, loss_sum + loss.astype(jnp.float32)), None

    micro = split_micro_batches(batch, steps)
    zeros = (jax.tree.map(lambda p: _zeros(p.shape, accum_dtype, varying_axes(p)), params), jnp.float32(0))
    micro_step, zeros = settled(micro_step, zeros, jax.tree.map(lambda x: x[0], micro))
    (sums, loss_sum), _ = jax.lax.scan(micro_step, zeros, micro)
    return from_step_sums(sums, loss_sum, steps=steps, reduce=reduce)
