"""Read a run directory back: ``read_run(DIR)`` -> :class:`Run` (the report and dashboard read only this).

A run still being written is read as far as it goes: a last line without its newline (being
written) is left out. Anything else malformed is a :class:`~torsh_jax.errors.RunLogError` naming
the file, the line or key, and what it should be: a file (or a line) that is not UTF-8 text, JSON
that is not strict (``NaN``), a ``run.json`` that is not an object or has no positive integer
``devices``, a complete line of ``steps.jsonl`` that is not a JSON object, has no positive integer
``step``, or has a figure that is not a finite number (``null`` is allowed).

Example:
    >>> read_steps("no/such/run")  # nothing logged yet
    []
    >>> run = read_run("runs/a")  # doctest: +SKIP
    >>> run.header["plan"], len(run.steps)  # doctest: +SKIP
    ('zero3', 20)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torsh_jax.errors import RunLogError
from torsh_jax.runlog import files
from torsh_jax.runlog.profile import trace_files

__all__ = ["Run", "read_run", "read_steps"]


@dataclass
class Run:
    """One run directory's contents.

    Attributes:
        path: the directory.
        header: ``run.json``.
        inspect: ``inspect.json`` (the compiled step's summary), or ``None``.
        plan_toml: ``plan.toml``, or ``None``.
        steps: the step records of ``steps.jsonl``, in order.
        label: the name pages show (default: the directory's name).
    """

    path: Path
    header: dict
    inspect: dict | None = None
    plan_toml: str | None = None
    steps: list[dict] = field(default_factory=list)
    label: str | None = None

    @property
    def name(self) -> str:
        """``label``, else the directory's name."""
        return self.label or self.path.name

    @property
    def traces(self) -> list[Path]:
        """Profiler traces under ``profile/``."""
        return trace_files(self.path / files.PROFILE_DIR)

    def plan(self) -> Any:
        """The :class:`~torsh_jax.plan.ParallelPlan` of ``plan.toml`` (``None`` without one)."""
        from torsh_jax.plan.io import plan_from_toml

        if self.plan_toml is None:
            return None
        return plan_from_toml(
            self.plan_toml, name=self.header.get("plan"), source=str(self.path / files.PLAN_TOML)
        )


_FIX = "pass a directory written by RunLog or demo --log-dir, or correct the file"

#: Step figures that are a finite number or null.
_NUMBERS = ("loss", "step_time_s", "tokens_per_s", "grad_norm", "loss_scale", "mfu", "compile_s")

#: run.json figures that are a positive integer or null (``devices`` is required).
_COUNTS = ("devices", "local_devices", "slices", "tokens_per_step")


def _not_strict(constant: str) -> None:
    raise ValueError(f"{constant} is not strict JSON (write null)")


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text, parse_constant=_not_strict)
    except ValueError as err:
        raise RunLogError(f"cannot read {where}: {err}", key=where, fix=_FIX) from None


def _decode(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text; a :class:`RunLogError` naming ``where`` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        byte = f"byte {data[err.start]:#04x} at offset {err.start}"
        fix = "write the file as UTF-8 (RunLog does), or pass another run directory"
        raise RunLogError(f"is not UTF-8 text ({byte})", key=where, fix=fix) from None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise RunLogError(f"cannot read {path.name}: {err}", key=str(path), fix=_FIX) from None


def _text_file(path: Path) -> str:
    """The UTF-8 text of run file ``path``."""
    return _decode(_read_bytes(path), str(path))


def _json_file(path: Path) -> Any:
    return _parse(_text_file(path), str(path))


def _bad(where: str, what: str) -> RunLogError:
    return RunLogError(what, key=where, fix=_FIX)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_header(header: Any, where: str) -> dict:
    if not isinstance(header, dict):
        raise _bad(where, f"is a JSON {type(header).__name__}, not an object")
    if "devices" not in header:
        raise _bad(f"{where}: devices", "missing (the number of devices the step runs on)")
    for key in _COUNTS:
        if (key == "devices" or header.get(key) is not None) and not _is_count(header.get(key)):
            raise _bad(f"{where}: {key}", f"must be a positive integer, got {header.get(key)!r}")
    return header


def _check_step(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise _bad(where, f"is a JSON {type(record).__name__}, not an object")
    if not _is_count(record.get("step")):
        raise _bad(f"{where}: step", f"must be a positive integer, got {record.get('step')!r}")
    for key in _NUMBERS:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _bad(f"{where}: {key}", f"must be a number or null, got {value!r}")
    compiles = record.get("compiles")
    if compiles is not None and not (_is_count(compiles) or compiles == 0):
        raise _bad(f"{where}: compiles", f"must be a count, got {compiles!r}")
    return record


def read_steps(path: str | Path, /, *, after: int = 0) -> list[dict]:
    """The step records of run directory ``path`` with ``step`` > ``after`` (a last line without its
    newline left out).

    Raises:
        RunLogError: a complete line is malformed (see the module's description).
    """
    steps_file = Path(path) / files.STEPS_FILE
    if not steps_file.is_file():
        return []
    lines = _read_bytes(steps_file).split(b"\n")[:-1]  # the last: being written, or b""
    records = []
    for number, line in enumerate(lines, start=1):
        where = f"{steps_file} line {number}"
        record = _check_step(_parse(_decode(line, where), where), where)
        if record["step"] > after:
            records.append(record)
    return records


def _why_not_a_run(path: Path) -> str:
    if path.is_dir():
        return f"no {files.RUN_FILE} in it"
    return "it is a file, not a directory" if path.exists() else "no such directory"


def read_run(path: str | Path, /, *, key: str = "DIR") -> Run:
    """The run in directory ``path``.

    Raises:
        RunLogError: ``path`` is not a directory or has no ``run.json``, or a file is malformed.
    """
    path = Path(path)
    if not (path / files.RUN_FILE).is_file():
        why = _why_not_a_run(path)
        raise RunLogError(
            f"{path} is not a run directory ({why})",
            key=key,
            fix="pass a directory written by torsh-jax demo --log-dir DIR or by RunLog",
        )
    inspect_file, plan_file = path / files.INSPECT_FILE, path / files.PLAN_TOML
    return Run(
        path=path,
        header=_check_header(_json_file(path / files.RUN_FILE), str(path / files.RUN_FILE)),
        inspect=_json_file(inspect_file) if inspect_file.is_file() else None,
        plan_toml=_text_file(plan_file) if plan_file.is_file() else None,
        steps=read_steps(path),
    )
