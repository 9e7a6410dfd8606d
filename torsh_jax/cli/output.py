"""What the commands write: results on stdout (strict JSON, tables), progress on stderr.

Progress is live when stderr is a terminal (each set-up phase with its running
time, then a bar from the first step) and plain, whole lines otherwise (at most
about :data:`PLAIN_LINES` of them per run), so a piped or logged run shows the
same information without control characters.

Example:
    >>> json_line({"loss": float("nan"), "step": 1})
    '{"loss": null, "step": 1}'
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress as Display

    from torsh_jax.errors import OutputError

__all__ = ["json_line", "json_text", "print_json", "write_output", "write_or_show", "Progress", "PLAIN_LINES"]

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


def write_output(path: Path, text: str, *, key: str = "--output") -> Path:
    """Write ``text`` to the file a command was asked to write (``path``, checked when the command
    started: :func:`~torsh_jax.cli.args.output_file_type`).

    Raises:
        OutputError: it cannot be written now (the disk is full, the directory went away).
    """
    from torsh_jax.errors import OutputError

    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise OutputError(
            f"cannot write {str(path)!r}: {err.strerror or err}", key=key, fix="choose a path you can write"
        ) from None
    return path


def write_or_show(path: Path, text: str, *, key: str = "--output") -> OutputError | None:
    """:func:`write_output`, for a command whose result took long to make (a search, a
    measurement): when ``path`` cannot be written, ``text`` goes to stderr instead, so that nothing
    made is lost, and the error is returned for the command to raise once it has printed its results.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "machine.json"
        >>> write_or_show(path, "{}\\n") is None, path.read_text()
        (True, '{}\\n')
    """
    from torsh_jax.errors import OutputError

    try:
        write_output(path, text, key=key)
    except OutputError as err:
        print(f"the file {key} names could not be written; its text follows:", file=sys.stderr)
        print(text, end="" if text.endswith("\n") else "\n", file=sys.stderr, flush=True)
        return err
    return None


class Progress:
    """Phase messages and per-step progress on stderr.

    Before the first step each phase (``compiling the train step``) shows with a
    spinner and the time it has taken so far; a finished phase keeps its time. The
    bar (percentage, time left) starts with the first step. Plain lines say how
    long the run has taken when a phase starts.

    Args:
        title: what runs (``training (zero3)``).
        total: steps expected.
        live: a live display (default: stderr is a terminal).
        console: the ``rich`` console to draw on (default: stderr).
    """

    def __init__(self, title: str, total: int, *, live: bool | None = None, console: Console | None = None):
        self.title = title
        self.total = total
        self.live = sys.stderr.isatty() if live is None else live
        self._console = console
        self._every = max(total // PLAIN_LINES, 1)
        self._started = time.perf_counter()
        self._phases = None  # rich display of the phases, until the first step
        self._phase_task = None
        self._bar = None
        self._task = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self._end_phases()
        if self._bar is not None:
            self._bar.stop()

    def phase(self, message: str) -> None:
        """Say what is happening before the first step (``compiling the train step``)."""
        if not self.live:
            elapsed = time.perf_counter() - self._started
            when = f" ({elapsed:.1f} s so far)" if elapsed >= 0.1 else ""
            print(f"{self.title}: {message}{when}", file=sys.stderr, flush=True)
            return
        if self._bar is not None:  # after the first step: the bar's text says it
            self._bar.update(self._task, info=message)
            return
        self._finish_phase()
        if self._phases is None:
            self._phases = _rich_progress(self._console, phases=True)
            self._phases.start()
        self._phase_task = self._phases.add_task(f"{self.title}: {message}", total=None)
        self._phases.refresh()

    def step(self, done: int, text: str) -> None:
        """Step ``done`` of ``total`` finished; ``text`` describes it."""
        if self.live and self._bar is None:
            self._start_bar(done, text)
        elif self.live:
            self._bar.update(self._task, completed=done, info=text)
        elif done % self._every == 0 or done == self.total:
            print(f"{self.title}: step {done}/{self.total} {text}", file=sys.stderr, flush=True)

    def _finish_phase(self) -> None:
        """Stop the clock of the current phase (its line keeps the time it took)."""
        if self._phase_task is not None:
            self._phases.update(self._phase_task, total=1, completed=1)
            self._phase_task = None

    def _end_phases(self) -> None:
        if self._phases is not None:
            self._finish_phase()
            self._phases.stop()
            self._phases = None

    def _start_bar(self, done: int, text: str) -> None:
        self._end_phases()
        self._bar = _rich_progress(self._console, phases=False)
        self._task = self._bar.add_task(self.title, total=self.total, completed=done, info=text)
        self._bar.start()


def _rich_progress(console: Console | None, *, phases: bool) -> Display:
    """A ``rich`` display on ``console`` (stderr): spinner, text and elapsed time for
    phases; title, bar, percentage, time left and the step's text (cut to the width) for steps."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Display
    from rich.table import Column

    console = console or Console(stderr=True)
    if not phases:
        info = TextColumn(
            "{task.fields[info]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")
        )
        bar = (
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            TaskProgressColumn(),
            TimeRemainingColumn(),
        )
        return Display(*bar, info, console=console, transient=False, expand=True)
    columns = (SpinnerColumn(finished_text="✓"), TextColumn("{task.description}"), TimeElapsedColumn())
    return Display(*columns, console=console, transient=False)
