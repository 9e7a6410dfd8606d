"""What the train step can run: checks that read the plan's axis roles.

* ``stage`` > 1 runs GPipe, 1F1B, interleaved 1F1B and ZB-H1 over a
  :class:`LayeredModel`'s stacked layers with DDP, ZeRO-1/2/3 and tensor
  blocks; compressed collectives with ZeRO-3 under a pipeline are not built
  yet. Each pass's batch (the micro batch) must split into
  ``pipeline.microbatches``.
* ``tensor`` > 1 needs a loss written with :mod:`torsh_jax.tensor` blocks
  (it computes on local shards); a loss without them would compute on shards
  as if they were whole weights.
* Gradients may be compressed over every batch axis, in every mode; ZeRO-3
  reduces ``fsdp`` gradients inside the backward pass, which keeps no state
  (no error feedback, no warm-up, nearest rounding).
* Weights are compressed only where they are gathered: ZeRO-3 over ``fsdp``.
* No dynamic loss scaling with compressed gradients (a skipped step would
  corrupt the error feedback).
* The plan's rules may not split a parameter over a batch axis (``data``,
  ``fsdp``): those split the batch, and ZeRO picks each parameter's ``fsdp`` dim.
* ``tensor`` > 1 splits at least one parameter over ``tensor`` (else every
  tensor device repeats the same work), unless ``tensor.allow_replicated``
  says so for a model the compiler partitions.
* The mesh is one the plan builds on its devices (axis names and sizes, for
  any slice count the plan accepts): another mesh would run another strategy.

Example:
    >>> import jax
    >>> from torsh_jax.plan import plan_from_dict
    >>> from torsh_jax.plan.roles import compose
    >>> plan = plan_from_dict({"compression": [{"axis": "data", "gradients": "int8"}]})
    >>> check_supported(plan, compose(plan, {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1}))
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torsh_jax.compress.collectives import WEIGHT_METHODS
from torsh_jax.errors import MeshError, NotSupportedYetError, PlanError, ShardingError, TorshError
from torsh_jax.plan.roles import Roles
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.mesh import default_num_slices, mesh_shape_str, resolve_mesh
from torsh_jax.runtime.specs import entry_axes
from torsh_jax.tensor.axis import has_tensor_blocks

__all__ = ["check_supported", "check_sequence_parallel", "check_param_axes", "check_mesh", "mesh_shape_text"]


def mesh_shape_text(roles: Roles) -> str:
    """``data=8, stage=1, ...``: the mesh shape for messages."""
    return ", ".join(f"{a}={s}" for a, s in roles.mesh_shape.items())


def _section_index(plan: ParallelPlan, axis: str) -> int:
    return next(i for i, c in enumerate(plan.compression) if c.axis == axis)


def _check_weights(plan: ParallelPlan, roles: Roles) -> None:
    for axis, spec in roles.weight_compression.items():
        key = f"compression[{_section_index(plan, axis)}].weights"
        if not roles.params_sharded or axis != roles.shard_axis:
            raise NotSupportedYetError(
                f"weight compression over {axis!r} under {roles.kind} (mesh {mesh_shape_text(roles)}): only "
                "ZeRO-3 all-gathers weights, over fsdp",
                key=key,
                fix="remove `weights`, or use zero.stage = 3 with the section on axis = 'fsdp'",
            )
        if spec.method not in WEIGHT_METHODS:
            raise NotSupportedYetError(
                f"method {spec.method!r} cannot compress weight all-gathers",
                key=f"{key}.method",
                fix=f"use one of {list(WEIGHT_METHODS)}",
            )


def _check_stateless_gradients(plan: ParallelPlan, roles: Roles) -> None:
    """ZeRO-3's fsdp gradients are reduced in the backward pass: no feedback, warm-up counter or key."""
    spec = roles.gradient_compression.get(roles.shard_axis) if roles.reduce == "in_backward" else None
    if spec is None:
        return
    rules = (
        ("error_feedback", spec.error_feedback, "set error_feedback = false"),
        ("warmup_steps", spec.warmup_steps != 0, "set warmup_steps = 0"),
        ("rounding", spec.rounding != "nearest", "set rounding = 'nearest'"),
    )
    for field, broken, fix in rules:
        if broken:
            raise NotSupportedYetError(
                "ZeRO-3 reduces fsdp gradients inside the backward pass, which keeps no state; "
                f"{field} needs state",
                key=f"compression[{_section_index(plan, roles.shard_axis)}].gradients.{field}",
                fix=f"{fix}, or compress the data axis (HSDP) instead",
            )


def _check_pipeline(plan: ParallelPlan, roles: Roles) -> None:
    if roles.stage_axis is None:
        return
    pipe, where = plan.pipeline, f"mesh {mesh_shape_text(roles)}"
    if roles.params_sharded and (roles.gradient_compression or roles.weight_compression):
        raise NotSupportedYetError(
            f"compressed collectives with ZeRO-3 under a pipeline ({where}) are not built yet",
            key="compression",
            fix="remove the [[compression]] sections, or use zero.stage = 1 or 2 with the pipeline",
        )
    micro, m = plan.batch.micro_batch_size, pipe.microbatches
    if micro % m:
        raise PlanError(
            f"the micro batch of {micro} examples does not split into {m} pipeline micro-batches",
            key="pipeline.microbatches",
            fix=f"set batch.micro_batch_size to a multiple of {m} (e.g. {m * max(1, micro // m)}), "
            "or pipeline.microbatches to a divisor of it",
        )


def check_supported(plan: ParallelPlan, roles: Roles) -> None:
    """Raise :class:`NotSupportedYetError` for what this version cannot run on this composition."""
    _check_pipeline(plan, roles)
    _check_weights(plan, roles)
    if roles.gradient_compression and plan.precision.loss_scale.mode != "none":
        raise NotSupportedYetError(
            "compressed gradients with dynamic loss scaling: skipped steps would corrupt the error feedback",
            key="precision.loss_scale",
            fix="use bfloat16 compute without loss scaling, or remove the gradient compression",
        )
    _check_stateless_gradients(plan, roles)


def check_sequence_parallel(model, roles: Roles) -> None:
    """Raise :class:`NotSupportedYetError` for sequence parallelism on a model not written with
    :mod:`torsh_jax.tensor` blocks: the compiler partitions such a model over ``tensor`` from its
    parameters, and its activations between blocks would stay whole."""
    if roles.sequence_parallel and not has_tensor_blocks(model):
        raise NotSupportedYetError(
            f"sequence parallelism (mesh {mesh_shape_text(roles)}) splits the activations between "
            "torsh_jax.tensor blocks; this model computes on whole arrays, which the compiler "
            "partitions over tensor, so its activations would stay whole",
            key="tensor.sequence_parallel",
            fix="set tensor.sequence_parallel = false, or write the layers with torsh_jax.tensor blocks "
            "(LayeredModel(..., tensor_blocks=True))",
        )


def check_param_axes(compute_specs, roles: Roles) -> None:
    """Raise :class:`ShardingError` when a rule splits a parameter over a batch axis."""
    batch = set(roles.batch_axes)

    def one(path, spec: P) -> None:
        for dim, entry in enumerate(spec):
            axes = entry_axes(entry)
            used = sorted(batch.intersection(axes))
            if used:
                raise ShardingError(
                    f"dim {dim} is split over the batch axis {used[0]!r} by the plan's rules "
                    f"(mesh {mesh_shape_text(roles)}); batch axes split the batch, and ZeRO picks "
                    "the dim each parameter is sharded along over fsdp",
                    key=jax.tree_util.keystr(path, simple=True, separator="/"),
                    fix="map the parameter's logical names to 'tensor' or to no axis in the plan's rules",
                )

    jax.tree_util.tree_map_with_path(one, compute_specs, is_leaf=lambda x: isinstance(x, P))


def _plan_shapes(plan: ParallelPlan, num_devices: int) -> list[dict[str, int]]:
    """Axis sizes ``plan`` builds on ``num_devices`` devices: its default slice count first, then
    every other slice count it accepts (a ``-1`` cross-slice size fills any)."""
    counts = [default_num_slices(plan)] + [n for n in range(1, num_devices + 1) if num_devices % n == 0]
    shapes = []
    for slices in dict.fromkeys(counts):
        try:
            shape = resolve_mesh(plan, num_devices, num_slices=slices).shape
        except TorshError:
            continue
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def check_mesh(plan: ParallelPlan, mesh: Mesh) -> None:
    """Raise :class:`MeshError` when ``mesh`` is not a mesh ``plan`` builds on its devices.

    Axis order is free; names and sizes must be the plan's (a mesh built from another plan would
    run another strategy: a ZeRO-3 plan on a ``data=4, tensor=2`` mesh trains as DDP).
    """
    given = {a: int(s) for a, s in mesh.shape.items()}
    shapes = _plan_shapes(plan, mesh.size)
    if not shapes:
        resolve_mesh(plan, mesh.size)  # raises the plan's own error, with the factorisations that fit
    if given in shapes:
        return
    builds = " or ".join(", ".join(f"{a}={s}" for a, s in shape.items()) for shape in shapes)
    raise MeshError(
        f"plan {plan.name!r} builds {builds} on {mesh.size} devices, but the mesh is {mesh_shape_str(mesh)} "
        "(another mesh runs another strategy)",
        key="mesh",
        fix="build the mesh from the same plan: build_mesh(plan, devices)",
    )


def _tensor_split_paths(compute_specs, axis: str) -> tuple[list[str], list[str]]:
    """``(paths split over axis, all paths)`` of a ``PartitionSpec`` pytree."""
    leaves = jax.tree_util.tree_leaves_with_path(compute_specs, is_leaf=lambda x: isinstance(x, P))
    key = lambda path: jax.tree_util.keystr(path, simple=True, separator="/")
    split = [key(path) for path, spec in leaves if any(axis in entry_axes(e) for e in spec)]
    return split, [key(path) for path, _ in leaves]


def check_tensor_split(compute_specs, roles: Roles, plan: ParallelPlan, *, tensor_blocks: bool) -> None:
    """Raise :class:`ShardingError` when ``tensor`` > 1 splits no parameter.

    A model with no logical names (and no matching ``param_dims``) would run replicated over
    ``tensor``: every tensor device repeating the same work. ``tensor.allow_replicated`` accepts
    that for a model the compiler partitions; :mod:`torsh_jax.tensor` blocks always need their
    weights split (on whole weights their sums over ``tensor`` would count each term ``tensor`` times).
    """
    axis = roles.tensor_axis
    if axis is None:
        return
    split, paths = _tensor_split_paths(compute_specs, axis)
    if split or (plan.tensor.allow_replicated and not tensor_blocks):
        return
    allow = "" if tensor_blocks else ", or set tensor.allow_replicated = true to run it replicated anyway"
    raise ShardingError(
        f"the plan's rules split none of the {len(paths)} parameters ({', '.join(paths[:3])}"
        f"{', ...' if len(paths) > 3 else ''}) over {axis}={roles.size(axis)} "
        f"(mesh {mesh_shape_text(roles)}): every {axis} device would repeat the same work",
        key="param_dims",
        fix="give the parameters logical names (flax with_logical_partitioning, nnx out_sharding) or "
        "param_dims entries whose names the rules map to 'tensor' (mlp, heads, vocab), or set "
        f"mesh.tensor = 1{allow}",
    )
