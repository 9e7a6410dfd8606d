"""What a checkpoint directory holds, for people and scripts (``torsh-jax checkpoint list|show``).

Reads orbax's metadata and the ``meta`` item only; no array is loaded.

Example:
    >>> try:
    ...     list_checkpoints("/nonexistent")
    ... except Exception as err:
    ...     print(type(err).__name__, err.key)
    CheckpointError /nonexistent
"""

from __future__ import annotations

from pathlib import Path

from torsh_jax.checkpoint.restore_state import arrays_by_path, newest_readable, read_meta, saved_metadata
from torsh_jax.checkpoint.store import (
    STATE,
    StepDir,
    complete_steps,
    open_manager,
    require_dir,
    root_cause,
    step_dirs,
)
from torsh_jax.errors import CheckpointUnreadableError

__all__ = ["list_checkpoints", "show_checkpoint"]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_checkpoints(directory: str | Path) -> list[dict]:
    """One entry per step directory: ``step``, ``status`` (``complete``; ``unreadable``: committed,
    but its ``meta`` item or array metadata cannot be read; ``incomplete``: a save was interrupted;
    ``damaged``: set aside after it could not be read), ``complete``, ``reason`` (why it is
    unreadable, else ``None``), ``path`` and ``bytes_on_disk``."""
    root = require_dir(directory)
    found = step_dirs(root)
    reasons = _unreadable_reasons(root, [d.step for d in found if d.complete])
    return [_entry(d, reasons.get(d.step) if d.complete else None) for d in found]


def _entry(step_dir: StepDir, reason: str | None) -> dict:
    return {
        "step": step_dir.step,
        "status": step_dir.status if reason is None else "unreadable",
        "complete": step_dir.complete and reason is None,
        "reason": reason,
        "path": str(step_dir.path),
        "bytes_on_disk": _dir_bytes(step_dir.path),
    }


def _unreadable_reasons(root: Path, steps: list[int]) -> dict[int, str]:
    """``{step: why}`` of the committed ``steps`` whose metadata cannot be read."""
    if not steps:
        return {}
    reasons = {}
    manager = open_manager(root, read_only=True)
    try:
        for step in steps:
            try:
                _read_step(manager, step)
            except CheckpointUnreadableError as err:
                reasons[step] = f"{err.key}: {err.message}"
    finally:
        manager.close()
    return reasons


def _saved_params(manager, step: int) -> dict[str, dict]:
    """Per saved parameter path: shape, dtype and partition spec, from orbax's metadata."""
    try:
        params = saved_metadata(manager, step, STATE).get("params", {})
    except CheckpointUnreadableError:
        raise
    except Exception as err:  # a damaged metadata file
        raise CheckpointUnreadableError(
            f"step {step}: the saved array metadata cannot be read ({root_cause(err)})",
            key=str(Path(manager.directory) / str(step) / STATE),
            fix="use an earlier complete step (checkpoint show falls back to one), "
            "or delete the damaged step directory",
        ) from None
    out = {}
    for path, array in arrays_by_path(params).items():
        spec = getattr(getattr(array, "sharding", None), "partition_spec", None)
        out[f"params/{path}"] = {
            "shape": list(array.shape),
            "dtype": str(array.dtype),
            "partition_spec": None if spec is None else list(spec),
        }
    return out


def _read_step(manager, step: int) -> tuple[dict, dict]:
    """``(meta, params)`` of ``step``; :class:`CheckpointUnreadableError` when either cannot be read."""
    return read_meta(manager, step), _saved_params(manager, step)


def show_checkpoint(directory: str | Path, *, step: int | None = None) -> dict:
    """The step (default: the newest complete one whose ``meta`` and array metadata read;
    ``skipped`` names newer ones that do not), its plan (TOML), mesh, items, bytes, data position,
    how many arrays carry a checksum, and the saved parameter shapes and partition specs.

    Raises:
        CheckpointUnreadableError: the step's metadata cannot be read or is malformed (naming the
            file and field).
    """
    root = require_dir(directory)
    steps = complete_steps(root, step)
    manager = open_manager(root, read_only=True)
    try:
        if step is None:
            step, (meta, params), skipped = newest_readable(steps, lambda s: _read_step(manager, s))
        else:
            (meta, params), skipped = _read_step(manager, step), []
    finally:
        manager.close()
    return {
        "step": step,
        "complete": True,
        "skipped": skipped,
        "path": str(root / str(step)),
        "plan": meta.get("plan"),
        "mesh": meta.get("mesh"),
        "items": meta.get("items"),
        "state_bytes": meta.get("bytes"),
        "bytes_on_disk": _dir_bytes(root / str(step)),
        "data_position": meta.get("data_position"),
        "has_rng": meta.get("rng") is not None,
        "checksummed_arrays": sum(len(sums) for sums in (meta.get("checksums") or {}).values()),
        "params": params,
    }
