"""Refuse a train step that cannot fit in device memory: before compiling it, and before running it.

Before compiling, :func:`step_memory` adds up what one device must hold at
the same time, a lower bound of the step's peak:

* **state**: the train state's largest shards (:meth:`StateLayout.bytes_per_device`),
  without fields offloaded to host memory;
* **batch**: the device's shard of the global batch;
* **activations**: for a :class:`~torsh_jax.runtime.layered.LayeredModel` of two
  or more layers outside a pipeline, the hidden state one micro-batch carries
  from layer to layer (from ``jax.eval_shape`` of the model's ``embed``, divided
  by ``tensor`` under sequence parallelism or when the compiler partitions
  ``tensor``); zero for a plain loss function and under a pipeline.

Why this never exceeds the peak: the state and the batch are the program's
arguments, all resident on the device when it starts and until it ends (the
state is donated, so the new state reuses its buffers); the layer scan is a
loop whose carried hidden state is one buffer, live while the loop runs, next
to the arguments. Everything else (the residuals kept for the backward pass,
gradients, optimizer temporaries, XLA's scratch) is left out, so a step this
refuses cannot fit, and one it passes may still not: after compiling,
:func:`check_compiled_fits` compares the compiled step's peak
(:func:`~torsh_jax.analysis.memory.peak_bytes`) with the same limit before the
step runs.

The limit (:func:`device_memory_limit`) is ``TORSH_JAX_DEVICE_MEMORY`` when set
(bytes, or a number with ``KiB``/``MiB``/``GiB``/``TiB``), else the device's
``memory_stats()["bytes_limit"]``, else for CPU devices the host's physical
memory divided among the mesh's CPU devices in this process.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from torsh_jax.plan import ParallelPlan, BatchSpec
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> from torsh_jax.runtime.step import make_train_step
    >>> plan = ParallelPlan(batch=BatchSpec(micro_batch_size=4))
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> train = make_train_step(loss, optax.sgd(0.1), plan, build_mesh(plan, jax.devices()[:1]),
    ...                         {"w": jax.ShapeDtypeStruct((256, 1), jnp.float32)})
    >>> batch = {"x": jax.ShapeDtypeStruct((4, 256), jnp.float32)}
    >>> need = step_memory(train, batch)
    >>> need.state_bytes, need.batch_bytes, need.activation_bytes
    (1028, 4096, 0)
    >>> try:
    ...     check_step_fits(train, batch, limit=MemoryLimit(4096, "a test"))
    ... except DeviceMemoryError as err:
    ...     print(err.key)
    batch.micro_batch_size
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax

from torsh_jax.analysis.memory import MemoryReport, memory_report, peak_bytes, temporaries_at_peak
from torsh_jax.errors import DeviceMemoryError, PlanError
from torsh_jax.runtime.layered import split_params
from torsh_jax.runtime.mesh import mesh_shape_str
from torsh_jax.runtime.precision import cast_tree
from torsh_jax.tensor.axis import has_tensor_blocks
from torsh_jax.typing import PyTree
from torsh_jax.units import format_bytes, parse_bytes

if TYPE_CHECKING:  # pragma: no cover
    from jax.sharding import Mesh

    from torsh_jax.plan.spec import ParallelPlan
    from torsh_jax.runtime.layout import StateLayout


class TrainStep(Protocol):
    """What a fit check reads of a :class:`torsh_jax.runtime.step.TrainStep`."""

    plan: ParallelPlan
    mesh: Mesh
    loss: Any

    @property
    def layout(self) -> StateLayout: ...


__all__ = [
    "LIMIT_VAR",
    "MemoryLimit",
    "StepMemory",
    "device_memory_limit",
    "step_memory",
    "check_step_fits",
    "check_compiled_fits",
    "batch_key",
    "batch_like",
]

#: Environment variable overriding the per-device memory limit (bytes, or e.g. ``512MiB``).
LIMIT_VAR = "TORSH_JAX_DEVICE_MEMORY"


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes one device may use, and where that figure comes from (shown in errors)."""

    bytes: int
    source: str


@dataclass(frozen=True)
class StepMemory:
    """A lower bound of one device's peak memory in a train step (see the module docstring)."""

    state_bytes: int
    batch_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.batch_bytes + self.activation_bytes

    def parts(self) -> dict[str, int]:
        return {"state": self.state_bytes, "batch": self.batch_bytes, "activations": self.activation_bytes}


def _parse_bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise PlanError(str(err), key=LIMIT_VAR, fix="set it to e.g. 2147483648 or 2GiB") from None


def _host_memory_bytes() -> int | None:
    """Physical memory of this host (the most any process here can have); ``None`` if unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_limit(mesh: Mesh) -> MemoryLimit | None:
    """Bytes each device of ``mesh`` may use; ``None`` when neither the backend nor the host says.

    Raises:
        PlanError: ``TORSH_JAX_DEVICE_MEMORY`` is set but is not a byte count.
    """
    if os.environ.get(LIMIT_VAR):
        return MemoryLimit(_parse_bytes(os.environ[LIMIT_VAR]), LIMIT_VAR)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    if local and all(limits):
        return MemoryLimit(int(min(limits)), f"{local[0].platform} memory_stats bytes_limit")
    host = _host_memory_bytes()
    cpus = sum(d.platform == "cpu" for d in local)
    if host is None or not cpus or cpus != len(local):
        return None
    devices = "1 CPU device" if cpus == 1 else f"{cpus} CPU devices"
    return MemoryLimit(host // cpus, f"host memory {format_bytes(host)} over {devices}")


def _leaf_shape(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), jax.dtypes.canonicalize_dtype(x.dtype))


def batch_like(example: PyTree, rows: int) -> PyTree:
    """Shapes of a batch of ``rows`` examples shaped like ``example`` (any leading dim), made of nothing.

    >>> import numpy as np
    >>> batch_like({"x": np.zeros((1, 3), np.int32)}, 10**9)["x"].shape
    (1000000000, 3)
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), _leaf_shape(x).dtype), example)


def batch_key(batch: PyTree) -> Hashable:
    """Tree structure, shapes and dtypes of ``batch``: calls with equal keys run the same program."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _batch_shard_bytes(train: TrainStep, batch: PyTree) -> int:
    """Bytes of one device's shard of ``batch`` (leading dim split over the batch axes)."""
    split = math.prod(train.mesh.shape[a] for a in train.layout.roles.batch_axes)
    total = 0
    for leaf in jax.tree.leaves(batch):
        x = _leaf_shape(leaf)
        rows = -(-x.shape[0] // split) if x.shape else 1
        total += rows * math.prod(x.shape[1:]) * x.dtype.itemsize
    return total


def _carry_bytes(train: TrainStep, batch: PyTree) -> int:
    """Bytes of the hidden state one micro-batch carries between layers on one device (0 where not known)."""
    layout, plan = train.layout, train.plan
    model, roles = layout.decided.model, layout.roles
    if not model.stacked or roles.stage_axis is not None:
        return 0
    stacked = jax.tree.leaves(layout.abstract.params[model.layers_key])
    if not stacked or stacked[0].shape[0] < 2:  # one layer: no loop, XLA may fuse the hidden state away
        return 0
    params = jax.eval_shape(lambda p: cast_tree(p, plan.precision.compute_dtype), layout.abstract.params)
    rows = plan.batch.micro_batch_size
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), _leaf_shape(x).dtype), batch)
    hidden = jax.eval_shape(model.embed, split_params(model, params)[0], micro)
    # split over tensor: on the sequence with sequence parallelism, by the compiler for plain models
    split_over_tensor = roles.tensor_axis and (roles.sequence_parallel or not has_tensor_blocks(model))
    split = roles.size(roles.tensor_axis) if split_over_tensor else 1
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(hidden)) // split


def step_memory(train: TrainStep, batch: PyTree | None = None) -> StepMemory:
    """A lower bound of one device's memory in ``train``'s step on a global ``batch`` (arrays or shapes).

    ``batch=None`` counts the state alone.
    """
    layout = train.layout
    state = sum(n for part, n in layout.bytes_per_device().items() if part not in layout.offloaded)
    if batch is None:
        return StepMemory(state, 0, 0)
    return StepMemory(state, _batch_shard_bytes(train, batch), _carry_bytes(train, batch))


def _fix(part: str, train: TrainStep) -> tuple[str, str]:
    """``(key, fix)`` for the part of the step that takes the most memory."""
    b = train.plan.batch
    if part == "state":
        return "zero.stage", (
            "shard the state over more devices (zero.stage 3 with a larger mesh.fsdp), set "
            "zero.offload_optimizer, or train a smaller model"
        )
    if part == "batch":
        rows = b.micro_batch_size * b.accumulation_steps
        key = "batch.accumulation_steps" if b.accumulation_steps > 1 else "batch.micro_batch_size"
        sizes = f"batch.micro_batch_size ({b.micro_batch_size:,})"
        if b.accumulation_steps > 1:
            sizes = f"batch.accumulation_steps ({b.accumulation_steps:,}) or {sizes}"
        return key, (
            f"lower {sizes}: each device holds {rows:,} examples of the global batch at once, "
            "or spread the batch over more devices (mesh.data, mesh.fsdp)"
        )
    return "batch.micro_batch_size", (
        f"lower batch.micro_batch_size ({b.micro_batch_size:,}) and raise batch.accumulation_steps to keep "
        "the global batch"
    )


def _limit_or_none(train: TrainStep, limit: MemoryLimit | None) -> MemoryLimit | None:
    return limit if limit is not None else device_memory_limit(train.mesh)


def check_step_fits(
    train: TrainStep, batch: PyTree | None = None, *, limit: MemoryLimit | None = None
) -> StepMemory:
    """Raise :class:`DeviceMemoryError` when :func:`step_memory` exceeds the limit; return the estimate.

    Args:
        train: a train step.
        batch: a global batch or its shapes (:func:`batch_like`); ``None``: the state alone.
        limit: bytes per device; default :func:`device_memory_limit` (no check when unknown).
    """
    need = step_memory(train, batch)
    limit = _limit_or_none(train, limit)
    if limit is None or need.total_bytes <= limit.bytes:
        return need
    parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in need.parts().items())
    key, fix = _fix(max(need.parts(), key=need.parts().get), train)
    raise DeviceMemoryError(
        f"the step needs at least {format_bytes(need.total_bytes)} per device on mesh "
        f"{mesh_shape_str(train.mesh)} ({parts}) but a device has {format_bytes(limit.bytes)} "
        f"({limit.source})",
        key=key,
        fix=fix,
    )


def check_compiled_fits(
    train: TrainStep, compiled: jax.stages.Compiled, *, limit: MemoryLimit | None = None
) -> MemoryReport:
    """Raise :class:`DeviceMemoryError` when the compiled step's peak (libtpu's own on a TPU, else
    ``argument + output + temp - alias``: :func:`~torsh_jax.analysis.memory.peak_bytes`) exceeds the
    limit; return the memory report (no check when the backend or the limit is silent)."""
    report = memory_report(compiled)
    limit = _limit_or_none(train, limit)
    platform = train.mesh.devices.flat[0].platform
    peak = peak_bytes(report, platform)
    if limit is None or peak is None or peak <= limit.bytes:
        return report
    temporaries = temporaries_at_peak(report, platform)
    part = "activations" if temporaries >= report.argument_bytes else "state"
    if part == "state":
        need = step_memory(train)
        part = "batch" if report.argument_bytes - need.state_bytes > need.state_bytes else "state"
    key, fix = _fix(part, train)
    raise DeviceMemoryError(
        f"the compiled step needs {format_bytes(peak)} per device on mesh {mesh_shape_str(train.mesh)} "
        f"(arguments {format_bytes(report.argument_bytes)}, temporaries {format_bytes(temporaries)}, "
        f"outputs {format_bytes(report.output_bytes)}, donated {format_bytes(report.alias_bytes or 0)}) "
        f"but a device has {format_bytes(limit.bytes)} ({limit.source})",
        key=key,
        fix=fix,
    )
