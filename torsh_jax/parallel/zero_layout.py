"""Which dim of each parameter ZeRO shards over the ``fsdp`` axis.

A parameter is sharded along its largest dim that divides the ``fsdp`` size
and is neither the stacked ``layers`` dim nor already split by another mesh
axis; a parameter with no such dim, or with fewer elements than
``zero.persistence_threshold``, stays replicated (its gradient is
all-reduced instead of reduce-scattered).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from torsh_jax.plan import plan_from_dict
    >>> from torsh_jax.parallel.mesh import build_mesh
    >>> plan = plan_from_dict({"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": 3}})
    >>> mesh = build_mesh(plan, jax.devices()[:8])
    >>> shard_dims({"layers": {"wq": jnp.zeros((2, 64, 4, 16)), "b": jnp.zeros((2, 3))}}, plan, mesh)
    {'layers': {'b': None, 'wq': 1}}
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torsh_jax.parallel.sharding import logical_dims, param_specs, path_str
from torsh_jax.plan.spec import ParallelPlan

__all__ = ["FSDP", "shard_dims", "sharded_specs", "local_slice", "shard_bytes"]

FSDP = "fsdp"
PyTree = Any


def _pick_dim(shape, names, spec: P, size: int) -> int | None:
    best = None
    for dim, length in enumerate(shape):
        taken = dim < len(spec) and spec[dim] is not None
        if names[dim] == "layers" or taken or length % size:
            continue
        if best is None or length > shape[best]:
            best = dim
    return best


def shard_dims(params: PyTree, plan: ParallelPlan, mesh: Mesh) -> PyTree:
    """Per parameter leaf: the dim sharded over ``fsdp``, or ``None`` (replicated)."""
    size = mesh.shape[FSDP]
    base = param_specs(params, plan, mesh)
    threshold = plan.zero.persistence_threshold

    def one(path, leaf, spec):
        shape = tuple(leaf.shape)
        if size == 1 or int(np.prod(shape)) < max(threshold, 1):
            return None
        return _pick_dim(shape, logical_dims(path_str(path), leaf, plan), spec, size)

    return jax.tree_util.tree_map_with_path(one, params, base, is_leaf=lambda x: isinstance(x, P))


def sharded_specs(base_specs: PyTree, dims: PyTree) -> PyTree:
    """``base_specs`` with ``fsdp`` added at each leaf's shard dim."""

    def one(spec: P, dim: int | None) -> P:
        entries = list(spec)
        if dim is not None:
            entries[dim] = FSDP
        return P(*entries)

    return jax.tree.map(one, base_specs, dims, is_leaf=lambda x: isinstance(x, P))


def local_slice(x: jax.Array, dim: int | None, *, size: int) -> jax.Array:
    """This device's ``fsdp`` shard of a replicated value (inside ``shard_map``)."""
    if dim is None:
        return x
    chunk = x.shape[dim] // size
    index = jax.lax.axis_index(FSDP)
    return jax.lax.dynamic_slice_in_dim(x, index * chunk, chunk, axis=dim)


def shard_bytes(tree: PyTree) -> int:
    """Bytes of ``tree``'s arrays held by one device (first addressable shard of each)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.addressable_shards[0].data
        total += int(np.prod(shard.shape)) * jnp.dtype(shard.dtype).itemsize
    return total
