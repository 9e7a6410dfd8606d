"""Checkpoints on orbax: asynchronous atomic saves of the whole train state, restored onto any plan.

Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax
    >>> from torsh_jax.plan import ParallelPlan, BatchSpec
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> from torsh_jax.runtime.step import make_train_step
    >>> from torsh_jax.checkpoint import Checkpointer, restore
    >>> plan = ParallelPlan(batch=BatchSpec(micro_batch_size=2))
    >>> params = {"w": jnp.ones((3, 1))}
    >>> train = make_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1), plan,
    ...                         build_mesh(plan, jax.devices()[:1]), params)
    >>> state = train.init(params)
    >>> directory = tempfile.mkdtemp()
    >>> with Checkpointer(directory) as saver:
    ...     saver.save(state, plan=plan, data_position={"batch": 0})
    0
    >>> restore(directory, train).data_position
    {'batch': 0}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Checkpointer": "torsh_jax.checkpoint.save",
    "restore": "torsh_jax.checkpoint.restore_state",
    "continue_plan": "torsh_jax.checkpoint.elastic",
    "Restored": "torsh_jax.checkpoint.restore_state",
    "list_checkpoints": "torsh_jax.checkpoint.describe",
    "show_checkpoint": "torsh_jax.checkpoint.describe",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.checkpoint", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.checkpoint.describe import list_checkpoints, show_checkpoint
    from torsh_jax.checkpoint.elastic import continue_plan
    from torsh_jax.checkpoint.restore_state import Restored, restore
    from torsh_jax.checkpoint.save import Checkpointer
