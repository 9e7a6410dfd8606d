"""The files of a run directory and strict JSON for them.

A run directory holds ``run.json`` (what the run is: devices, FLOPs and peak with their sources,
memory capacity, profile window), ``plan.toml`` and ``plan.json``, ``inspect.json`` (the
``inspect`` summary of the compiled step), ``steps.jsonl`` (one JSON object per step, flushed per
line), and optionally ``profile/`` (``jax.profiler`` traces of this run; an earlier run's are moved
to ``profile.1``, ``profile.2``, ...) and ``tensorboard/``.

Example:
    >>> flat_json_line({"loss": float("nan"), "step": 1})
    '{"loss": null, "step": 1}'
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from torsh_jax.errors import RunLogError

__all__ = [
    "RUN_FILE",
    "PLAN_TOML",
    "PLAN_JSON",
    "INSPECT_FILE",
    "STEPS_FILE",
    "PROFILE_DIR",
    "TENSORBOARD_DIR",
    "flat_json_line",
    "make_run_dir",
    "rotate_profile",
    "steps_up_to",
    "write_json",
]

RUN_FILE = "run.json"
PLAN_TOML = "plan.toml"
PLAN_JSON = "plan.json"
INSPECT_FILE = "inspect.json"
STEPS_FILE = "steps.jsonl"
PROFILE_DIR = "profile"
TENSORBOARD_DIR = "tensorboard"


def _plain(value: Any) -> Any:
    """A float that is not finite becomes ``None`` (strict JSON has no NaN)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def flat_json_line(record: dict) -> str:
    """A flat record (scalar values) as one line of strict JSON."""
    return json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False)


def _strict(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return _plain(value)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented strict JSON, atomically (a reader never sees half a file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(_strict(data), indent=1, allow_nan=False, default=str))
    partial.replace(path)


def make_run_dir(directory: str | Path, *, key: str = "log_dir") -> Path:
    """``directory``, created if missing.

    Raises:
        RunLogError: it is a file, or cannot be created or written.
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise RunLogError(
            f"cannot write the run directory {path}: {err.strerror or err}",
            key=key,
            fix="pass a directory you can write, e.g. runs/demo",
        ) from None
    return path


def rotate_profile(path: Path) -> Path | None:
    """Move an earlier run's ``profile/`` in run directory ``path`` to the first free ``profile.N``
    (nothing is deleted); the new name, or ``None`` when there was none.

    Raises:
        RunLogError: it cannot be moved.
    """
    old = path / PROFILE_DIR
    if not old.exists():
        return None
    n = 1
    while (path / f"{PROFILE_DIR}.{n}").exists():
        n += 1
    try:
        return old.rename(path / f"{PROFILE_DIR}.{n}")
    except OSError as err:
        raise RunLogError(
            f"cannot move the earlier run's {old} aside: {err.strerror or err}",
            key="log_dir",
            fix=f"move or remove {old}, or pass another directory",
        ) from None


def steps_up_to(path: Path, step: int, /) -> list[str]:
    """The lines of run directory ``path``'s ``steps.jsonl`` whose ``step`` is at most ``step``
    (what a run resumed from its checkpoint at ``step`` keeps of the run before it); a line that is
    not a step's JSON (a crash's half line) is left out.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp())
        >>> _ = (path / STEPS_FILE).write_text('{"step": 1}\\n{"step": 2}\\n{"step": 3}\\n{"st')
        >>> steps_up_to(path, 2)
        ['{"step": 1}', '{"step": 2}']
    """
    if not (path / STEPS_FILE).is_file():
        return []
    kept = []
    for raw in (path / STEPS_FILE).read_bytes().splitlines():
        try:
            record = json.loads(raw)
        except ValueError:  # also not UTF-8
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(raw.decode("utf-8"))
    return kept
