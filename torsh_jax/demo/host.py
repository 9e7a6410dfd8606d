"""How many CPU devices this host can simulate, decided before JAX starts.

Each simulated device holds its own copy of the program's buffers and a
runtime thread, so host memory bounds the count. The cost per device was
measured with ``torsh-jax demo --layers 1 --steps 2``: peak RSS rose by
0.92 GiB from 64 to 256 devices (about 5 MiB per device) above a base of
about 0.8 GiB.

Example:
    >>> simulated_device_limit(available_bytes=8 * 2**30)
    1484
"""

from __future__ import annotations

import os

from torsh_jax.errors import MeshError

__all__ = ["simulated_device_limit", "check_simulated_devices", "available_memory_bytes"]

#: Host bytes one simulated CPU device takes in the demo (measured, see the module docstring).
DEVICE_BYTES = 5 * 2**20
#: Host bytes of the process before the first device (JAX, XLA, the compiled step).
BASE_BYTES = 768 * 2**20


def available_memory_bytes() -> int | None:
    """Memory the kernel can still give (``MemAvailable``), else physical memory; ``None`` if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def simulated_device_limit(*, available_bytes: int | None = None) -> int | None:
    """Most CPU devices that fit in ``available_bytes`` (default: this host now); ``None`` if unknown."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if available is None:
        return None
    return max((available - BASE_BYTES) // DEVICE_BYTES, 1)


def check_simulated_devices(count: int, *, flag: str = "--devices") -> None:
    """Raise :class:`MeshError` when ``count`` simulated CPU devices would not fit in memory."""
    limit = simulated_device_limit()
    if limit is not None and count > limit:
        need = (BASE_BYTES + count * DEVICE_BYTES) / 2**30
        raise MeshError(
            f"{count:,} simulated CPU devices need about {need:,.1f} GiB of host memory; "
            f"this host can simulate at most {limit:,} (about {DEVICE_BYTES // 2**20} MiB each)",
            key=flag,
            fix=f"pass {flag} {min(limit, 8)} (8 shows every preset), or run on a host with more memory",
        )
