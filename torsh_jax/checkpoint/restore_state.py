"""Restoring a checkpoint onto any plan and mesh, through the runtime's state layout.

The target shardings come from the train step the state is restored *into*
(``train_step.layout``), so a ZeRO-3 checkpoint from 8 devices restores as a
DDP state on 4, or onto ``fsdp_tp``: orbax reads each device's shard of the
new layout from the saved arrays. Before reading, every saved array's path,
shape and dtype is checked against the new state (a checkpoint of another
model names the parameter and both shapes); after, the step.

Rules for the parts that depend on the plan rather than the model:

* **Compression feedback** is per device of the saved mesh. It is restored
  only onto the same mesh shape and the same ``[[compression]]`` sections;
  otherwise it restarts from zero, with a note (error feedback is a residual:
  dropping it loses at most one step's quantisation error).
* **Loss-scale state** is restored when both plans scale the loss; a plan
  that starts scaling starts from its initial scale, with a note.

Example:
    >>> try:
    ...     restore("/nonexistent", None)
    ... except Exception as err:
    ...     print(type(err).__name__, err.key)
    CheckpointError /nonexistent
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

from torsh_jax.checkpoint.checksum import mismatched
from torsh_jax.checkpoint.meta_fields import meta_problem
from torsh_jax.checkpoint.quiet import quiet_orbax
from torsh_jax.checkpoint.relayer import read_targets, relayered, saved_chunks
from torsh_jax.checkpoint.store import (
    FEEDBACK,
    LOSS_SCALE,
    META,
    STATE,
    complete_steps,
    mark_damaged,
    nonempty_leaves,
    open_manager,
    require_dir,
    root_cause,
)
from torsh_jax.errors import CheckpointError, CheckpointUnreadableError, TorshError
from torsh_jax.plan.io import plan_from_toml, plan_to_dict
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.specs import path_str
from torsh_jax.runtime.state import TrainState
from torsh_jax.typing import PyTree

__all__ = [
    "Restored",
    "restore",
    "read_meta",
    "newest_meta",
    "newest_readable",
    "saved_metadata",
    "saved_arrays",
    "arrays_by_path",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
#: The file orbax writes an item's JSON to (``DIR/<step>/meta/metadata``).
META_FILE = "metadata"
#: The file of an item's array metadata (shapes, dtypes, shardings).
ITEM_METADATA = "_METADATA"
#: How orbax's warning about an item it has no metadata for begins (its message, before ``%``).
_ORBAX_NO_ITEM = 'Item "%s" was found in the checkpoint, but could not'


@dataclass
class Restored:
    """A restored state and what the loop saved with it.

    Attributes:
        state: the train state, placed in the new step's layout.
        step: its step.
        plan: the plan it was saved under.
        data_position: what the loop passed as ``data_position`` when saving.
        rng: the loop's JAX key, or ``None``.
        notes: what was not carried over (an unreadable newer step skipped, first; feedback reset).
        skipped: the newer steps that could not be read (with ``fallback``), newest first; each
            was logged as a warning and has the first notes.
    """

    state: TrainState
    step: int
    plan: ParallelPlan
    data_position: Any = None
    rng: Any = None
    notes: list[str] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


def _is_array_meta(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def arrays_by_path(tree: PyTree) -> dict[str, Any]:
    """``{path: leaf}`` of the array-like leaves (arrays, shapes, orbax array metadata) of ``tree``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_array_meta)
    return {path_str(p): x for p, x in leaves if _is_array_meta(x)}


def _by_path(tree: PyTree) -> dict[str, tuple[tuple[int, ...], str]]:
    return {p: (tuple(x.shape), str(np.dtype(x.dtype))) for p, x in arrays_by_path(tree).items()}


def read_meta(manager, step: int) -> dict:
    """The ``meta`` item of ``step``, its fields checked (:mod:`~torsh_jax.checkpoint.meta_fields`);
    :class:`CheckpointUnreadableError` naming the file and field when it cannot be read."""
    import orbax.checkpoint as ocp

    try:
        meta = manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as err:  # a missing or damaged file: JSON, orbax
        raise _unreadable_meta(manager, step, f"cannot be read ({root_cause(err)})") from None
    problem = meta_problem(meta)
    if problem is not None:
        raise _unreadable_meta(manager, step, f"is malformed ({problem})")
    return meta


def _unreadable_meta(manager, step: int, what: str) -> CheckpointUnreadableError:
    return CheckpointUnreadableError(
        f"step {step}: its meta item {what}",
        key=str(Path(manager.directory) / str(step) / META / META_FILE),
        fix="use an earlier complete step (demo --resume and checkpoint show fall back to one), "
        "or delete the damaged step directory",
    )


def newest_readable(steps: list[int], read: Callable[[int], T]) -> tuple[int, T, list[str]]:
    """``(step, read(step), notes)`` of the newest of ``steps`` that reads; ``notes`` name the newer
    steps skipped. Raises the :class:`CheckpointUnreadableError` of the oldest when none reads."""
    notes: list[str] = []
    for step in sorted(steps, reverse=True):
        try:
            return step, read(step), notes
        except CheckpointUnreadableError as err:
            if step == min(steps):
                raise
            notes.append(f"step {step} skipped: {err}")
    raise AssertionError("unreachable")  # an empty list: callers pass complete_steps()


def newest_meta(manager, steps: list[int]) -> tuple[int, dict, list[str]]:
    """``(step, meta, notes)`` of the newest of ``steps`` whose ``meta`` reads (:func:`newest_readable`)."""
    return newest_readable(steps, lambda step: read_meta(manager, step))


def saved_metadata(manager, step: int, item: str) -> PyTree:
    """The orbax metadata tree of one saved item (shapes, dtypes, shardings; no array is read).

    Raises:
        CheckpointUnreadableError: orbax finds no metadata for it (the item or its ``_METADATA`` is
            missing).
    """
    with _quiet_item_warning(item):
        saved = manager.item_metadata(step)
    try:
        metadata = saved[item]
    except KeyError:  # no directory for the item
        metadata = None
    if metadata is None:
        raise _missing_item_metadata(manager, step, item)
    return getattr(metadata, "tree", metadata)


def _missing_item_metadata(manager, step: int, item: str) -> CheckpointUnreadableError:
    item_dir = Path(manager.directory) / str(step) / item
    missing = f"{item}/{ITEM_METADATA}" if item_dir.is_dir() else f"the {item} item"
    return CheckpointUnreadableError(
        f"step {step}: {missing} is missing, so the saved arrays' shapes and dtypes cannot be read",
        key=str(item_dir),
        fix="use an earlier complete step (restore with fallback, checkpoint show falls back to one), "
        "or delete the damaged step directory",
    )


@contextlib.contextmanager
def _quiet_item_warning(item: str):
    """Leave out orbax's warning that ``item`` "could not be restored": the caller raises its own
    error instead (warnings about other items still show)."""

    def keep(record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith(_ORBAX_NO_ITEM) and record.args == (item,))

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def saved_arrays(manager, step: int, item: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, dtype)}`` of one saved item."""
    return _by_path(saved_metadata(manager, step, item))


def _check_arrays(saved: dict, wanted: dict, *, where: str) -> None:
    """Parameters first: a mismatch there names what the user changed (the optimizer state follows)."""
    for path, (shape, dtype) in sorted(wanted.items(), key=lambda kv: not kv[0].startswith("params/")):
        if path not in saved:
            raise CheckpointError(
                f"the checkpoint ({where}) has no array here; the model expects {shape} {dtype}",
                key=path,
                fix="restore into the model (and optimizer) the checkpoint was saved from",
            )
        if saved[path] != (shape, dtype):
            got = saved[path]
            raise CheckpointError(
                f"the checkpoint ({where}) holds {got[0]} {got[1]}, the model {shape} {dtype}",
                key=path,
                fix="restore into the model the checkpoint was saved from, or start from fresh parameters",
            )
    extra = sorted(set(saved) - set(wanted))
    if extra:
        raise CheckpointError(
            f"the checkpoint ({where}) has arrays the model lacks ({len(extra)}, first {extra[0]!r})",
            key=extra[0],
            fix="restore into the model (and optimizer) the checkpoint was saved from",
        )


def _compression(plan: ParallelPlan) -> Any:
    return plan_to_dict(plan).get("compression")


def _feedback_args(manager, step, meta, saved_plan, train_step, layout, abstract, notes):
    """``(restore args or None, fresh feedback or None)`` for the target's feedback (``abstract``:
    the target state's :meth:`~torsh_jax.runtime.layout.StateLayout.abstract_state`)."""
    import orbax.checkpoint as ocp

    if abstract.feedback is None:
        return None, None
    target = nonempty_leaves(abstract.feedback)
    same = (
        FEEDBACK in meta.get("items", [])
        and meta.get("mesh") == {k: int(v) for k, v in layout.mesh.shape.items()}
        and _compression(saved_plan) == _compression(train_step.plan)
        and saved_arrays(manager, step, FEEDBACK) == _by_path(target)
    )
    if same:
        return ocp.args.StandardRestore(target), None
    saved_on = f"mesh {meta.get('mesh')} with {_compression(saved_plan)}"
    restored_on = f"{dict(layout.mesh.shape)} with {_compression(train_step.plan)}"
    notes.append(f"compression feedback restarts from zero: saved on {saved_on}, restored onto {restored_on}")
    return None, jax.jit(layout.init_feedback, out_shardings=_shardings(abstract.feedback))()


def _shardings(abstract: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x.sharding, abstract)


def _loss_scale_args(meta, train_step, abstract, notes):
    import orbax.checkpoint as ocp

    from torsh_jax.runtime.update import scaler_for

    if abstract.loss_scale is None:
        if LOSS_SCALE in meta.get("items", []):
            notes.append("loss-scale state dropped: the new plan does not scale the loss")
        return None, None
    if LOSS_SCALE in meta.get("items", []):
        return ocp.args.StandardRestore(abstract.loss_scale), None
    notes.append("loss scaling starts from its initial scale: the checkpoint was saved without it")
    return None, jax.jit(scaler_for(train_step.plan).init, out_shardings=_shardings(abstract.loss_scale))()


def _restore_step(manager, root: Path, step: int, train_step) -> Restored:
    import orbax.checkpoint as ocp

    meta = read_meta(manager, step)
    saved_plan = plan_from_toml(meta["plan"], source=f"{root / str(step)} (meta)")
    chunks = saved_chunks(saved_plan, meta.get("mesh") or {})
    layout = train_step.layout
    abstract = layout.abstract_state()
    target = {"step": abstract.step, "params": abstract.params, "opt_state": abstract.opt_state}
    on_disk = saved_arrays(manager, step, STATE)
    reads = read_targets(
        on_disk, target, stacked_key=layout.stacked_key, saved=chunks, chunks=layout.layer_chunks
    )
    read = jax.tree_util.tree_map_with_path(lambda p, x: reads.get(path_str(p), x), target)
    _check_arrays(on_disk, _by_path(read), where=f"step {step}")
    notes: list[str] = []
    args = {STATE: ocp.args.StandardRestore(read)}
    fb_args, fresh_feedback = _feedback_args(
        manager, step, meta, saved_plan, train_step, layout, abstract, notes
    )
    ls_args, fresh_scale = _loss_scale_args(meta, train_step, abstract, notes)
    args.update({k: v for k, v in ((FEEDBACK, fb_args), (LOSS_SCALE, ls_args)) if v is not None})
    out = _read(manager, step, args)
    _verify(meta, out, step, root)
    read_state = relayered(out[STATE], target, reads)
    state = TrainState(
        step=read_state["step"],
        params=read_state["params"],
        opt_state=read_state["opt_state"],
        loss_scale=out[LOSS_SCALE] if ls_args is not None else fresh_scale,
        feedback=_feedback_tree(out[FEEDBACK], abstract.feedback) if fb_args is not None else fresh_feedback,
    )
    _check_step(state, step, meta, root)
    return Restored(state, step, saved_plan, meta.get("data_position"), _rng(meta.get("rng")), notes)


def _feedback_tree(saved: dict, target: PyTree) -> PyTree:
    """The feedback tree from its saved non-empty leaves (zero-size leaves are made again)."""

    def one(path, leaf):
        key = path_str(path)
        return saved[key] if key in saved else jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)

    return jax.tree_util.tree_map_with_path(one, target)


def _read(manager, step: int, args: dict) -> dict:
    import orbax.checkpoint as ocp

    return manager.restore(step, args=ocp.args.Composite(**args))


def _restore_readable(manager, root: Path, step: int, train_step) -> Restored:
    """:func:`_restore_step`, with any failure to read the files as a :class:`CheckpointError`."""
    try:
        return _restore_step(manager, root, step, train_step)
    except (TorshError, MemoryError):
        raise
    except Exception as err:  # orbax, tensorstore, JSON: a damaged or missing file
        cause = root_cause(err)
    raise CheckpointUnreadableError(
        f"step {step} cannot be read ({cause})",
        key=str(root / str(step)),
        fix="restore an earlier complete step, or delete the damaged step directory",
    )


def _verify(meta: dict, read: dict, step: int, root: Path) -> None:
    """Compare the arrays read with the checksums the save recorded (steps saved without them pass)."""
    saved = meta.get("checksums") or {}
    for item, tree in read.items():
        bad = mismatched(saved.get(item, {}), tree)
        if bad:
            path, want, got = bad[0]
            raise CheckpointUnreadableError(
                f"step {step}: {len(bad)} array(s) differ from what was saved, first {path!r} "
                f"(checksum {got:#010x}, saved {want:#010x}): the files changed after they were written",
                key=str(root / str(step) / item),
                fix="restore an earlier complete step (fallback=True, or demo --resume, does so), "
                "or delete the damaged step directory",
            )


def _check_step(state: TrainState, step: int, meta: dict, root: Path) -> None:
    from torsh_jax.checkpoint.save import scalar

    got = scalar(state.step)
    if got != step or meta.get("step") != step:
        raise CheckpointError(
            f"directory step {step}, state step {got}, recorded step {meta.get('step')} disagree",
            key=str(root / str(step)),
            fix="restore another step; this one was not written by a single save",
        )


def _rng(saved: dict | None) -> Any:
    if not saved:
        return None
    data = np.asarray(saved["data"], np.uint32)
    if not saved.get("typed"):
        return jax.numpy.asarray(data)
    return jax.random.wrap_key_data(data, impl=saved.get("impl") or None)


def restore(
    directory: str | Path, train_step, *, step: int | None = None, fallback: bool = False
) -> Restored:
    """Restore step ``step`` (default: the newest complete one) into ``train_step``'s layout.

    Args:
        directory: the checkpoint directory.
        train_step: a :class:`~torsh_jax.runtime.step.TrainStep` of the plan and
            mesh to continue on (its layout is read; nothing needs to be initialised).
        step: the step to restore; ``None``: the newest complete one.
        fallback: with ``step=None``, go back to the previous complete step
            when the newest cannot be read (noted in :attr:`Restored.notes`);
            the unreadable step is set aside as ``DIR/<step>.damaged``
            (:func:`~torsh_jax.checkpoint.store.mark_damaged`), so that
            retention no longer counts it and the run can save that step again.

    Raises:
        CheckpointError: a missing directory, no complete step, a step that
            does not exist (listing those that do), a checkpoint of another
            model (naming the parameter and both shapes) or an unreadable file.
    """
    root = require_dir(directory)
    steps = complete_steps(root, step)
    candidates = [step] if step is not None else steps[::-1]
    with quiet_orbax():
        restored = _restore_on_a_manager(root, train_step, candidates, fallback)
        if isinstance(restored, CheckpointUnreadableError) or restored.skipped:
            gc.collect()  # the reads a damaged step left pending, unreferenced once its manager closed
    if isinstance(restored, CheckpointUnreadableError):
        raise restored
    return restored


def _restore_on_a_manager(
    root: Path, train_step, candidates: list[int], fallback: bool
) -> Restored | CheckpointUnreadableError:
    """The restored state, or the error of an unreadable step (returned without its traceback,
    which would keep the pending reads of the step alive past :func:`quiet_orbax`)."""
    manager = open_manager(root, read_only=True)
    try:
        return _restore_newest(manager, root, train_step, candidates, fallback)
    except CheckpointUnreadableError as err:
        return err.with_traceback(None)
    finally:
        manager.close()


def _restore_newest(manager, root: Path, train_step, candidates: list[int], fallback: bool) -> Restored:
    skipped: list[str] = []
    for index, candidate in enumerate(candidates):
        try:
            restored = _restore_readable(manager, root, candidate, train_step)
        except CheckpointUnreadableError as err:
            if not (fallback and index + 1 < len(candidates)):
                raise
            aside = mark_damaged(root, candidate)
            moved = f", set aside as {aside.name}" if aside else ""
            skipped.append(f"step {candidate} skipped{moved}: {err}")
            log.warning("checkpoint step %d skipped%s; trying step %d: %s", candidate, moved,
                        candidates[index + 1], err)  # fmt: skip
            continue
        restored.notes[:0] = skipped
        restored.skipped = candidates[: len(skipped)]
        return restored
    raise AssertionError("unreachable")  # every path above returns or raises
