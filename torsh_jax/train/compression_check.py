"""Which plan compression sections the train step can run, per strategy.

* DDP: gradients compressed over one data-parallel axis (the other, if any,
  is reduced first without compression); error feedback in the train state.
* ZeRO-1/2 and their HSDP form: the reduce-scatter over ``fsdp`` and/or the
  all-reduce of the shards over ``data``, each with error feedback.
* ZeRO-3 and HSDP: weights all-gathered compressed over ``fsdp``; gradients
  over ``data`` with error feedback; over ``fsdp`` (in the gather's backward
  pass) without feedback, nearest rounding and no warm-up.
* Everywhere: no dynamic loss scaling with compressed gradients.

Example:
    >>> import jax
    >>> from torsh_jax.plan import plan_from_dict
    >>> from torsh_jax.parallel.mesh import build_mesh
    >>> plan = plan_from_dict({"compression": [{"axis": "data", "gradients": "int8"}]})
    >>> check_compression(plan, build_mesh(plan, jax.devices()[:1]))  # size-1 axes send nothing
"""

from __future__ import annotations

from jax.sharding import Mesh

from torsh_jax.compress.collectives import WEIGHT_METHODS
from torsh_jax.errors import NotSupportedYetError
from torsh_jax.parallel.mesh import mesh_shape_str
from torsh_jax.plan.spec import AxisCompression, ParallelPlan
from torsh_jax.train.programs import strategy
from torsh_jax.train.update import scaler_for

__all__ = ["check_compression"]


def _active(section: AxisCompression, field: str) -> bool:
    spec = getattr(section, field)
    return spec is not None and spec.method != "none"


def _check_weights(index: int, section: AxisCompression, kind: str, mesh: Mesh) -> None:
    key = f"compression[{index}].weights"
    if kind != "zero3" or section.axis != "fsdp":
        raise NotSupportedYetError(
            f"weight compression over {section.axis!r} under {kind} (mesh {mesh_shape_str(mesh)}): only "
            "ZeRO-3 all-gathers weights, over fsdp",
            key=key,
            fix="remove `weights`, or use zero.stage = 3 with the section on axis = 'fsdp'",
        )
    if section.weights.method not in WEIGHT_METHODS:
        raise NotSupportedYetError(
            f"method {section.weights.method!r} cannot compress weight all-gathers",
            key=f"{key}.method",
            fix=f"use one of {list(WEIGHT_METHODS)}",
        )


def _check_zero3_fsdp_gradients(index: int, section: AxisCompression) -> None:
    """The gather's backward pass holds no state: no feedback, no warm-up counter, no random key."""
    spec = section.gradients
    rules = (
        ("error_feedback", spec.error_feedback, "set error_feedback = false"),
        ("warmup_steps", spec.warmup_steps != 0, "set warmup_steps = 0"),
        ("rounding", spec.rounding != "nearest", "set rounding = 'nearest'"),
    )
    for field, broken, fix in rules:
        if broken:
            raise NotSupportedYetError(
                f"ZeRO-3 reduces fsdp gradients inside the backward pass, which keeps no state; "
                f"{field} needs state",
                key=f"compression[{index}].gradients.{field}",
                fix=f"{fix}, or compress the data axis (HSDP) instead",
            )


def check_compression(plan: ParallelPlan, mesh: Mesh) -> None:
    """Raise :class:`NotSupportedYetError` for compression sections the train step cannot run."""
    kind = strategy(plan, mesh.shape)
    active = [(i, c) for i, c in enumerate(plan.compression) if mesh.shape[c.axis] > 1]
    gradients = [(i, c) for i, c in active if _active(c, "gradients")]
    for index, section in active:
        if _active(section, "weights"):
            _check_weights(index, section, kind, mesh)
    if gradients and scaler_for(plan) is not None:
        raise NotSupportedYetError(
            "compressed gradients with dynamic loss scaling: skipped steps would corrupt the error feedback",
            key="precision.loss_scale",
            fix="use bfloat16 compute without loss scaling, or remove the gradient compression",
        )
    if kind == "ddp" and len(gradients) > 1:
        raise NotSupportedYetError(
            f"DDP compresses one data-parallel axis; {len(gradients)} are compressed "
            f"(mesh {mesh_shape_str(mesh)})",
            key=f"compression[{gradients[1][0]}].gradients",
            fix="keep gradient compression on one axis (the cross-slice `data` axis)",
        )
    for index, section in gradients:
        if kind == "zero3" and section.axis == "fsdp":
            _check_zero3_fsdp_gradients(index, section)
