"""Per-device gradients over accumulation micro-steps (no communication).

Runs inside ``shard_map``: the local batch ``[accum * micro, ...]`` is split
into ``accum`` micro-batches, gradients are summed in ``accum_dtype`` with a
``lax.scan`` and averaged (DeepSpeed) or kept summed (Horovod). No collective
is issued here, so the caller reduces exactly once per optimizer step. A layered
model whose micro-steps are not reduced apart adds each layer's gradient into the
sum in place instead (:mod:`torsh_jax.runtime.sink`).

Example:
    >>> import jax.numpy as jnp
    >>> loss = lambda p, b: jnp.mean((b * p["w"]) ** 2)
    >>> grads, value = local_gradients(loss, {"w": jnp.float32(1.0)}, jnp.arange(4.0),
    ...                                steps=2, reduce="mean")
    >>> float(value), float(grads["w"])
    (3.5, 7.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from torsh_jax.runtime.traced import traced_once
from torsh_jax.tensor.axis import vary_over
from torsh_jax.typing import PyTree

__all__ = ["local_gradients", "accumulate", "split_micro_batches", "from_step_sums"]


def _zeros_of(shape: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``shape``, varying over the ``shard_map`` axes it varies over."""
    manual = getattr(shape, "manual_axis_type", None)
    zeros = jnp.zeros(shape.shape, shape.dtype)
    return vary_over(zeros, sorted(manual.varying)) if manual is not None else zeros


def split_micro_batches(batch: PyTree, steps: int) -> PyTree:
    """Reshape every leaf ``[steps * m, ...] -> [steps, m, ...]``."""
    return jax.tree.map(lambda x: x.reshape(steps, x.shape[0] // steps, *x.shape[1:]), batch)


def local_gradients(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    batch: PyTree,
    /,
    *,
    steps: int,
    reduce: str = "mean",
    accum_dtype: Any = jnp.float32,
    loss_scale: jax.Array | None = None,
    per_step: Callable[[PyTree], PyTree] | None = None,
) -> tuple[PyTree, jax.Array]:
    """Gradients of ``loss_fn`` at ``params`` over ``steps`` micro-batches.

    Args:
        loss_fn: ``(params, batch) -> scalar``.
        params: parameters in compute dtype.
        batch: local batch, leading dim divisible by ``steps``.
        steps: accumulation micro-steps.
        reduce: ``mean`` or ``sum`` over micro-steps.
        accum_dtype: dtype of the gradient accumulator.
        loss_scale: multiply the loss by this before differentiating.
        per_step: applied to each micro-step's gradients before they are
            accumulated (e.g. ZeRO-2's reduce-scatter into a sharded
            accumulator); default: none, so nothing is communicated here.

    Returns:
        ``(grads in accum_dtype, mean unscaled loss)``.
    """

    def scaled(p, b):
        loss = loss_fn(p, b)
        return (loss if loss_scale is None else loss * loss_scale.astype(loss.dtype)), loss

    grad_fn = jax.value_and_grad(scaled, has_aux=True)

    def gradients(p, micro):
        (_, loss), grads = grad_fn(p, micro)
        return grads, loss, ()

    grads, loss, _ = accumulate(gradients, params, batch, steps=steps, reduce=reduce,
                                accum_dtype=accum_dtype, per_step=per_step)  # fmt: skip
    return grads, loss


def accumulate(
    gradients: Callable[[PyTree, PyTree], tuple[PyTree, jax.Array, PyTree]],
    params: PyTree,
    batch: PyTree,
    /,
    *,
    steps: int,
    reduce: str = "mean",
    accum_dtype: Any = jnp.float32,
    per_step: Callable[[PyTree], PyTree] | None = None,
) -> tuple[PyTree, jax.Array, PyTree]:
    """:func:`local_gradients` for any ``gradients(params, micro batch) -> (grads, loss, extras)``
    (e.g. a pipeline pass); ``extras`` (counters) are summed over the micro-steps."""

    def to_acc(tree):
        tree = jax.tree.map(lambda g: g.astype(accum_dtype), tree)
        return tree if per_step is None else jax.tree.map(lambda g: g.astype(accum_dtype), per_step(tree))

    def one(micro):
        grads, loss, extras = gradients(params, micro)
        return to_acc(grads), loss.astype(jnp.float32), extras

    if steps == 1:
        return one(batch)

    micro = split_micro_batches(batch, steps)
    # ``one`` (the model's whole micro-step) traced once for both the loop's zeros and its body
    one_traced, shapes = traced_once(one, jax.tree.map(lambda x: x[0], micro))

    def body(carry, micro):
        return jax.tree.map(jnp.add, carry, one_traced(micro)), None

    # every micro-step in the loop, from zeros: a first step outside it would keep its activations
    # apart from the loop body's (two micro-steps' activations at the peak, seen on XLA:CPU and TPU)
    (grads, loss_sum, extras), _ = jax.lax.scan(body, jax.tree.map(_zeros_of, shapes), micro)
    return (*from_step_sums(grads, loss_sum, steps=steps, reduce=reduce), extras)


def from_step_sums(
    grads: PyTree, loss_sum: jax.Array, *, steps: int, reduce: str
) -> tuple[PyTree, jax.Array]:
    """The step's ``(grads, mean loss)`` from their sums over ``steps`` micro-steps: the gradients
    averaged (``reduce`` ``mean``) or kept summed (``sum``), the loss averaged either way.

    Example:
        >>> grads, loss = from_step_sums({"w": jnp.float32(6.0)}, jnp.float32(3.0), steps=2, reduce="mean")
        >>> float(grads["w"]), float(loss)
        (3.0, 1.5)
    """
    if reduce == "mean":
        grads = jax.tree.map(lambda g: g / jnp.asarray(steps, g.dtype), grads)
    return grads, loss_sum / steps
