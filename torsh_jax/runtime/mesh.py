"""Build a :class:`jax.sharding.Mesh` from a plan.

The mesh always has the four plan axes in :data:`MESH_AXIS_ORDER`
(``data, stage, fsdp, tensor``); axes of size 1 cost nothing. All axes are
``AxisType.Auto``: collectives are placed by our ``shard_map`` programs, and
``jit`` reshards inputs that arrive with another layout.

A plan whose cross-slice (DCN) sizes multiply to more than 1 builds a hybrid
mesh: one slice per process when there are several processes
(``mesh_utils.create_hybrid_device_mesh`` with ``process_is_granule``), or
consecutive groups of local devices when a single process simulates slices.

Example:
    >>> import jax
    >>> from torsh_jax.plan import load_plan
    >>> mesh = build_mesh(load_plan("ddp"), jax.devices()[:1])
    >>> dict(mesh.shape)
    {'data': 1, 'stage': 1, 'fsdp': 1, 'tensor': 1}
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from torsh_jax.errors import MeshError
from torsh_jax.plan.spec import MESH_AXIS_ORDER, ParallelPlan, ResolvedMesh

__all__ = ["build_mesh", "resolve_mesh", "mesh_shape_str", "default_num_slices"]


def mesh_shape_str(mesh: Mesh) -> str:
    """``data=8, fsdp=1, ...``: the mesh shape for messages."""
    return ", ".join(f"{a}={s}" for a, s in mesh.shape.items())


def resolve_mesh(plan: ParallelPlan, num_devices: int, *, num_slices: int | None = None) -> ResolvedMesh:
    """Concrete axis sizes for ``num_devices`` devices.

    Args:
        plan: the plan.
        num_devices: devices in the mesh.
        num_slices: slices (default: the product of the plan's DCN sizes,
            with a ``-1`` DCN size meaning one slice per process).
    """
    if num_slices is None:
        num_slices = default_num_slices(plan)
    return plan.mesh.resolve(num_devices, num_slices=num_slices)


def default_num_slices(plan: ParallelPlan) -> int:
    sizes = [getattr(plan.mesh, a).dcn for a in MESH_AXIS_ORDER]
    if -1 in sizes:
        return jax.process_count()
    return int(np.prod(sizes))


def build_mesh(
    plan: ParallelPlan,
    devices: Sequence[jax.Device] | None = None,
    *,
    num_slices: int | None = None,
) -> Mesh:
    """The mesh for ``plan`` over ``devices`` (default: all devices).

    Raises:
        MeshError: the plan's sizes do not fit the devices; the message
            lists factorisations that would.
    """
    devices = list(jax.devices() if devices is None else devices)
    resolved = resolve_mesh(plan, len(devices), num_slices=num_slices)
    ici = [resolved.ici[a] for a in MESH_AXIS_ORDER]
    dcn = [resolved.dcn[a] for a in MESH_AXIS_ORDER]
    if int(np.prod(dcn)) == 1:
        array = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
    else:
        array = _hybrid_device_array(ici, dcn, devices)
    return Mesh(array, MESH_AXIS_ORDER, axis_types=(AxisType.Auto,) * len(MESH_AXIS_ORDER))


def _hybrid_device_array(ici: list[int], dcn: list[int], devices: list[jax.Device]) -> np.ndarray:
    num_slices = int(np.prod(dcn))
    if len({getattr(d, "slice_index", 0) for d in devices}) == num_slices:  # TPU slices, real or compile-only
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=False)
    processes = sorted({d.process_index for d in devices})
    if len(processes) == num_slices:
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    if len(processes) != 1:
        raise MeshError(
            f"{num_slices} slices requested but devices span {len(processes)} processes",
            key="mesh (dcn)",
            fix="run one process per slice, or make the DCN sizes multiply to the process count",
        )
    return _simulated_slices(ici, dcn, devices)


def _simulated_slices(ici: list[int], dcn: list[int], devices: list[jax.Device]) -> np.ndarray:
    """A hybrid mesh in one process: consecutive device groups act as slices."""
    per_slice = len(devices) // int(np.prod(dcn))
    slices = [
        mesh_utils.create_device_mesh(ici, devices[i * per_slice : (i + 1) * per_slice])
        for i in range(int(np.prod(dcn)))
    ]
    grid = np.empty(dcn, dtype=object)
    for index, slice_array in zip(np.ndindex(*dcn), slices):
        grid[index] = slice_array
    return np.block(grid.tolist())
