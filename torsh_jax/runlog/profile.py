"""Which steps ``jax.profiler`` traces: ``--profile 3:5`` (steps 3 to 5, both included) or ``--profile 4``.

Example:
    >>> ProfileWindow.parse("3:5")
    ProfileWindow(first=3, last=5)
    >>> 4 in ProfileWindow.parse("3:5"), 6 in ProfileWindow.parse("3:5")
    (True, False)
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torsh_jax.errors import RunLogError

__all__ = ["ProfileWindow", "trace_files", "HOW_TO_OPEN", "hlo_module_name", "collective_seconds"]

#: How to look at a trace, shown in the report.
HOW_TO_OPEN = (
    "open perfetto_trace.json.gz at https://ui.perfetto.dev (Open trace file; the file stays in the "
    "browser), or the directory with XProf: pip install xprof && xprof --logdir DIR/profile"
)


@dataclass(frozen=True)
class ProfileWindow:
    """Global steps ``first`` to ``last`` (1-based, both included)."""

    first: int
    last: int

    def __contains__(self, step: int) -> bool:
        return self.first <= step <= self.last

    @classmethod
    def parse(cls, text: str, /, *, key: str = "--profile") -> ProfileWindow:
        """``"3:5"`` or ``"4"``.

        Raises:
            RunLogError: another form, a step below 1 or a last step before the first.
        """
        match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
        if match is None:
            raise RunLogError(
                f"cannot read {text!r}", key=key, fix="write FIRST:LAST steps, e.g. 3:5, or one step"
            )
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if first < 1 or last < first:
            raise RunLogError(
                f"steps {first} to {last} are not a window of steps counted from 1",
                key=key,
                fix=f"write {max(first, 1)}:{max(first, last, 1)}",
            )
        return cls(first, last)

    def to_dict(self) -> dict:
        return {"first": self.first, "last": self.last}


def trace_files(profile_dir: Path) -> list[Path]:
    """The traces ``jax.profiler`` wrote under ``profile_dir``: Perfetto JSON and XProf ``.xplane.pb``."""
    if not profile_dir.is_dir():
        return []
    found = [*profile_dir.rglob("*.trace.json.gz"), *profile_dir.rglob("perfetto_trace.json.gz")]
    return sorted(set(found) | set(profile_dir.rglob("*.xplane.pb")))


def hlo_module_name(compiled: Any) -> str | None:
    """The compiled program's HLO module name (``jit_step``), which names its ops in a trace."""
    first = compiled.as_text().split("\n", 1)[0].split()
    return first[1].rstrip(",") if len(first) > 1 and first[0] == "HloModule" else None


#: Parsed traces by (path, modification time, size): the dashboard asks again every poll.
_PARSED: dict[tuple, list[dict]] = {}


def _trace_events(path: Path) -> list[dict]:
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _PARSED:
        _PARSED.clear()
        _PARSED[key] = _read_trace(path)
    return _PARSED[key]


def _read_trace(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        data = json.load(handle)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def collective_seconds(
    trace: Path, collectives: list[dict], /, *, module: str | None = None
) -> dict[str, float]:
    """Seconds the traced devices spent in each mesh-axis set's collectives, summed over devices and
    traced steps: the trace's op events named as ``collectives`` (the ``inspect`` summary's rows) are,
    in the program ``module``. On CPU an op's time includes waiting for the other devices."""
    axes_of = {
        c["name"]: "+".join(c["axes"]) if c["axes"] else "-" for c in collectives if c.get("axes") is not None
    }
    seconds: dict[str, float] = {}
    for event in _trace_events(trace):
        args = event.get("args") or {}
        op = args.get("hlo_op")
        if event.get("ph") != "X" or op not in axes_of:
            continue
        if module is not None and args.get("hlo_module", module) != module:
            continue
        seconds[axes_of[op]] = seconds.get(axes_of[op], 0.0) + float(event.get("dur", 0.0)) / 1e6
    return seconds
