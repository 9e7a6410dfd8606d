"""What each mesh axis does in a plan's train step: the one place the data-parallel mode is decided.

A plan's axes compose into a train step by role:

* **batch** (``data``, ``fsdp``): split the batch and synchronise gradients;
* **shard** (``fsdp`` with ``zero.stage`` >= 1): shard optimizer state
  (stage 1), gradients (2) and parameters, gathered on use (3);
* **tensor** (``tensor``): split weights (heads, MLP features, vocabulary)
  and the work on them; the model's :mod:`torsh_jax.tensor` blocks place its
  collectives, with sequence parallelism when ``tensor.sequence_parallel``;
* **pipeline** (``stage``): run a schedule table over a ``LayeredModel``'s
  stacked layers split into stages, and own micro-batching
  (:mod:`torsh_jax.runtime.pipeline`).

:func:`compose` reads only the plan and the mesh shape (no JAX), so the
runtime, the support checks, ``inspect`` and the communication theory all
read the same answer.

Example:
    >>> from torsh_jax.plan import plan_from_dict
    >>> plan = plan_from_dict({"mesh": {"data": {"ici": 1, "dcn": 2}, "fsdp": -1}, "zero": {"stage": 3}})
    >>> roles = compose(plan, {"data": 2, "stage": 1, "fsdp": 4, "tensor": 1})
    >>> roles.kind, roles.batch_axes, roles.shard_axis, roles.hybrid
    ('zero3', ('data', 'fsdp'), 'fsdp', True)
    >>> roles.describe()
    'HSDP ZeRO-3: data=2 x fsdp=4'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from torsh_jax.errors import NotSupportedYetError
from torsh_jax.plan.spec import DATA_AXES, CompressorSpec, ParallelPlan

__all__ = ["Roles", "compose", "head_backward_first", "sums_in_place", "SHARD_AXIS", "TENSOR_AXIS"]

#: The mesh axis ZeRO shards state over.
SHARD_AXIS = "fsdp"
#: The mesh axis weights are split over by tensor parallelism.
TENSOR_AXIS = "tensor"
STAGE_AXIS = "stage"


def _active(spec: CompressorSpec | None) -> bool:
    return spec is not None and spec.method != "none"


@dataclass(frozen=True)
class Roles:
    """The composition of a plan's axes on one mesh shape.

    Attributes:
        mesh_shape: axis name -> size.
        batch_axes: axes (size > 1) that split the batch and reduce gradients, mesh order.
        shard_axis: the axis state is sharded over (``fsdp``), or ``None`` (replicated state).
        zero_stage: the stage that runs (0 when nothing is sharded).
        gradient_compression: axis -> compressor of the gradient reductions over it.
        weight_compression: axis -> compressor of the parameter gathers over it.
        tensor_axis: the axis weights are split over (``tensor``), or ``None``.
        sequence_parallel: activations split on the sequence over ``tensor_axis``.
        stage_axis: the axis pipeline stages run over (``stage``), or ``None``.
        gather: how the step gets whole parameters: ``stored`` (kept whole: DDP, ZeRO-1/2),
            ``on_use`` (ZeRO-3: gathered where the model reads them, gradients reduce-scattered in
            the backward pass) or ``per_stage`` (ZeRO-3 under a pipeline with ``pipeline.gather =
            "once"``: a stage's parameters gathered once per step).
        reduce: when the gradients are synchronised: ``per_step`` (once per optimizer step),
            ``per_micro_step`` (every accumulation micro-step, reduce-scattered: ZeRO-2 and
            ``per_stage`` without compression) or ``in_backward`` (``on_use``: in the gather's
            backward pass; compressed replica axes are still synchronised once per step).
        prefetch_layers: layers gathered ahead of use in the layer scan, and reduced one layer
            late (``on_use`` outside a pipeline with ``zero.reshard_after_forward``): 0 or 1.
    """

    mesh_shape: Mapping[str, int]
    batch_axes: tuple[str, ...]
    shard_axis: str | None
    zero_stage: int
    gradient_compression: Mapping[str, CompressorSpec] = field(default_factory=dict)
    weight_compression: Mapping[str, CompressorSpec] = field(default_factory=dict)
    tensor_axis: str | None = None
    sequence_parallel: bool = False
    stage_axis: str | None = None
    gather: Literal["stored", "on_use", "per_stage"] = "stored"
    reduce: Literal["per_step", "per_micro_step", "in_backward"] = "per_step"
    prefetch_layers: int = 0

    @property
    def kind(self) -> str:
        """``ddp``, ``zero1``, ``zero2`` or ``zero3``."""
        return "ddp" if self.shard_axis is None else f"zero{self.zero_stage}"

    @property
    def hybrid(self) -> bool:
        """Sharded within ``fsdp`` and replicated across another batch axis (HSDP)."""
        return self.shard_axis is not None and any(a != self.shard_axis for a in self.batch_axes)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Batch axes the (possibly sharded) state is replicated over."""
        return tuple(a for a in self.batch_axes if a != self.shard_axis)

    @property
    def batch_size(self) -> int:
        """Devices the batch is split over (the product of the batch axes)."""
        size = 1
        for axis in self.batch_axes:
            size *= self.mesh_shape[axis]
        return size

    @property
    def params_sharded(self) -> bool:
        return self.zero_stage == 3

    @property
    def grads_sharded(self) -> bool:
        return self.zero_stage >= 2

    @property
    def opt_state_sharded(self) -> bool:
        return self.zero_stage >= 1

    def size(self, axis: str) -> int:
        return int(self.mesh_shape[axis])

    def describe(self) -> str:
        """One line, e.g. ``ZeRO-2 over fsdp=8`` or ``DDP over data=4 x tensor=2 (sequence parallel)``."""
        return self._data_parallel() + self._tensor() + self._stage()

    def _data_parallel(self) -> str:
        axes = " x ".join(f"{a}={self.size(a)}" for a in self.batch_axes) or "data=1"
        if self.shard_axis is None:
            return f"DDP over {axes}"
        if self.hybrid:
            return f"HSDP ZeRO-{self.zero_stage}: {axes}"
        return f"ZeRO-{self.zero_stage} over {axes}"

    def _stage(self) -> str:
        if self.stage_axis is None:
            return ""
        return f" x {self.stage_axis}={self.size(self.stage_axis)} (pipeline)"

    def _tensor(self) -> str:
        if self.tensor_axis is None:
            return ""
        sp = " (sequence parallel)" if self.sequence_parallel else ""
        return f" x {self.tensor_axis}={self.size(self.tensor_axis)}{sp}"


def _compressors(plan: ParallelPlan, shape: Mapping[str, int], part: str) -> dict[str, CompressorSpec]:
    out = {}
    for section in plan.compression:
        spec = getattr(section, part)
        if _active(spec) and int(shape[section.axis]) > 1:
            out[section.axis] = spec
    return out


def compose(plan: ParallelPlan, mesh_shape: Mapping[str, int]) -> Roles:
    """The roles of ``plan``'s axes on a mesh of ``mesh_shape`` (axis name -> size)."""
    shape = {a: int(s) for a, s in mesh_shape.items()}
    batch = tuple(a for a in DATA_AXES if shape.get(a, 1) > 1)
    sharded = plan.zero.stage > 0 and shape.get(SHARD_AXIS, 1) > 1
    tensor = shape.get(TENSOR_AXIS, 1) > 1
    stage = plan.zero.stage if sharded else 0
    pipelined = shape.get(STAGE_AXIS, 1) > 1
    gradients = _compressors(plan, shape, "gradients")
    gather = _gather(stage, pipelined, plan.pipeline.gather)
    compressed = any(axis in batch for axis in gradients)
    return Roles(
        mesh_shape=shape,
        batch_axes=batch,
        shard_axis=SHARD_AXIS if sharded else None,
        zero_stage=stage,
        gradient_compression=gradients,
        weight_compression=_compressors(plan, shape, "weights"),
        tensor_axis=TENSOR_AXIS if tensor else None,
        sequence_parallel=tensor and plan.tensor.sequence_parallel,
        stage_axis=STAGE_AXIS if pipelined else None,
        gather=gather,
        reduce=_reduce(stage, gather, compressed),
        prefetch_layers=_prefetch(plan, gather, pipelined),
    )


def _gather(stage: int, pipelined: bool, pipeline_gather: str) -> str:
    if stage != 3:
        return "stored"
    return "per_stage" if pipelined and pipeline_gather == "once" else "on_use"


def _prefetch(plan: ParallelPlan, gather: str, pipelined: bool) -> int:
    if gather != "on_use" or pipelined or not plan.zero.reshard_after_forward:
        return 0
    if plan.zero.prefetch_layers > 1:
        raise NotSupportedYetError(
            f"{plan.zero.prefetch_layers} layers ahead: gathering more than one layer ahead is not built yet",
            key="zero.prefetch_layers",
            fix="set zero.prefetch_layers = 1 (or 0)",
        )
    return plan.zero.prefetch_layers


def _reduce(stage: int, gather: str, compressed: bool) -> str:
    if gather == "on_use":
        return "in_backward"
    return "per_micro_step" if (stage == 2 or gather == "per_stage") and not compressed else "per_step"


def sums_in_place(plan: ParallelPlan, sizes: Mapping[str, int]) -> bool:
    """Whether the step's accumulation micro-steps add their layers' gradients into the step's sum
    in place (:func:`torsh_jax.runtime.sink.accumulate_into`): several micro-steps reduced once a
    step (:attr:`Roles.reduce` ``per_step``), parameters stored whole, no pipeline (whose stages
    carry their own sum).

    Example:
        >>> from torsh_jax.plan import plan_from_dict
        >>> ddp = plan_from_dict({"mesh": {"data": -1}, "batch": {"accumulation_steps": 2}})
        >>> sums_in_place(ddp, {"data": 8}), sums_in_place(ddp, {"data": 4, "stage": 2})
        (True, False)
    """
    roles = compose(plan, sizes)
    several = plan.batch.accumulation_steps > 1
    return several and roles.reduce == "per_step" and roles.gather == "stored" and roles.stage_axis is None


def head_backward_first(plan: ParallelPlan, sizes: Mapping[str, int], *, remat: bool = False) -> bool:
    """Whether the step finishes the head's backward before the layers', outside a pipeline's
    stages: every step where ZeRO-3 gathers each layer on use
    (:func:`torsh_jax.runtime.fsdp.gathered_loss`), its gradients reduced, and with ``remat``
    (each layer recomputed) every step but one summing its micro-steps in place
    (:func:`sums_in_place`; :func:`torsh_jax.runtime.layered.head_first`). Then the logits and a
    recomputed layer's working set are never held at once; under ZeRO-3 neither is the head's
    whole gradient beside the layers' backward, and accumulating, the head's weights are gathered
    every micro-step.

    Example:
        >>> from torsh_jax.plan import plan_from_dict
        >>> zero3 = plan_from_dict({"mesh": {"fsdp": -1}, "zero": {"stage": 3}})
        >>> sizes = {"data": 2, "fsdp": 4, "tensor": 1, "stage": 1}
        >>> head_backward_first(zero3, sizes), head_backward_first(zero3, {**sizes, "stage": 2, "data": 1})
        (True, False)
        >>> ddp = plan_from_dict({"mesh": {"data": -1}})
        >>> head_backward_first(ddp, {"data": 8}), head_backward_first(ddp, {"data": 8}, remat=True)
        (False, True)
    """
    roles = compose(plan, sizes)
    if roles.stage_axis is not None:
        return False
    return roles.gather == "on_use" or remat and not sums_in_place(plan, sizes)
