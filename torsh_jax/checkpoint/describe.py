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
from typing import Any

from torsh_jax.checkpoint.restore_state import read_meta
from torsh_jax.checkpoint.store import STATE, complete_steps, open_manager, require_dir, step_dirs

__all__ = ["list_checkpoints", "show_checkpoint"]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_checkpoints(directory: str | Path) -> list[dict]:
    """One entry per step directory: ``step``, ``complete``, ``path`` and ``bytes_on_disk``."""
    root = require_dir(directory)
    return [
        {"step": d.step, "complete": d.complete, "path": str(d.path), "bytes_on_disk": _dir_bytes(d.path)}
        for d in step_dirs(root)
    ]


def _shardings(manager, step: int) -> dict[str, dict]:
    metadata = manager.item_metadata(step)[STATE]
    tree = getattr(metadata, "tree", metadata)
    out = {}
    for group in ("params",):
        _flatten(tree.get(group, {}), group, out)
    return out


def _flatten(tree: Any, prefix: str, out: dict) -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            _flatten(value, f"{prefix}/{key}", out)
        return
    if isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            _flatten(value, f"{prefix}/{index}", out)
        return
    if tree is None:
        return
    sharding = getattr(tree, "sharding", None)
    spec = getattr(sharding, "partition_spec", None)
    out[prefix] = {
        "shape": list(tree.shape),
        "dtype": str(tree.dtype),
        "partition_spec": None if spec is None else [None if e is None else e for e in spec],
    }


def show_checkpoint(directory: str | Path, *, step: int | None = None) -> dict:
    """The step (default: newest complete), its plan (TOML), mesh, items, bytes, data position and
    the saved parameter shapes and partition specs."""
    root = require_dir(directory)
    steps = complete_steps(root, step)
    step = steps[-1] if step is None else step
    manager = open_manager(root, read_only=True)
    try:
        meta = read_meta(manager, step)
        params = _shardings(manager, step)
    finally:
        manager.close()
    return {
        "step": step,
        "complete": True,
        "path": str(root / str(step)),
        "plan": meta.get("plan"),
        "mesh": meta.get("mesh"),
        "items": meta.get("items"),
        "state_bytes": meta.get("bytes"),
        "bytes_on_disk": _dir_bytes(root / str(step)),
        "data_position": meta.get("data_position"),
        "has_rng": meta.get("rng") is not None,
        "params": params,
    }
