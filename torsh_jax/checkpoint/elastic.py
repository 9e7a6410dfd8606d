"""The plan that continues a checkpoint on the devices present now, with the same global batch.

After a restart on fewer processes (``launch --min-processes``) the plan's
mesh is resolved for the devices left and :func:`restore` reshards the state
onto it; this module keeps the step's data the same by carrying the saved
global batch over (more accumulation steps on fewer ranks).

Example:
    >>> import tempfile, jax, jax.numpy as jnp
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.runtime.state import TrainState
    >>> from torsh_jax.checkpoint import Checkpointer
    >>> directory = tempfile.mkdtemp()
    >>> state = TrainState(step=jnp.int32(5), params={"w": jnp.ones(2)}, opt_state=())
    >>> with Checkpointer(directory) as saver:
    ...     saver.save(state, plan=load_plan("ddp"))  # micro batch 8, saved from 1 device
    5
    >>> continue_plan(directory, load_plan("ddp"), num_devices=1).batch.micro_batch_size
    8
"""

from __future__ import annotations

import logging
from pathlib import Path

from torsh_jax.checkpoint.restore_state import newest_meta, read_meta
from torsh_jax.checkpoint.store import complete_steps, open_manager, require_dir
from torsh_jax.plan.elastic import global_batch_size, keep_global_batch
from torsh_jax.plan.io import plan_from_toml
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.mesh import resolve_mesh

__all__ = ["continue_plan", "saved_global_batch"]

log = logging.getLogger(__name__)


def saved_global_batch(directory: str | Path, *, step: int | None = None) -> int:
    """The global batch of the run that saved ``step`` (default: the newest complete step whose
    ``meta`` reads, the step a restore with ``fallback`` starts from)."""
    root = require_dir(directory)
    steps = complete_steps(root, step)
    manager = open_manager(root, read_only=True)
    try:
        meta = newest_meta(manager, steps)[1] if step is None else read_meta(manager, step)
    finally:
        manager.close()
    saved_plan = plan_from_toml(meta["plan"], source=f"{root}: saved plan")
    return global_batch_size(saved_plan, meta.get("mesh") or {})


def continue_plan(
    directory: str | Path,
    plan: ParallelPlan,
    *,
    num_devices: int,
    num_slices: int | None = None,
    step: int | None = None,
) -> ParallelPlan:
    """``plan`` with its batch split so that, on ``num_devices``, the global batch is the saved one.

    Raises:
        CheckpointError: no directory or no complete step.
        PlanError: the saved global batch does not split over the new data-parallel ranks.
    """
    global_batch = saved_global_batch(directory, step=step)
    shape = resolve_mesh(plan, num_devices, num_slices=num_slices).shape
    continued = keep_global_batch(plan, global_batch, shape)
    if continued.batch != plan.batch:
        b = continued.batch
        log.info(
            "continuing a global batch of %d on %d devices: micro batch %d x %d accumulation steps",
            global_batch, num_devices, b.micro_batch_size, b.accumulation_steps,
        )  # fmt: skip
    return continued
