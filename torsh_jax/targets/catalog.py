"""Accelerators as users name them, and the facts of their chips (no JAX here).

A target name is ``<family>-<count>``, counted as the cloud counts it: TPU v4 and v5p count
TensorCores (two per chip: ``v4-32`` is 16 chips), v5e (also ``v5litepod``) and v6e count chips, GPUs
count GPUs (8 per node: ``h100-16`` is two nodes). ``slices`` copies of a TPU slice are joined over
the data-center network (multi-slice). Each device of a target is one chip (TPU v4 and v5p as
megacore: both TensorCores of a chip form one device, as JAX shows them on the hardware).

Chip facts and where they come from (bandwidths in bytes/s; ICI and NVLink bidirectional, per chip):

============  =======  =============  ==========  =============  ===========  =====================
chip          HBM      bf16 FLOP/s    HBM B/s     ICI / NVLink   DCN / IB     source
============  =======  =============  ==========  =============  ===========  =====================
TPU v4        32 GiB   275e12         1.2e12      n/p            n/p          cloud.google.com/tpu/docs/v4
TPU v5e       16 GiB   197e12         819e9       400e9          3.125e9 (1)  cloud.google.com/tpu/docs/v5e
TPU v5p       95 GiB   459e12         2765e9      1200e9         6.25e9       cloud.google.com/tpu/docs/v5p
TPU v6e       32 GiB   918e12         1640e9      800e9          12.5e9 (1)   cloud.google.com/tpu/docs/v6e
H100 SXM      80 GiB   989.4e12 (2)   3.35e12     900e9          50e9 (3)     NVIDIA H100 datasheet
A100 SXM 80G  80 GiB   312e12 (2)     2.039e12    600e9          25e9 (3)     NVIDIA A100 datasheet
============  =======  =============  ==========  =============  ===========  =====================

n/p: not published on the page. (1) the page's data-center network bandwidth per pod divided by
its 256 chips. (2) dense (the datasheets' larger figures assume 2:4 sparsity). (3) one InfiniBand
NIC per GPU in a DGX node: 400 Gb/s NDR (H100), 200 Gb/s HDR (A100).

``compiler_hbm_bytes`` is what the TPU compiler (libtpu 0.0.42.1) says it may use per chip, read
from its out-of-memory message ("... exceeds available HBM (15.75G)", binary units): v4 30.75 GiB,
v5e 15.75 GiB, v5p 95.74 GiB (more than the page's 95 GiB), v6e 31.25 GiB; a test checks them
against the installed libtpu. For a GPU it is the device memory its XLA target config states (H100
79.10 GiB, A100 80 GiB). A plan fits when its peak is within :attr:`Target.memory_limit_bytes`:
on a TPU that figure; on a GPU the share of it JAX's allocator takes (:func:`jax_gpu_memory_fraction`:
75 % unless ``XLA_CLIENT_MEM_FRACTION`` says otherwise).

Example:
    >>> target = parse_target("v5e-16")
    >>> target.topology, target.chips, target.chip.hbm_bytes / 2**30
    ('v5e:4x4', 16, 16.0)
    >>> parse_target("v4-32").chips, parse_target("v4-32").topology
    (16, 'v4:2x2x4')
    >>> parse_target("h100-16").topology
    '2x1x8'
    >>> parse_target("v5e-16").memory_limit_bytes / 2**30
    15.75
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from torsh_jax.errors import TargetError

__all__ = [
    "Chip",
    "Family",
    "Target",
    "CHIPS",
    "FAMILIES",
    "JAX_GPU_MEMORY_FRACTION",
    "JAX_GPU_MEMORY_VARIABLES",
    "jax_gpu_memory_fraction",
    "parse_target",
    "target_names",
]

GiB = 2**30
#: The share of each GPU's memory JAX's allocator takes where nothing says otherwise (JAX's "GPU
#: memory allocation" page; jaxlib 0.10.2's ``generate_pjrt_gpu_plugin_options``).
JAX_GPU_MEMORY_FRACTION = 0.75
#: The names jaxlib reads the share under, the newer first.
_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
#: The name jaxlib reads its allocator under (``platform``: on demand, no share kept).
_ALLOCATOR_VARIABLE = "XLA_PYTHON_CLIENT_ALLOCATOR"
#: The environment variables :func:`jax_gpu_memory_fraction` reads, as jaxlib does.
JAX_GPU_MEMORY_VARIABLES = (*_FRACTION_VARIABLES, _ALLOCATOR_VARIABLE)


@dataclass(frozen=True)
class Chip:
    """One accelerator chip (one device of a target).

    Attributes:
        name: as its maker names it.
        hbm_bytes: HBM capacity.
        peak_bf16_flops: dense bf16 FLOP/s.
        hbm_bytes_per_s: HBM bandwidth.
        ici_bytes_per_s: chip-to-chip bandwidth in a slice or node (ICI, NVLink), bidirectional.
        dcn_bytes_per_s: bandwidth across slices or nodes (DCN, InfiniBand); ``None``: not published.
        compiler_hbm_bytes: HBM the compiler may use (TPU: libtpu's "available HBM"; GPU: the
            device memory of its XLA target config), else ``None``.
        source: where the figures come from.
    """

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float | None
    dcn_bytes_per_s: float | None
    compiler_hbm_bytes: int | None
    source: str

    @property
    def usable_hbm_bytes(self) -> int:
        """The limit a program is held to: the compiler's figure where known, else the capacity."""
        return self.compiler_hbm_bytes or self.hbm_bytes


CHIPS = {
    "v4": Chip("TPU v4", 32 * GiB, 275e12, 1200e9, None, None, round(30.75 * GiB),
               "https://cloud.google.com/tpu/docs/v4; available HBM from libtpu 0.0.42.1 (megacore)"),
    "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 819e9, 400e9, 6.4e12 / 8 / 256, round(15.75 * GiB),
                "https://cloud.google.com/tpu/docs/v5e; available HBM from libtpu 0.0.42.1"),
    "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2765e9, 1200e9, 50e9 / 8, round(95.74 * GiB),
                "https://cloud.google.com/tpu/docs/v5p; available HBM from libtpu 0.0.42.1"),
    "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1640e9, 800e9, 25.6e12 / 8 / 256, round(31.25 * GiB),
                "https://cloud.google.com/tpu/docs/v6e; available HBM from libtpu 0.0.42.1"),
    "h100": Chip("NVIDIA H100 SXM 80GB", 80 * GiB, 989.4e12, 3.35e12, 900e9, 400e9 / 8, 84_929_347_584,
                 "NVIDIA H100 Tensor Core GPU datasheet (SXM); DGX H100: one 400 Gb/s NDR NIC per GPU; "
                 "device memory from its XLA target config"),
    "a100": Chip("NVIDIA A100 SXM4 80GB", 80 * GiB, 312e12, 2039e9, 600e9, 200e9 / 8, 85_899_345_920,
                 "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB); DGX A100: one 200 Gb/s HDR NIC per GPU; "
                 "device memory from its XLA target config"),
}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """How a family's names map to devices and topologies.

    Attributes:
        chip: key in :data:`CHIPS`.
        platform: ``tpu`` or ``gpu``.
        cores_per_unit: what the name counts per chip (2: TensorCores of v4/v5p; 1: chips, GPUs).
        grid_dims: TPU chip grid dimensions (2 or 3); 0 for GPUs.
        largest: most units a name may count (the largest power-of-two slice or 8-GPU nodes).
        accelerator: the cloud's accelerator type name for a count of units (libtpu reads it).
        gpu_config: XLA GPU target config file in ``torsh_jax/gpu_targets`` (GPUs only).
    """

    chip: str
    platform: str
    cores_per_unit: int
    grid_dims: int
    largest: int
    accelerator: str = ""
    gpu_config: str | None = None


FAMILIES = {
    "v4": Family("v4", "tpu", 2, 3, 4096, "v4-{n}"),
    "v5e": Family("v5e", "tpu", 1, 2, 256, "v5litepod-{n}"),
    "v5litepod": Family("v5e", "tpu", 1, 2, 256, "v5litepod-{n}"),
    "v5p": Family("v5p", "tpu", 2, 3, 8192, "v5p-{n}"),
    "v6e": Family("v6e", "tpu", 1, 2, 256, "v6e-{n}"),
    "h100": Family("h100", "gpu", 1, 0, 1024, gpu_config="h100_sxm_80gb.txtpb"),
    "a100": Family("a100", "gpu", 1, 0, 1024, gpu_config="a100_sxm4_80gb.txtpb"),
}

#: TPU chips per host (libtpu's ``chips_per_host_bounds``); the smallest slice is one host.
TPU_HOST = (2, 2, 1)
#: GPUs per node.
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Target:
    """An accelerator to compile for.

    Attributes:
        name: as the user wrote it (``v5e-16``).
        family: key in :data:`FAMILIES` (``v5litepod`` reads as ``v5e``).
        chips: devices of one slice (TPU) or of all nodes (GPU).
        slices: TPU slices joined over DCN (1 for GPUs).
        topology: JAX's topology name (``v5e:4x4``; ``nodes x 1 x gpus`` for GPUs).
    """

    name: str
    family: str
    chips: int
    slices: int
    topology: str

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    @property
    def platform(self) -> str:
        return self.spec.platform

    @property
    def chip(self) -> Chip:
        return CHIPS[self.spec.chip]

    @property
    def devices(self) -> int:
        """Devices of the whole target: chips x slices."""
        return self.chips * self.slices

    @property
    def gpu_config(self) -> str | None:
        return self.spec.gpu_config

    @property
    def memory_limit_bytes(self) -> int:
        """What one device's program may hold: a TPU chip's usable HBM; on a GPU, the share of its
        memory JAX's allocator takes (:func:`jax_gpu_memory_fraction`)."""
        if self.platform == "gpu":
            return int(self.chip.usable_hbm_bytes * jax_gpu_memory_fraction())
        return self.chip.usable_hbm_bytes

    @property
    def memory_limit_source(self) -> str:
        """Where :attr:`memory_limit_bytes` comes from, for messages."""
        if self.platform == "gpu":
            whole = f"each GPU's {self.chip.usable_hbm_bytes / GiB:.2f} GiB"
            if _platform_allocator(os.environ):
                return f"all of {whole}: XLA_PYTHON_CLIENT_ALLOCATOR=platform allocates on demand"
            share = f"{jax_gpu_memory_fraction() * 100:g} %"
            return f"JAX's allocator takes {share} of {whole}; XLA_CLIENT_MEM_FRACTION sets the share"
        return "the TPU compiler's usable HBM"

    @property
    def accelerator_type(self) -> str:
        """The cloud's name of one slice (``v5litepod-16``), as libtpu's environment spells it."""
        return self.spec.accelerator.format(n=self.chips * self.spec.cores_per_unit)


def jax_gpu_memory_fraction(environ: Mapping[str, str] | None = None) -> float:
    """The share of each GPU's memory a JAX process may use, read as jaxlib reads it:
    ``XLA_CLIENT_MEM_FRACTION`` (or its older name ``XLA_PYTHON_CLIENT_MEM_FRACTION``), else
    :data:`JAX_GPU_MEMORY_FRACTION`; all of it with ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``, which
    allocates on demand. ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` keeps the share as a limit.

    Raises:
        TargetError: both names set, or a value that is not a fraction in (0, 1].

    Example:
        >>> jax_gpu_memory_fraction({}), jax_gpu_memory_fraction({"XLA_CLIENT_MEM_FRACTION": ".9"})
        (0.75, 0.9)
    """
    environ = os.environ if environ is None else environ
    if _platform_allocator(environ):
        return 1.0
    names = [n for n in _FRACTION_VARIABLES if environ.get(n)]
    if len(names) == 2:
        fix = "unset XLA_PYTHON_CLIENT_MEM_FRACTION (the older name)"
        raise TargetError("set together with XLA_PYTHON_CLIENT_MEM_FRACTION", key=names[0], fix=fix)
    if not names:
        return JAX_GPU_MEMORY_FRACTION
    text = environ[names[0]]
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise TargetError(
            f"{text!r} is not a fraction of a GPU's memory", key=names[0], fix="set it to e.g. 0.9"
        )
    return share


def _platform_allocator(environ: Mapping[str, str]) -> bool:
    """JAX allocates each buffer from the device as it is needed (no share of the memory kept)."""
    return environ.get(_ALLOCATOR_VARIABLE, "").lower() == "platform"


def target_names() -> list[str]:
    """Family patterns, for messages: ``['v4-N', 'v5e-N', ...]``."""
    return [f"{family}-N" for family in FAMILIES]


def _error(name: str, why: str, fix: str | None = None) -> TargetError:
    return TargetError(
        why, key=f"target {name!r}", fix=fix or f"use one of {target_names()}, e.g. v5e-16 or h100-8"
    )


def _tpu_grid(name: str, family: Family, count: int) -> tuple[int, str]:
    """Chips and chip grid of ``count`` units: a power of two from one host (4 chips) up."""
    unit = "TensorCores (2 per chip)" if family.cores_per_unit == 2 else "chips"
    smallest = 4 * family.cores_per_unit
    if count % family.cores_per_unit or count < smallest or count > family.largest or count & (count - 1):
        why = f"{count} {unit}: a power of two in {smallest}..{family.largest} is needed"
        raise _error(name, why, fix=f"name a slice of {smallest}, {2 * smallest}, {4 * smallest}, ... {unit}")
    chips = count // family.cores_per_unit
    grid = [2, 2] if family.grid_dims == 2 else [2, 2, 1]
    while math.prod(grid) < chips:  # double the smallest side, the last of equals first (v4: 2x2x4)
        smallest_side = min(grid)
        grid[max(i for i, side in enumerate(grid) if side == smallest_side)] *= 2
    return chips, "x".join(map(str, grid))


def _gpu_nodes(name: str, family: Family, gpus: int) -> str:
    if gpus < 1:
        raise _error(name, "no GPUs", fix=f"name 1..8 GPUs or whole nodes, e.g. {name.split('-')[0]}-8")
    if gpus <= GPUS_PER_NODE:
        return f"1x1x{gpus}"
    if gpus % GPUS_PER_NODE or gpus > family.largest:
        raise _error(name, f"{gpus} GPUs: more than one node needs a multiple of {GPUS_PER_NODE} GPUs",
                     fix=f"name 1..8 GPUs or whole nodes, e.g. {name.split('-')[0]}-16")  # fmt: skip
    return f"{gpus // GPUS_PER_NODE}x1x{GPUS_PER_NODE}"


def parse_target(name: str, /, *, slices: int = 1) -> Target:
    """The target ``name`` names, ``slices`` times (TPU multi-slice over DCN).

    Raises:
        TargetError: an unknown family, a count its topology cannot have, or slices for a GPU.
    """
    match = re.fullmatch(r"([a-z0-9]+)-([0-9]{1,6})", name.strip().lower())
    if match is None or match[1] not in FAMILIES:
        why = "not a target name" if match is None else f"unknown accelerator {match[1]!r}"
        raise _error(name, why)
    family, count = FAMILIES[match[1]], int(match[2])
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise TargetError(f"must be a whole number >= 1, got {slices!r}", key="slices", fix="pass --slices 2")
    if family.platform == "gpu":
        if slices != 1:
            fix = f"name the GPUs of every node instead, e.g. {match[1]}-16 for two nodes"
            raise TargetError("GPU targets have no slices", key="slices", fix=fix)
        return Target(name, match[1], count, 1, _gpu_nodes(name, family, count))
    chips, grid = _tpu_grid(name, family, count)
    return Target(
        name, "v5e" if match[1] == "v5litepod" else match[1], chips, slices, f"{family.chip}:{grid}"
    )
