"""Apply an optax update the same way in every strategy and in the twin.

optax mixes Python floats with int32 counters, which strict dtype promotion
rejects; the update therefore runs under standard promotion whatever mode
the caller's loss function uses.

Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.adam(0.1)
    >>> params = {"w": jnp.ones(2)}
    >>> new, _ = apply_optimizer(opt, {"w": jnp.ones(2)}, opt.init(params), params)
    >>> [round(float(x), 3) for x in new["w"]]
    [0.9, 0.9]
"""

from __future__ import annotations

from typing import Any

import jax
import optax

__all__ = ["apply_optimizer"]

PyTree = Any


def apply_optimizer(
    optimizer: optax.GradientTransformation, grads: PyTree, opt_state: PyTree, params: PyTree, **extra
) -> tuple[PyTree, PyTree]:
    """``(new_params, new_opt_state)`` after one optax update."""
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state
