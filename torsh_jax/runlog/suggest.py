"""Changes to a run's plan, each with its figures computed: bytes per step from the plan theory,
state memory from the state theory, pipeline bubbles from the schedule tables.

The estimates change one thing of the measured run: the peak of another ZeRO stage is the run's
compiled peak plus the difference of the two stages' training-state bytes
(:func:`~torsh_jax.analysis.theory.theoretical_memory_per_device`); the bytes are
:func:`~torsh_jax.analysis.theory.plan_theory` of both plans, counted alike.

Example:
    >>> percent(0.61, 1), percent(0.0022, 1)
    ('61 %', '0.22 %')
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torsh_jax.analysis.memory import peak_of
from torsh_jax.runlog.read import Run
from torsh_jax.units import format_bytes

__all__ = ["ZeroOption", "zero_options", "pipeline_options", "percent"]


def percent(part: float, whole: float) -> str:
    """``"61 %"`` (two significant digits under 10 %: ``"0.22 %"``)."""
    value = 100 * part / whole
    return f"{value:.0f} %" if abs(value) >= 10 else f"{value:.2g} %"


@dataclass(frozen=True)
class ZeroOption:
    """Another ZeRO stage (and fsdp axis) for the run: its bytes per step and estimated peak."""

    label: str
    stage: int
    wire_bytes: float
    current_wire_bytes: float
    peak_bytes: int | None

    def bytes_phrase(self) -> str:
        """``1.5× fewer bytes per step (3.0 MiB -> 2.0 MiB per device)`` or ``1.5× more ...``."""
        ratio = self.current_wire_bytes / self.wire_bytes if self.wire_bytes else float("inf")
        moved = (
            f"theory {format_bytes(self.current_wire_bytes)} -> {format_bytes(self.wire_bytes)} per device"
        )
        if abs(ratio - 1) < 0.005:
            return f"the same bytes per step ({moved})"
        word, factor = ("fewer", ratio) if ratio >= 1 else ("more", 1 / ratio)
        return f"{factor:.2g}× {word} bytes per step ({moved})"

    def memory_phrase(self, capacity: int | None) -> str:
        """``peak ≈ 1.2 GiB (61 % of 2.0 GiB)``, or ``does not fit`` when over ``capacity``."""
        if self.peak_bytes is None:
            return "peak unknown"
        text = f"peak ≈ {format_bytes(self.peak_bytes)}"
        if not capacity:
            return text
        verdict = "" if self.peak_bytes <= capacity else ", does not fit"
        return f"{text} ({percent(self.peak_bytes, capacity)} of {format_bytes(capacity)}{verdict})"


def _state_bytes(run: Run, plan, stage: int, fsdp: int) -> int:
    """Training-state bytes per device of ``plan``'s parameters under ``stage`` over ``fsdp`` devices."""
    from torsh_jax.analysis.theory import DTYPE_BYTES, theoretical_memory_per_device

    inspected = run.inspect
    params = inspected["shard_param_count"]
    held = inspected["state_bytes_per_device"]["opt_state"]
    now_fsdp = inspected["mesh"].get("fsdp", 1)
    opt_full = held * (now_fsdp if plan.zero.stage >= 1 else 1)
    param_bytes = params * DTYPE_BYTES[plan.precision.param_dtype]
    grad_bytes = params * DTYPE_BYTES[plan.precision.reduce_dtype]
    return theoretical_memory_per_device(param_bytes, opt_full, grad_bytes, stage, fsdp).total_bytes


def _theory_bytes(run: Run, plan) -> float:
    from torsh_jax.analysis.theory import plan_theory

    layers = (run.header.get("model") or {}).get("layers")
    return plan_theory(
        plan, param_count=run.inspect["shard_param_count"], num_devices=run.header["devices"], layers=layers
    ).wire_bytes


def _sharded_plan(plan, mesh: dict):
    """``plan`` with its data axis moved onto ``fsdp`` (one slice), or ``None`` when it cannot be."""
    from torsh_jax.plan.spec import AxisSize

    if mesh.get("fsdp", 1) > 1:
        return plan
    if mesh.get("data", 1) <= 1 or plan.mesh.data.dcn != 1:
        return None
    return replace(plan, mesh=replace(plan.mesh, data=AxisSize(ici=1), fsdp=AxisSize(ici=-1)))


def zero_options(run: Run, *, stages: tuple[int, ...]) -> list[ZeroOption]:
    """The run under each ZeRO stage of ``stages`` (its ``fsdp`` axis, or its ``data`` axis moved onto
    ``fsdp``): bytes per step and estimated peak. Empty without a plan or an inspect summary."""
    plan = run.plan()
    if plan is None or run.inspect is None or "shard_param_count" not in run.inspect:
        return []
    mesh = run.inspect["mesh"]
    sharded = _sharded_plan(plan, mesh)
    if sharded is None:
        return []
    fsdp = mesh.get("fsdp", 1) if sharded is plan else mesh["data"]
    peak = peak_of(run.inspect.get("memory") or {})
    current_state = _state_bytes(run, plan, plan.zero.stage, mesh.get("fsdp", 1))
    current_bytes = _theory_bytes(run, plan)
    options = []
    for stage in stages:
        if stage == plan.zero.stage and sharded is plan:
            continue
        other = replace(sharded, zero=replace(sharded.zero, stage=stage))
        state = _state_bytes(run, plan, stage, fsdp)
        label = f"ZeRO-{stage}" + ("" if sharded is plan else f" over fsdp={fsdp} (the data axis)")
        new_peak = None if peak is None else peak + state - current_state
        options.append(ZeroOption(label, stage, _theory_bytes(run, other), current_bytes, new_peak))
    return options


def _more_microbatches(m: int, k: int, micro_batch_size: int | None) -> tuple[str, float]:
    """``k`` times the micro-batches, and the factor of the examples per step: the micro batch grows
    with them where it would not split."""
    change = f"pipeline.microbatches {m} -> {k * m}"
    if micro_batch_size is None or micro_batch_size % (k * m) == 0:
        return change, 1.0
    bigger = _multiple(micro_batch_size, k * m)
    return f"{change} with batch.micro_batch_size {micro_batch_size} -> {bigger}", bigger / micro_batch_size


def _multiple(value: int, of: int) -> int:
    """The smallest multiple of ``of`` that is at least ``value``."""
    return -(-value // of) * of


def pipeline_options(
    pipe: dict, *, micro_batch_size: int | None, layers: int | None
) -> list[tuple[str, float, float]]:
    """``(change, bubble, examples)`` for 2× and 4× the micro-batches (the micro batch grown to split
    into them where needed; ``examples``: the factor of the examples per step) and an interleaved
    schedule (when the layers split into 2 chunks per stage), bubbles from the schedule tables."""
    from torsh_jax.errors import PlanError
    from torsh_jax.pipeline.schedule import build_pipeline_schedule

    p, m, v, name = pipe["stages"], pipe["microbatches"], pipe["virtual_stages"], pipe["schedule"]
    tries = [(*_more_microbatches(m, k, micro_batch_size), name, k * m, v) for k in (2, 4)]
    if name != "interleaved" and layers and layers % (2 * p) == 0 and m % p == 0:
        tries.append(("schedule interleaved with virtual_stages 2", 1.0, "interleaved", m, 2))
    options = []
    for change, examples, schedule, micro, virtual in tries:
        try:
            table = build_pipeline_schedule(schedule, stages=p, microbatches=micro, virtual_stages=virtual)
        except PlanError:
            continue
        options.append((change, table.bubble, examples))
    return options
