"""Argument types shared by the commands: bounded counts with a ``Fix:`` in their errors.

Example:
    >>> steps = count_type(0, 1_000_000, fix="pass --steps 20")
    >>> steps("20")
    20
    >>> steps("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a whole number in 0..1,000,000, got '-1'. Fix: pass --steps 20
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["count_type", "MAX_STEPS", "MAX_DEVICES"]

#: Most optimizer steps the demo runs in one call (hours of CPU time at the default size).
MAX_STEPS = 1_000_000

#: Most devices a command addresses; more than any pod has. Simulated CPU devices are
#: bounded further by host memory (``torsh_jax.demo.host``).
MAX_DEVICES = 65_536


def count_type(low: int, high: int, *, fix: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting whole numbers in ``low..high`` (decimal digits only)."""

    def parse(text: str) -> int:
        stripped = text.strip()
        digits = stripped.removeprefix("-")
        value = int(stripped) if digits.isdigit() and len(digits) <= 30 else None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a whole number in {low:,}..{high:,}, got {text!r}. Fix: {fix}"
            )
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse
