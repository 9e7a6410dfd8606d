"""build_optimizer: each name against optax or hand-computed PyTorch/DeepSpeed updates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from torsh_jax.errors import PlanError
from torsh_jax.optim import build_optimizer
from torsh_jax.plan import OptimizerSpec, ScheduleSpec

KEY = jax.random.PRNGKey(0)
PARAMS = {"w": jax.random.normal(KEY, (4, 3)), "b": jnp.linspace(-1.0, 1.0, 3)}


def _grads(step: int):
    return jax.tree.map(lambda p: jnp.sin(p * (step + 1)) + 0.1 * step, PARAMS)


def _run(opt, steps=3):
    params, state, outs = PARAMS, opt.init(PARAMS), []
    for step in range(steps):
        updates, state = opt.update(_grads(step), state, params)
        params = optax.apply_updates(params, updates)
        outs.append(params)
    return outs


def _reference(opt, steps=3):
    """optax's own transforms promote int32 counts; run them with standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        return _run(opt, steps)


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_none_is_adamw_default():
    _close(_run(build_optimizer(None)), _reference(optax.adamw(1e-3)))


def test_adamw_matches_optax_adamw():
    spec = OptimizerSpec("adamw", 3e-3, {"b1": 0.8, "b2": 0.99, "eps": 1e-6, "weight_decay": 0.05})
    _close(
        _run(build_optimizer(spec)),
        _reference(optax.adamw(3e-3, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05)),
    )


def test_adam_weight_decay_is_l2_like_torch():
    spec = OptimizerSpec("adam", 1e-3, {"weight_decay": 0.1})
    expected = optax.chain(optax.add_decayed_weights(0.1), optax.adam(1e-3))
    _close(_run(build_optimizer(spec)), _reference(expected))


def test_adam_without_bias_correction_first_step():
    """DeepSpeed FusedAdam bias_correction=False: update = m / (sqrt(v) + eps) with raw moments."""
    spec = OptimizerSpec("adamw", 0.01, {"bias_correction": False, "b1": 0.9, "b2": 0.999, "eps": 1e-8})
    opt = build_optimizer(replace_clip(spec))
    g = _grads(0)
    updates, _ = opt.update(g, opt.init(PARAMS), PARAMS)
    expected = jax.tree.map(lambda x: -0.01 * (0.1 * x) / (jnp.sqrt(0.001 * x * x) + 1e-8), g)
    _close(updates, expected)


def replace_clip(spec: OptimizerSpec) -> OptimizerSpec:
    return OptimizerSpec(spec.name, spec.learning_rate, spec.params, spec.schedule, 0.0)


def test_sgd_matches_optax_sgd_with_nesterov():
    spec = OptimizerSpec("sgd", 0.05, {"momentum": 0.9, "nesterov": True})
    _close(_run(build_optimizer(spec)), _reference(optax.sgd(0.05, momentum=0.9, nesterov=True)))


def test_lamb_trust_ratio_is_clamped():
    """DeepSpeed FusedLamb clamps |w| / |update| into [min_coeff, max_coeff]."""
    big = {"w": jnp.full((3,), 1e4)}
    spec = OptimizerSpec("lamb", 1.0, {"max_coeff": 0.3, "min_coeff": 0.01})
    opt = build_optimizer(spec)
    updates, _ = opt.update({"w": jnp.ones(3)}, opt.init(big), big)
    adam_step = 1.0 / (1.0 + 1e-8)
    np.testing.assert_allclose(np.asarray(updates["w"]), -0.3 * adam_step, rtol=1e-5)


def test_gradient_clipping_uses_global_norm():
    spec = OptimizerSpec("sgd", 1.0, {}, gradient_clipping=1.0)
    opt = build_optimizer(spec)
    updates, _ = opt.update({"w": jnp.array([3.0, 4.0])}, opt.init({"w": jnp.zeros(2)}))
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.6, -0.8], rtol=1e-6)


def test_schedule_drives_learning_rate():
    schedule = ScheduleSpec(
        "warmup_lr",
        {"warmup_min_lr": 0.5, "warmup_max_lr": 1.0, "warmup_num_steps": 2, "warmup_type": "linear"},
    )
    opt = build_optimizer(OptimizerSpec("sgd", 1.0, {}, schedule=schedule))
    state = opt.init({"w": jnp.zeros(1)})
    rates = []
    for _ in range(4):
        updates, state = opt.update({"w": jnp.ones(1)}, state)
        rates.append(-float(updates["w"][0]))
    assert rates == pytest.approx([0.5, 0.5, 0.75, 1.0])


def test_one_cycle_cycles_adam_beta1():
    """OneCycle cycle_momentum drives beta1; update 0 uses cycle_min_mom (DeepSpeed lr_schedules.py)."""
    schedule = ScheduleSpec(
        "one_cycle",
        {
            "cycle_min_lr": 0.1,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 4,
            "cycle_min_mom": 0.5,
            "cycle_max_mom": 0.9,
        },
    )
    opt = build_optimizer(
        OptimizerSpec("adamw", 0.1, {"bias_correction": False, "eps": 0.0}, schedule=schedule)
    )
    updates, _ = opt.update({"w": jnp.ones(1)}, opt.init({"w": jnp.zeros(1)}), {"w": jnp.zeros(1)})
    # m = (1 - 0.5) * 1, v = 0.001 -> update = -0.1 * 0.5 / sqrt(0.001)
    assert float(updates["w"][0]) == pytest.approx(-0.1 * 0.5 / np.sqrt(0.001), rel=1e-5)


@pytest.mark.parametrize("name", ["lion", "adafactor"])
def test_other_names_build_and_step(name):
    opt = build_optimizer(OptimizerSpec(name, 1e-3))
    outs = _run(opt, steps=2)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(outs))
    assert not np.allclose(np.asarray(outs[-1]["w"]), np.asarray(PARAMS["w"]))


def test_unknown_optimizer_raises_plan_error():
    with pytest.raises(PlanError, match="unknown optimizer"):
        build_optimizer(OptimizerSpec("adagrad"))
