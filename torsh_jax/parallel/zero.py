"""ZeRO stages 1-3 and HSDP as per-device gradient programs (run inside ``shard_map``).

Stage 1: ``grads reduce-scattered over fsdp (+ all-reduced over data) once per step; opt[D/fsdp]``
Stage 2: ``grads reduce-scattered every micro-step into a sharded accumulator dW[D/fsdp]``
Stage 3: ``W[D/fsdp] all-gathered on use (per layer), dW reduce-scattered on the way back``

Each program returns this device's gradient shards (plan's parameter dtype)
and the mean loss; the optimizer then updates only the shards and, for
stages 1 and 2, the updated shards are all-gathered back to every device.
Stages 1 and 2 reduce once per optimizer step; stage 3 reduces every
micro-step (its parameters exist only as shards between uses).

Example:
    >>> from torsh_jax.plan import plan_from_dict
    >>> plan = plan_from_dict({"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": 3}})
    >>> gather_config(plan, axes=("data", "fsdp"), size=8, replicated_axes=("data",)).post
    0.125
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from torsh_jax.parallel.accumulate import local_gradients
from torsh_jax.parallel.compressed import AxisRoute, reduce_tree, step_key
from torsh_jax.parallel.ddp import gradient_factors, mark_varying
from torsh_jax.parallel.gather import GatherConfig, gather_tree
from torsh_jax.parallel.layered import LayeredModel, layered_loss, scan_layers, split_params
from torsh_jax.parallel.reduce_scatter import reduce_scatter_in_buckets
from torsh_jax.parallel.zero_compressed import make_compressed_scatter
from torsh_jax.parallel.zero_layout import FSDP
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.train.precision import cast_tree, dtype_of

__all__ = ["gather_config", "zero12_gradients", "zero3_gradients"]

PyTree = Any
LossOrModel = Callable[[PyTree, PyTree], jax.Array] | LayeredModel


def gather_config(
    plan: ParallelPlan,
    *,
    axes: tuple[str, ...],
    size: int,
    replicated_axes: tuple[str, ...],
    routes: dict[str, AxisRoute] | None = None,
) -> GatherConfig:
    """The dtypes, factors and compression of stage 3's gather / reduce-scatter pair.

    A compressed ``data`` axis is deferred: the backward pass reduces over
    ``fsdp`` only and the program all-reduces the shards over ``data`` with
    error feedback once per step.
    """
    pre, post = gradient_factors(plan, data_parallel_size=size)
    p = plan.precision
    routes = routes or {}
    fsdp = plan.compression_for(FSDP)
    return GatherConfig(
        p.compute_dtype, p.reduce_dtype, p.param_dtype, pre, post, axes, replicated_axes,
        deferred_axes=("data",) if "data" in routes else (),
        weights=fsdp.weights if fsdp is not None and fsdp.weights and fsdp.weights.method != "none" else None,
        gradients=routes.get(FSDP),
    )  # fmt: skip


def _plain_loss(loss: LossOrModel) -> Callable:
    return layered_loss(loss) if isinstance(loss, LayeredModel) else loss


def zero12_gradients(
    loss: LossOrModel,
    plan: ParallelPlan,
    *,
    axes: tuple[str, ...],
    size: int,
    dims: PyTree,
    routes: dict[str, AxisRoute] | None = None,
) -> Callable:
    """Stage 1/2: ``(params, local batch, scale, feedback, step) -> (grad shards, mean loss, feedback)``.

    With compressed axes (``routes``) the gradients are reduced once per
    optimizer step, stage 2 included, so that every bucket's error feedback
    advances once per step.
    """
    loss_fn = _plain_loss(loss)
    precision = plan.precision
    routes = routes or {}

    def program(params, batch, scale=None, feedback=(), step=None):
        if routes:
            grads, value = _local(params, batch, scale, per_step=None)
            shards, feedback = _compressed_reduce_scatter(grads, feedback, step)
            return shards, value, feedback
        scatter = lambda grads: _reduce_scatter(grads, plan, axes=axes, size=size, dims=dims)
        per_step = scatter if plan.zero.stage == 2 else None
        grads, value = _local(params, batch, scale, per_step=per_step)
        shards = grads if per_step is not None else scatter(grads)
        return cast_tree(shards, precision.param_dtype), value, feedback

    def _compressed_reduce_scatter(grads, feedback, step):
        scatter, new_feedback = make_compressed_scatter(
            feedback,
            routes=routes,
            other_axes=tuple(a for a in axes if a != FSDP),
            factors=gradient_factors(plan, data_parallel_size=size),
            key=step_key(step, routes),
        )
        shards = _bucketed(grads, plan, dims=dims, scatter=scatter, axes=axes, size=size)
        return cast_tree(shards, precision.param_dtype), tuple(new_feedback)

    def _local(params, batch, scale, *, per_step):
        params_c = mark_varying(cast_tree(params, precision.compute_dtype), axes)
        grads, value = local_gradients(
            loss_fn,
            params_c,
            batch,
            steps=plan.batch.accumulation_steps,
            reduce=plan.batch.accumulation_reduce,
            accum_dtype=dtype_of(precision.param_dtype),
            per_step=per_step,
            loss_scale=scale,
        )
        return grads, jax.lax.pmean(value, axes)

    return program


def _scale(x: jax.Array, factor: float) -> jax.Array:
    return x if factor == 1.0 else x * jax.numpy.asarray(factor, x.dtype)


def _bucketed(grads, plan, *, dims, scatter, axes, size):
    """Reduce-scatter sharded leaves in buckets with ``scatter``; all-reduce replicated leaves plainly."""
    pre, post = gradient_factors(plan, data_parallel_size=size)
    return reduce_scatter_in_buckets(
        cast_tree(grads, plan.precision.reduce_dtype),
        dims,
        size=jax.lax.axis_size(FSDP),
        bucket_bytes=int(plan.communication.bucket_mb * 1e6),
        scatter=scatter,
        all_reduce=lambda flat: _scale(jax.lax.psum(_scale(flat, pre), axes), post),
    )


def _reduce_scatter(grads, plan, *, axes, size, dims):
    pre, post = gradient_factors(plan, data_parallel_size=size)
    other = tuple(a for a in axes if a != FSDP)

    def scatter(rows, index):
        shard = jax.lax.psum_scatter(_scale(rows, pre), FSDP, scatter_dimension=0, tiled=True)
        return _scale(jax.lax.psum(shard, other) if other else shard, post)

    return _bucketed(grads, plan, dims=dims, scatter=scatter, axes=axes, size=size)


def _remat_policy(plan: ParallelPlan):
    """Re-gather in the backward pass: recompute each layer (or top-level
    entry) from its input, gather included; otherwise keep everything."""
    return jax.checkpoint_policies.nothing_saveable if plan.zero.reshard_after_forward else None


def _checkpointed(fn: Callable, policy) -> Callable:
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


def _layer_dims(dims: PyTree) -> PyTree:
    """Shard dims of one layer's slice of stacked parameters (the layers dim is gone)."""
    return jax.tree.map(lambda d: None if d is None else d - 1, dims, is_leaf=lambda x: x is None)


def _layered_zero3_loss(model: LayeredModel, dims: dict, config: GatherConfig, policy) -> Callable:
    def loss(shards, batch):
        embed_s, stacked_s, head_s = split_params(model, shards)
        embed_d, stacked_d, head_d = split_params(model, dims)
        layer_d = _layer_dims(stacked_d)
        # Embed and head stay gathered through the backward pass (like FSDP's root
        # module); each stacked layer is re-gathered when reshard_after_forward.
        layer = _checkpointed(lambda s, h: model.layer(gather_tree(s, layer_d, config), h), policy)
        hidden = model.embed(gather_tree(embed_s, embed_d, config), batch)
        hidden = scan_layers(layer, stacked_s, hidden)
        return model.head(gather_tree(head_s, head_d, config), hidden, batch)

    return loss


def zero3_gradients(
    loss: LossOrModel,
    plan: ParallelPlan,
    *,
    axes: tuple[str, ...],
    size: int,
    dims: PyTree,
    routes: dict[str, AxisRoute] | None = None,
) -> Callable:
    """Stage 3: ``(param shards, local batch, scale, feedback, step) -> (grad shards, mean loss, feedback)``.

    A :class:`LayeredModel` gathers one layer at a time inside the layer
    scan; a plain loss function gathers every top-level entry before use.
    With ``reshard_after_forward`` the gathered parameters are not kept for
    the backward pass: they are gathered again. A compressed ``data`` axis
    (HSDP) is reduced once per step after accumulation, with error feedback.
    """
    replicated = tuple(a for a in axes if a != FSDP)
    routes = routes or {}
    config = gather_config(plan, axes=axes, size=size, replicated_axes=replicated, routes=routes)
    if isinstance(loss, LayeredModel):
        loss_fn = _layered_zero3_loss(loss, dims, config, _remat_policy(plan))
    else:
        policy = _remat_policy(plan)
        loss_fn = _checkpointed(lambda s, b: loss(gather_tree(s, dims, config), b), policy)
    precision = plan.precision

    deferred = config.deferred_axes

    def program(shards, batch, scale=None, feedback=(), step=None):
        grads, value = local_gradients(
            loss_fn,
            mark_varying(shards, deferred),
            batch,
            steps=plan.batch.accumulation_steps,
            reduce=plan.batch.accumulation_reduce,
            accum_dtype=dtype_of(precision.param_dtype),
            loss_scale=scale,
        )
        if deferred:
            grads, feedback = reduce_tree(
                cast_tree(grads, precision.reduce_dtype),
                feedback,
                route=routes["data"],
                plain_axes=(),
                factors=(1.0, config.post),
                bucket_bytes=int(plan.communication.bucket_mb * 1e6),
                key=step_key(step, routes),
            )
            grads = cast_tree(grads, precision.param_dtype)
        return grads, jax.lax.pmean(value, axes), feedback

    return program
