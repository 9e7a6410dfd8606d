"""Optax optimizers from an :class:`~torsh_jax.plan.OptimizerSpec`.

Names and the meaning of ``weight_decay`` follow the PyTorch/DeepSpeed
optimizers the plan was translated from:

* ``adam``: Adam with L2 weight decay added to the gradient (``torch.optim.Adam``,
  DeepSpeed ``Adam`` with ``adam_w_mode: false``).
* ``adamw``: Adam with decoupled weight decay (DeepSpeed ``AdamW``, or ``Adam``
  with its default ``adam_w_mode: true``).
* ``lamb``: Adam direction plus decoupled decay, scaled per parameter by the
  trust ratio ``|w| / |update|`` clamped to ``[min_coeff, max_coeff]``
  (DeepSpeed ``FusedLamb``).
* ``sgd``: momentum SGD with L2 weight decay (``torch.optim.SGD``).
* ``lion``, ``adafactor``: optax's own.

``bias_correction: false`` turns Adam's bias correction off. Gradient clipping
(global norm) runs first; the learning rate comes from the spec's schedule.

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.plan import OptimizerSpec
    >>> opt = build_optimizer(OptimizerSpec("sgd", learning_rate=0.1))
    >>> upd, _ = opt.update({"w": jnp.ones(2)}, opt.init({"w": jnp.zeros(2)}))
    >>> upd["w"].tolist()
    [-0.10000000149011612, -0.10000000149011612]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from torsh_jax.errors import PlanError
from torsh_jax.optim.schedules import build_schedule, one_cycle_momentum
from torsh_jax.plan.spec import OptimizerSpec

__all__ = ["build_optimizer", "scale_by_deepspeed_adam", "scale_by_clamped_trust_ratio", "OPTIMIZERS"]

Params = Mapping[str, Any]
Beta = float | Callable[[jax.Array], jax.Array]


class AdamState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


def scale_by_deepspeed_adam(
    b1: Beta = 0.9, b2: float = 0.999, eps: float = 1e-8, *, bias_correction: bool = True
) -> optax.GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` as PyTorch computes it.

    Args:
        b1: first-moment decay, or a schedule ``count -> b1`` (OneCycle momentum).
        b2: second-moment decay.
        eps: added to the square root of the second moment.
        bias_correction: divide the moments by ``1 - b**t`` (``t`` from 1).
    """

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AdamState(jnp.zeros([], jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        beta1 = b1(state.count) if callable(b1) else b1
        mu = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
        t = (state.count + 1).astype(jnp.float32)
        c1 = 1 - beta1**t if bias_correction else 1.0
        c2 = 1 - b2**t if bias_correction else 1.0
        out = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return out, AdamState(state.count + 1, mu, nu)

    return optax.GradientTransformation(init, update)


def scale_by_clamped_trust_ratio(
    min_coeff: float = 0.01, max_coeff: float = 10.0
) -> optax.GradientTransformation:
    """Multiply each update by ``clip(|param| / |update|, min_coeff, max_coeff)`` (1 when a norm is 0)."""

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        if params is None:
            raise PlanError("lamb needs params in update()", key="optimizer.name", fix="pass params=")

        def scale(u, p):
            p_norm, u_norm = jnp.linalg.norm(p.ravel()), jnp.linalg.norm(u.ravel())
            safe = jnp.where(u_norm > 0, u_norm, 1.0)
            ratio = jnp.where((p_norm > 0) & (u_norm > 0), p_norm / safe, 1.0)
            return u * jnp.clip(ratio, min_coeff, max_coeff).astype(u.dtype)

        return jax.tree.map(scale, updates, params), state

    return optax.GradientTransformation(init, update)


def _betas(params: Params) -> tuple[float, float]:
    return float(params.get("b1", 0.9)), float(params.get("b2", 0.999))


def _adam_core(params: Params, b1: Beta) -> optax.GradientTransformation:
    _, b2 = _betas(params)
    eps, bias = float(params.get("eps", 1e-8)), bool(params.get("bias_correction", True))
    return scale_by_deepspeed_adam(b1, b2, eps, bias_correction=bias)


def _decay(params: Params) -> list:
    """Weight decay (needs ``params`` in ``update``), only when it is not zero."""
    rate = float(params.get("weight_decay", 0.0))
    return [optax.add_decayed_weights(rate)] if rate else []


def _adam(params: Params, b1: Beta) -> list:
    return [*_decay(params), _adam_core(params, b1)]


def _adamw(params: Params, b1: Beta) -> list:
    return [_adam_core(params, b1), *_decay(params)]


def _lamb(params: Params, b1: Beta) -> list:
    clamp = scale_by_clamped_trust_ratio(
        float(params.get("min_coeff", 0.01)), float(params.get("max_coeff", 10.0))
    )
    return [*_adamw(params, b1), clamp]


def _sgd(params: Params, b1: Beta) -> list:
    momentum = float(params.get("momentum", 0.0))
    chain = [*_decay(params)]
    if momentum:
        chain.append(optax.trace(decay=momentum, nesterov=bool(params.get("nesterov", False))))
    return chain


def _lion(params: Params, b1: Beta) -> list:
    b1v, b2 = float(params.get("b1", 0.9)), float(params.get("b2", 0.99))
    return [
        optax.scale_by_lion(b1=b1v, b2=b2),
        *_decay(params),
    ]


def _adafactor(params: Params, b1: Beta) -> list:
    return [optax.scale_by_factored_rms(), *_decay(params)]


OPTIMIZERS: dict[str, Callable[[Params, Beta], list]] = {
    "adam": _adam,
    "adamw": _adamw,
    "lamb": _lamb,
    "sgd": _sgd,
    "lion": _lion,
    "adafactor": _adafactor,
}


def _first_beta(spec: OptimizerSpec) -> Beta:
    schedule = spec.schedule
    if schedule is not None and schedule.name == "one_cycle" and schedule.params.get("cycle_momentum", True):
        if spec.name in ("adam", "adamw", "lamb"):
            return one_cycle_momentum(schedule.params)
    return _betas(spec.params)[0]


def build_optimizer(spec: OptimizerSpec | None) -> optax.GradientTransformation:
    """The optax optimizer for ``spec``; ``None`` gives ``optax.adamw(1e-3)``'s update.

    ``None`` is built from the same pieces as every other spec (AdamW, lr 1e-3,
    optax's default weight decay 1e-4), which also runs under strict dtype
    promotion.

    Raises:
        PlanError: unknown optimizer or schedule name.
    """
    if spec is None:
        spec = OptimizerSpec("adamw", 1e-3, {"weight_decay": 1e-4}, gradient_clipping=0.0)
    factory = OPTIMIZERS.get(spec.name)
    if factory is None:
        raise PlanError(
            f"unknown optimizer {spec.name!r}", key="optimizer.name", fix=f"use one of {list(OPTIMIZERS)}"
        )
    schedule = build_schedule(spec.schedule, spec.learning_rate)
    chain = [optax.clip_by_global_norm(spec.gradient_clipping)] if spec.gradient_clipping > 0 else []
    chain += factory(spec.params, _first_beta(spec))
    chain.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*chain)
