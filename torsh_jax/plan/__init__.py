"""Plans: the intermediate representation every input becomes (no JAX import).

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.plan import load_plan
    >>> load_plan("zero3").zero.stage
    3
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "load_compressor": "torsh_jax.plan.io",
    "load_plan": "torsh_jax.plan.io",
    "plan_from_dict": "torsh_jax.plan.io",
    "plan_from_json": "torsh_jax.plan.io",
    "plan_from_toml": "torsh_jax.plan.io",
    "plan_to_dict": "torsh_jax.plan.io",
    "plan_to_json": "torsh_jax.plan.io",
    "plan_to_toml": "torsh_jax.plan.io",
    "save_plan": "torsh_jax.plan.io",
    "AXES": "torsh_jax.plan.spec",
    "DATA_AXES": "torsh_jax.plan.spec",
    "MESH_AXIS_ORDER": "torsh_jax.plan.spec",
    "AxisCompression": "torsh_jax.plan.spec",
    "AxisSize": "torsh_jax.plan.spec",
    "BatchSpec": "torsh_jax.plan.spec",
    "CommunicationSpec": "torsh_jax.plan.spec",
    "CompressorSpec": "torsh_jax.plan.spec",
    "LossScaleSpec": "torsh_jax.plan.spec",
    "MeshSpec": "torsh_jax.plan.spec",
    "OptimizerSpec": "torsh_jax.plan.spec",
    "ParallelPlan": "torsh_jax.plan.spec",
    "PipelineSpec": "torsh_jax.plan.spec",
    "PrecisionSpec": "torsh_jax.plan.spec",
    "ResolvedMesh": "torsh_jax.plan.spec",
    "ScheduleSpec": "torsh_jax.plan.spec",
    "TensorSpec": "torsh_jax.plan.spec",
    "ZeroSpec": "torsh_jax.plan.spec",
    "Roles": "torsh_jax.plan.roles",
    "global_batch_size": "torsh_jax.plan.elastic",
    "keep_global_batch": "torsh_jax.plan.elastic",
    "compose": "torsh_jax.plan.roles",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.plan", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.plan.io import (
        load_compressor,
        load_plan,
        plan_from_dict,
        plan_from_json,
        plan_from_toml,
        plan_to_dict,
        plan_to_json,
        plan_to_toml,
        save_plan,
    )
    from torsh_jax.plan.roles import Roles, compose
    from torsh_jax.plan.spec import (
        AXES,
        DATA_AXES,
        MESH_AXIS_ORDER,
        AxisCompression,
        AxisSize,
        BatchSpec,
        CommunicationSpec,
        CompressorSpec,
        LossScaleSpec,
        MeshSpec,
        OptimizerSpec,
        ParallelPlan,
        PipelineSpec,
        PrecisionSpec,
        ResolvedMesh,
        ScheduleSpec,
        TensorSpec,
        ZeroSpec,
    )
