"""One convention for sizes shown to people: binary (IEC) units, B, KiB, MiB, GiB, TiB.

JSON output always carries exact byte counts; this is only for text.

Example:
    >>> format_bytes(1536)
    '1.50 KiB'
    >>> format_bytes(None)
    'n/a'
    >>> parse_bytes("14GiB"), parse_bytes("16e9"), parse_bytes("512 MB")
    (15032385536, 16000000000, 512000000)
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = ("KiB", "MiB", "GiB", "TiB")
#: Units :func:`parse_bytes` reads: binary (KiB = 1024 B) and decimal (kB = 1000 B), any case.
_READ = {"": 1, "B": 1} | {u.upper(): 1024 ** (i + 1) for i, u in enumerate(_UNITS)}
_READ |= {u: 1000 ** (i + 1) for i, u in enumerate(("KB", "MB", "GB", "TB"))}


def format_bytes(value: float | None) -> str:
    """``value`` bytes in the largest binary unit it reaches (``"n/a"`` for ``None``)."""
    if value is None:
        return "n/a"
    if abs(value) < 1024:
        return f"{value:,.0f} B"
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
    return f"{value:,.2f} {unit}"


def parse_bytes(text: str) -> int:
    """A positive byte count written as a number (``2147483648``, ``16e9``) with an optional unit
    (``KiB`` ... ``TiB``, ``kB`` ... ``TB``, any case).

    Raises:
        ValueError: not one, with what was read.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and _READ.get(match.group(2).upper())
    value = int(float(match.group(1)) * unit) if unit else 0
    if value < 1:
        raise ValueError(f"must be a positive byte count, got {text!r} (e.g. 2147483648, 16e9 or 14GiB)")
    return value
