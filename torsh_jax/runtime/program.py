"""The one step shape every composition of axis roles runs.

``shard_map(local gradients -> sync) -> optax update on the update layout -> stored layout``

1. Inside one ``shard_map`` over the whole mesh, every device computes its
   gradients (gathering sharded parameters on use at ZeRO-3) and synchronises
   them (:mod:`torsh_jax.runtime.sync`): all collectives are placed here.
2. The optax update runs on the update layout (sharded from ZeRO stage 1 on),
   so global norms and trust ratios see the whole model.
3. Updated parameters return to the stored layout: ZeRO-1/2 all-gather them
   over ``fsdp``; DDP and ZeRO-3 store them as updated.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.runtime.decide import decide
    >>> from torsh_jax.runtime.layout import layout_for
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> plan = load_plan("ddp")
    >>> decided = decide(lambda p, b: jnp.mean((b @ p["w"]) ** 2), plan, build_mesh(plan, jax.devices()[:1]))
    >>> layout = layout_for(decided, {"w": jnp.zeros((3, 1))}, optax.sgd(0.1))
    >>> run = build_program(decided, optax.sgd(0.1), layout)  # jit it with the layout's shardings
    >>> layout.roles.kind, callable(run)
    ('ddp', True)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torsh_jax.plan.roles import sums_in_place
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.accumulate import accumulate, from_step_sums, local_gradients
from torsh_jax.runtime.compiler_axes import manual_over, tree_only, tree_without
from torsh_jax.runtime.data_parallel import batch_specs, mark_varying
from torsh_jax.runtime.decide import StepPlan
from torsh_jax.runtime.fsdp import all_gather_params, gathered_loss, gathering_model
from torsh_jax.runtime.layered import layered_loss
from torsh_jax.runtime.layout import StateLayout
from torsh_jax.runtime.pipeline import pipeline_gradients, reduce_over_stage
from torsh_jax.runtime.pipeline.ends import pairs_end_sums
from torsh_jax.runtime.precision import cast_tree
from torsh_jax.runtime.sink import accumulate_into, sinks_layers
from torsh_jax.runtime.state import TrainState
from torsh_jax.runtime.sync import sync_gradients
from torsh_jax.runtime.update import guarded_update, scaler_for
from torsh_jax.tensor.axis import planned_sequence_parallel
from torsh_jax.typing import PyTree

__all__ = ["build_program", "gradient_program"]


def _accumulate(plan: ParallelPlan, loss_fn, params, batch, scale, per_step=None, pipeline=None, model=None):
    """``(grads, mean loss, extras)`` over the accumulation micro-steps; ``pipeline``: the pipeline's
    passes ``(params, batch, scale, passes) -> (grads, summed loss, slots)`` instead of
    differentiating ``loss_fn``, all in the pipeline's own scan unless each pass's gradients are
    reduced apart (``per_step``). ``model``: the layered model ``loss_fn`` computes, given where
    the plan sums the micro-steps in place (:func:`~torsh_jax.plan.roles.sums_in_place`): its
    layers' gradients add into the running sum."""
    steps, reduce = plan.batch.accumulation_steps, plan.batch.accumulation_reduce
    options = {"steps": steps, "reduce": reduce, "accum_dtype": jax.numpy.dtype(plan.precision.param_dtype)}
    if pipeline is not None and per_step is None:
        grads, loss_sum, slots = pipeline(params, batch, scale, steps)
        return (*from_step_sums(grads, loss_sum, steps=steps, reduce=reduce), slots)
    if pipeline is not None:
        return accumulate(lambda p, b: pipeline(p, b, scale), params, batch, per_step=per_step, **options)
    if model is not None and sinks_layers(model, params):
        return (*accumulate_into(model, params, batch, loss_scale=scale, **options), ())
    grads, loss = local_gradients(loss_fn, params, batch, loss_scale=scale, per_step=per_step, **options)
    return grads, loss, ()


def _local_loss(decided: StepPlan, layout: StateLayout, split: PyTree) -> Callable:
    """``loss(local params, batch)``: gathering on use, or the model's loss on whole parameters."""
    if decided.roles.gather == "on_use":
        return gathered_loss(decided, layout.dims, specs=split)
    return layered_loss(decided.model)


def _pipeline_passes(decided: StepPlan, layout: StateLayout, split: PyTree) -> Callable | None:
    """The pipeline's passes ``(params, batch, scale, passes=1) -> (grads, summed loss, slots)``
    (``None``: no pipeline)."""
    if decided.schedule is None:
        return None
    model = decided.model
    if decided.roles.gather == "on_use":  # gather one layer at a time in every slot
        model = gathering_model(decided, layout.dims, specs=split)
    accum_dtype = jax.numpy.dtype(decided.plan.precision.param_dtype)
    pair_ends = pairs_end_sums(decided.roles.size(axis) for axis in decided.compiler_axes)
    return pipeline_gradients(model, decided.schedule, accum_dtype=accum_dtype, pair_ends=pair_ends)


def gradient_program(decided: StepPlan, layout: StateLayout) -> Callable:
    """Per device: ``(stored params, local batch, scale, feedback, step) -> (grads, mean loss, feedback)``.

    The gradients come back synchronised, in the update layout and the plan's parameter dtype.
    """
    plan, roles, sync, compiler = decided.plan, decided.roles, decided.sync, decided.compiler_axes
    precision = plan.precision
    split = tree_only(layout.compute, compiler)
    loss_fn = _local_loss(decided, layout, split)
    cast_first = roles.gather != "on_use"  # gathered on use: cast after the gather, per leaf
    pipeline = _pipeline_passes(decided, layout, split)
    model = decided.model if sums_in_place(plan, roles.mesh_shape) else None
    per_micro_step = roles.reduce == "per_micro_step"
    gather_stage = roles.gather == "per_stage"

    def reduce(grads, feedback, step):
        grads = cast_tree(grads, precision.reduce_dtype)
        return sync_gradients(
            grads, feedback, spec=sync, dims=layout.dims, step=step, split_over=layout.split
        )

    feedback_split = tree_only(_feedback_specs(layout), compiler)
    reduce = manual_over(reduce, compiler, (split, feedback_split, P()), (split, feedback_split))

    def program(params, batch, scale=None, feedback=(), step=None):
        if cast_first:
            params = cast_tree(params, precision.compute_dtype)
        if gather_stage:  # this stage's parameters, whole, for every pass of the step
            params = all_gather_params(params, layout.dims)
        per_step = (lambda g: reduce(g, (), None)[0]) if per_micro_step else None
        params = mark_varying(params, decided.vary)
        grads, value, extras = _accumulate(plan, loss_fn, params, batch, scale, per_step, pipeline, model)
        if pipeline is not None:
            grads, value = reduce_over_stage(grads, value, decided.stacked_key)
        if sync.axes and not per_micro_step:
            grads, feedback = reduce(grads, feedback, step)
        extras = {"pipeline_slots": extras} if pipeline is not None else {}
        value = jax.lax.pmean(value, roles.batch_axes)
        return cast_tree(grads, precision.param_dtype), value, feedback, extras

    return program


def _feedback_specs(layout: StateLayout) -> PyTree:
    return () if layout.state.feedback is None else layout.state.feedback


def _to_stored(layout: StateLayout, mesh: Mesh) -> Callable[[PyTree], PyTree]:
    """Updated parameters (update layout) -> stored layout: ZeRO-1/2 all-gather over ``fsdp``."""
    if layout.update is layout.state.params:
        return lambda params: params
    # all_gather results are typed per-device; they are replicated by construction.
    return jax.shard_map(
        lambda s: all_gather_params(s, layout.dims),
        mesh=mesh,
        in_specs=(layout.update,),
        out_specs=layout.state.params,
        check_vma=False,
    )


def build_program(
    decided: StepPlan,
    optimizer: optax.GradientTransformation,
    layout: StateLayout,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """The per-step function (to be jitted) of the step ``decided`` with state ``layout``.

    Args:
        decided: the step's decisions (:func:`~torsh_jax.runtime.decide.decide`).
        optimizer: optax transformation.
        layout: the state layout (:func:`~torsh_jax.runtime.layout.layout_for`).
    """
    mesh, roles = decided.mesh, decided.roles
    grads_of = gradient_program(decided, layout)
    compiler = decided.compiler_axes
    manual = set(mesh.axis_names) - set(compiler)
    fb_specs = tree_without(_feedback_specs(layout), compiler)
    params_specs, update_specs = tree_without((layout.state.params, layout.update), compiler)
    update_shardings = jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh, s), layout.update, is_leaf=lambda x: isinstance(x, P)
    )
    to_stored = _to_stored(layout, mesh)
    scaler = scaler_for(decided.plan)
    # per stage: [forward, backward, weight] slots the pipeline ran this step
    extras_specs = {"pipeline_slots": P(roles.stage_axis)} if roles.stage_axis else {}

    def run(state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        program = jax.shard_map(
            grads_of,
            mesh=mesh,
            in_specs=(params_specs, batch_specs(batch, roles), P(), fb_specs, P()),
            out_specs=(update_specs, P(), fb_specs, extras_specs),
            axis_names=manual,
        )
        scale = None if scaler is None else state.loss_scale.scale
        feedback = () if state.feedback is None else state.feedback
        with planned_sequence_parallel(roles.sequence_parallel):  # the blocks split as the plan says
            grads, loss_value, feedback, extras = program(state.params, batch, scale, feedback, state.step)
        # this device's slice of the stored parameters: no communication
        params = jax.lax.with_sharding_constraint(state.params, update_shardings)
        update = guarded_update(
            optimizer, grads, state.opt_state, params, scaler=scaler, scale_state=state.loss_scale
        )
        new_state = update.advance(state, to_stored(update.params))
        if layout.state.feedback is not None:
            new_state = new_state._replace(feedback=feedback)
        return new_state, {"loss": loss_value, **update.metrics, **extras}

    return run
