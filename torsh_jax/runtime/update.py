"""Apply an optax update the same way in every strategy and in the twin.

optax mixes Python floats with int32 counters, which strict dtype promotion
rejects; the update therefore runs under standard promotion whatever mode
the caller's loss function uses. With a loss scaler the gradients are
unscaled first and a step whose gradients are not finite changes nothing but
the scaler (DeepSpeed's skipped step: the schedule does not advance).

Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.adam(0.1)
    >>> params = {"w": jnp.ones(2)}
    >>> new, _ = apply_optimizer(opt, {"w": jnp.ones(2)}, opt.init(params), params)
    >>> [round(float(x), 3) for x in new["w"]]
    [0.9, 0.9]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from torsh_jax.optim.loss_scale import LossScaler, loss_scaler
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.typing import PyTree

__all__ = ["apply_optimizer", "scaler_for", "Update", "guarded_update"]


def apply_optimizer(
    optimizer: optax.GradientTransformation, grads: PyTree, opt_state: PyTree, params: PyTree, **extra
) -> tuple[PyTree, PyTree]:
    """``(new_params, new_opt_state)`` after one optax update."""
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state


def scaler_for(plan: ParallelPlan) -> LossScaler | None:
    """The plan's loss scaler, or ``None`` when the loss is not scaled."""
    spec = plan.precision.loss_scale
    return None if spec.mode == "none" else loss_scaler(spec)


class Update(NamedTuple):
    """The result of :func:`guarded_update`."""

    params: PyTree
    opt_state: PyTree
    loss_scale: PyTree
    metrics: dict

    def advance(self, state, params: PyTree | None = None):
        """``state`` one step on, with these parameters (default: ``self.params``)."""
        return state._replace(
            step=state.step + 1,
            params=self.params if params is None else params,
            opt_state=self.opt_state,
            loss_scale=self.loss_scale,
        )


def guarded_update(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state: PyTree,
    params: PyTree,
    /,
    *,
    scaler: LossScaler | None,
    scale_state: PyTree,
) -> Update:
    """Optimizer update, loss-scale aware.

    Without a scaler this is :func:`apply_optimizer`. With one, ``grads``
    are the gradients of the scaled loss: they are unscaled, checked for
    inf/NaN and the update is kept only when all are finite.
    """
    if scaler is None:
        new_params, new_opt = apply_optimizer(optimizer, grads, opt_state, params)
        return Update(new_params, new_opt, scale_state, {"grad_norm": optax.tree.norm(grads)})
    grads, finite, new_scale = scaler.adjust(grads, scale_state)
    new_params, new_opt = apply_optimizer(optimizer, grads, opt_state, params)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    metrics = {
        "grad_norm": jnp.where(finite, optax.tree.norm(grads), jnp.nan),
        "loss_scale": scale_state.scale,
        "skipped": jnp.logical_not(finite),
    }
    return Update(keep(new_params, params), keep(new_opt, opt_state), new_scale, metrics)
