"""FLOPs of a train step and the peak FLOP/s of its devices, each with where the figure comes from.

MFU (model FLOP utilisation) of one step is
``flops_per_step / (step_time_s * peak_flops_per_device * devices)``, where ``flops_per_step``
counts the whole step over all devices:

* ``cost_analysis``: the compiled program's ``cost_analysis()["flops"]`` (one device's program
  after partitioning) times the devices. It counts what the program executes, recomputed
  activations included. XLA counts a while loop's body once whatever its trip count, so it is used
  only for a program without while loops;
* ``model``: a formula of the model given by the caller (the demo: 3 x (2 N + attention) FLOPs per
  token, PaLM's count, Chowdhery et al. 2022, appendix B, without recomputation), times the tokens
  of the step;
* ``given``: a figure the caller passes.

The peak is a chip's datasheet figure (:data:`torsh_jax.targets.catalog.CHIPS`, dense bf16) for
the device kinds of :data:`DEVICE_KINDS`, a figure the caller passes, or on CPU measured here: an
f32 matmul run on every device at once (simulated CPU devices share the host's cores), best of 5.

Example:
    >>> mfu(flops_per_step=1e12, step_time_s=0.5, peak_flops_per_device=1e12, devices=4)
    0.5
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["StepFlops", "PeakFlops", "step_flops", "peak_flops", "mfu", "while_loops", "DEVICE_KINDS"]

#: Side of the square matmul timed to measure a CPU device's FLOP/s.
_MATMUL_SIDE = 512


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step over all devices (``None``: unknown) and their source."""

    flops_per_step: float | None
    flops_source: str
    cost_analysis_flops_per_device: float | None
    while_loops: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PeakFlops:
    """Peak FLOP/s of one device and where the figure comes from."""

    peak_flops_per_device: float | None
    peak_flops_source: str

    def to_dict(self) -> dict:
        return asdict(self)


def while_loops(compiled: Any) -> int:
    """While loops in a compiled program (XLA's cost analysis counts each body once)."""
    return sum(" while(" in line for line in compiled.as_text().splitlines())


def _cost_flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops else None


def step_flops(
    compiled: Any, /, *, devices: int, model_flops_per_step: float | None = None, model_source: str = "model"
) -> StepFlops:
    """The step's FLOPs: the compiled program's count when it has no while loop, else the model's.

    Args:
        compiled: the compiled train step.
        devices: devices the program runs on (its count is one device's).
        model_flops_per_step: the model's FLOPs per step over all devices, if known.
        model_source: how ``model_flops_per_step`` was computed (kept as ``flops_source``).
    """
    counted, loops = _cost_flops(compiled), while_loops(compiled)
    if counted is not None and loops == 0:
        return StepFlops(counted * devices, "cost_analysis", counted, loops)
    if model_flops_per_step is not None:
        return StepFlops(float(model_flops_per_step), model_source, counted, loops)
    why = f"unknown: cost_analysis counts each of {loops} while loop bodies once; pass flops_per_step"
    return StepFlops(None, why if counted is not None else "unknown: no cost_analysis", counted, loops)


#: ``device.device_kind`` -> the chip of :data:`torsh_jax.targets.catalog.CHIPS` it is, exactly (a
#: kind not listed has no datasheet peak here: an H100 PCIe is not an H100 SXM).
DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA A100-SXM4-80GB": "a100",
}


def _chip_of(device: Any):
    from torsh_jax.targets.catalog import CHIPS

    key = DEVICE_KINDS.get(device.device_kind)
    return CHIPS[key] if key else None


def _measured_cpu_peak(devices: list) -> PeakFlops:
    """Every device multiplies two f32 ``[512, 512]`` matrices at once; FLOPs per device over the
    best time of 5."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = _MATMUL_SIDE
    mesh = Mesh(np.array(devices), ("d",))
    x = jax.device_put(jnp.ones((len(devices) * n, n), jnp.float32), NamedSharding(mesh, P("d")))
    matmul = jax.jit(jax.shard_map(lambda a: a @ a[:n].T, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    matmul(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    source = f"measured: f32 [{n},{n}] @ [{n},{n}] on each of {len(devices)} cpu devices at once, best of 5"
    return PeakFlops(2 * n**3 / best, source)


def peak_flops(devices: list, /, *, given: float | None = None, given_source: str = "given") -> PeakFlops:
    """Peak FLOP/s of one of ``devices``: ``given``, else the chip's datasheet, else measured (CPU)."""
    if given is not None:
        return PeakFlops(float(given), given_source)
    device = devices[0]
    chip = _chip_of(device) if device.platform != "cpu" else None
    if chip is not None:
        return PeakFlops(chip.peak_bf16_flops, f"datasheet dense bf16 of {chip.name}: {chip.source}")
    if device.platform == "cpu":
        return _measured_cpu_peak(devices)
    return PeakFlops(None, f"unknown for {device.device_kind}; pass peak_flops")


def mfu(
    *, flops_per_step: float | None, step_time_s: float, peak_flops_per_device: float | None, devices: int
) -> float | None:
    """``flops_per_step / (step_time_s * peak_flops_per_device * devices)``; ``None`` when unknown."""
    if not flops_per_step or not peak_flops_per_device or step_time_s <= 0:
        return None
    return flops_per_step / (step_time_s * peak_flops_per_device * devices)
