"""Choose the devices a command runs on; simulate CPU devices when asked.

Example:
    >>> devices = select_devices(1)
    >>> len(devices)
    1
"""

from __future__ import annotations

import jax

from torsh_jax.demo.host import check_simulated_devices
from torsh_jax.errors import MeshError

__all__ = ["select_devices"]


def _request_cpu_devices(count: int) -> None:
    """Ask for ``count`` simulated CPU devices if JAX has not started yet."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backend already running: the check in select_devices reports a shortfall


def select_devices(count: int | None) -> list[jax.Device]:
    """The first ``count`` devices (all when ``None``).

    On a CPU-only machine this first requests ``count`` simulated devices,
    which works only before JAX's backend starts (a command's first JAX use).

    Raises:
        MeshError: fewer than ``count`` devices exist, or more simulated
            devices are asked for than host memory holds.
    """
    if count is not None and count < 1:
        raise MeshError(f"--devices must be >= 1, got {count}", key="--devices", fix="pass a positive count")
    if count is not None and jax.config.jax_platforms in (None, "", "cpu"):
        check_simulated_devices(count)
        _request_cpu_devices(count)
    devices = jax.devices()
    if count is not None and len(devices) < count:
        raise MeshError(
            f"{count} devices requested, {len(devices)} available ({devices[0].platform})",
            key="--devices",
            fix=f"pass --devices {len(devices)} or fewer, or start with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}",
        )
    return devices if count is None else devices[:count]
