"""Global batches from process-local data.

Each process loads only its part of the global batch; :func:`global_batch_from_local`
assembles global ``jax.Array`` s whose shards live on that process's devices.

Example (one process, so its local data is the whole batch):
    >>> import jax, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> batch = global_batch_from_local({"x": np.zeros((16, 3), np.float32)}, mesh=mesh, spec=P("data"))
    >>> batch["x"].shape
    (16, 3)
    >>> local_batch_slice(32, process_index=1, process_count=4)
    slice(8, 16, None)
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torsh_jax.errors import ShardingError
from torsh_jax.typing import PyTree

__all__ = ["PyTree", "global_batch_from_local", "local_batch_slice", "local_shard_counts"]


def global_batch_from_local(local_batch: PyTree, /, *, mesh: Mesh, spec: PartitionSpec) -> PyTree:
    """Global arrays sharded as ``spec`` over ``mesh`` from this process's share.

    ``In_local[B / P, ...] -> Global[B, ...]`` sharded ``spec``, for ``P``
    processes along the batch dim. Along a dim split over mesh axes, this
    process supplies the rows of its own devices, in mesh order; along other
    dims it supplies the full extent. Every leaf uses the same ``spec``.

    Args:
        local_batch: pytree of host arrays (NumPy or JAX) holding this
            process's rows.
        mesh: the global mesh (all processes' devices).
        spec: how each leaf is sharded, e.g. ``P(("data", "fsdp"))``.

    Returns:
        The same pytree of global ``jax.Array`` s.

    Raises:
        ShardingError: a leaf has fewer dims than ``spec`` names, or a local
            dim does not divide over this process's devices along its mesh
            axes; the message names the leaf path, shape and mesh shape.
    """
    sharding = NamedSharding(mesh, spec)
    counts = local_shard_counts(mesh, spec)

    def build(path, leaf):
        local = np.asarray(leaf)
        _check_local_shape(_path_name(path), local.shape, counts, mesh=mesh, spec=spec)
        return jax.make_array_from_process_local_data(sharding, local)

    return jax.tree_util.tree_map_with_path(build, local_batch)


def local_shard_counts(mesh: Mesh, spec: PartitionSpec) -> tuple[int, ...]:
    """Per entry of ``spec``: how many distinct slices this process's devices hold along that dim.

    Example:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> n = jax.device_count()
        >>> mesh = jax.make_mesh((n, 1), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        >>> local_shard_counts(mesh, P("data", "tensor")) == (n, 1)  # one process holds every device
        True
    """
    here = jax.process_index()
    local_coords = [
        index for index in np.ndindex(mesh.devices.shape) if mesh.devices[index].process_index == here
    ]
    names = list(mesh.axis_names)
    counts = []
    for entry in spec:
        axes = _entry_axes(entry)
        positions = [names.index(a) for a in axes]
        counts.append(len({tuple(c[p] for p in positions) for c in local_coords}) if axes else 1)
    return tuple(counts)


def local_batch_slice(global_batch_size: int, /, *, process_index: int, process_count: int) -> slice:
    """Rows of a global batch that one process loads (contiguous, equal shares).

    Args:
        global_batch_size: rows in the global batch.
        process_index: this process (``jax.process_index()``).
        process_count: processes (``jax.process_count()``).

    Raises:
        ShardingError: the batch does not divide by ``process_count`` or the
            index is out of range.

    Example:
        >>> local_batch_slice(12, process_index=2, process_count=3)
        slice(8, 12, None)
    """
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ShardingError(
            f"process {process_index} is outside [0, {process_count})",
            key="process_index",
            fix="pass jax.process_index() and jax.process_count()",
        )
    if global_batch_size % process_count:
        raise ShardingError(
            f"{global_batch_size} rows do not split evenly over {process_count} processes",
            key="global_batch_size",
            fix=f"use a multiple of {process_count}, e.g. {_round_up(global_batch_size, process_count)}",
        )
    share = global_batch_size // process_count
    return slice(process_index * share, (process_index + 1) * share)


def _check_local_shape(
    name: str, shape: tuple[int, ...], counts: tuple[int, ...], *, mesh: Mesh, spec: PartitionSpec
) -> None:
    mesh_shape = dict(mesh.shape)
    if len(counts) > len(shape):
        raise ShardingError(
            f"local shape {shape} has {len(shape)} dims but spec {spec} names {len(counts)} "
            f"(mesh {mesh_shape})",
            key=name,
            fix="shorten the spec or add dims to the array",
        )
    for dim, (size, count) in enumerate(zip(shape, counts, strict=False)):
        if size % count:
            axes = _entry_axes(spec[dim])
            total = math.prod(mesh_shape[a] for a in axes)
            raise ShardingError(
                f"local dim {dim} of shape {shape} has {size} rows, which do not split over this "
                f"process's {count} shards along mesh axes {axes} (mesh {mesh_shape}, "
                f"{total} shards in all)",
                key=name,
                fix=f"load a multiple of {count} rows per process, e.g. {_round_up(size, count)}",
            )


def _entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _path_name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "batch"


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)
