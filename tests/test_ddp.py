"""DDP on 8 simulated devices against its single-device twin."""

from __future__ import annotations

import chex
import jax
import pytest
from helpers import SMALL, assert_matches_twin, mlp_model, mlp_params, recording_optimizer, twin_report

from torsh_jax.demo.model import synthetic_tokens
from torsh_jax.plan import BatchSpec, CommunicationSpec, ParallelPlan, load_plan
from torsh_jax.runtime.layered import layered_loss
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(load_plan("ddp"), id="ddp"),
        pytest.param(load_plan("ddp_accum"), id="ddp-accum4"),
        pytest.param(ParallelPlan(communication=CommunicationSpec(bucket_mb=0.01)), id="small-buckets"),
        pytest.param(
            ParallelPlan(communication=CommunicationSpec(gradient_predivide_factor=4.0)), id="predivide"
        ),
        pytest.param(ParallelPlan(communication=CommunicationSpec(prescale_gradients=True)), id="prescale"),
    ],
)
def test_ddp_matches_single_device_twin(plan):
    report, train = twin_report(plan, steps=5, mlp=True)  # DDP reduces gradients: any model shows it
    assert train.mesh.shape["data"] == 8
    assert_matches_twin(report)
    assert report.losses[-1] < report.losses[0]  # it trains
    assert train.traces == 1


def test_accumulation_equals_one_big_batch():
    """4 micro-steps of 2 per device = one step on the same 64 examples."""
    accum = ParallelPlan(batch=BatchSpec(micro_batch_size=2, accumulation_steps=4))
    big = ParallelPlan(batch=BatchSpec(micro_batch_size=8, accumulation_steps=1))
    reports = [twin_report(p, steps=3, mlp=True)[0] for p in (accum, big)]
    for report in reports:
        assert_matches_twin(report)
    assert reports[0].twin_losses == reports[1].twin_losses  # one twin: the 64 examples at once


def test_horovod_sum_accumulation_scales_gradients():
    """accumulation_reduce = sum gives accumulation_steps x the mean gradient (Horovod)."""
    summed = ParallelPlan(
        batch=BatchSpec(micro_batch_size=2, accumulation_steps=4, accumulation_reduce="sum")
    )
    report, _ = twin_report(summed, steps=2, mlp=True)
    assert_matches_twin(report)


def test_step_compiles_once_over_ten_steps():
    plan = load_plan("ddp")
    # the loss is traced by the one step trace only
    loss = chex.assert_max_traces(layered_loss(mlp_model(SMALL)), n=1)
    params = mlp_params(SMALL, jax.random.key(1))
    train = make_train_step(loss, recording_optimizer(), plan, build_mesh(plan), params)
    state = train.init(params)
    for i in range(10):
        state, _ = train.step(state, synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=i))
    assert train.traces == 1
    assert int(state.step) == 10
    chex.assert_trees_all_equal_shapes_and_dtypes(state.params, params)
    chex.assert_tree_all_finite(state.params)


def test_a_weakly_typed_parameter_compiles_the_step_once():
    """``jnp.asarray(2.0)`` is weakly typed and the step's new state is not: init stores it strong."""
    import jax.numpy as jnp
    import optax

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] * params["scale"] - batch["y"]) ** 2)

    params = {"w": jnp.ones((4, 2)), "scale": jnp.asarray(2.0)}
    assert params["scale"].weak_type
    plan = load_plan("ddp")
    train = make_train_step(loss, optax.sgd(0.1), plan, build_mesh(plan), params)
    state = train.init(params)
    batch = {"x": jnp.ones((train.global_batch_size, 4)), "y": jnp.zeros((train.global_batch_size, 2))}
    for _ in range(3):
        state, _ = train.step(state, batch)
    assert train.traces == 1
    assert not state.params["scale"].weak_type and state.params["scale"].dtype == jnp.float32
