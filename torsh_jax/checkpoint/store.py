"""Where checkpoints live: the orbax manager, its items, and the step directories on disk.

A checkpoint of step ``s`` is the directory ``DIR/s`` written by orbax's
``CheckpointManager`` (a step exists only once complete: orbax writes to a
temporary directory and renames it). It holds up to four items:

* ``state``: ``{"step", "params", "opt_state"}``;
* ``loss_scale``: the dynamic loss-scaler state, when the plan scales the loss;
* ``feedback``: per-device compression error feedback, when the plan compresses;
* ``meta``: JSON: the plan (TOML), the mesh, the data position and RNG state
  the training loop handed over, and which items were written.

Example:
    >>> [d.step for d in step_dirs("/nonexistent")]
    []
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torsh_jax.errors import CheckpointError

__all__ = [
    "STATE",
    "LOSS_SCALE",
    "FEEDBACK",
    "META",
    "FORMAT",
    "StepDir",
    "step_dirs",
    "complete_steps",
    "open_manager",
    "require_dir",
    "nonempty_leaves",
]

STATE, LOSS_SCALE, FEEDBACK, META = "state", "loss_scale", "feedback", "meta"
#: Version of the ``meta`` item's layout.
FORMAT = 1
_STEP = re.compile(r"^(\d+)(\.orbax-checkpoint-tmp-\d+)?$")


@dataclass(frozen=True)
class StepDir:
    """One step's directory: ``complete`` once orbax committed it."""

    step: int
    path: Path
    complete: bool


def step_dirs(directory: str | Path) -> list[StepDir]:
    """Every step directory under ``directory``, complete or not, by step."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP.match(child.name)
        if match and child.is_dir():
            complete = match.group(2) is None and (child / "_CHECKPOINT_METADATA").exists()
            found.append(StepDir(int(match.group(1)), child, complete))
    return sorted(found, key=lambda d: (d.step, d.complete))


def has_complete_step(directory: str | Path) -> bool:
    """Whether ``directory`` holds a complete checkpoint (``False`` when it does not exist)."""
    return any(d.complete for d in step_dirs(directory))


def nonempty_leaves(tree) -> dict:
    """``{path: leaf}`` of the leaves with elements (orbax cannot store zero-size arrays;
    compression feedback has some, e.g. an unused warm-start buffer)."""
    import jax

    from torsh_jax.runtime.specs import path_str

    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {path_str(p): x for p, x in leaves if int(np.prod(x.shape))}


def complete_steps(directory: str | Path, step: int | None = None) -> list[int]:
    """The complete steps of an existing ``directory``, checking that there is one and that
    ``step`` (if given) is among them."""
    root = require_dir(directory)
    steps = [d.step for d in step_dirs(root) if d.complete]
    if not steps:
        raise CheckpointError(
            "has no complete checkpoint", key=str(root), fix="save one first, or pass another directory"
        )
    if step is not None and step not in steps:
        raise CheckpointError(
            f"no complete checkpoint for step {step}; complete steps: {steps}",
            key=str(root),
            fix=f"pass one of {steps}",
        )
    return steps


def require_dir(directory: str | Path) -> Path:
    """``directory`` as a path; a typed error when it does not exist."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(
            "no such checkpoint directory",
            key=str(root),
            fix="pass the directory a run saved its checkpoints to (demo --checkpoint-dir)",
        )
    return root


def open_manager(
    directory: str | Path,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    asynchronous: bool = True,
    read_only: bool = False,
):
    """An orbax ``CheckpointManager`` on ``directory`` (created unless ``read_only``)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        save_interval_steps=0 if read_only else 1,
        max_to_keep=keep_last,
        keep_period=keep_every,
        enable_async_checkpointing=asynchronous,
        create=not read_only,
        read_only=read_only,
    )
    handlers = {name: ocp.StandardCheckpointHandler() for name in (STATE, LOSS_SCALE, FEEDBACK)}
    handlers[META] = ocp.JsonCheckpointHandler()
    with _quiet_absl(read_only):  # orbax warns that a read-only directory is read-only
        return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_handlers=handlers)


@contextlib.contextmanager
def _quiet_absl(quiet: bool):
    logger = logging.getLogger("absl")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
