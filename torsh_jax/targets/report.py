"""Compile a train step for a target and say whether it fits, and how fast it could be at best.

What the target's compiler reports for one device (:class:`TargetReport`):

* **memory** from ``compiled.memory_analysis()``: argument, output, temp and alias bytes, and the
  ``peak``, against what a device's program may hold
  (:attr:`~torsh_jax.targets.catalog.Target.memory_limit_bytes`: a TPU chip's usable HBM, the share
  of a GPU's memory JAX's allocator takes): ``fits`` and ``margin_bytes`` (negative: over by that
  much). On a TPU the peak is libtpu's own (``peak_memory_in_bytes``): the most its buffers, the
  arguments among them, hold at once, which its out-of-memory check holds to HBM. libtpu's ``temp``
  is not what is live at that peak: on large steps it is more (measured: the 150 M demo model's
  ``zero1 fsdp=16 acc=2`` on v5e-16 at global batch 224, temp 15.42 GiB and arguments 0.72 GiB,
  compiled with a peak of 14.62 GiB), so ``argument + output + temp - alias``, the peak on other
  targets (:func:`~torsh_jax.analysis.memory.peak_bytes`), would refuse programs it runs; on some
  small steps it is less. The TPU compiler refuses a program over HBM (``RESOURCE_EXHAUSTED: ... HLO
  temporaries (16.94G) exceeds available HBM (15.75G)``): that is a result, ``fits`` false with the
  compiler's figures. Its figure is that peak, arguments included (a program of one 20 GiB argument
  is refused at "HLO temporaries (20.00G)"), and becomes the report's ``peak``.
* **overlap** from the compiled schedule (:func:`~torsh_jax.analysis.overlap.collective_overlap`):
  which collectives are asynchronous and have compute scheduled between their start and done, by
  bytes, per kind and per mesh-axis set. A multi-slice TPU program's cross-slice collectives are
  runtime calls, not collectives of the program; its figures cover the in-slice ones.
* **cost** from ``compiled.cost_analysis()``: FLOPs and bytes accessed of one device's program
  after partitioning and optimisation (checked on TPU v5e: a ``[8192, 4096] @ [4096, 8192]`` bf16
  matmul split 16 ways reports exactly ``2*512*4096*8192`` FLOPs per device; its bytes accessed
  are 4.4 times the operands and result, since the compiler counts its tiled re-reads), and the
  roofline bound ``max(flops / peak FLOP/s, bytes / HBM B/s)``. The counts take each while loop's
  body once, whatever its trip count (measured: ZeRO-3 on the demo model with 1, 2 and 4 scanned
  layers reports 1.026e9, 1.027e9 and 1.029e9 FLOPs per v5e chip), so with ``while_loops`` > 0 the
  FLOPs, bytes and roofline are lower bounds that miss the loops' other iterations. Collectives are
  not in the bound (their time is the overlap analysis's subject), nor on GPU in the compiler's
  counts. ``mfu_bound`` is the compute time's share of the bound, the highest FLOP utilisation
  the step can reach counting the compiler's FLOPs (recomputed activations included); ``None``
  where loops make the counts incomplete.

Example:
    >>> report = compile_for_target(train, batch, target=parse_target("v5e-16"))  # doctest: +SKIP
    >>> report.fits, report.memory["temp"]  # doctest: +SKIP
    (True, 2340421632)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import jax

from torsh_jax.analysis.memory import memory_report, peak_bytes
from torsh_jax.analysis.overlap import collective_overlap
from torsh_jax.targets.catalog import Target

__all__ = ["TargetReport", "compile_for_target", "parse_out_of_memory"]

_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([0-9.]+)([KMGT]?)i?B?"
#: libtpu's two out-of-memory messages (sizes in binary units: "15.75G" is 15.75 GiB).
_TEMPORARIES = re.compile(rf"HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)")
_USED = re.compile(rf"Used {_SIZE} of {_SIZE} hbm\. Exceeded hbm capacity by {_SIZE}")


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNIT[unit])


def parse_out_of_memory(message: str) -> dict[str, int] | None:
    """The figures of a TPU compiler's out-of-memory message: the ``peak`` it needed (arguments
    included, whatever the message calls it) and the ``limit``.

    Example:
        >>> parse_out_of_memory("RESOURCE_EXHAUSTED: ... HLO temporaries (16.94G) exceeds "
        ...                     "available HBM (15.75G).")
        {'peak': 18189186499, 'limit': 16911433728}
    """
    found = _TEMPORARIES.search(message) or _USED.search(message)
    if found is None:
        return None
    return {"peak": _bytes(*found.group(1, 2)), "limit": _bytes(*found.group(3, 4))}


@dataclass(frozen=True)
class TargetReport:
    """What the target's compiler says about one device's program (see the module docstring).

    ``compiled`` is the compiled program (``None`` when the compiler refused it); the other fields
    are JSON-able (:meth:`to_json`).
    """

    target: Target
    memory: dict[str, int | None]
    hbm_limit_bytes: int
    fits: bool
    margin_bytes: int
    flops: float | None = None
    bytes_accessed: float | None = None
    roofline_step_s: float | None = None
    mfu_bound: float | None = None
    compiler_estimate_s: float | None = None
    while_loops: int | None = None
    overlap: dict[str, Any] | None = None
    compiler_message: str | None = None
    compiled: Any = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The ``target`` section of ``torsh-jax inspect --target --json``."""
        chip = self.target.chip
        return {
            "name": self.target.name,
            "platform": self.target.platform,
            "chip": chip.name,
            "chips": self.target.devices,
            "slices": self.target.slices,
            "topology": self.target.topology,
            "hbm_bytes_per_chip": chip.hbm_bytes,
            "hbm_limit_bytes": self.hbm_limit_bytes,
            "hbm_limit_source": self.target.memory_limit_source,
            "memory": self.memory,
            "fits": self.fits,
            "margin_bytes": self.margin_bytes,
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "peak_bf16_flops_per_chip": chip.peak_bf16_flops,
            "hbm_bytes_per_s": chip.hbm_bytes_per_s,
            "ici_bytes_per_s": chip.ici_bytes_per_s,
            "dcn_bytes_per_s": chip.dcn_bytes_per_s,
            "roofline_step_s": self.roofline_step_s,
            "mfu_bound": self.mfu_bound,
            "compiler_estimate_s": self.compiler_estimate_s,
            "while_loops": self.while_loops,
            "overlap": self.overlap,
            "compiler_message": self.compiler_message,
            "chip_source": chip.source,
        }


def _memory(compiled: Any, target: Target) -> dict[str, int | None]:
    report = memory_report(compiled)
    return {
        "argument": report.argument_bytes,
        "output": report.output_bytes,
        "temp": report.temp_bytes,
        "alias": report.alias_bytes,
        "peak": peak_bytes(report, target.platform),
    }


def _cost(compiled: Any) -> dict[str, float]:
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):
        return {}
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def _while_loops(compiled: Any) -> int:
    """While loops in the compiled program (their bodies count once in the cost analysis)."""
    return sum(" while(" in line for line in compiled.as_text().splitlines())


def _roofline(cost: dict[str, float], target: Target, *, loops: int) -> dict[str, float | None]:
    flops, moved = cost.get("flops"), cost.get("bytes accessed")
    if flops is None or moved is None:
        return {"flops": flops, "bytes_accessed": moved, "roofline_step_s": None, "mfu_bound": None}
    compute_s = flops / target.chip.peak_bf16_flops
    bound = max(compute_s, moved / target.chip.hbm_bytes_per_s)
    complete = loops == 0 and bound > 0
    return {"flops": flops, "bytes_accessed": moved, "roofline_step_s": bound,
            "mfu_bound": compute_s / bound if complete else None}  # fmt: skip


def _refused(target: Target, message: str, figures: dict[str, int]) -> TargetReport:
    limit = figures["limit"]
    memory = {"argument": None, "output": None, "temp": None, "alias": None, "peak": figures["peak"]}
    first_line = " ".join(message.strip().splitlines()[0].split())
    return TargetReport(target, memory, limit, False, limit - figures["peak"], compiler_message=first_line)


def compile_for_target(train: Any, batch: Any, /, *, target: Target) -> TargetReport:
    """Compile ``train`` (a :class:`~torsh_jax.runtime.step.TrainStep` over ``target``'s devices)
    from its abstract state for a global ``batch`` (arrays or ``jax.ShapeDtypeStruct`` s).

    Nothing is allocated: the state is :meth:`~torsh_jax.runtime.step.TrainStep.abstract_state`.

    Raises:
        jax.errors.JaxRuntimeError: the compiler failed for another reason than memory.
    """
    lowered = train.lower(train.abstract_state(), batch)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        figures = parse_out_of_memory(str(err))
        if figures is None:
            raise
        return _refused(target, str(err), figures)
    memory, cost, loops = _memory(compiled, target), _cost(compiled), _while_loops(compiled)
    # A multi-slice program is one slice's: its collectives' axes cannot be named from the mesh.
    overlap = collective_overlap(compiled, train.mesh if target.slices == 1 else None).to_dict()
    limit = target.memory_limit_bytes
    peak = memory["peak"]
    return TargetReport(
        target,
        memory,
        limit,
        fits=peak is not None and peak <= limit,
        margin_bytes=limit - (peak or 0),
        **_roofline(cost, target, loops=loops),
        compiler_estimate_s=cost.get("optimal_seconds"),
        while_loops=loops,
        overlap=overlap,
        compiled=compiled,
    )
