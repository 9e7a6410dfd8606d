"""Unmodified flax models under ``tensor`` > 1: the compiler partitions the model over ``tensor``
from the parameters' logical names, our data-parallel collectives move one tensor shard each, and
every composition equals its single-device twin."""

from __future__ import annotations

import jax
import optax
import pytest
from conftest import require_devices
from flax import nnx
from flax_models import SEQ, VOCAB, linen_loss, linen_params, nnx_loss, nnx_model
from helpers import assert_matches_twin, shared_twin_runs, twin_plan_key
from jax.sharding import PartitionSpec as P

from torsh_jax import load_plan
from torsh_jax.plan import plan_from_dict
from torsh_jax.runtime.inspect import inspect_step
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import compare_with_twin, record_gradients


def _plan(mesh: dict, zero: int, **extra):
    return plan_from_dict({"mesh": mesh, "zero": {"stage": zero}, "batch": {"micro_batch_size": 2}, **extra})


def _sgd():
    return optax.chain(record_gradients(), optax.sgd(0.05, momentum=0.9))


def _batches(train, steps: int = 5):
    n = train.global_batch_size
    return [jax.random.randint(jax.random.key(i), (n, SEQ), 0, VOCAB) for i in range(steps)]


def _twin(loss, params, plan, optimizer=_sgd, *, lockstep=False):
    """``plan`` against its twin with the optimizer ``optimizer()`` makes; free-running, the twin runs
    are shared by the plans with the same twin (helpers.shared_twin_runs)."""
    train = make_train_step(loss, optimizer(), plan, build_mesh(plan), params)
    batches = _batches(train)
    if lockstep:  # the twin restarts from the parallel program's state: nothing to share
        twin, exact = (make_reference_step(loss, optimizer(), plan, dtype=d) for d in (None, "float64"))
    else:
        key = ("tensor_compiler", loss, optimizer, twin_plan_key(plan))
        twin, exact = shared_twin_runs(key, loss, loss, optimizer, plan, params, batches)
    report = compare_with_twin(tuple(train), twin, params, batches, lockstep=lockstep, exact=exact)
    return report, train


#: every plan's global batch is the presets' 32: one twin run serves them all
LINEN_PLANS = [
    pytest.param(load_plan("fsdp_tp"), id="fsdp4-tp2-zero3"),
    pytest.param(_plan({"data": 1, "fsdp": 2, "tensor": 4}, 3, batch={"micro_batch_size": 16}),
                 id="fsdp2-tp4-zero3"),
    pytest.param(load_plan("hsdp_tp"), id="hsdp-tp-zero3"),
    pytest.param(_plan({"data": 1, "fsdp": 4, "tensor": 2}, 2, batch={"micro_batch_size": 4,
                                                                     "accumulation_steps": 2}),
                 id="zero2-tp-accum"),
    pytest.param(_plan({"data": 2, "fsdp": 2, "tensor": 2}, 1, batch={"micro_batch_size": 8},
                       compression=[{"axis": "data", "gradients": "int8"}],
                       communication={"bucket_mb": 0}), id="zero1-hsdp-tp-int8-data"),
]  # fmt: skip


@pytest.mark.parametrize("plan", LINEN_PLANS)
def test_linen_model_equals_its_twin_with_the_compiler_partitioning_tensor(plan):
    require_devices(8)
    report, train = _twin(linen_loss, linen_params(jax.random.key(0)), plan)
    # int8 gradients: their quantisation error (bounds of tests/test_compressed_step.py), not round-off
    if plan.compression:
        assert report.max_loss_rel_err <= 3e-3, report
        assert report.max_grad_rel_err <= 0.1, report
    else:
        assert_matches_twin(report, params=True)
    assert report.losses[-1] < report.losses[0]
    mlp_in = train.layout.state.params["LinenBlock_0"]["Dense_0"]["kernel"]
    assert "tensor" in mlp_in, mlp_in  # split over tensor by its logical name ("embed", "mlp")


def test_nnx_state_trains_under_fsdp_tp_and_equals_its_twin():
    require_devices(8)
    graphdef, state = nnx.split(nnx_model(), nnx.Param)
    report, train = _twin(nnx_loss(graphdef), state, load_plan("fsdp_tp"))
    assert_matches_twin(report, params=True)
    assert train.layout.state.params["w_in"] == P("fsdp", "tensor")
    assert train.layout.state.params["embed"] == P("tensor", "fsdp")


def test_adam_gradients_equal_the_twin_in_lockstep():
    """Adam amplifies round-off in near-zero gradient elements (docs/strategies.md): compared in lockstep."""
    require_devices(8)
    adam = lambda: optax.chain(record_gradients(), optax.adamw(1e-2))
    report, _ = _twin(linen_loss, linen_params(jax.random.key(0)), load_plan("fsdp_tp"), adam, lockstep=True)
    assert_matches_twin(report)


def test_data_parallel_collectives_move_one_tensor_shard():
    """fsdp bytes equal the ZeRO-3 theory for one tensor shard; the compiler adds tensor collectives."""
    require_devices(8)
    plan = load_plan("fsdp_tp")
    params = linen_params(jax.random.key(0))
    train = make_train_step(linen_loss, optax.adamw(1e-3), plan, build_mesh(plan), params)
    # compiled for the state's shapes and shardings (what the bytes depend on): none initialised
    report = inspect_step(train, train.abstract_state(), _batches(train, 1)[0])
    assert report["shard_param_count"] < report["param_count"]
    assert report["theory"]["wire_ratio"] == pytest.approx(1.0, abs=0.01)
    fsdp = report["totals"]["by_axis"]["fsdp"]["wire_bytes"]
    assert fsdp == pytest.approx(report["theory"]["wire_bytes"], rel=0.01)
    assert report["totals"]["by_axis"]["tensor"]["wire_bytes"] > 0
