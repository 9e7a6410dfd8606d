"""The single-device twin of every parallel train step.

Same loss, optimizer and precision policy, the whole global batch at once
on one device, no collectives. Parallel programs are tested against it.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from torsh_jax.plan import ParallelPlan
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> init, step = make_reference_step(loss, optax.sgd(0.1), ParallelPlan())
    >>> state, metrics = step(init({"w": jnp.zeros((3, 1))}), {"x": jnp.ones((2, 3)), "y": jnp.ones((2, 1))})
    >>> float(metrics["loss"])
    1.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.params import take_params
from torsh_jax.runtime.precision import cast_tree, state_params
from torsh_jax.runtime.state import TrainState
from torsh_jax.runtime.update import guarded_update, scaler_for

__all__ = ["make_reference_step", "reference_gradients"]

PyTree = Any


def reference_gradients(
    loss_fn: Callable,
    params: PyTree,
    batch: PyTree,
    plan: ParallelPlan,
    scale: jax.Array | None = None,
    *,
    dtype: str | None = None,
):
    """``(loss, grads)`` on the whole batch with the plan's precision policy, or every floating
    value in ``dtype`` when given (gradients of the loss times ``scale`` when given)."""
    param_dtype, compute_dtype, reduce_dtype = _policy(plan, dtype)
    params_c = cast_tree(params, compute_dtype)

    def scaled(p, b):
        loss = loss_fn(p, b)
        return (loss if scale is None else loss * scale.astype(loss.dtype)), loss

    (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params_c, batch)
    if plan.batch.accumulation_reduce == "sum":
        grads = jax.tree.map(lambda g: g * plan.batch.accumulation_steps, grads)
    grads = cast_tree(cast_tree(grads, reduce_dtype), param_dtype)
    return (loss if loss.dtype == jnp.float64 else loss.astype(jnp.float32)), grads


def _policy(plan: ParallelPlan, dtype: str | None) -> tuple[str, str, str]:
    """``(param, compute, reduce)`` dtypes: the plan's, or ``dtype`` for all three."""
    precision = plan.precision
    if dtype is not None:
        return dtype, dtype, dtype
    return precision.param_dtype, precision.compute_dtype, precision.reduce_dtype


def make_reference_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    plan: ParallelPlan,
    *,
    dtype: str | None = None,
):
    """``(init, step)`` of the single-device twin (jitted, no sharding).

    ``dtype`` replaces the plan's precision policy: parameters, compute and reduction all in it.
    ``"float64"`` (called under ``jax.enable_x64``) is the same math with negligible round-off, the
    reference :func:`torsh_jax.runtime.verify.compare_with_twin` measures both float32 programs
    against.
    """

    scaler = scaler_for(plan)
    param_dtype = _policy(plan, dtype)[0]

    def init(params: PyTree) -> TrainState:
        params = state_params(take_params(params, plan).params, param_dtype)
        scale_state = None if scaler is None else scaler.init()
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), scale_state)

    @jax.jit
    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        scale = None if scaler is None else state.loss_scale.scale
        loss, grads = reference_gradients(loss_fn, state.params, batch, plan, scale, dtype=dtype)
        update = guarded_update(
            optimizer, grads, state.opt_state, state.params, scaler=scaler, scale_state=state.loss_scale
        )
        new_state = update.advance(state)
        return new_state, {"loss": loss, **update.metrics}

    return init, step
