"""Saving train states: asynchronous, atomic, keeping the last N plus every K-th step.

Example:
    >>> import jax.numpy as jnp, tempfile
    >>> from torsh_jax.plan import ParallelPlan
    >>> from torsh_jax.runtime.state import TrainState
    >>> state = TrainState(step=jnp.int32(3), params={"w": jnp.ones(2)}, opt_state=())
    >>> with Checkpointer(tempfile.mkdtemp()) as saver:
    ...     saver.save(state, plan=ParallelPlan())
    3
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from torsh_jax.checkpoint.checksum import checksums as array_checksums
from torsh_jax.checkpoint.quiet import abandon_manager, quiet_orbax
from torsh_jax.checkpoint.store import (
    FEEDBACK,
    FORMAT,
    LOSS_SCALE,
    META,
    STATE,
    complete_steps,
    nonempty_leaves,
    open_manager,
    require_writable_dir,
    root_cause,
    step_dirs,
)
from torsh_jax.errors import CheckpointError
from torsh_jax.plan.io import plan_to_toml
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.state import TrainState
from torsh_jax.typing import PyTree

__all__ = ["Checkpointer", "scalar", "rng_to_json"]


def scalar(value: Any) -> int:
    """A replicated scalar (possibly spanning processes) as a Python int."""
    if isinstance(value, jax.Array):
        value = value.addressable_data(0)
    return int(np.asarray(value))


def rng_to_json(rng: Any) -> dict | None:
    """A JAX key (typed or raw ``uint32``) as JSON: its implementation and key data."""
    if rng is None:
        return None
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(rng) if typed else rng
    impl = str(jax.random.key_impl(rng)) if typed else None
    return {"typed": typed, "impl": impl, "data": np.asarray(jax.device_get(data)).tolist()}


def _total_bytes(tree: PyTree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


class Checkpointer:
    """Saves :class:`~torsh_jax.runtime.state.TrainState` s with orbax.

    Args:
        directory: where step directories go (created).
        keep_last: keep the newest N checkpoints (``None``: all).
        keep_every: also keep every step divisible by K.
        asynchronous: write in the background; training continues, and
            :meth:`wait` (or leaving the ``with`` block) blocks until written.
        checksums: record a checksum of every array, which :func:`restore`
            verifies (:mod:`torsh_jax.checkpoint.checksum`); ``save`` waits
            for the sums, one pass over the state on its devices.

    Every process of a multi-process job calls :meth:`save`; each writes the
    shards it holds.

    Raises:
        CheckpointError: at construction, a directory that cannot be written
            (a file in the way, a read-only parent); from :meth:`save`,
            :meth:`wait` or :meth:`close`, a save that failed (disk full...):
            one line naming the newest complete step, which is left as it was.
            The failed save is abandoned (its background threads end) and the
            checkpointer is closed.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        asynchronous: bool = True,
        checksums: bool = True,
    ):
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise CheckpointError(f"must be a positive integer or None, got {value!r}", key=name,
                                      fix=f"pass {name}=N with N >= 1, or None")  # fmt: skip
        self.directory = require_writable_dir(directory)
        self.checksums = checksums
        self._started: int | None = None  # the step of the newest save started
        self._manager = open_manager(
            directory, keep_last=keep_last, keep_every=keep_every, asynchronous=asynchronous
        )
        self._quiet = contextlib.ExitStack()  # the noise of a save that fails
        self._quiet.enter_context(quiet_orbax())

    def save(
        self, state: TrainState, *, plan: ParallelPlan, data_position: Any = None, rng: Any = None
    ) -> int:
        """Start saving ``state`` under its own step; returns the step.

        Args:
            state: the train state (its ``step`` names the checkpoint).
            plan: the plan it was trained under (stored as TOML).
            data_position: anything JSON-able that says where the data loader is.
            rng: the loop's JAX key, restored with the state.
        """
        import orbax.checkpoint as ocp

        step = scalar(state.step)
        items = {STATE: {"step": state.step, "params": state.params, "opt_state": state.opt_state}}
        if state.loss_scale is not None:
            items[LOSS_SCALE] = state.loss_scale
        if state.feedback is not None:
            items[FEEDBACK] = nonempty_leaves(state.feedback)
        meta = {
            "format": FORMAT,
            "step": step,
            "plan": plan_to_toml(plan),
            "mesh": _mesh_shape(state.params),
            "items": sorted(items),
            "bytes": _total_bytes((state.params, state.opt_state)),
            "data_position": data_position,
            "rng": rng_to_json(rng),
            "checksums": {k: array_checksums(tree) for k, tree in items.items()} if self.checksums else None,
        }
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        args[META] = ocp.args.JsonSave(meta)
        manager = self._open()
        self.wait()  # orbax would wait too; here an earlier save's failure is named as its own
        self._or_abandon(
            lambda: manager.save(step, args=ocp.args.Composite(**args), force=True), f"step {step}"
        )
        self._started = step
        return step

    @property
    def steps(self) -> list[int]:
        """Complete steps, oldest first (a save in progress counts once finished)."""
        if self._manager is None:
            return [d.step for d in step_dirs(self.directory) if d.complete]
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Block until every started save is on disk."""
        if self._manager is not None and self._started is not None:
            self._or_abandon(self._manager.wait_until_finished, f"step {self._started}")

    def close(self) -> None:
        """Wait, then release the manager (a no-op once closed)."""
        if self._manager is None:
            return
        self.wait()
        manager, self._manager = self._manager, None
        manager.close()
        self._quiet.close()

    def _open(self):
        if self._manager is None:
            raise CheckpointError(
                "is closed", key=str(self.directory), fix="make a new Checkpointer to save again"
            )
        return self._manager

    def _or_abandon(self, action: Callable[[], Any], saving: str) -> Any:
        """``action()``; when it raises (a save that failed, now or in the background), abandon the
        manager and raise one :class:`CheckpointError` naming the newest complete step."""
        try:
            return action()
        except Exception as err:  # orbax, the file system
            cause = root_cause(err)
        manager, self._manager = self._manager, None
        abandon_manager(manager)
        self._quiet.close()
        raise CheckpointError(
            f"saving {saving} failed ({cause}); {_newest_complete(self.directory)}",
            key=str(self.directory),
            fix="free space or make the directory writable, then resume from the newest complete step",
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _newest_complete(directory: Path) -> str:
    try:
        return f"the newest complete step is {complete_steps(directory)[-1]}, left as it was"
    except CheckpointError:
        return "no step is complete"


def _mesh_shape(params: PyTree) -> dict[str, int] | None:
    for leaf in jax.tree.leaves(params):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return {name: int(size) for name, size in mesh.shape.items()}
    return None
