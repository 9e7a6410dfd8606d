"""The batch role: ``data`` and ``fsdp`` split the batch and synchronise the gradients.

``In[B_(data,fsdp), ...] -> local grads -> sync over (data, fsdp)``

Every device differentiates its share of the batch; the gradients are then
synchronised once per optimizer step by :func:`~torsh_jax.runtime.sync.sync_gradients`
with the :class:`~torsh_jax.runtime.sync.SyncSpec` built here (ZeRO-2 without
compression reduces every micro-step; ZeRO-3 reduces inside the gather's
backward pass, see :mod:`torsh_jax.runtime.fsdp`).

Example:
    >>> from torsh_jax.plan import ParallelPlan
    >>> gradient_factors(ParallelPlan(), data_parallel_size=8)
    (1.0, 0.125)
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from torsh_jax.plan.roles import Roles
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.sync import AxisRoute, SyncSpec
from torsh_jax.tensor.axis import vary_over
from torsh_jax.typing import PyTree

__all__ = [
    "gradient_factors",
    "mark_varying",
    "gradient_routes",
    "gradient_sync",
    "backward_sync",
    "batch_specs",
]


def gradient_factors(plan: ParallelPlan, *, data_parallel_size: int) -> tuple[float, float]:
    """``(pre, post)`` multipliers around the gradient sum over data-parallel ranks.

    ``prescale_gradients`` divides before the sum; otherwise
    ``gradient_predivide_factor`` f divides by f before and multiplies by
    f / n after (DeepSpeed and Horovod semantics). ``reduce_op = "sum"``
    keeps the sum.
    """
    comm = plan.communication
    n = float(data_parallel_size)
    if comm.reduce_op == "sum":
        return 1.0 / comm.gradient_predivide_factor, comm.gradient_predivide_factor
    if comm.prescale_gradients:
        return 1.0 / n, 1.0
    f = comm.gradient_predivide_factor
    return 1.0 / f, f / n


def mark_varying(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Mark replicated values as per-device along ``axes``.

    Differentiating a replicated value against a per-device batch would make
    JAX insert the gradient sum itself; marking it varying first keeps the
    gradients per-device so that the program places the reduction.
    """
    return jax.tree.map(lambda x: vary_over(x, axes), tree) if axes else tree


def gradient_routes(roles: Roles, kernels: Mapping[str, str]) -> dict[str, AxisRoute]:
    """The compressed gradient axes of a composition (size-1 axes send nothing and are absent);
    ``kernels``: per axis, ``pallas`` or ``reference``."""
    return {
        axis: AxisRoute(axis, roles.size(axis), spec, kernels.get(axis, "reference"))
        for axis, spec in roles.gradient_compression.items()
        if axis in roles.batch_axes
    }


def batch_specs(batch: PyTree, roles: Roles) -> PyTree:
    """Leading (batch) dim of every leaf split over the batch axes."""
    return jax.tree.map(lambda x: P(roles.batch_axes, *([None] * (x.ndim - 1))), batch)


def _bucketing(plan: ParallelPlan) -> dict:
    return {
        "bucket_bytes": int(plan.communication.bucket_mb * 1e6),
        "itemsize": jnp.dtype(plan.precision.reduce_dtype).itemsize,
    }


def gradient_sync(plan: ParallelPlan, roles: Roles, kernels: Mapping[str, str]) -> SyncSpec:
    """The once-per-step synchronisation of the composition's gradients.

    DDP all-reduces over the batch axes; ZeRO-1/2 reduce-scatter sharded
    leaves over ``fsdp``; ZeRO-3 synchronises here only its compressed replica
    axes (HSDP's ``data``), deferred from the backward pass so that their
    error feedback advances once per step. Under a pipeline ZeRO-3 gathers a
    stage's parameters once per step and reduce-scatters their gradients
    here, as ZeRO-2 does.
    """
    routes = gradient_routes(roles, kernels)
    factors = gradient_factors(plan, data_parallel_size=roles.batch_size)
    if roles.gather == "on_use":
        deferred = _deferred(routes, roles)
        return SyncSpec(
            axes=tuple(deferred),
            routes=deferred,
            sharded_over=roles.shard_axis,
            factors=(1.0, factors[1]),
            **_bucketing(plan),
        )
    scatter = roles.shard_axis
    return SyncSpec(
        axes=roles.batch_axes,
        scatter_axis=scatter,
        scatter_size=roles.size(scatter) if scatter else 1,
        routes=routes,
        sharded_over=scatter,
        factors=factors,
        **_bucketing(plan),
    )


def _deferred(routes: Mapping[str, AxisRoute], roles: Roles) -> dict[str, AxisRoute]:
    """ZeRO-3's routes over its replica axes (compressed): synchronised once per step by
    :func:`gradient_sync`, not in the backward pass."""
    return {a: r for a, r in routes.items() if a != roles.shard_axis}


def backward_sync(plan: ParallelPlan, roles: Roles, kernels: Mapping[str, str]) -> SyncSpec:
    """ZeRO-3's per-leaf synchronisation inside the gather's backward pass (no feedback).

    Reduce-scatters over ``fsdp`` (compressed when the plan says so) and sums
    over the replica axes that are not deferred to :func:`gradient_sync`.
    """
    routes = gradient_routes(roles, kernels)
    deferred = _deferred(routes, roles)
    pre, post = gradient_factors(plan, data_parallel_size=roles.batch_size)
    shard = roles.shard_axis
    return SyncSpec(
        axes=tuple(a for a in roles.batch_axes if a not in deferred),
        scatter_axis=shard,
        scatter_size=roles.size(shard),
        routes={a: r for a, r in routes.items() if a == shard},
        factors=(pre, 1.0 if deferred else post),
    )
