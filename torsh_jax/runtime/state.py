"""The train state: a pytree that jits, shards and checkpoints as one value.

Example:
    >>> import jax.numpy as jnp
    >>> state = TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)}, opt_state=())
    >>> int(state.step), state.loss_scale is None
    (0, True)
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from torsh_jax.typing import PyTree

__all__ = ["TrainState"]


class TrainState(NamedTuple):
    """Everything a train step reads and writes.

    Args:
        step: optimizer steps taken (int32 scalar).
        params: master parameters (plan's ``param_dtype``).
        opt_state: optax state.
        loss_scale: dynamic loss-scaler state, when the plan scales the loss.
        feedback: compression error-feedback residuals, when the plan compresses.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    loss_scale: PyTree = None
    feedback: PyTree = None
