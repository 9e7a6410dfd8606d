"""Host offload: optimizer state (and ZeRO-3 parameters) kept in pinned host memory between steps.

The state's shardings carry ``memory_kind="pinned_host"`` for the offloaded
parts; the step moves them to device memory where they are used and XLA
moves the results back (the jitted step's output shardings say where they
live). A backend without a pinned-host memory kind gets a typed error, never
a silent no-op. On the CPU backend host and device memory are the same RAM:
the mechanism runs (and is tested) but saves nothing.

Example:
    >>> from torsh_jax.plan import plan_from_dict
    >>> offloaded_parts(plan_from_dict({"zero": {"stage": 3, "offload_optimizer": True}}))
    ('opt_state',)
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from torsh_jax.errors import NotSupportedYetError
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.mesh import mesh_shape_str
from torsh_jax.typing import PyTree

__all__ = ["HOST", "offloaded_parts", "check_offload", "to_device_memory"]

HOST = "pinned_host"


def offloaded_parts(plan: ParallelPlan) -> tuple[str, ...]:
    """Train-state fields the plan keeps in host memory."""
    parts = ("opt_state",) if plan.zero.offload_optimizer else ()
    return parts + (("params",) if plan.zero.offload_params else ())


def check_offload(plan: ParallelPlan, mesh: Mesh) -> None:
    """Raise :class:`NotSupportedYetError` when the plan offloads what this backend cannot."""
    if plan.zero.offload_params and plan.zero.stage != 3:
        raise NotSupportedYetError(
            f"parameter offload needs ZeRO stage 3 (parameters gathered on use), got stage {plan.zero.stage}",
            key="zero.offload_params",
            fix="set zero.stage = 3, or offload_params = false",
        )
    if not offloaded_parts(plan):
        return
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST not in kinds:
        key = "zero.offload_optimizer" if plan.zero.offload_optimizer else "zero.offload_params"
        raise NotSupportedYetError(
            f"the {device.platform} backend has no {HOST!r} memory kind (has {sorted(kinds)}; "
            f"mesh {mesh_shape_str(mesh)})",
            key=key,
            fix=f"set {key} = false on this backend",
        )


def to_device_memory(state: PyTree, shardings: PyTree, plan: ParallelPlan) -> PyTree:
    """Inside the step: the offloaded fields moved to device memory for use."""
    moved = {
        part: jax.device_put(getattr(state, part), _with_kind(getattr(shardings, part), "device"))
        for part in offloaded_parts(plan)
    }
    return state._replace(**moved)


def _with_kind(tree: PyTree, kind: str) -> PyTree:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), tree)
