"""Loss scaling with DeepSpeed's rule, as a pure ``(init, scale, adjust)`` triple.

The dynamic rule is DeepSpeed's ``DynamicLossScaler.update_scale`` (source:
DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``), scale factor 2:

* overflow: if ``hysteresis == 1`` or the hysteresis left is 1, the scale is
  halved (never below ``min_loss_scale``); otherwise one unit of hysteresis
  is used up. The overflow iteration is remembered.
* clean step: with ``consecutive_hysteresis`` the hysteresis is refilled.
  The scale doubles (and, without ``consecutive_hysteresis``, the hysteresis
  is refilled) when the number of clean iterations since the last overflow
  is a positive multiple of ``loss_scale_window``. ``rule="current"`` counts
  as DeepSpeed 0.19 does (``iteration - last_overflow - 1``);
  ``rule="legacy"`` as earlier releases did (``iteration - last_overflow``).

DeepSpeed raises when an overflow happens at the minimum scale; a compiled
step cannot raise, so the scale stays at the minimum and the step is skipped.

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.plan import LossScaleSpec
    >>> scaler = loss_scaler(LossScaleSpec(mode="dynamic", initial_scale_power=4, hysteresis=1))
    >>> state = scaler.init()
    >>> grads, finite, state = scaler.adjust({"w": jnp.array([jnp.inf])}, state)
    >>> bool(finite), float(state.scale)
    (False, 8.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from torsh_jax.plan.spec import LossScaleSpec
from torsh_jax.typing import PyTree

__all__ = ["LossScaleState", "LossScaler", "loss_scaler", "all_finite", "skip_if_nonfinite"]


class LossScaleState(NamedTuple):
    """Scaler state (a pytree of scalars).

    Attributes:
        scale: current loss scale (float32).
        iteration: DeepSpeed's ``cur_iter``: steps seen so far (int32).
        last_overflow: DeepSpeed's ``last_overflow_iter`` (int32, -1 at start).
        hysteresis_left: DeepSpeed's ``cur_hysteresis`` (int32).
    """

    scale: jax.Array
    iteration: jax.Array
    last_overflow: jax.Array
    hysteresis_left: jax.Array


class LossScaler(NamedTuple):
    """``init() -> state``; ``scale(loss, state)``; ``adjust(grads, state) -> (grads, finite, state)``."""

    init: Callable[[], LossScaleState]
    scale: Callable[[jax.Array, LossScaleState], jax.Array]
    adjust: Callable[[PyTree, LossScaleState], tuple[PyTree, jax.Array, LossScaleState]]


def all_finite(tree: PyTree) -> jax.Array:
    """True when every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _initial_scale(spec: LossScaleSpec) -> float:
    if spec.mode == "dynamic":
        return float(2.0**spec.initial_scale_power)
    if spec.mode == "static":
        return float(spec.static_scale)
    return 1.0


def _next_dynamic(spec: LossScaleSpec, state: LossScaleState, finite: jax.Array, rule: str) -> LossScaleState:
    scale, it, last, hyst = state
    shrink = (spec.hysteresis == 1) | (hyst == 1)
    over_scale = jnp.where(shrink, jnp.maximum(scale / 2.0, spec.min_loss_scale), scale)
    over_hyst = jnp.where(shrink, hyst, hyst - 1)
    clean = it - last - (1 if rule == "current" else 0)
    grow = (clean > 0) & (clean % spec.loss_scale_window == 0)
    refill = jnp.asarray(spec.consecutive_hysteresis) | grow
    ok_scale = jnp.where(grow, scale * 2.0, scale)
    ok_hyst = jnp.where(refill, spec.hysteresis, hyst)
    return LossScaleState(
        scale=jnp.where(finite, ok_scale, over_scale).astype(jnp.float32),
        iteration=it + 1,
        last_overflow=jnp.where(finite, last, it),
        hysteresis_left=jnp.where(finite, ok_hyst, over_hyst).astype(jnp.int32),
    )


def loss_scaler(spec: LossScaleSpec, *, rule: Literal["current", "legacy"] = "current") -> LossScaler:
    """A loss scaler for ``spec`` (``none``: scale 1; ``static``; ``dynamic``).

    Args:
        spec: the plan's loss-scale settings.
        rule: window counting of DeepSpeed 0.19 (``current``) or of earlier
            releases (``legacy``); see the module docstring.

    Returns:
        A :class:`LossScaler`. ``adjust`` divides the gradients by the scale,
        checks them for inf/NaN and advances the state; all three functions jit.
    """

    def init() -> LossScaleState:
        return LossScaleState(
            scale=jnp.asarray(_initial_scale(spec), jnp.float32),
            iteration=jnp.asarray(0, jnp.int32),
            last_overflow=jnp.asarray(-1, jnp.int32),
            hysteresis_left=jnp.asarray(spec.hysteresis, jnp.int32),
        )

    def scale(loss: jax.Array, state: LossScaleState) -> jax.Array:
        return loss * state.scale.astype(loss.dtype)

    def adjust(grads: PyTree, state: LossScaleState) -> tuple[PyTree, jax.Array, LossScaleState]:
        finite = all_finite(grads)
        inverse = 1.0 / state.scale
        unscaled = jax.tree.map(lambda g: (g.astype(jnp.float32) * inverse).astype(g.dtype), grads)
        if spec.mode == "dynamic":
            new_state = _next_dynamic(spec, state, finite, rule)
        else:
            new_state = state._replace(iteration=state.iteration + 1)
        return unscaled, finite, new_state

    return LossScaler(init=init, scale=scale, adjust=adjust)


def skip_if_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that a non-finite step changes nothing.

    ``update(updates, state, params=None, *, all_finite, **extra)``: when
    ``all_finite`` is false the updates are zeros and the *unchanged* inner
    state is returned, so step counters (and the learning-rate schedule) do
    not advance, as DeepSpeed does not step its scheduler on overflow.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = skip_if_nonfinite(optax.sgd(0.1))
        >>> state = opt.init({"w": jnp.zeros(2)})
        >>> upd, _ = opt.update({"w": jnp.ones(2)}, state, all_finite=jnp.asarray(False))
        >>> upd["w"].tolist()
        [0.0, 0.0]
    """
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return inner.init(params)

    def update(updates, state, params=None, *, all_finite, **extra):
        new_updates, new_state = inner.update(updates, state, params, **extra)
        keep = jnp.asarray(all_finite)
        new_updates = jax.tree.map(lambda u: jnp.where(keep, u, jnp.zeros_like(u)), new_updates)
        new_state = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new_state, state)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init, update)
