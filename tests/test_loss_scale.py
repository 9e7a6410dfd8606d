"""The loss scaler against DeepSpeed's DynamicLossScaler on scripted overflow sequences.

Reference rule: DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py``,
``DynamicLossScaler.update_scale`` (scale factor 2; hysteresis; window counted
as ``cur_iter - last_overflow_iter - 1`` in the pinned release and
``cur_iter - last_overflow_iter`` in earlier ones).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from torsh_jax.optim import build_schedule, loss_scaler, skip_if_nonfinite
from torsh_jax.plan import LossScaleSpec, ScheduleSpec


class ReferenceScaler:
    """Plain-Python DeepSpeed dynamic loss scaler (no exception at the minimum)."""

    def __init__(self, spec: LossScaleSpec, legacy: bool = False):
        self.scale = 2.0**spec.initial_scale_power
        self.it, self.last, self.hyst = 0, -1, spec.hysteresis
        self.spec, self.legacy = spec, legacy

    def update(self, overflow: bool) -> None:
        s = self.spec
        if overflow:
            if s.hysteresis == 1 or self.hyst == 1:
                self.scale = max(self.scale / 2, s.min_loss_scale)
            else:
                self.hyst -= 1
            self.last = self.it
        else:
            if s.consecutive_hysteresis:
                self.hyst = s.hysteresis
            clean = self.it - self.last - (0 if self.legacy else 1)
            if clean > 0 and clean % s.loss_scale_window == 0:
                if not s.consecutive_hysteresis:
                    self.hyst = s.hysteresis
                self.scale *= 2
        self.it += 1


SEQUENCE = (
    [False] * 5
    + [True]
    + [False] * 9
    + [True, True, True]
    + [False] * 12
    + [True, False, True]
    + [False] * 20
)

SPECS = {
    "hysteresis2": LossScaleSpec(mode="dynamic", initial_scale_power=8, loss_scale_window=4, hysteresis=2),
    "hysteresis1": LossScaleSpec(
        mode="dynamic", initial_scale_power=3, loss_scale_window=3, hysteresis=1, min_loss_scale=2.0
    ),
    "consecutive": LossScaleSpec(
        mode="dynamic", initial_scale_power=6, loss_scale_window=5, hysteresis=3, consecutive_hysteresis=True
    ),
}


def _grads(overflow: bool, scale: float):
    value = jnp.inf if overflow else 2.0 * scale
    return {"w": jnp.full((3,), value, jnp.float32), "b": jnp.ones((2,), jnp.bfloat16)}


@pytest.mark.parametrize("rule", ["current", "legacy"])
@pytest.mark.parametrize("name", list(SPECS))
def test_dynamic_scaler_follows_deepspeed_rule(name, rule):
    """DeepSpeed loss_scaler.py DynamicLossScaler.update_scale on a scripted overflow sequence."""
    spec = SPECS[name]
    scaler = loss_scaler(spec, rule=rule)
    adjust = jax.jit(scaler.adjust)
    state = scaler.init()
    ref = ReferenceScaler(spec, legacy=rule == "legacy")
    for step, overflow in enumerate(SEQUENCE):
        assert float(state.scale) == ref.scale, (step, overflow)
        grads, finite, state = adjust(_grads(overflow, float(state.scale)), state)
        ref.update(overflow)
        assert bool(finite) is (not overflow)
        assert int(state.hysteresis_left) == ref.hyst, step
        if not overflow:
            assert grads["w"].tolist() == [2.0, 2.0, 2.0]
            assert grads["b"].dtype == jnp.bfloat16
    assert float(state.scale) == ref.scale


def test_window_rules_differ_by_one_step():
    """Pinned release doubles after window + 1 clean iterations from the start; earlier ones after window."""
    spec = LossScaleSpec(mode="dynamic", initial_scale_power=2, loss_scale_window=3)
    scales = {}
    for rule in ("current", "legacy"):
        scaler, state = loss_scaler(spec, rule=rule), None
        state = scaler.init()
        seen = []
        for _ in range(5):
            _, _, state = scaler.adjust({"w": jnp.ones(2)}, state)
            seen.append(float(state.scale))
        scales[rule] = seen
    assert scales["legacy"] == [4.0, 4.0, 8.0, 8.0, 8.0]
    assert scales["current"] == [4.0, 4.0, 4.0, 8.0, 8.0]


def test_static_and_none_scalers():
    static = loss_scaler(LossScaleSpec(mode="static", static_scale=128.0))
    state = static.init()
    assert float(static.scale(jnp.float32(2.0), state)) == 256.0
    grads, finite, state = static.adjust({"w": jnp.array([256.0, jnp.nan])}, state)
    assert not bool(finite) and float(state.scale) == 128.0
    none = loss_scaler(LossScaleSpec())
    grads, finite, _ = none.adjust({"w": jnp.array([3.0])}, none.init())
    assert bool(finite) and grads["w"].tolist() == [3.0]


def test_skipped_steps_do_not_advance_schedule_or_moments():
    """DeepSpeed engine: on overflow the step is skipped and lr_scheduler.step() is not called."""
    params = {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 1, "lr_range_test_step_rate": 1.0}
    schedule = build_schedule(ScheduleSpec("lr_range_test", params), 0.1)  # 0.1 * (1 + k) at update k
    opt = skip_if_nonfinite(optax.chain(optax.trace(decay=0.5), optax.scale_by_learning_rate(schedule)))
    state = opt.init({"w": jnp.zeros(2)})
    update = jax.jit(opt.update)
    applied = []
    for finite in (True, False, False, True, True):
        grads = {"w": jnp.full(2, 1.0 if finite else jnp.nan)}
        updates, state = update(grads, state, all_finite=jnp.asarray(finite))
        if finite:
            applied.append(-float(updates["w"][0]))
        else:
            assert updates["w"].tolist() == [0.0, 0.0]
    # momentum trace 1, 1.5, 1.75 (skipped steps leave it alone); rates 0.1, 0.2, 0.3.
    assert applied == pytest.approx([0.1 * 1.0, 0.2 * 1.5, 0.3 * 1.75])
