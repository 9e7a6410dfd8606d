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
from torsh_jax.parallel.ddp import gradient_factors, mark_varying
from torsh_jax.parallel.gather import GatherConfig, gather_tree
from torsh_jax.parallel.layered import LayeredModel, layered_loss, scan_layers, split_params
from torsh_jax.parallel.reduce_scatter import reduce_scatter_in_buckets
from torsh_jax.parallel.zero_layout import FSDP
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.train.precision import cast_tree, dtype_of

__all__ = ["gather_config", "zero12_gradients", "zero3_gradients"]

PyTree = Any
LossOrModel = Callable[[PyTree, PyTree], jax.Array] | LayeredModel


def gather_config(
    plan: ParallelPlan, *, axes: tuple[str, ...], size: int, replicated_axes: tuple[str, ...]
) -> GatherConfig:
    """The dtypes and factors of stage 3's gather / reduce-scatter pair."""
    pre, post = gradient_factors(plan, data_parallel_size=size)
    p = plan.precision
    return GatherConfig(p.compute_dtype, p.reduce_dtype, p.param_dtype, pre, post, axes, replicated_axes)


def _plain_loss(loss: LossOrModel) -> Callable:
    return layered_loss(loss) if isinstance(loss, LayeredModel) else loss


def zero12_gradients(
    loss: LossOrModel, plan: ParallelPlan, *, axes: tuple[str, ...], size: int, dims: PyTree
) -> Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]:
    """Stage 1/2: ``(replicated params, local batch) -> (grad shards, mean loss)``."""
    loss_fn = _plain_loss(loss)
    precision = plan.precision

    def program(params: PyTree, batch: PyTree, scale: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
        scatter = lambda grads: _reduce_scatter(grads, plan, axes=axes, size=size, dims=dims)
        params_c = mark_varying(cast_tree(params, precision.compute_dtype), axes)
        grads, value = local_gradients(
            loss_fn,
            params_c,
            batch,
            steps=plan.batch.accumulation_steps,
            reduce=plan.batch.accumulation_reduce,
            accum_dtype=dtype_of(precision.param_dtype),
            per_step=scatter if plan.zero.stage == 2 else None,
            loss_scale=scale,
        )
        shards = grads if plan.zero.stage == 2 else scatter(grads)
        return cast_tree(shards, precision.param_dtype), jax.lax.pmean(value, axes)

    return program


def _reduce_scatter(grads, plan, *, axes, size, dims):
    pre, post = gradient_factors(plan, data_parallel_size=size)
    other = tuple(a for a in axes if a != FSDP)
    scale = lambda x, f: x if f == 1.0 else x * jax.numpy.asarray(f, x.dtype)

    def scatter(rows):
        shard = jax.lax.psum_scatter(scale(rows, pre), FSDP, scatter_dimension=0, tiled=True)
        return scale(jax.lax.psum(shard, other) if other else shard, post)

    def all_reduce(flat):
        return scale(jax.lax.psum(scale(flat, pre), axes), post)

    return reduce_scatter_in_buckets(
        cast_tree(grads, plan.precision.reduce_dtype),
        dims,
        size=jax.lax.axis_size(FSDP),
        bucket_bytes=int(plan.communication.bucket_mb * 1e6),
        scatter=scatter,
        all_reduce=all_reduce,
    )


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
) -> Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]:
    """Stage 3: ``(param shards, local batch) -> (grad shards, mean loss)``.

    A :class:`LayeredModel` gathers one layer at a time inside the layer
    scan; a plain loss function gathers every top-level entry before use.
    With ``reshard_after_forward`` the gathered parameters are not kept for
    the backward pass: they are gathered again.
    """
    replicated = tuple(a for a in axes if a != FSDP)
    config = gather_config(plan, axes=axes, size=size, replicated_axes=replicated)
    if isinstance(loss, LayeredModel):
        loss_fn = _layered_zero3_loss(loss, dims, config, _remat_policy(plan))
    else:
        policy = _remat_policy(plan)
        loss_fn = _checkpointed(lambda s, b: loss(gather_tree(s, dims, config), b), policy)
    precision = plan.precision

    def program(shards: PyTree, batch: PyTree, scale: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
        grads, value = local_gradients(
            loss_fn,
            shards,
            batch,
            steps=plan.batch.accumulation_steps,
            reduce=plan.batch.accumulation_reduce,
            accum_dtype=dtype_of(precision.param_dtype),
            loss_scale=scale,
        )
        return grads, jax.lax.pmean(value, axes)

    return program
