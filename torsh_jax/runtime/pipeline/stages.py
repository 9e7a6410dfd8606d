"""Stage specs of a pipeline plan: its schedule table, the stacked layers split over ``stage``, and what
a model must be for a pipeline.

Example (the table and the layout a plan gets):
    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.plan.roles import compose
    >>> plan = load_plan("pp_1f1b")
    >>> roles = compose(plan, {"data": 2, "stage": 4, "fsdp": 1, "tensor": 1})
    >>> schedule_for(plan, roles).ticks
    22
    >>> params = {"layers": {"w": jnp.zeros((8, 3))}}
    >>> stage_specs({"layers": {"w": P(None, None)}}, params, plan, roles, "layers")
    {'layers': {'w': P('stage', None)}}
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from torsh_jax.errors import NotSupportedYetError, PlanError
from torsh_jax.pipeline.schedule import Schedule, build_pipeline_schedule
from torsh_jax.plan.roles import STAGE_AXIS, Roles
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.layered import LayeredModel, shared_keys
from torsh_jax.runtime.specs import path_str
from torsh_jax.typing import PyTree

__all__ = ["schedule_for", "stage_specs", "require_layered"]


def schedule_for(plan: ParallelPlan, roles: Roles) -> Schedule:
    """The schedule table of ``plan`` on the stages of ``roles``."""
    pipe = plan.pipeline
    return build_pipeline_schedule(
        pipe.schedule,
        stages=roles.size(STAGE_AXIS),
        microbatches=pipe.microbatches,
        virtual_stages=pipe.virtual_stages,
    )


def require_layered(loss: LayeredModel, roles: Roles) -> None:
    """A pipeline needs the model's layer boundaries. A ``tensor`` axis is either the model's own
    (tensor blocks) or the compiler's (whole-array layers, split by the parameters' shardings, as
    without a pipeline: tests/test_models_linen.py runs ``3d`` so)."""
    if roles.stage_axis is None:
        return
    if not loss.stacked:
        raise PlanError(
            f"a pipeline over stage={roles.size(STAGE_AXIS)} needs a LayeredModel (embed, stacked layers, "
            "head), not a plain loss function",
            key="loss_fn",
            fix="pass torsh_jax.LayeredModel(embed=..., layer=..., head=...), or set mesh.stage = 1",
        )
    _require_whole_stage_keys(loss, roles)


def _require_whole_stage_keys(model: LayeredModel, roles: Roles) -> None:
    """The stacked layers are split over ``stage``: embed and head (on one stage each) cannot read them
    (nor can a head given the whole tree, ``head_keys=None``)."""
    whole_tree = model.head_keys is None
    readers = ("layers", "head") if whole_tree else shared_keys(model).get(model.layers_key)
    if readers is None:
        return
    other = next(part for part in readers if part != "layers")
    raise NotSupportedYetError(
        f"{other} reads the stacked layers {model.layers_key!r}, which a pipeline over "
        f"stage={roles.size(STAGE_AXIS)} splits over its stages (the {other} runs on one stage)",
        key=f"loss_fn.{other}_keys",
        fix=f"keep what the {other} reads outside the stacked layers (a top-level key of its own), "
        "or set mesh.stage = 1",
    )


def stage_specs(compute: PyTree, params_like: PyTree, plan: ParallelPlan, roles: Roles, stacked_key: str):
    """``compute`` with the stacked layers' leading dim split over ``stage`` (contiguous groups).

    Raises:
        PlanError: a stacked leaf's layer count does not divide into stages x virtual stages.
    """
    if roles.stage_axis is None:
        return compute
    groups = roles.size(STAGE_AXIS) * plan.pipeline.virtual_stages

    def one(path, leaf, spec: P):
        if not (path and path_str(path[:1]) == stacked_key):
            return spec
        layers = leaf.shape[0] if leaf.shape else 0
        if layers % groups:
            raise PlanError(
                f"{layers} stacked layers do not split into {roles.size(STAGE_AXIS)} stages x "
                f"{plan.pipeline.virtual_stages} virtual stages (mesh {dict(roles.mesh_shape)})",
                key=path_str(path),
                fix=f"use a layer count divisible by {groups}, or change mesh.stage or the virtual stages",
            )
        return P(STAGE_AXIS, *tuple(spec)[1:])

    return jax.tree_util.tree_map_with_path(one, params_like, compute)
