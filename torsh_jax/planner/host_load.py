"""How much of the host other work took while this process measured it.

``calibrate`` times the devices; a compile, a test run or another VM on the same host slows what it
times, and the machine file would keep those slow figures for every ``plan`` after. So it meters the
host's CPU time while it measures (``psutil``, the system's counters): the share of the host's cores
that other processes used (all busy time less this process's own) and that the hypervisor gave to
other guests (steal), and warns where they come to :data:`BUSY_LIMIT` or more.

Example:
    >>> with HostMeter() as meter:
    ...     _ = sum(range(10_000))
    >>> meter.load is None or 0.0 <= meter.load.busy <= 1.0
    True
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

from torsh_jax.errors import BusyHostWarning

__all__ = [
    "BUSY_LIMIT",
    "CpuSample",
    "HostLoad",
    "HostMeter",
    "host_load",
    "recorded_busy",
    "sample",
    "warn_if_busy",
]

#: Share of the host's cores taken by other work (processes and steal together) from which a
#: measurement counts as disturbed. An idle 2-core host measured here: 0.1 % over 5 s.
BUSY_LIMIT = 0.05


@dataclass(frozen=True)
class CpuSample:
    """The host's CPU seconds at one moment: busy (every process, kernel included), stolen by the
    hypervisor, this process's own, and the wall clock."""

    busy_s: float
    steal_s: float
    own_s: float
    wall_s: float


@dataclass(frozen=True)
class HostLoad:
    """Shares of the host's cores over an interval: ``others``, what processes other than this one
    used; ``steal``, what the hypervisor gave to other guests."""

    others: float
    steal: float

    @classmethod
    def recorded(cls, fields: dict[str, float], /) -> HostLoad | None:
        """A machine file's :attr:`~torsh_jax.planner.machine.Machine.host_load`; ``None`` where it
        was not metered (``{}``)."""
        return cls(float(fields.get("others", 0.0)), float(fields.get("steal", 0.0))) if fields else None

    @property
    def busy(self) -> float:
        return self.others + self.steal

    @property
    def disturbs(self) -> bool:
        """Other work took :data:`BUSY_LIMIT` of the host or more: the figures may be slow."""
        return self.busy >= BUSY_LIMIT

    def describe(self) -> str:
        """``other processes used 37% of the host's cores and the hypervisor took 2%``."""
        return (
            f"other processes used {self.others:.0%} of the host's cores and the hypervisor took "
            f"{self.steal:.0%}"
        )


def sample() -> CpuSample | None:
    """The host's counters now; ``None`` where ``psutil`` cannot read them."""
    import psutil

    try:
        times = psutil.cpu_times()
    except (OSError, RuntimeError):  # a sandbox without /proc/stat
        return None
    busy = sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
    return CpuSample(busy, getattr(times, "steal", 0.0), time.process_time(), time.perf_counter())


def host_load(before: CpuSample, after: CpuSample, cores: int) -> HostLoad:
    """The shares of ``cores`` (the host's: its counters add up every core) that other work took
    between two samples.

    Example:
        >>> host_load(CpuSample(10, 0, 1, 0), CpuSample(14, 0.5, 2, 10), cores=2)
        HostLoad(others=0.15, steal=0.025)
    """
    capacity = max(after.wall_s - before.wall_s, 1e-9) * cores
    own = after.own_s - before.own_s
    others = max(0.0, (after.busy_s - before.busy_s) - own)  # the counters tick in 10 ms
    return HostLoad(min(1.0, others / capacity), min(1.0, (after.steal_s - before.steal_s) / capacity))


class HostMeter:
    """``with HostMeter() as meter:`` meters the host over the block; ``meter.load`` after it
    (``None`` where the counters cannot be read)."""

    def __init__(self) -> None:
        self.load: HostLoad | None = None
        self._start: CpuSample | None = None

    def __enter__(self) -> HostMeter:
        self._start = sample()
        return self

    def __exit__(self, *exc) -> None:
        import psutil

        end = sample()
        if self._start is not None and end is not None:
            self.load = host_load(self._start, end, psutil.cpu_count() or 1)


def recorded_busy(recorded: dict[str, float], /) -> HostLoad | None:
    """A machine file's :attr:`~torsh_jax.planner.machine.Machine.host_load` where it comes to
    :data:`BUSY_LIMIT` or more; else (quiet, or not metered) ``None``.

    Example:
        >>> recorded_busy({"others": 0.3, "steal": 0.0})
        HostLoad(others=0.3, steal=0.0)
        >>> recorded_busy({"others": 0.01, "steal": 0.0}), recorded_busy({})  # quiet; not metered
        (None, None)
    """
    load = HostLoad.recorded(recorded)
    return load if load is not None and load.disturbs else None


def warn_if_busy(load: HostLoad | None, during: str, /) -> None:
    """A :class:`~torsh_jax.errors.BusyHostWarning` where other work took :data:`BUSY_LIMIT` of
    the host or more ``during`` a measurement (``"while calibrate measured"``)."""
    if load is not None and load.disturbs:
        message = f"{during}, {load.describe()}: its figures may be slow; run it again on a quiet host"
        warnings.warn(message, BusyHostWarning, stacklevel=3)
