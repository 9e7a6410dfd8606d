"""Which comparison the 1e-5 twin guarantee covers, on a model that strains it.

A 3-layer tanh MLP with two saturated units: their bias gradients are ~1e-7 of the
largest gradient. Adam normalises each element by its own magnitude, so across steps
it amplifies one-ulp differences of reduction order in those elements (free-running,
the parameters drift apart by ~1e-4 after three steps with ``ddp_accum``), while every
single step, compared from the same state (lockstep), stays within 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from torsh_jax import load_plan
from torsh_jax.plan import plan_from_dict
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import compare_with_twin, record_gradients

WIDTH, DEPTH, GLOBAL_BATCH = 16, 3, 128


def saturated_mlp(key: jax.Array) -> dict:
    keys = jax.random.split(key, DEPTH)
    params = {
        f"l{i}": {"w": jax.random.normal(keys[i], (WIDTH, WIDTH)) / 4, "b": jnp.zeros(WIDTH)}
        for i in range(DEPTH)
    }
    params["l0"]["b"] = params["l0"]["b"].at[0].set(9.0)  # tanh'(9) ~ 6e-8
    params["l1"]["b"] = params["l1"]["b"].at[3].set(-8.5)
    return params


def mlp_loss(params: dict, batch: dict) -> jax.Array:
    h = batch["x"]
    for i in range(DEPTH):
        h = jnp.tanh(h @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def batches(steps: int) -> list[dict]:
    xs = [jax.random.normal(jax.random.key(s), (GLOBAL_BATCH, WIDTH)) for s in range(steps)]
    return [{"x": x, "y": jnp.tanh(x[:, ::-1])} for x in xs]


def run(plan: ParallelPlan, optimizer, *, lockstep: bool):
    opt = optax.chain(record_gradients(), optimizer)
    parallel = make_train_step(mlp_loss, opt, plan, build_mesh(plan))
    twin = make_reference_step(mlp_loss, opt, plan)
    return compare_with_twin(
        tuple(parallel), twin, saturated_mlp(jax.random.key(0)), batches(4), lockstep=lockstep
    )


ACCUM_PLANS = [
    pytest.param(load_plan("ddp_accum"), id="ddp-accum4"),
    pytest.param(
        plan_from_dict(
            {
                "mesh": {"data": 1, "fsdp": -1},
                "zero": {"stage": 2},
                "batch": {"micro_batch_size": 4, "accumulation_steps": 4},
            }
        ),
        id="zero2-accum4",
    ),
]


@pytest.mark.parametrize("plan", ACCUM_PLANS)
def test_lockstep_adam_steps_equal_the_twin(plan):
    report = run(plan, optax.adamw(1e-2), lockstep=True)
    assert report.max_loss_rel_err <= 1e-5
    assert report.max_grad_rel_err <= 1e-5
    assert report.max_param_rel_err <= 1e-5


def test_free_running_sgd_equals_the_twin():
    report = run(load_plan("ddp_accum"), optax.sgd(1e-2), lockstep=False)
    assert report.max_loss_rel_err <= 1e-5
    assert report.max_grad_rel_err <= 1e-5
    assert report.max_param_rel_err <= 1e-5


def test_free_running_adam_keeps_losses_and_gradients_within_bound():
    """Free-running, the guarantee is on losses and gradients; Adam's parameters may drift
    (measured 2.9e-4 here) where an element's gradient is within round-off of zero."""
    report = run(load_plan("ddp_accum"), optax.adamw(1e-2), lockstep=False)
    assert report.max_loss_rel_err <= 1e-5
    assert report.max_grad_rel_err <= 1e-5
