"""What the commands write: results on stdout (strict JSON, tables), progress on stderr.

Progress is a live bar when stderr is a terminal and plain, whole lines
otherwise (at most about :data:`PLAIN_LINES` of them per run), so a piped or
logged run shows the same information without control characters.

Example:
    >>> json_line({"loss": float("nan"), "step": 1})
    '{"loss": null, "step": 1}'
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

__all__ = ["json_line", "json_text", "print_json", "Progress", "PLAIN_LINES"]

#: Plain progress lines printed per run when stderr is not a terminal.
PLAIN_LINES = 20


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_line(record: dict) -> str:
    """``record`` as one line of standard JSON: NaN and infinities become ``null``."""
    return json.dumps(_finite(record), allow_nan=False)


def json_text(record: dict) -> str:
    """``record`` as indented standard JSON (NaN and infinities as ``null``)."""
    return json.dumps(_finite(record), allow_nan=False, indent=2)


def print_json(record: dict) -> None:
    """Print :func:`json_line` of ``record`` to stdout and flush."""
    print(json_line(record), flush=True)


class Progress:
    """Phase messages and per-step progress on stderr.

    Args:
        title: what runs (``training (zero3)``).
        total: steps expected.
        live: a live bar (default: stderr is a terminal).
    """

    def __init__(self, title: str, total: int, *, live: bool | None = None):
        self.title = title
        self.total = total
        self.live = sys.stderr.isatty() if live is None else live
        self._every = max(total // PLAIN_LINES, 1)
        self._bar = None
        self._task = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def phase(self, message: str) -> None:
        """Say what is happening before the first step (``compiling the train step``)."""
        if self.live:
            self._start_bar()
            self._bar.update(self._task, description=f"{self.title}: {message}")
        else:
            print(f"{self.title}: {message}", file=sys.stderr, flush=True)

    def step(self, done: int, text: str) -> None:
        """Step ``done`` of ``total`` finished; ``text`` describes it."""
        if self.live:
            self._start_bar()
            self._bar.update(self._task, completed=done, description=f"{self.title}: {text}")
        elif done % self._every == 0 or done == self.total:
            print(f"{self.title}: step {done}/{self.total} {text}", file=sys.stderr, flush=True)

    def _start_bar(self) -> None:
        if self._bar is not None:
            return
        from rich.console import Console
        from rich.progress import Progress as Bar

        self._bar = Bar(console=Console(stderr=True), transient=False)
        self._bar.start()
        self._task = self._bar.add_task(self.title, total=self.total)
