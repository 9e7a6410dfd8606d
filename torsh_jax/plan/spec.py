"""The ParallelPlan: the one intermediate representation of a training setup.

Every input (preset TOML, DeepSpeed JSON, Horovod line, environment, FSDP
options) is translated into a plan; every runtime piece (mesh, shardings,
train step, reports) is derived from it. Plans are frozen and validate
eagerly; an invalid field raises :class:`~torsh_jax.errors.PlanError` naming
its key path.

Example:
    >>> from torsh_jax.plan import ParallelPlan, MeshSpec, AxisSize, BatchSpec
    >>> plan = ParallelPlan(mesh=MeshSpec(data=AxisSize(ici=4, dcn=2)),
    ...                     batch=BatchSpec(micro_batch_size=8, accumulation_steps=2))
    >>> plan.mesh.resolve(8, num_slices=2).shape
    {'data': 8, 'stage': 1, 'fsdp': 1, 'tensor': 1}
    >>> plan.batch.global_batch_size(8)
    128
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from torsh_jax.errors import PlanError
from torsh_jax.plan.compressors import METHODS, method_names
from torsh_jax.plan.factor import resolve_sizes

__all__ = [
    "AXES",
    "MESH_AXIS_ORDER",
    "DTYPES",
    "AxisSize",
    "MeshSpec",
    "ResolvedMesh",
    "ZeroSpec",
    "LossScaleSpec",
    "PrecisionSpec",
    "BatchSpec",
    "CommunicationSpec",
    "CompressorSpec",
    "AxisCompression",
    "PipelineSpec",
    "TensorSpec",
    "ScheduleSpec",
    "OptimizerSpec",
    "ParallelPlan",
    "DEFAULT_RULES",
    "DEFAULT_PARAM_DIMS",
    "DATA_AXES",
]

#: Plan axis names.
AXES = ("data", "fsdp", "tensor", "stage")
#: Order of axes in the built mesh: slowest links (outermost) first.
MESH_AXIS_ORDER = ("data", "stage", "fsdp", "tensor")
#: Floating dtypes a precision policy may name.
DTYPES = ("float32", "bfloat16", "float16")
#: Data-parallel axes: the batch is split over these, gradients reduced over them.
DATA_AXES = ("data", "fsdp")

Scalar = int | float | str | bool


#: Largest batch count (micro batch per device, accumulation steps, global batch): int32 indexing.
MAX_BATCH_SIZE = 2**31 - 1


def _check(ok: bool, key: str, message: str, fix: str | None = None) -> None:
    if not ok:
        raise PlanError(message, key=key, fix=fix or f"change {key} in the plan (docs/plans.md describes it)")


def _check_positive_int(value: object, key: str, *, maximum: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    _check(ok, key, f"must be an integer >= 1, got {value!r}", fix="write a whole number >= 1")
    if maximum is not None:
        _check(
            value <= maximum, key, f"must be at most {maximum:,}, got {value:,}", fix=f"use at most {maximum}"
        )


def _check_choice(value: object, choices: tuple, key: str) -> None:
    _check(value in choices, key, f"must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class AxisSize:
    """Size of one plan axis: in-slice (ICI) part times cross-slice (DCN) part.

    Args:
        ici: devices along this axis inside one slice; ``-1`` fills the rest.
        dcn: slices along this axis; ``-1`` fills the rest.
    """

    ici: int = 1
    dcn: int = 1

    def __post_init__(self):
        for part in ("ici", "dcn"):
            value = getattr(self, part)
            ok = isinstance(value, int) and not isinstance(value, bool)
            _check(ok and (value >= 1 or value == -1), part, f"must be -1 or >= 1, got {value!r}")


@dataclass(frozen=True)
class ResolvedMesh:
    """Concrete axis sizes for a device count, in :data:`MESH_AXIS_ORDER`."""

    ici: dict[str, int]
    dcn: dict[str, int]

    @property
    def shape(self) -> dict[str, int]:
        return {a: self.ici[a] * self.dcn[a] for a in MESH_AXIS_ORDER}

    @property
    def num_devices(self) -> int:
        n = 1
        for size in self.shape.values():
            n *= size
        return n

    @property
    def data_parallel_size(self) -> int:
        return self.shape["data"] * self.shape["fsdp"]


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the four plan axes (see :class:`AxisSize`).

    The default is pure data parallelism over every device. ``data`` left out
    (``None``) takes the devices the other axes leave (``ici = -1``), or 1 when
    another axis already has ``ici = -1``: one inferred size per part.

    >>> MeshSpec(fsdp=AxisSize(ici=-1)).data
    AxisSize(ici=1, dcn=1)
    """

    data: AxisSize | None = None
    fsdp: AxisSize = AxisSize()
    tensor: AxisSize = AxisSize()
    stage: AxisSize = AxisSize()

    def __post_init__(self):
        if self.data is None:
            inferred = any(getattr(self, a).ici == -1 for a in AXES if a != "data")
            object.__setattr__(self, "data", AxisSize(ici=1 if inferred else -1))

    def resolve(self, num_devices: int, *, num_slices: int = 1) -> ResolvedMesh:
        """Fill ``-1`` sizes and check the product against the device count.

        Raises:
            MeshError: the sizes do not multiply to ``num_devices``; the
                message lists factorisations that would work.
        """
        sizes = {a: (getattr(self, a).ici, getattr(self, a).dcn) for a in MESH_AXIS_ORDER}
        used = tuple(a for a in AXES if a in self.used_axes())
        ici, dcn = resolve_sizes(sizes, num_devices=num_devices, num_slices=num_slices, used_axes=used)
        return ResolvedMesh(ici=ici, dcn=dcn)

    def used_axes(self) -> tuple[str, ...]:
        """Plan axes whose size is not known to be 1."""
        return tuple(a for a in AXES if getattr(self, a) != AxisSize())


@dataclass(frozen=True)
class ZeroSpec:
    """What is sharded over the ``fsdp`` axis (DeepSpeed ZeRO semantics).

    Args:
        stage: 0 nothing, 1 optimizer state, 2 plus gradients, 3 plus parameters.
        reshard_after_forward: stage 3: re-gather parameters in the backward
            pass (lowest memory) instead of keeping the gathered layer.
        offload_optimizer: keep optimizer state in host memory.
        offload_params: keep parameters in host memory (stage 3).
        prefetch_layers: stage 3: layers gathered ahead of use by a hand-written layer scan
            (0 or 1; 0: the compiler schedules the plain scan's gathers, see docs/strategies.md).
        persistence_threshold: stage 3: parameters with fewer elements stay
            replicated (DeepSpeed's ``stage3_param_persistence_threshold``).
    """

    stage: int = 0
    reshard_after_forward: bool = True
    offload_optimizer: bool = False
    offload_params: bool = False
    prefetch_layers: int = 0
    persistence_threshold: int = 0

    def __post_init__(self):
        _check_choice(self.stage, (0, 1, 2, 3), "zero.stage")
        _check(self.prefetch_layers >= 0, "zero.prefetch_layers", "must be >= 0")
        _check(self.persistence_threshold >= 0, "zero.persistence_threshold", "must be >= 0")


@dataclass(frozen=True)
class LossScaleSpec:
    """Loss scaling with DeepSpeed's semantics.

    Args:
        mode: ``none``, ``static`` (multiply by ``static_scale``) or
            ``dynamic`` (start at ``2**initial_scale_power``, halve on
            overflow after ``hysteresis`` overflows, double after
            ``loss_scale_window`` clean steps, never below ``min_loss_scale``).
    """

    mode: Literal["none", "static", "dynamic"] = "none"
    static_scale: float = 1.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self):
        _check_choice(self.mode, ("none", "static", "dynamic"), "precision.loss_scale.mode")
        _check(self.static_scale > 0, "precision.loss_scale.static_scale", "must be > 0")
        _check_positive_int(self.loss_scale_window, "precision.loss_scale.loss_scale_window")
        _check_positive_int(self.hysteresis, "precision.loss_scale.hysteresis")
        _check(self.min_loss_scale > 0, "precision.loss_scale.min_loss_scale", "must be > 0")


@dataclass(frozen=True)
class PrecisionSpec:
    """Dtypes of master parameters, compute (and all-gathers), and gradient reduction."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    reduce_dtype: str = "float32"
    loss_scale: LossScaleSpec = LossScaleSpec()

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "reduce_dtype"):
            _check_choice(getattr(self, name), DTYPES, f"precision.{name}")


@dataclass(frozen=True)
class BatchSpec:
    """Batch layout: global batch = micro batch x accumulation steps x data-parallel size.

    Args:
        micro_batch_size: examples per data-parallel rank per micro-step
            (DeepSpeed's ``train_micro_batch_size_per_gpu``).
        accumulation_steps: micro-steps per optimizer step; gradients are
            reduced once per optimizer step.
        accumulation_reduce: ``mean`` (DeepSpeed) or ``sum`` (Horovod's
            ``backward_passes_per_step``) of the micro-step gradients.
    """

    micro_batch_size: int = 1
    accumulation_steps: int = 1
    accumulation_reduce: Literal["mean", "sum"] = "mean"

    def __post_init__(self):
        _check_positive_int(self.micro_batch_size, "batch.micro_batch_size", maximum=MAX_BATCH_SIZE)
        _check_positive_int(self.accumulation_steps, "batch.accumulation_steps", maximum=MAX_BATCH_SIZE)
        _check_choice(self.accumulation_reduce, ("mean", "sum"), "batch.accumulation_reduce")

    def global_batch_size(self, data_parallel_size: int) -> int:
        return self.micro_batch_size * self.accumulation_steps * data_parallel_size


@dataclass(frozen=True)
class CommunicationSpec:
    """How gradients cross the wire.

    Args:
        bucket_mb: gradients are fused into buckets of this many MB (1e6
            bytes) per reduction; 0 reduces each gradient on its own.
        reduce_op: ``mean`` over data-parallel ranks, or ``sum``.
        prescale_gradients: divide by the data-parallel size before reducing.
        gradient_predivide_factor: divide by this before and multiply by it
            over the data-parallel size after reducing (DeepSpeed/Horovod).
    """

    bucket_mb: float = 25.0
    reduce_op: Literal["mean", "sum"] = "mean"
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0

    def __post_init__(self):
        _check(self.bucket_mb >= 0, "communication.bucket_mb", f"must be >= 0, got {self.bucket_mb}")
        _check_choice(self.reduce_op, ("mean", "sum"), "communication.reduce_op")
        _check(self.gradient_predivide_factor > 0, "communication.gradient_predivide_factor", "must be > 0")


#: ``none`` and the methods of the compressor registry (:mod:`torsh_jax.plan.compressors`, no JAX).
COMPRESSION_METHODS = method_names()


@dataclass(frozen=True)
class CompressorSpec:
    """One compressor (see ``compression/*.toml`` for named presets).

    Args:
        method: ``none`` or a method of the compressor registry
            (:data:`~torsh_jax.plan.compressors.METHODS`: ``fp16``, ``bf16``, ``fp8_e4m3``,
            ``fp8_e5m2``, ``int8``, ``int4``, ``sign``, ``topk``, ``powersgd``).
        block_size: elements per scale block (the methods with block scales: int8/int4/sign/fp8).
        rounding: ``nearest``, or ``stochastic`` for the methods that have it (int8, int4).
        error_feedback: keep the residual and add it to the next step.
        topk_fraction: fraction of elements kept per chunk (top-k).
        chunk_size: elements per top-k chunk (indices are local int16).
        rank: PowerSGD rank.
        warmup_steps: steps before compression starts (1-bit Adam's
            ``freeze_step``).
    """

    method: str = "none"
    block_size: int = 256
    rounding: Literal["nearest", "stochastic"] = "nearest"
    error_feedback: bool = True
    topk_fraction: float = 0.01
    chunk_size: int = 4096
    rank: int = 4
    warmup_steps: int = 0

    def __post_init__(self):
        _check_choice(self.method, COMPRESSION_METHODS, "method")
        _check_positive_int(self.block_size, "block_size")
        _check_choice(self.rounding, ("nearest", "stochastic"), "rounding")
        stochastic = sorted(name for name, m in METHODS.items() if m.stochastic)
        _check(
            self.rounding == "nearest" or self.method in stochastic,
            "rounding",
            f"method {self.method!r} has no stochastic rounding",
            fix=f"use rounding = 'nearest', or a method with stochastic rounding: {stochastic}",
        )
        _check(0 < self.topk_fraction <= 1, "topk_fraction", "must be in (0, 1]")
        _check(1 <= self.chunk_size <= 32768, "chunk_size", "must be in [1, 32768] (int16 indices)")
        _check_positive_int(self.rank, "rank")
        _check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")


@dataclass(frozen=True)
class AxisCompression:
    """Compression of the collectives over one mesh axis.

    Args:
        axis: plan axis (``data`` or ``fsdp``).
        gradients: compressor for gradient reductions over the axis.
        weights: compressor for ZeRO-3 parameter all-gathers over the axis.
        implementation: what runs the blockwise compressors (int8, int4, sign): ``auto``
            (the Pallas kernels on TPU and GPU devices, the ``jnp`` reference on CPU),
            ``pallas`` (the kernels; on CPU in the Pallas interpreter) or ``reference``.
    """

    axis: str
    gradients: CompressorSpec | None = None
    weights: CompressorSpec | None = None
    implementation: str = "auto"

    def __post_init__(self):
        _check_choice(self.axis, DATA_AXES, "axis")
        _check_choice(self.implementation, ("auto", "pallas", "reference"), "implementation")


@dataclass(frozen=True)
class PipelineSpec:
    """Pipeline settings used when the ``stage`` axis is larger than 1.

    Args:
        microbatches: pipeline micro-batches each pass splits the micro batch into.
        schedule: a key of :data:`torsh_jax.pipeline.schedule.PIPELINE_SCHEDULES`: ``gpipe``,
            ``1f1b``, ``interleaved`` or ``zb_h1`` (1F1B with each backward split into input and
            weight gradients).
        virtual_stages: layer chunks per stage (``interleaved``).
        gather: under ZeRO-3, gather a stage's parameters ``once`` per step or
            ``per_microbatch`` (one layer at a time in every slot).
    """

    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    gather: Literal["once", "per_microbatch"] = "once"

    def __post_init__(self):
        _check_positive_int(self.microbatches, "pipeline.microbatches")
        from torsh_jax.pipeline.schedule import PIPELINE_SCHEDULES  # the registry (numpy only)

        _check_choice(self.schedule, tuple(PIPELINE_SCHEDULES), "pipeline.schedule")
        _check_positive_int(self.virtual_stages, "pipeline.virtual_stages")
        _check_choice(self.gather, ("once", "per_microbatch"), "pipeline.gather")


#: Values of ``tensor.rules``.
TENSOR_RULES = ("names", "auto")


@dataclass(frozen=True)
class TensorSpec:
    """Tensor-parallel settings used when the ``tensor`` axis is larger than 1.

    Args:
        sequence_parallel: activations between blocks are split on the sequence dim.
        allow_replicated: run a model none of whose parameters the rules split over ``tensor``
            (no logical names, no matching ``param_dims``), each tensor device repeating the same
            work; without it such a model is refused. Not for :mod:`torsh_jax.tensor` blocks.
        rules: ``"names"``: parameters are split by their logical names and ``param_dims``;
            ``"auto"``: the parameters neither names also get Megatron's split from their shapes
            (:mod:`torsh_jax.runtime.tensor_names`).
    """

    sequence_parallel: bool = False
    allow_replicated: bool = False
    rules: str = "names"

    def __post_init__(self):
        _check(
            self.rules in TENSOR_RULES,
            "tensor.rules",
            f"unknown {self.rules!r}",
            fix=f"use one of {', '.join(TENSOR_RULES)}",
        )


@dataclass(frozen=True)
class ScheduleSpec:
    """A learning-rate schedule by name with its hyper-parameters.

    Names: ``constant``, ``warmup_lr``, ``warmup_decay_lr``,
    ``warmup_cosine_lr``, ``one_cycle``, ``lr_range_test``, ``cosine``.
    """

    name: str = "constant"
    params: dict[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    """An optax optimizer by name with its hyper-parameters.

    Names: ``adam``, ``adamw``, ``lamb``, ``sgd``, ``adafactor``, ``lion``.
    ``params`` uses optax's argument names (``b1``, ``b2``, ``eps``,
    ``weight_decay``, ``momentum``, ``nesterov``).
    """

    name: str = "adamw"
    learning_rate: float = 1e-3
    params: dict[str, Scalar] = field(default_factory=dict)
    schedule: ScheduleSpec | None = None
    gradient_clipping: float = 0.0

    def __post_init__(self):
        _check(self.learning_rate >= 0, "optimizer.learning_rate", "must be >= 0")
        _check(self.gradient_clipping >= 0, "optimizer.gradient_clipping", "must be >= 0 (0 = off)")


#: Logical dimension name -> mesh axes (ordered; first match wins).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("tensor",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv", ()),
    ("embed", ()),
    ("layers", ()),
    ("length", ()),
)

#: Parameter path regex -> logical dimension names (first match wins).
DEFAULT_PARAM_DIMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(^|/)embedding$", ("vocab", "embed")),
    (r"(^|/)position$", ("length", "embed")),
    (r"(^|/)layers/(.*/)?(wq|wk|wv)(/kernel)?$", ("layers", "embed", "heads", "kv")),
    (r"(^|/)layers/(.*/)?wo(/kernel)?$", ("layers", "heads", "kv", "embed")),
    (r"(^|/)layers/(.*/)?(w_in|w_up|w_gate)(/kernel)?$", ("layers", "embed", "mlp")),
    (r"(^|/)layers/(.*/)?(w_out|w_down)(/kernel)?$", ("layers", "mlp", "embed")),
    (r"(^|/)head(/kernel)?$", ("embed", "vocab")),
)


@dataclass(frozen=True)
class ParallelPlan:
    """A complete parallel training setup (see module docstring).

    Args:
        name: preset or source name, for reports.
        description: one line for humans.
        mesh: axis sizes.
        zero: ZeRO stage and offload.
        precision: dtypes and loss scaling.
        batch: micro batch and accumulation.
        communication: bucketing and reduction op.
        compression: per-axis compressors.
        pipeline: pipeline schedule (``stage`` axis).
        tensor: tensor-parallel options (``tensor`` axis).
        rules: logical dimension name -> mesh axes.
        param_dims: parameter path regex -> logical dimension names.
        optimizer: optimizer and schedule, when the plan carries one.
    """

    name: str = "custom"
    description: str = ""
    mesh: MeshSpec = MeshSpec()
    zero: ZeroSpec = ZeroSpec()
    precision: PrecisionSpec = PrecisionSpec()
    batch: BatchSpec = BatchSpec()
    communication: CommunicationSpec = CommunicationSpec()
    compression: tuple[AxisCompression, ...] = ()
    pipeline: PipelineSpec = PipelineSpec()
    tensor: TensorSpec = TensorSpec()
    rules: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_RULES
    param_dims: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_PARAM_DIMS
    optimizer: OptimizerSpec | None = None

    def __post_init__(self):
        self._check_rules()
        axes = [c.axis for c in self.compression]
        _check(len(axes) == len(set(axes)), "compression", f"axis listed twice: {axes}")

    def _check_rules(self) -> None:
        for i, (logical, mesh_axes) in enumerate(self.rules):
            for axis in mesh_axes:
                _check(
                    axis in AXES,
                    f"rules[{i}]",
                    f"logical dim {logical!r} maps to unknown mesh axis {axis!r}",
                    f"use axes from {list(AXES)}",
                )
        for i, (pattern, _) in enumerate(self.param_dims):
            try:
                re.compile(pattern)
            except re.error as err:
                raise PlanError(
                    f"bad regex {pattern!r}: {err}",
                    key=f"param_dims[{i}]",
                    fix="write a valid Python regular expression",
                ) from None

    def replace(self, **changes) -> ParallelPlan:
        """A copy with some top-level fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    def compression_for(self, axis: str) -> AxisCompression | None:
        """The compression section of ``axis``, if any."""
        return next((c for c in self.compression if c.axis == axis), None)
