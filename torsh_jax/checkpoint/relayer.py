"""Restoring stacked layers saved in another number of chunks.

An interleaved pipeline stores its stacked layers as ``[chunks, layers /
chunks, ...]`` (:func:`torsh_jax.runtime.pipeline.layer_chunks`); every other
plan as ``[layers, ...]``. The values keep their order in both forms, so a
saved leaf is read in its saved shape, split over the target's mesh axes where
they divide it, and reshaped on the mesh into the target's form: one
resharding at restore, no host copy of a whole leaf.

Example:
    >>> logical_shape((2, 4, 16), chunks=2), logical_shape((8, 16), chunks=1)
    ((8, 16), (8, 16))
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.plan.roles import compose
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.pipeline import layer_chunks
from torsh_jax.runtime.specs import entry_axes, path_str
from torsh_jax.typing import PyTree

__all__ = ["saved_chunks", "logical_shape", "read_targets", "relayered"]


def saved_chunks(plan: ParallelPlan, mesh_shape: dict) -> int:
    """Chunks the stacked layers were saved in, from the saved plan and mesh shape."""
    return layer_chunks(plan, compose(plan, mesh_shape))


def logical_shape(shape: tuple[int, ...], *, chunks: int) -> tuple[int, ...]:
    """``[layers, ...]`` of a stacked leaf stored in ``chunks`` chunks."""
    return tuple(shape) if chunks == 1 else (shape[0] * shape[1], *shape[2:])


def read_targets(on_disk: dict, target: PyTree, *, stacked_key: str, saved: int, chunks: int) -> dict:
    """``{path: ShapeDtypeStruct}`` to read instead of the target's leaf: the stacked leaves whose
    saved form (``on_disk``: ``{path: (shape, dtype)}``, in ``saved`` chunks) differs from the
    target's (in ``chunks``) only by their chunks. Empty when the chunks agree."""
    if saved == chunks:
        return {}
    out = {}
    for path, want in jax.tree_util.tree_leaves_with_path(target):
        key = path_str(path)
        if f"/{stacked_key}/" not in f"/{key}/" or key not in on_disk:
            continue
        shape, dtype = on_disk[key]
        same = logical_shape(shape, chunks=saved) == logical_shape(want.shape, chunks=chunks)
        if same and dtype == str(want.dtype):
            sharding = _read_sharding(shape, want, saved, chunks)
            out[key] = jax.ShapeDtypeStruct(shape, want.dtype, sharding=sharding)
    return out


def _read_sharding(shape: tuple[int, ...], want: Any, saved: int, chunks: int) -> NamedSharding:
    """The target's sharding moved onto the saved form: the same split of the trailing dims, the
    layer split kept where it divides the saved layer dim."""
    spec = (*want.sharding.spec, *(None,) * (len(want.shape) - len(want.sharding.spec)))
    layer_entry, rest = (spec[1], spec[2:]) if chunks > 1 else (spec[0], spec[1:])
    mesh = want.sharding.mesh
    size = math.prod(mesh.shape[a] for a in entry_axes(layer_entry))
    layer_dim = 1 if saved > 1 else 0
    entry = layer_entry if shape[layer_dim] % size == 0 else None
    lead = (None, entry) if saved > 1 else (entry,)
    return NamedSharding(mesh, P(*lead, *rest), memory_kind=want.sharding.memory_kind)


def relayered(read: PyTree, target: PyTree, reads: dict) -> PyTree:
    """``read`` with every leaf read in another form (``reads``) reshaped into the target's."""
    if not reads:
        return read

    def one(path, x, want):
        if path_str(path) not in reads:
            return x
        return jax.jit(lambda v: v.reshape(want.shape), out_shardings=want.sharding)(x)

    return jax.tree_util.tree_map_with_path(one, read, target)
