"""Theoretical minimum communication and memory of data-parallel plans (pure arithmetic).

``P`` is the bytes of the parameters one device's model replica holds (the
parameters of one tensor × stage shard), counted in the reduction dtype;
``n`` a data-parallel axis size. Per training step and device:

=========================  ===============================================  ======================
plan                       collectives (payload)                            wire bytes (ring)
=========================  ===============================================  ======================
DDP (``data=n``)           all-reduce P                                     2P(n−1)/n
ZeRO-1, ZeRO-2 (``fsdp``)  reduce-scatter grads P, all-gather params P      2P(n−1)/n
ZeRO-3 (``fsdp``)          all-gather params C ×2 (forward and backward     (2C + P)(n−1)/n
                           re-gather; ×1 without re-gather), reduce-
                           scatter grads P
HSDP (``data=d``,          reduce-scatter P over fsdp, all-reduce P/f       2P(f−1)/f
``fsdp=f``, stage 1-2)     over data, all-gather params P over fsdp         + 2(P/f)(d−1)/d
=========================  ===============================================  ======================

``C`` is the parameter bytes in the compute dtype (the dtype of ZeRO-3
gathers). ZeRO-1 and ZeRO-2 both use the sharded update: each device
reduce-scatters the gradients, updates its shard of the parameters with its
shard of the optimizer state, and all-gathers the updated parameters; this
moves the same bytes as DDP's all-reduce (an all-reduce *is* a
reduce-scatter plus an all-gather). They differ under gradient accumulation:
ZeRO-1 accumulates full local gradients and reduces once per step, ZeRO-2
reduce-scatters every micro-step into a sharded accumulator (and ZeRO-3
also gathers every micro-step), so their counts scale with the micro-steps.

Example:
    >>> t = zero(4_000_000, stage=3, fsdp_size=4, compute_param_bytes=2_000_000)
    >>> t.payload_bytes_by_kind
    {'all-gather': 4000000, 'reduce-scatter': 4000000}
    >>> t.wire_bytes
    6000000.0
    >>> ddp(4_000_000, data_size=8).wire_bytes
    7000000.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torsh_jax.errors import PlanError
from torsh_jax.plan.roles import compose

__all__ = [
    "ring_wire_bytes",
    "TheoryCollective",
    "Theory",
    "ddp",
    "zero",
    "hsdp",
    "plan_theory",
    "MemoryTheory",
    "theoretical_memory_per_device",
    "DTYPE_BYTES",
]

#: Bytes per element of the plan dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def ring_wire_bytes(kind: str, payload_bytes: float, group_size: int) -> float:
    """Bytes one device sends for one collective under ring-algorithm conventions.

    Args:
        kind: ``all-reduce``, ``reduce-scatter``, ``all-gather``,
            ``all-to-all`` or ``collective-permute``.
        payload_bytes: logical size S: the all-reduce operand, the
            reduce-scatter input, the all-gather output, the all-to-all
            operand, the permuted operand.
        group_size: devices per group n.

    Returns:
        all-reduce ``2·S·(n−1)/n``; reduce-scatter, all-gather, all-to-all
        ``S·(n−1)/n``; collective-permute ``S``.

    Example:
        >>> ring_wire_bytes("all-reduce", 1024, 4), ring_wire_bytes("all-gather", 1024, 4)
        (1536.0, 768.0)
    """
    if kind == "collective-permute":
        return float(payload_bytes)
    if group_size <= 1:
        return 0.0
    share = payload_bytes * (group_size - 1) / group_size
    return 2.0 * share if kind == "all-reduce" else float(share)


@dataclass(frozen=True)
class TheoryCollective:
    """One collective a plan needs per step: ``count`` times ``kind`` of ``payload_bytes`` over ``axes``."""

    kind: str
    axes: tuple[str, ...]
    payload_bytes: int
    group_size: int
    count: int = 1

    @property
    def wire_bytes(self) -> float:
        return ring_wire_bytes(self.kind, self.payload_bytes, self.group_size) * self.count


@dataclass(frozen=True)
class Theory:
    """The minimum collectives of a plan per step and device.

    Attributes:
        description: e.g. ``"ZeRO-3 over fsdp=4"``.
        collectives: what must cross the wire.
    """

    description: str
    collectives: tuple[TheoryCollective, ...]

    @property
    def payload_bytes_by_kind(self) -> dict[str, int]:
        """Payload bytes per collective kind (counts multiplied in)."""
        totals: dict[str, int] = {}
        for c in self.collectives:
            totals[c.kind] = totals.get(c.kind, 0) + c.payload_bytes * c.count
        return totals

    @property
    def payload_bytes_by_axis(self) -> dict[str, int]:
        """Payload bytes per axis key (``"data"``, ``"data+fsdp"``)."""
        totals: dict[str, int] = {}
        for c in self.collectives:
            key = "+".join(c.axes)
            totals[key] = totals.get(key, 0) + c.payload_bytes * c.count
        return totals

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes * c.count for c in self.collectives)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per step."""
        return sum(c.wire_bytes for c in self.collectives)

    def to_dict(self) -> dict:
        return {
            "description": self.description,
            "payload_bytes_by_kind": self.payload_bytes_by_kind,
            "payload_bytes_by_axis": self.payload_bytes_by_axis,
            "payload_bytes": self.payload_bytes,
            "wire_bytes": self.wire_bytes,
        }


def _check_sizes(**sizes: int) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(
                f"must be an integer >= 1, got {value!r}", key=key, fix="pass a positive integer axis size"
            )


def ddp(param_bytes: int, /, *, data_size: int, axes: tuple[str, ...] = ("data",)) -> Theory:
    """DDP: one all-reduce of the gradients (``param_bytes``) over ``axes``.

    Example:
        >>> ddp(1000, data_size=4).collectives[0].wire_bytes
        1500.0
    """
    _check_sizes(data_size=data_size)
    return Theory(
        f"DDP over {'+'.join(axes)}={data_size}",
        (TheoryCollective("all-reduce", axes, param_bytes, data_size),),
    )


def _param_gathers(param_bytes, stage, axes, size, compute_param_bytes, regather) -> tuple:
    """Parameter all-gathers: stages 1-2 gather the updated parameters (``compute_param_bytes``
    then means the master parameter bytes), stage 3 gathers in the compute dtype, plus a
    backward re-gather of the ``regather`` fraction (True = all, False = none)."""
    gathered = param_bytes if compute_param_bytes is None else compute_param_bytes
    if stage != 3:
        return (TheoryCollective("all-gather", axes, gathered, size),)
    first = TheoryCollective("all-gather", axes, gathered, size)
    again = round(gathered * float(regather))
    return (first, TheoryCollective("all-gather", axes, again, size)) if again else (first,)


def _per_micro_step(stage, micro_steps, gather, reductions):
    """Counts per optimizer step: stage 2 reduces, stage 3 also gathers, every micro-step."""
    times = lambda c: replace(c, count=c.count * micro_steps)
    if stage >= 2:
        reductions = tuple(times(c) for c in reductions)
    if stage == 3:
        gather = tuple(times(c) for c in gather)
    return gather, reductions


def zero(
    param_bytes: int,
    /,
    *,
    stage: int,
    fsdp_size: int,
    compute_param_bytes: int | None = None,
    regather: bool | float = True,
    micro_steps: int = 1,
) -> Theory:
    """ZeRO over the ``fsdp`` axis (stage 0 is DDP over it).

    Args:
        param_bytes: parameter (gradient) bytes in the reduction dtype.
        stage: 0-3.
        fsdp_size: size of the ``fsdp`` axis.
        compute_param_bytes: bytes of the gathered parameters: stage 3
            gathers in the compute dtype, stages 1-2 gather the updated
            master parameters (parameter dtype); defaults to ``param_bytes``.
        regather: stage 3: parameters are gathered again in the backward
            pass (``zero.reshard_after_forward``); a float is the fraction
            of the parameter bytes gathered again.
        micro_steps: accumulation micro-steps per optimizer step. Stage 1
            reduces once per step; stage 2 reduce-scatters every micro-step
            (gradients stay sharded); stage 3 also gathers every micro-step.

    Example:
        >>> zero(1000, stage=1, fsdp_size=4).payload_bytes_by_kind
        {'reduce-scatter': 1000, 'all-gather': 1000}
    """
    _check_sizes(fsdp_size=fsdp_size)
    if stage not in (0, 1, 2, 3):
        raise PlanError(
            f"must be 0, 1, 2 or 3, got {stage!r}", key="zero.stage", fix="use a ZeRO stage of 0, 1, 2 or 3"
        )
    if stage == 0:
        return ddp(param_bytes, data_size=fsdp_size, axes=("fsdp",))
    axes = ("fsdp",)
    gather = _param_gathers(param_bytes, stage, axes, fsdp_size, compute_param_bytes, regather)
    scatter = TheoryCollective("reduce-scatter", axes, param_bytes, fsdp_size)
    gather, scatter = _per_micro_step(stage, micro_steps, gather, (scatter,))
    ordered = (*gather, *scatter) if stage == 3 else (*scatter, *gather)
    return Theory(f"ZeRO-{stage} over fsdp={fsdp_size}", ordered)


def hsdp(
    param_bytes: int,
    /,
    *,
    data_size: int,
    fsdp_size: int,
    stage: int = 3,
    compute_param_bytes: int | None = None,
    regather: bool | float = True,
    micro_steps: int = 1,
) -> Theory:
    """HSDP: ZeRO ``stage`` inside a slice (``fsdp``), replicas across slices (``data``).

    Gradients are reduce-scattered over ``fsdp`` (payload P), the shards
    all-reduced over ``data`` (payload P/fsdp), parameters all-gathered over
    ``fsdp`` as in :func:`zero`.

    Example:
        >>> hsdp(1000, data_size=2, fsdp_size=4, stage=2).payload_bytes_by_axis
        {'fsdp': 2000, 'data': 250}
    """
    _check_sizes(data_size=data_size, fsdp_size=fsdp_size)
    if stage not in (1, 2, 3):
        raise PlanError(
            f"HSDP needs ZeRO stage 1, 2 or 3, got {stage!r}",
            key="zero.stage",
            fix="use zero.stage = 1, 2 or 3 with an fsdp axis, or a data-only mesh for DDP",
        )
    fsdp = ("fsdp",)
    gather = _param_gathers(param_bytes, stage, fsdp, fsdp_size, compute_param_bytes, regather)
    steps = (
        TheoryCollective("reduce-scatter", fsdp, param_bytes, fsdp_size),
        TheoryCollective("all-reduce", ("data",), math.ceil(param_bytes / fsdp_size), data_size),
    )
    gather, steps = _per_micro_step(stage, micro_steps, gather, steps)
    ordered = (*gather, *steps) if stage == 3 else (*steps, *gather)
    return Theory(f"HSDP ZeRO-{stage}: data={data_size} x fsdp={fsdp_size}", ordered)


def plan_theory(
    plan, /, *, param_count: int, num_devices: int, num_slices: int = 1, regathered_fraction: float = 1.0
) -> Theory:
    """The theory for a :class:`~torsh_jax.plan.ParallelPlan`'s data-parallel axes.

    For a plan with compression sections this is the *uncompressed* minimum
    (the description says so); the measured/theory ratio then shows the saving.

    Args:
        plan: the plan (its mesh, ZeRO stage and precision are used).
        param_count: parameters of one tensor × stage shard of the model.
        num_devices: devices the mesh is resolved for.
        num_slices: slices (DCN) the mesh is resolved for.
        regathered_fraction: ZeRO-3 with ``reshard_after_forward``: the part
            of the parameters gathered again in the backward pass (the
            stacked layers of a layered model; top-level entries such as
            embeddings and the head stay gathered, as FSDP keeps its root).

    Example:
        >>> from torsh_jax.plan import ParallelPlan
        >>> plan_theory(ParallelPlan(), param_count=1000, num_devices=8).description
        'DDP over data=8'
    """
    theory = _uncompressed_theory(plan, param_count, num_devices, num_slices, regathered_fraction)
    if plan.compression:  # the minimum without compression: the plan sends fewer bytes than this
        return replace(theory, description=f"{theory.description} (uncompressed minimum)")
    return theory


def _uncompressed_theory(plan, param_count, num_devices, num_slices, regathered_fraction) -> Theory:
    roles = compose(plan, plan.mesh.resolve(num_devices, num_slices=num_slices).shape)
    stage = roles.zero_stage
    param_bytes = param_count * DTYPE_BYTES[plan.precision.reduce_dtype]
    gathered_dtype = plan.precision.compute_dtype if stage == 3 else plan.precision.param_dtype
    compute = param_count * DTYPE_BYTES[gathered_dtype]
    regather = regathered_fraction if plan.zero.reshard_after_forward else 0.0
    gathers = {
        "compute_param_bytes": compute,
        "regather": regather,
        "micro_steps": plan.batch.accumulation_steps,
    }
    if roles.shard_axis is None:
        axes = roles.batch_axes or ("data",)
        return ddp(param_bytes, data_size=roles.batch_size, axes=axes)
    if not roles.hybrid:
        return zero(param_bytes, stage=stage, fsdp_size=roles.size("fsdp"), **gathers)
    return hsdp(
        param_bytes, data_size=roles.size("data"), fsdp_size=roles.size("fsdp"), stage=stage, **gathers
    )


@dataclass(frozen=True)
class MemoryTheory:
    """Minimum bytes per device of the training state, by part."""

    param_bytes: int
    grad_bytes: int
    opt_state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.opt_state_bytes


def theoretical_memory_per_device(
    param_bytes: int,
    opt_state_bytes: int,
    grad_bytes: int,
    stage: int,
    fsdp_size: int,
) -> MemoryTheory:
    """Training-state bytes per device under ZeRO ``stage`` over ``fsdp_size`` devices.

    Stage 1 divides the optimizer state by ``fsdp_size``, stage 2 also the
    gradients, stage 3 also the parameters (rounded up: uneven shards are
    padded). Activations and temporaries are not included.

    Example:
        >>> theoretical_memory_per_device(400, 800, 400, 2, 4).total_bytes
        700
    """
    _check_sizes(fsdp_size=fsdp_size)
    if stage not in (0, 1, 2, 3):
        raise PlanError(
            f"must be 0, 1, 2 or 3, got {stage!r}", key="zero.stage", fix="use a ZeRO stage of 0, 1, 2 or 3"
        )

    def part(nbytes: int, sharded_from: int) -> int:
        return math.ceil(nbytes / fsdp_size) if stage >= sharded_from else nbytes

    return MemoryTheory(part(param_bytes, 3), part(grad_bytes, 2), part(opt_state_bytes, 1))
