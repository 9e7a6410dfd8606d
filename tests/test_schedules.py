"""Learning rates of the DeepSpeed schedules at updates 0, 1, 2, 10, 100 and 1000.

Expected values come from a plain-Python model of DeepSpeed's schedulers
(source: DeepSpeed ``deepspeed/runtime/lr_schedules.py``: ``WarmupLR``,
``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``): the
scheduler sets the rate at construction (``last_batch_iteration = -1``) and
``step()`` runs after every applied update, so update ``k`` uses the rate for
iteration ``k - 1``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from torsh_jax.optim import build_schedule
from torsh_jax.optim.schedules import one_cycle_momentum
from torsh_jax.plan import ScheduleSpec

UPDATES = (0, 1, 2, 10, 100, 1000)


def _gamma_warmup(it, steps, kind):
    steps = max(2, steps)
    if kind == "linear":
        return it / steps
    return math.log(it + 1) / math.log(steps)


def ref_warmup_lr(it, p, base_lr):
    low, high = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", base_lr)
    steps = max(2, p.get("warmup_num_steps", 1000))
    if it < 0:
        return low
    gamma = _gamma_warmup(it, steps, p.get("warmup_type", "log")) if it < steps else 1.0
    return low + (high - low) * gamma


def ref_warmup_decay_lr(it, p, base_lr):
    low, high = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", 0.001)
    steps, total = max(2, p.get("warmup_num_steps", 1000)), p["total_num_steps"]
    if it < 0:
        return low
    if it < steps:
        gamma = _gamma_warmup(it, steps, p.get("warmup_type", "log"))
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - steps))
    return low + (high - low) * gamma


def ref_warmup_cosine_lr(it, p, base_lr):
    if it < 0:
        return 0.0
    steps, total = max(2, p.get("warmup_num_steps", 1000)), p["total_num_steps"]
    min_ratio, cos_min = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 0.0001)
    if it < steps:
        ratio = min_ratio + _gamma_warmup(it, steps, p.get("warmup_type", "log")) * (1 - min_ratio)
    else:
        progress = min(1.0, (it - steps + 1) / max(1, total - steps))
        ratio = max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)
    return base_lr * ratio


def _one_cycle_scale(it, p):
    first = float(p.get("cycle_first_step_size", 2000))
    second = float(p.get("cycle_second_step_size") or first)
    s1 = p.get("cycle_first_stair_count", 0)
    s2 = p.get("cycle_second_stair_count", s1)
    total = first + second
    batch = it + 1
    cycle = math.floor(1 + batch / total)
    x = 1.0 + batch / total - cycle
    ratio = first / total
    if x <= ratio:
        scale, stairs = x / ratio, s1
    else:
        scale, stairs = (x - 1) / (ratio - 1), s2
    if stairs > 0:
        offset = batch % total
        pos = offset * stairs / first if offset <= first else (total - offset) * stairs / second
        scale = math.floor(pos) / stairs
    return scale, total


def ref_one_cycle(it, p, base_lr):
    low, high = p["cycle_min_lr"], p["cycle_max_lr"]
    scale, total = _one_cycle_scale(it, p)
    if it < total:
        return low + (high - low) * scale
    rate, size = p.get("decay_lr_rate", 0.0), p.get("decay_step_size", 0)
    if rate == 0 or size == 0:
        return low
    return low / (1 + rate * (it - total + 1) / size)


def ref_lr_range_test(it, p, base_lr):
    interval = (it + 1) / p["lr_range_test_step_size"]
    if p.get("lr_range_test_staircase", False):
        interval = math.floor(interval)
    return p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * interval)


CASES = [
    ("warmup_lr", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}, ref_warmup_lr),
    (
        "warmup_lr",
        {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 50, "warmup_type": "linear"},
        ref_warmup_lr,
    ),
    ("warmup_lr", {"warmup_min_lr": 0.0, "warmup_num_steps": 1}, ref_warmup_lr),
    (
        "warmup_decay_lr",
        {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "total_num_steps": 500},
        ref_warmup_decay_lr,
    ),
    (
        "warmup_decay_lr",
        {"warmup_max_lr": 2e-3, "warmup_num_steps": 100, "total_num_steps": 2000, "warmup_type": "linear"},
        ref_warmup_decay_lr,
    ),
    (
        "warmup_cosine_lr",
        {"total_num_steps": 800, "warmup_num_steps": 20, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01},
        ref_warmup_cosine_lr,
    ),
    (
        "warmup_cosine_lr",
        {"total_num_steps": 50, "warmup_num_steps": 5, "warmup_type": "linear"},
        ref_warmup_cosine_lr,
    ),
    (
        "one_cycle",
        {
            "cycle_min_lr": 0.004,
            "cycle_max_lr": 0.015,
            "cycle_first_step_size": 1000,
            "cycle_second_step_size": 100,
            "cycle_first_stair_count": 100,
            "cycle_second_stair_count": 100,
            "decay_step_size": 1000,
            "decay_lr_rate": 0.01,
        },
        ref_one_cycle,
    ),
    (
        "one_cycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 40,
            "cycle_second_step_size": 60,
            "decay_step_size": 10,
            "decay_lr_rate": 0.5,
        },
        ref_one_cycle,
    ),
    ("one_cycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 8}, ref_one_cycle),
    (
        "lr_range_test",
        {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10, "lr_range_test_step_rate": 0.5},
        ref_lr_range_test,
    ),
    (
        "lr_range_test",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 7,
            "lr_range_test_step_rate": 2.0,
            "lr_range_test_staircase": True,
        },
        ref_lr_range_test,
    ),
]


def _ids():
    return [f"{name}-{i}" for i, (name, _, _) in enumerate(CASES)]


@pytest.mark.parametrize(("name", "params", "reference"), CASES, ids=_ids())
def test_schedule_matches_deepspeed_at_every_listed_update(name, params, reference):
    """DeepSpeed lr_schedules.py: update k uses the rate for last_batch_iteration = k - 1."""
    base_lr = 3e-4
    schedule = jax.jit(build_schedule(ScheduleSpec(name, params), base_lr))
    for k in UPDATES:
        expected = reference(k - 1, params, base_lr)
        got = float(schedule(k))
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-12), (name, k)


def test_resumed_schedule_uses_optimizer_rate_first_then_offsets():
    """DeepSpeed WarmupLR with last_batch_iteration >= 0 leaves the optimizer's rate for the first update."""
    params = {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 100,
        "last_batch_iteration": 49,
    }
    schedule = build_schedule(ScheduleSpec("warmup_lr", params), 5e-4)
    assert float(schedule(0)) == pytest.approx(5e-4)
    for k in (1, 2, 10, 100):
        assert float(schedule(k)) == pytest.approx(ref_warmup_lr(49 + k, params, 5e-4), rel=1e-5)


def test_one_cycle_momentum_follows_deepspeed():
    """DeepSpeed OneCycle sets beta1 = cycle_min_mom at construction, then max - (max - min) * scale."""
    params = {
        "cycle_min_lr": 1e-4,
        "cycle_max_lr": 1e-3,
        "cycle_first_step_size": 10,
        "cycle_min_mom": 0.85,
        "cycle_max_mom": 0.95,
    }
    momentum = one_cycle_momentum(params)
    assert float(momentum(0)) == pytest.approx(0.85)
    for k in (1, 2, 10, 15):
        scale, _ = _one_cycle_scale(k - 1, params)
        assert float(momentum(k)) == pytest.approx(0.95 - 0.1 * scale, rel=1e-5)


def test_constant_and_unknown_schedule():
    assert float(build_schedule(None, 0.1)(123)) == pytest.approx(0.1)
    from torsh_jax.errors import PlanError

    with pytest.raises(PlanError, match="unknown schedule"):
        build_schedule(ScheduleSpec("triangle", {}), 0.1)


def test_one_cycle_stairs_are_exact_under_jit_at_every_update():
    """The QANet OneCycle config (1000 + 100 steps, 100 stairs each): under jit every update from 0 to
    2,300 equals DeepSpeed's float64 rule, including just after the stair edges (update 1001: 0.01489)."""
    params = {
        "cycle_min_lr": 0.004, "cycle_max_lr": 0.015, "cycle_first_step_size": 1000,
        "cycle_second_step_size": 100, "cycle_first_stair_count": 100, "cycle_second_stair_count": 100,
        "decay_step_size": 1000, "decay_lr_rate": 0.01,
    }  # fmt: skip
    schedule = jax.jit(jax.vmap(build_schedule(ScheduleSpec("one_cycle", params), 1e-3)))
    got = schedule(jnp.arange(2301))
    expected = [ref_one_cycle(k - 1, params, 1e-3) for k in range(2301)]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)
    assert float(got[1001]) == pytest.approx(0.01489, abs=5e-6)
    momentum = jax.jit(jax.vmap(one_cycle_momentum({**params, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99})))
    scales = [_one_cycle_scale(k - 1, params)[0] for k in range(1, 1101)]
    np.testing.assert_allclose(
        np.asarray(momentum(jnp.arange(1, 1101))), 0.99 - 0.14 * np.asarray(scales), rtol=1e-6
    )
