"""Read a run directory back: ``read_run(DIR)`` -> :class:`Run` (the report and dashboard read only this).

A run still being written is read as far as it goes: a last line cut in the middle is left out.

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


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunLogError(
            f"cannot read {path.name}: {err}",
            key=str(path),
            fix="pass a directory written by RunLog or demo --log-dir",
        ) from None


def read_steps(path: str | Path, /, *, after: int = 0) -> list[dict]:
    """The step records of run directory ``path`` with ``step`` > ``after`` (a cut last line left out)."""
    steps_file = Path(path) / files.STEPS_FILE
    if not steps_file.is_file():
        return []
    records = []
    for line in steps_file.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the line being written
        if isinstance(record, dict) and record.get("step", 0) > after:
            records.append(record)
    return records


def read_run(path: str | Path, /, *, key: str = "DIR") -> Run:
    """The run in directory ``path``.

    Raises:
        RunLogError: ``path`` is not a directory or has no ``run.json``.
    """
    path = Path(path)
    if not (path / files.RUN_FILE).is_file():
        why = "no such directory" if not path.is_dir() else f"no {files.RUN_FILE} in it"
        raise RunLogError(
            f"{path} is not a run directory ({why})",
            key=key,
            fix="pass a directory written by torsh-jax demo --log-dir DIR or by RunLog",
        )
    inspect_file, plan_file = path / files.INSPECT_FILE, path / files.PLAN_TOML
    return Run(
        path=path,
        header=_json_file(path / files.RUN_FILE),
        inspect=_json_file(inspect_file) if inspect_file.is_file() else None,
        plan_toml=plan_file.read_text() if plan_file.is_file() else None,
        steps=read_steps(path),
    )
