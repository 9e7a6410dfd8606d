"""Optimizers, learning-rate schedules and loss scaling (imports JAX and optax).

Example:
    >>> from torsh_jax.optim import build_optimizer
    >>> opt = build_optimizer(None)  # optax.adamw(1e-3)
"""

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

__all__ = [
    "LossScaleState",
    "LossScaler",
    "all_finite",
    "build_optimizer",
    "build_schedule",
    "loss_scaler",
    "one_cycle_momentum",
    "scale_by_clamped_trust_ratio",
    "scale_by_deepspeed_adam",
    "skip_if_nonfinite",
]
