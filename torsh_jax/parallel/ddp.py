"""Distributed data parallel as a per-device ``shard_map`` program.

``In[B_(data,fsdp), ...] · W[replicated] -> grads all-reduced over (data, fsdp)``

Each device computes gradients on its batch shard (accumulating micro-steps
locally), the gradients cross the wire once per optimizer step as fused
buckets in the plan's reduction dtype, and every device applies the same
optax update to its replica.

Example:
    >>> from torsh_jax.plan import ParallelPlan
    >>> gradient_factors(ParallelPlan(), data_parallel_size=8)
    (1.0, 0.125)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax  # noqa: F401  (types in signatures)

from torsh_jax.parallel.accumulate import local_gradients
from torsh_jax.parallel.buckets import reduce_in_buckets
from torsh_jax.parallel.compressed import AxisRoute, reduce_tree, step_key, tree_feedback
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.train.precision import cast_tree, dtype_of
from torsh_jax.train.state import TrainState
from torsh_jax.train.update import guarded_update, scaler_for

__all__ = [
    "gradient_factors",
    "all_reduce_gradients",
    "compressed_all_reduce_gradients",
    "ddp_feedback",
    "ddp_local_step",
    "mark_varying",
]

PyTree = Any


def gradient_factors(plan: ParallelPlan, *, data_parallel_size: int) -> tuple[float, float]:
    """``(pre, post)`` multipliers around the gradient sum over data-parallel ranks.

    ``prescale_gradients`` divides before the sum; otherwise
    ``gradient_predivide_factor`` f divides by f before and multiplies by
    f / n after (DeepSpeed and Horovod semantics). ``reduce_op = "sum"``
    keeps the sum.
    """
    comm = plan.communication
    n = float(data_parallel_size)
    if comm.reduce_op == "sum":
        return 1.0 / comm.gradient_predivide_factor, comm.gradient_predivide_factor
    if comm.prescale_gradients:
        return 1.0 / n, 1.0
    f = comm.gradient_predivide_factor
    return 1.0 / f, f / n


def mark_varying(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Mark replicated values as per-device along ``axes``.

    Differentiating a replicated value against a per-device batch would make
    JAX insert the gradient sum itself; marking it varying first keeps the
    gradients per-device so that the program places the reduction.
    """
    if not axes:
        return tree
    return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)


def all_reduce_gradients(grads: PyTree, plan: ParallelPlan, *, axes: tuple[str, ...], size: int) -> PyTree:
    """Bucketed all-reduce of per-device gradients over ``axes`` (mean by default)."""
    pre, post = gradient_factors(plan, data_parallel_size=size)
    reduce_dtype = dtype_of(plan.precision.reduce_dtype)
    bucket_bytes = int(plan.communication.bucket_mb * 1e6)

    def reduce(flat):
        if pre != 1.0:
            flat = flat * jax.numpy.asarray(pre, flat.dtype)
        total = jax.lax.psum(flat, axes)
        return total if post == 1.0 else total * jax.numpy.asarray(post, total.dtype)

    return reduce_in_buckets(cast_tree(grads, reduce_dtype), bucket_bytes=bucket_bytes, reduce=reduce)


def _bucket_options(plan: ParallelPlan) -> dict:
    return {
        "bucket_bytes": int(plan.communication.bucket_mb * 1e6),
        "itemsize": jnp.dtype(dtype_of(plan.precision.reduce_dtype)).itemsize,
    }


def ddp_feedback(params_like: PyTree, plan: ParallelPlan, *, route: AxisRoute, copies: int) -> tuple:
    """Zero error feedback of every gradient bucket (global: ``copies`` devices on dim 0)."""
    return tree_feedback(jax.tree.leaves(params_like), route=route, copies=copies, **_bucket_options(plan))


def compressed_all_reduce_gradients(
    grads: PyTree,
    feedback: tuple,
    plan: ParallelPlan,
    *,
    axes: tuple[str, ...],
    size: int,
    route: AxisRoute,
    key: jax.Array | None,
) -> tuple[PyTree, tuple]:
    """Bucketed all-reduce with ``route.axis`` compressed (the other axes first, plain).

    Returns the reduced gradients (reduction dtype) and every bucket's new feedback.
    """
    return reduce_tree(
        cast_tree(grads, plan.precision.reduce_dtype),
        feedback,
        route=route,
        plain_axes=tuple(a for a in axes if a != route.axis),
        factors=gradient_factors(plan, data_parallel_size=size),
        bucket_bytes=_bucket_options(plan)["bucket_bytes"],
        key=key,
    )


def ddp_local_step(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    optimizer: optax.GradientTransformation,
    plan: ParallelPlan,
    *,
    axes: tuple[str, ...],
    size: int,
    route: AxisRoute | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """The per-device DDP step ``(state, local_batch) -> (state, metrics)``.

    Args:
        loss_fn: ``(params, batch) -> scalar`` on a local batch.
        optimizer: optax transformation.
        plan: the plan (precision, batch, communication).
        axes: data-parallel mesh axes to reduce over.
        size: product of their sizes.
        route: the compressed axis, if any (feedback in ``state.feedback``).
    """
    precision = plan.precision
    param_dtype = dtype_of(precision.param_dtype)
    scaler = scaler_for(plan)

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        params_c = mark_varying(cast_tree(state.params, precision.compute_dtype), axes)
        grads, loss = local_gradients(
            loss_fn,
            params_c,
            batch,
            steps=plan.batch.accumulation_steps,
            reduce=plan.batch.accumulation_reduce,
            accum_dtype=param_dtype,
            loss_scale=None if scaler is None else state.loss_scale.scale,
        )
        feedback = state.feedback
        if route is None:
            grads = all_reduce_gradients(grads, plan, axes=axes, size=size)
        else:
            key = step_key(state.step, {route.axis: route})
            grads, feedback = compressed_all_reduce_gradients(
                grads, feedback, plan, axes=axes, size=size, route=route, key=key
            )
        grads = cast_tree(grads, param_dtype)
        update = guarded_update(
            optimizer, grads, state.opt_state, state.params, scaler=scaler, scale_state=state.loss_scale
        )
        metrics = {"loss": jax.lax.pmean(loss, axes), **update.metrics}
        return update.advance(state)._replace(feedback=feedback), metrics

    return step
