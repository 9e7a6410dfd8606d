"""Optimizers, learning-rate schedules and loss scaling.

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.optim import build_schedule
    >>> float(build_schedule(None, 1e-3)(0))
    0.001
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LossScaler": "torsh_jax.optim.loss_scale",
    "LossScaleState": "torsh_jax.optim.loss_scale",
    "all_finite": "torsh_jax.optim.loss_scale",
    "loss_scaler": "torsh_jax.optim.loss_scale",
    "skip_if_nonfinite": "torsh_jax.optim.loss_scale",
    "build_optimizer": "torsh_jax.optim.optimizers",
    "scale_by_clamped_trust_ratio": "torsh_jax.optim.optimizers",
    "scale_by_deepspeed_adam": "torsh_jax.optim.optimizers",
    "build_schedule": "torsh_jax.optim.schedules",
    "one_cycle_momentum": "torsh_jax.optim.schedules",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.optim", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.optim.loss_scale import (
        LossScaler,
        LossScaleState,
        all_finite,
        loss_scaler,
        skip_if_nonfinite,
    )
    from torsh_jax.optim.optimizers import (
        build_optimizer,
        scale_by_clamped_trust_ratio,
        scale_by_deepspeed_adam,
    )
    from torsh_jax.optim.schedules import build_schedule, one_cycle_momentum
