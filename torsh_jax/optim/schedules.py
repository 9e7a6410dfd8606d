"""Learning-rate schedules with DeepSpeed's semantics, as optax schedules.

A schedule maps ``count`` (optimizer updates applied so far) to the learning
rate of the next update. DeepSpeed sets the rate when the scheduler is built
(``last_batch_iteration = -1``) and calls ``scheduler.step()`` after every
applied update, so update ``k`` uses the rate for ``last_batch_iteration + k``
(source: DeepSpeed ``deepspeed/runtime/lr_schedules.py``). Steps skipped on
fp16 overflow do not step the scheduler; wrap the optimizer in
:func:`torsh_jax.optim.skip_if_nonfinite` to get the same behaviour.

Example:
    >>> from torsh_jax.plan import ScheduleSpec
    >>> from torsh_jax.optim.schedules import build_schedule
    >>> spec = ScheduleSpec("warmup_lr", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
    ...                                   "warmup_num_steps": 10, "warmup_type": "linear"})
    >>> [round(float(build_schedule(spec, 1e-3)(k)), 6) for k in (0, 1, 5, 20)]
    [0.0, 0.0, 0.0004, 0.001]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import optax

from torsh_jax.errors import PlanError
from torsh_jax.plan.spec import ScheduleSpec

__all__ = ["build_schedule", "one_cycle_momentum", "SCHEDULES"]

Params = Mapping[str, Any]
Curve = Callable[[jnp.ndarray], jnp.ndarray]


def _warmup_gamma(it: jnp.ndarray, num_steps: int, warmup_type: str) -> jnp.ndarray:
    """Warm-up fraction at iteration ``it`` (< ``num_steps``)."""
    if warmup_type == "linear":
        return it / num_steps
    return jnp.log(jnp.maximum(it, 0.0) + 1.0) / math.log(num_steps)


def _warmup_steps(params: Params) -> int:
    return max(2, int(params.get("warmup_num_steps", 1000)))


def _warmup_type(params: Params) -> str:
    kind = params.get("warmup_type", "log")
    return kind if kind in ("log", "linear") else "log"


def _warmup_lr(params: Params, base_lr: float) -> Curve:
    low = float(params.get("warmup_min_lr", 0.0))
    high = float(params.get("warmup_max_lr", base_lr))
    steps, kind = _warmup_steps(params), _warmup_type(params)

    def curve(it):
        gamma = jnp.where(it < steps, _warmup_gamma(it, steps, kind), 1.0)
        return jnp.where(it < 0, low, low + (high - low) * gamma)

    return curve


def _warmup_decay_lr(params: Params, base_lr: float) -> Curve:
    low = float(params.get("warmup_min_lr", 0.0))
    high = float(params.get("warmup_max_lr", 0.001))
    total = int(params["total_num_steps"])
    steps, kind = _warmup_steps(params), _warmup_type(params)

    def curve(it):
        decay = jnp.maximum(0.0, (total - it) / max(1.0, float(total - steps)))
        gamma = jnp.where(it < steps, _warmup_gamma(it, steps, kind), decay)
        return jnp.where(it < 0, low, low + (high - low) * gamma)

    return curve


def _warmup_cosine_lr(params: Params, base_lr: float) -> Curve:
    total = int(params["total_num_steps"])
    min_ratio = float(params.get("warmup_min_ratio", 0.0))
    cos_min = float(params.get("cos_min_ratio", 0.0001))
    steps, kind = _warmup_steps(params), _warmup_type(params)
    span = max(1, total - steps)

    def curve(it):
        warm = min_ratio + _warmup_gamma(it, steps, kind) * (1.0 - min_ratio)
        progress = jnp.minimum(1.0, (it - steps + 1) / span)
        cosine = jnp.maximum(0.0, cos_min + (1.0 - cos_min) * (1 + jnp.cos(jnp.pi * progress)) / 2)
        ratio = jnp.where(it < steps, warm, cosine)
        return base_lr * jnp.where(it < 0, 0.0, ratio)

    return curve


def _cycle_shape(params: Params) -> tuple[float, float, int, int]:
    first = float(params.get("cycle_first_step_size", 2000))
    second = params.get("cycle_second_step_size")
    second = first if second is None or second == -1 else float(second)
    first_stairs = int(params.get("cycle_first_stair_count", 0))
    second_stairs = params.get("cycle_second_stair_count")
    second_stairs = first_stairs if second_stairs is None else int(second_stairs)
    return first, second, max(first_stairs, 0), max(second_stairs, 0)


def _floor_mul_div(a: jnp.ndarray, num: int, den: int) -> jnp.ndarray:
    """``floor(a * num / den)`` in int32 for ``a >= 0`` and static positive ``num``, ``den``.

    Split as ``a = k * den + r`` so that no product exceeds the result or
    ``den**2``: exact while the reduced ``den`` is at most 46,340.
    """
    g = math.gcd(num, den)
    num, den = num // g, den // g
    whole, part = divmod(num, den)
    k, r = a // den, a % den
    rest = (r * part) // den if den <= 46_340 else jnp.floor(r * (part / den)).astype(jnp.int32)
    return k * num + r * whole + rest


def _stair_index(batch: jnp.ndarray, params: Params) -> jnp.ndarray | None:
    """The stair OneCycle is on, counted in integers; ``None`` for fractional step sizes."""
    first, second, first_stairs, second_stairs = _cycle_shape(params)
    if not (first.is_integer() and second.is_integer()):
        return None
    first, second = int(first), int(second)
    b = jnp.round(batch).astype(jnp.int32)
    offset = jnp.mod(b, first + second)
    up = _floor_mul_div(offset, max(first_stairs, 1), first)
    down = _floor_mul_div(first + second - offset, max(second_stairs, 1), second)
    return jnp.where(offset <= first, up, down)


def _cycle_scale(it: jnp.ndarray, params: Params) -> jnp.ndarray:
    """OneCycle's ``_get_scale_factor`` (stair counts quantise from the batch offset).

    The stair index is an integer division, as in DeepSpeed's float64
    ``math.floor``: a float32 ratio would round across stair edges.
    """
    first, second, first_stairs, second_stairs = _cycle_shape(params)
    total = first + second
    ratio = first / total
    batch = it + 1.0
    x = 1.0 + batch / total - jnp.floor(1.0 + batch / total)
    rising = x <= ratio
    scale = jnp.where(rising, x / ratio, (x - 1) / (ratio - 1))
    stairs = jnp.where(rising, first_stairs, second_stairs)
    index = _stair_index(batch, params)
    if index is None:
        offset = jnp.mod(batch, total)
        index = jnp.floor(jnp.where(offset <= first, offset / first, (total - offset) / second) * stairs)
    stepped = index / jnp.maximum(stairs, 1)
    return jnp.where(stairs > 0, stepped, scale)


def _one_cycle(params: Params, base_lr: float) -> Curve:
    low = float(params.get("cycle_min_lr", 0.01))
    high = float(params.get("cycle_max_lr", 0.1))
    rate = float(params.get("decay_lr_rate", 0.0))
    decay_size = float(params.get("decay_step_size", 0))
    first, second, _, _ = _cycle_shape(params)
    total = first + second
    skip_decay = math.isclose(decay_size, 0) or math.isclose(rate, 0)

    def curve(it):
        cycle = low + (high - low) * _cycle_scale(it, params)
        if skip_decay:
            decay = jnp.asarray(low, jnp.float32)
        else:
            decay = low / (1 + rate * (it - total + 1) / decay_size)
        return jnp.where(it < total, cycle, decay)

    return curve


def one_cycle_momentum(params: Params) -> optax.Schedule:
    """OneCycle's first Adam beta at each update (``cycle_momentum``).

    DeepSpeed sets beta1 to ``cycle_min_mom`` when the scheduler is built and
    to ``get_mom()`` after each step (source: DeepSpeed
    ``deepspeed/runtime/lr_schedules.py``, ``OneCycle``).
    """
    low = float(params.get("cycle_min_mom", 0.8))
    high = float(params.get("cycle_max_mom", 0.9))
    rate = float(params.get("decay_mom_rate", 0.0))
    decay_size = float(params.get("decay_step_size", 0))
    first, second, _, _ = _cycle_shape(params)
    total = first + second
    start = int(params.get("last_batch_iteration", -1))
    skip_decay = math.isclose(decay_size, 0) or math.isclose(rate, 0)

    def schedule(count):
        it = jnp.asarray(count, jnp.float32) + start
        cycle = high - (high - low) * _cycle_scale(it, params)
        decay = high if skip_decay else high * (1 + rate * (it - total + 1) / decay_size)
        value = jnp.where(it < total, cycle, decay)
        return jnp.where((count == 0) & (start == -1), low, value)

    return schedule


def _lr_range_test(params: Params, base_lr: float) -> Curve:
    low = float(params.get("lr_range_test_min_lr", 1e-3))
    size = float(params.get("lr_range_test_step_size", 2000))
    rate = float(params.get("lr_range_test_step_rate", 1.0))
    staircase = bool(params.get("lr_range_test_staircase", False))

    def curve(it):
        interval = (it + 1) / size
        interval = jnp.floor(interval) if staircase else interval
        return low * (1 + rate * interval)

    return curve


def _neox_cosine(params: Params, base_lr: float) -> Curve:
    """Linear warm-up, then cosine decay to ``min_lr`` (gpt-neox ``lr_decay_style = cosine``)."""
    warmup = int(params.get("warmup_steps", 0))
    decay = max(1, int(params.get("decay_steps", 1)) - warmup)
    low = float(params.get("min_lr", 0.0))

    def curve(it):
        done = it + 1  # gpt-neox counts iterations from 1 after the first step
        warm = base_lr * done / max(warmup, 1)
        progress = jnp.clip((done - warmup) / decay, 0.0, 1.0)
        cosine = low + (base_lr - low) / 2 * (jnp.cos(jnp.pi * progress) + 1)
        return jnp.where((warmup > 0) & (done <= warmup), warm, cosine)

    return curve


SCHEDULES: dict[str, Callable[[Params, float], Curve]] = {
    "warmup_lr": _warmup_lr,
    "warmup_decay_lr": _warmup_decay_lr,
    "warmup_cosine_lr": _warmup_cosine_lr,
    "one_cycle": _one_cycle,
    "lr_range_test": _lr_range_test,
    "cosine": _neox_cosine,
}


def build_schedule(spec: ScheduleSpec | None, base_lr: float) -> optax.Schedule:
    """The optax schedule for ``spec`` (``None`` or ``constant``: ``base_lr``).

    Args:
        spec: schedule name and DeepSpeed-named parameters.
        base_lr: the optimizer's learning rate (used by ``warmup_cosine_lr``,
            and by ``warmup_lr`` when ``warmup_max_lr`` is absent).

    Returns:
        ``count -> learning rate``; ``count`` is the number of applied updates.

    Raises:
        PlanError: unknown schedule name or a missing required parameter.
    """
    if spec is None or spec.name == "constant":
        return optax.constant_schedule(base_lr)
    factory = SCHEDULES.get(spec.name)
    if factory is None:
        raise PlanError(
            f"unknown schedule {spec.name!r}",
            key="optimizer.schedule.name",
            fix=f"use one of {['constant', *SCHEDULES]}",
        )
    try:
        curve = factory(spec.params, base_lr)
    except KeyError as err:
        raise PlanError(
            f"missing parameter {err.args[0]!r}",
            key="optimizer.schedule.params",
            fix=f"add {err.args[0]!r} under optimizer.schedule.params",
        ) from None
    start = int(spec.params.get("last_batch_iteration", -1))

    def schedule(count):
        it = jnp.asarray(count, jnp.float32) + start
        value = curve(it)
        if start != -1:  # resumed: DeepSpeed leaves the optimizer's rate for the first update
            value = jnp.where(count == 0, base_lr, value)
        return jnp.asarray(value, jnp.float32)

    return schedule
