"""Where checkpoints live: the orbax manager, its items, and the step directories on disk.

A checkpoint of step ``s`` is the directory ``DIR/s`` written by orbax's
``CheckpointManager`` (a step exists only once complete: orbax writes to a
temporary directory and renames it). It holds up to four items:

* ``state``: ``{"step", "params", "opt_state"}``;
* ``loss_scale``: the dynamic loss-scaler state, when the plan scales the loss;
* ``feedback``: per-device compression error feedback, when the plan compresses;
* ``meta``: JSON: the plan (TOML), the mesh, the data position and RNG state
  the training loop handed over, and which items were written.

Beside them: ``DIR/<s>.orbax-checkpoint-tmp`` is a save that was interrupted,
and ``DIR/<s>.damaged`` a step that could not be read, which a restore with
``fallback`` renamed so that it is neither restored nor counted by retention.

Example:
    >>> [d.step for d in step_dirs("/nonexistent")]
    []
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
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
    "mark_damaged",
    "open_manager",
    "require_dir",
    "require_writable_dir",
    "root_cause",
    "nonempty_leaves",
]

STATE, LOSS_SCALE, FEEDBACK, META = "state", "loss_scale", "feedback", "meta"
#: Version of the ``meta`` item's layout.
FORMAT = 1
#: ``<step>``, an interrupted save ``<step>.orbax-checkpoint-tmp`` (older orbax: ``...-tmp-<n>``), or
#: a step set aside as unreadable ``<step>.damaged`` (``.damaged-<n>`` when set aside again)
_STEP = re.compile(r"^(\d+)(?:(\.orbax-checkpoint-tmp(?:-\d+)?)|(\.damaged(?:-\d+)?))?$")
_DAMAGED = ".damaged"


@dataclass(frozen=True)
class StepDir:
    """One step's directory; ``status`` is ``complete`` (committed by orbax), ``incomplete`` (a save
    that was interrupted) or ``damaged`` (set aside by :func:`mark_damaged`)."""

    step: int
    path: Path
    status: str

    @property
    def complete(self) -> bool:
        return self.status == "complete"


def _status(child: Path, match: re.Match) -> str:
    if match.group(3):
        return "damaged"
    committed = match.group(2) is None and (child / "_CHECKPOINT_METADATA").exists()
    return "complete" if committed else "incomplete"


def step_dirs(directory: str | Path) -> list[StepDir]:
    """Every step directory under ``directory``, complete or not, by step."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP.match(child.name)
        if match and child.is_dir():
            found.append(StepDir(int(match.group(1)), child, _status(child, match)))
    return sorted(found, key=lambda d: (d.step, d.status, d.path.name))


def mark_damaged(directory: str | Path, step: int) -> Path | None:
    """Set the unreadable ``step`` aside: rename ``DIR/<step>`` to ``DIR/<step>.damaged`` (nothing is
    deleted; rename it back to retry). orbax then neither lists nor keeps it, and the step can be
    saved again. Only process 0 renames; returns the new path, or ``None`` when not renamed
    (another process, or a read-only directory).

    Example:
        >>> import tempfile, pathlib
        >>> root = pathlib.Path(tempfile.mkdtemp()); (root / "6").mkdir()
        >>> mark_damaged(root, 6).name, [(d.step, d.status) for d in step_dirs(root)]
        ('6.damaged', [(6, 'damaged')])
    """
    import jax

    source = Path(directory) / str(step)
    if jax.process_index() != 0 or not source.is_dir():
        return None
    target, n = source.with_name(f"{step}{_DAMAGED}"), 0
    while target.exists():
        n += 1
        target = source.with_name(f"{step}{_DAMAGED}-{n}")
    try:
        source.rename(target)
    except OSError:
        return None
    return target


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
    """``directory`` as a path; a typed error when it does not exist or is a file."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(
            "is a file, not a checkpoint directory" if root.exists() else "no such checkpoint directory",
            key=str(root),
            fix="pass the directory a run saved its checkpoints to (demo --checkpoint-dir)",
        )
    return root


def require_writable_dir(directory: str | Path) -> Path:
    """``directory``, created if missing, after checking that a file can be written in it; a typed
    error (a file in the way, a read-only parent or file system) before anything is trained.

    Example:
        >>> try:
        ...     require_writable_dir("/proc/checkpoints")
        ... except Exception as err:
        ...     print(type(err).__name__, err.key)
        CheckpointError /proc/checkpoints
    """
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            "is a file, not a directory",
            key=str(root),
            fix="pass a directory for the checkpoints (it is created if missing), or move the file away",
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as err:
        other = err.filename and root not in (Path(err.filename), Path(err.filename).parent)  # not the probe
        where = f" ({err.filename})" if other else ""
        raise CheckpointError(
            f"cannot be written: {err.strerror or err}{where}",
            key=str(root),
            fix="pass a directory this process can create and write to",
        ) from None
    return root


def root_cause(err: BaseException) -> str:
    """The innermost error of a chain, on one line (tensorstore names the array and the file;
    the TensorStore spec it appends is left out)."""
    while (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    text = " ".join(f"{type(err).__name__}: {err}".split()).split(" [tensorstore_spec=")[0]
    return text if len(text) <= 600 else f"{text[:300]} ... {text[-300:]}"


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
