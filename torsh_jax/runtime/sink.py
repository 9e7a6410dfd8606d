"""Accumulation that adds each layer's gradient into the step's running sum in place.

Summing gradients over micro-steps the plain way makes each micro-step's whole stacked layer
gradient and then adds it to the sum: two gradient-sized buffers at the backward pass's peak. Here
the layers run through :func:`~torsh_jax.runtime.tap.scan_into`, differentiated with the running
sum as its sink's cotangent: the backward returns the sum plus this micro-step's layer gradients,
added a layer at a time into the one buffer.

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

from typing import Any

import jax
import jax.numpy as jnp

from torsh_jax.runtime.accumulate import from_step_sums, split_micro_batches
from torsh_jax.runtime.layered import LayeredModel, shared_keys, split_params
from torsh_jax.runtime.pipeline.varying import settled
from torsh_jax.runtime.tap import scan_into, zeros_varying
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


def _sunk_loss(model: LayeredModel, stacked: PyTree):
    """``loss(rest, sink, batch) -> (loss, sink)``: the model's loss with its layers read from
    ``stacked`` through the sink (``rest``: every other parameter). Differentiate it with respect to
    ``rest`` and ``sink`` only: the layers' gradients go to the sink, and ``stacked`` gets none."""

    def loss(rest, sink, batch):
        embed, _, head = split_params(model, {**rest, model.layers_key: stacked})
        bound = model.on(batch)
        hidden, sink = scan_into(bound.layer, stacked, model.embed(embed, batch), sink, remat=model.remat)
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
    sums = jax.tree.map(lambda p: zeros_varying(p.shape, accum_dtype, varying_axes(p)), params)
    zeros = (sums, jnp.float32(0))
    micro_step, zeros = settled(micro_step, zeros, jax.tree.map(lambda x: x[0], micro))
    (sums, loss_sum), _ = jax.lax.scan(micro_step, zeros, micro)
    return from_step_sums(sums, loss_sum, steps=steps, reduce=reduce)
