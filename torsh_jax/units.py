"""One convention for sizes shown to people: binary (IEC) units, B, KiB, MiB, GiB, TiB.

JSON output always carries exact byte counts; this is only for text.

Example:
    >>> format_bytes(1536)
    '1.50 KiB'
    >>> format_bytes(None)
    'n/a'
"""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("KiB", "MiB", "GiB", "TiB")


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
