"""The step program of each strategy: state specs plus ``(state, batch) -> (state, metrics)``.

DDP runs entirely inside one ``shard_map``. ZeRO runs its gradient program
inside ``shard_map`` (where every gradient collective is placed), updates
only the shards with optax on sharded arrays (so global norms and trust
ratios see the whole model), and for stages 1 and 2 all-gathers the
updated shards in a second ``shard_map``.

Example:
    >>> from torsh_jax.plan import plan_from_dict
    >>> strategy(plan_from_dict({"mesh": {"fsdp": -1, "data": 1}, "zero": {"stage": 2}}), {"fsdp": 8})
    'zero2'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torsh_jax.parallel.compressed import feedback_specs, gradient_routes, tree_feedback
from torsh_jax.parallel.ddp import ddp_feedback, ddp_local_step
from torsh_jax.parallel.layered import LayeredModel, layered_loss
from torsh_jax.parallel.mesh import data_axes
from torsh_jax.parallel.reduce_scatter import all_gather_params
from torsh_jax.parallel.sharding import named_shardings, param_specs
from torsh_jax.parallel.zero import zero3_gradients, zero12_gradients
from torsh_jax.parallel.zero_compressed import local_shard_shapes, zero12_feedback
from torsh_jax.parallel.zero_layout import FSDP, shard_dims, sharded_specs
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.train.precision import dtype_of
from torsh_jax.train.state import TrainState
from torsh_jax.train.update import guarded_update, scaler_for

__all__ = ["Program", "strategy", "build_program", "opt_state_specs"]

PyTree = Any


class Program(NamedTuple):
    """A strategy's state layout and per-step function (to be jitted).

    ``init_feedback`` returns the zero error-feedback state (``None`` without compression).
    """

    state_specs: TrainState
    run: Callable[[TrainState, PyTree], tuple[TrainState, dict]]
    init_feedback: Callable[[], PyTree] | None = None


def strategy(plan: ParallelPlan, mesh_shape) -> str:
    """``ddp``, ``zero1``, ``zero2`` or ``zero3`` for this plan on this mesh."""
    if plan.zero.stage == 0 or mesh_shape["fsdp"] == 1:
        return "ddp"
    return f"zero{plan.zero.stage}"


def opt_state_specs(optimizer: optax.GradientTransformation, abstract_opt_state: PyTree, specs: PyTree):
    """Specs for optimizer state: parameter-shaped leaves follow their parameter."""
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        abstract_opt_state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


def _scale_specs(plan: ParallelPlan) -> PyTree:
    """Replicated specs for the loss-scaler state, or ``None`` without scaling."""
    scaler = scaler_for(plan)
    return None if scaler is None else jax.tree.map(lambda _: P(), jax.eval_shape(scaler.init))


def _batch_specs(batch: PyTree, axes: tuple[str, ...]) -> PyTree:
    return jax.tree.map(lambda x: P(axes, *([None] * (x.ndim - 1))), batch)


def _dp_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    return size


def build_program(loss, optimizer, plan: ParallelPlan, mesh: Mesh, params_like: PyTree) -> Program:
    """The program for ``plan``'s strategy on ``mesh``.

    Args:
        loss: ``loss_fn(params, batch)`` or a :class:`LayeredModel`.
        optimizer: optax transformation.
        plan: the plan.
        mesh: the mesh.
        params_like: parameters or their shapes (in the plan's param dtype).
    """
    axes = data_axes(mesh)
    base = param_specs(params_like, plan, mesh)
    kind = strategy(plan, mesh.shape)
    if kind == "ddp":
        return _ddp_program(loss, optimizer, plan, mesh, params_like, base, axes)
    dims = shard_dims(params_like, plan, mesh)
    return _zero_program(loss, optimizer, plan, mesh, params_like, base, dims, axes)


def _feedback_layout(init_feedback, axes) -> tuple:
    """``(init, specs)`` of the feedback state; ``(None, None)`` without compression."""
    if init_feedback is None:
        return None, None
    return init_feedback, feedback_specs(jax.eval_shape(init_feedback), axes)


def _bucket_itemsize(plan: ParallelPlan) -> int:
    return jax.numpy.dtype(dtype_of(plan.precision.reduce_dtype)).itemsize


def _ddp_program(loss, optimizer, plan, mesh, params_like, base, axes) -> Program:
    loss_fn = layered_loss(loss) if isinstance(loss, LayeredModel) else loss
    abstract_opt = jax.eval_shape(optimizer.init, params_like)
    size = _dp_size(mesh, axes)
    route = next(iter(gradient_routes(plan, mesh.shape).values()), None)
    # The other data-parallel axis is reduced before compression: the feedback is replicated over it.
    fb_axes = () if route is None else (route.axis,)
    make = None if route is None else lambda: ddp_feedback(params_like, plan, route=route, copies=route.size)
    init_feedback, fb_specs = _feedback_layout(make, fb_axes)
    specs = TrainState(
        step=P(),
        params=base,
        opt_state=opt_state_specs(optimizer, abstract_opt, base),
        loss_scale=_scale_specs(plan),
        feedback=fb_specs,
    )
    local = ddp_local_step(loss_fn, optimizer, plan, axes=axes, size=size, route=route)

    def run(state, batch):
        program = jax.shard_map(
            local, mesh=mesh, in_specs=(specs, _batch_specs(batch, axes)), out_specs=(specs, P())
        )
        return program(state, batch)

    return Program(specs, run, init_feedback)


def _zero_feedback(plan, mesh, params_like, dims, routes, copies):
    """The zero-feedback builder of a ZeRO program (``None`` without compressed gradients)."""
    options = {
        "bucket_bytes": int(plan.communication.bucket_mb * 1e6),
        "itemsize": _bucket_itemsize(plan),
        "copies": copies,
    }
    fsdp = mesh.shape[FSDP]
    if plan.zero.stage == 3 and "data" in routes:
        shapes = local_shard_shapes(params_like, dims, fsdp)
        return lambda: tree_feedback(shapes, route=routes["data"], **options)
    if plan.zero.stage in (1, 2) and routes:
        return lambda: zero12_feedback(params_like, dims, routes=routes, fsdp_size=fsdp, **options)
    return None


def _zero_program(loss, optimizer, plan, mesh, params_like, base, dims, axes) -> Program:
    stage = plan.zero.stage
    shard = sharded_specs(base, dims)
    abstract_opt = jax.eval_shape(optimizer.init, params_like)
    param_state = shard if stage == 3 else base
    size = _dp_size(mesh, axes)
    routes = gradient_routes(plan, mesh.shape)
    init_feedback, fb_specs = _feedback_layout(
        _zero_feedback(plan, mesh, params_like, dims, routes, size), axes
    )
    specs = TrainState(
        step=P(),
        params=param_state,
        opt_state=opt_state_specs(optimizer, abstract_opt, shard),
        loss_scale=_scale_specs(plan),
        feedback=fb_specs,
    )
    build = zero3_gradients if stage == 3 else zero12_gradients
    grads_of = build(loss, plan, axes=axes, size=size, dims=dims, routes=routes)
    fb_in = () if fb_specs is None else fb_specs
    shard_shardings = named_shardings(shard, mesh)
    # all_gather results are typed per-device; they are replicated by construction.
    gather = jax.shard_map(
        lambda s: all_gather_params(s, dims), mesh=mesh, in_specs=(shard,), out_specs=base, check_vma=False
    )

    scaler = scaler_for(plan)

    def run(state, batch):
        scale = None if scaler is None else state.loss_scale.scale
        program = jax.shard_map(
            grads_of,
            mesh=mesh,
            in_specs=(param_state, _batch_specs(batch, axes), P(), fb_in, P()),
            out_specs=(shard, P(), fb_in),
        )
        feedback = () if state.feedback is None else state.feedback
        grads, loss_value, feedback = program(state.params, batch, scale, feedback, state.step)
        params = state.params
        if stage != 3:  # this device's slice of the replicated parameters: no communication
            params = jax.lax.with_sharding_constraint(params, shard_shardings)
        update = guarded_update(
            optimizer, grads, state.opt_state, params, scaler=scaler, scale_state=state.loss_scale
        )
        params = update.params if stage == 3 else gather(update.params)
        new_state = update.advance(state, params)
        if fb_specs is not None:
            new_state = new_state._replace(feedback=feedback)
        return new_state, {"loss": loss_value, **update.metrics}

    return Program(specs, run, init_feedback)
