"""Keeping the global batch when a run continues on another number of data-parallel ranks.

A job that restarts on fewer (or more) devices should see the same data and
take the same optimizer steps: the global batch (micro batch x accumulation
x data-parallel size) stays, and the per-rank split changes. The micro batch
(what one device holds at once) is kept when it can be, and the accumulation
steps absorb the change, as DeepSpeed's elastic training does.

Example:
    >>> from torsh_jax.plan import load_plan
    >>> plan = load_plan("zero3")  # micro batch 8
    >>> global_batch_size(plan, {"data": 1, "fsdp": 4})
    32
    >>> continued = keep_global_batch(plan, 32, {"data": 1, "fsdp": 2})
    >>> continued.batch.micro_batch_size, continued.batch.accumulation_steps
    (8, 2)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from torsh_jax.errors import PlanError
from torsh_jax.plan.roles import compose
from torsh_jax.plan.spec import ParallelPlan

__all__ = ["global_batch_size", "keep_global_batch"]


def global_batch_size(plan: ParallelPlan, mesh_shape: Mapping[str, int]) -> int:
    """Examples per optimizer step of ``plan`` on a mesh of ``mesh_shape``."""
    return plan.batch.global_batch_size(compose(plan, mesh_shape).batch_size)


def keep_global_batch(plan: ParallelPlan, global_batch: int, mesh_shape: Mapping[str, int]) -> ParallelPlan:
    """``plan`` with micro batch and accumulation steps that give ``global_batch`` on ``mesh_shape``.

    The micro batch is kept when ``global_batch / (micro x ranks)`` is whole;
    otherwise the largest micro batch below it that divides the per-rank
    batch is used (per-device memory never grows).

    Raises:
        PlanError: ``global_batch`` does not split evenly over the data-parallel ranks.
    """
    ranks = compose(plan, mesh_shape).batch_size
    if global_batch % ranks:
        shape = ", ".join(f"{a}={s}" for a, s in mesh_shape.items())
        raise PlanError(
            f"the global batch {global_batch} does not split over {ranks} data-parallel ranks (mesh {shape})",
            key="batch",
            fix=f"continue on a device count whose data-parallel size divides {global_batch}",
        )
    per_rank = global_batch // ranks
    micro = max(m for m in range(1, min(plan.batch.micro_batch_size, per_rank) + 1) if per_rank % m == 0)
    batch = replace(plan.batch, micro_batch_size=micro, accumulation_steps=per_rank // micro)
    return plan if batch == plan.batch else plan.replace(batch=batch)
