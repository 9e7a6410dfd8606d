"""What make_train_step and its step refuse before compiling: a mesh that is not the plan's, a
``tensor`` axis that splits no parameter, a state of another plan, optimizer or model, a loss
that is not a scalar. Each is one typed line naming what was passed, what was expected and the fix."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import require_devices
from helpers import assert_matches_twin
from jax.sharding import AxisType

from torsh_jax import tensor
from torsh_jax.errors import ArgumentError, MeshError, NotSupportedYetError, ShardingError
from torsh_jax.plan import load_plan, plan_from_dict
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import compare_with_twin, record_gradients


def _mse(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


PARAMS = {"w": jnp.zeros((8, 1))}


def _head_mse(params, batch):
    return jnp.mean((batch["x"] @ params["head"] - batch["y"]) ** 2)


#: a parameter the default ``param_dims`` split over ``tensor`` (named ``embed``, ``vocab``)
HEAD = {"head": jnp.zeros((8, 2))}


def _batch(train, seed: int = 0):
    x = jax.random.normal(jax.random.key(seed), (train.global_batch_size, 8))
    return {"x": x, "y": x[:, :1] * 2.0}


def _train(name: str, optimizer=None, loss=_mse, params=PARAMS):
    plan = load_plan(name)
    return make_train_step(loss, optimizer or optax.sgd(0.1), plan, build_mesh(plan), params)


# --- the mesh is the plan's -------------------------------------------------------------------


def test_a_mesh_built_from_another_plan_is_refused_with_both_shapes():
    require_devices(8)
    with pytest.raises(MeshError) as info:  # trained as "DDP over data=4 x tensor=2" before
        make_train_step(_mse, optax.sgd(0.1), load_plan("zero3"), build_mesh(load_plan("tp")), PARAMS)
    message = str(info.value)
    assert "builds data=1, stage=1, fsdp=8, tensor=1 on 8 devices" in message
    assert "the mesh is data=4, stage=1, fsdp=1, tensor=2" in message
    assert info.value.key == "mesh" and "build_mesh(plan" in info.value.fix
    assert "\n" not in message


def test_meshes_the_plan_builds_are_accepted():
    """Any slice count the plan accepts (a -1 cross-slice size), and a mesh built by hand with
    the plan's axes and sizes in another order."""
    devices = require_devices(8)
    hsdp_any_slices = plan_from_dict(
        {"mesh": {"data": {"ici": 1, "dcn": -1}, "fsdp": -1}, "zero": {"stage": 3}}
    )
    for slices in (1, 2, 4):
        mesh = build_mesh(hsdp_any_slices, num_slices=slices)
        assert make_train_step(_head_mse, optax.sgd(0.1), hsdp_any_slices, mesh, HEAD).mesh is mesh
    for name in ("ddp_2slice", "hsdp", "hsdp_tp", "zero3"):
        make_train_step(_head_mse, optax.sgd(0.1), load_plan(name), build_mesh(load_plan(name)), HEAD)
    by_hand = jax.make_mesh(
        (2, 1, 1, 4), ("tensor", "stage", "fsdp", "data"), axis_types=(AxisType.Auto,) * 4, devices=devices
    )
    train = make_train_step(_head_mse, optax.sgd(0.1), load_plan("tp"), by_hand, HEAD)
    assert train.mesh is by_hand


def test_a_mesh_without_the_plan_axes_is_refused():
    require_devices(8)
    data_only = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with pytest.raises(MeshError, match="builds data=8, stage=1, fsdp=1, tensor=1 on 8 devices"):
        make_train_step(_mse, optax.sgd(0.1), load_plan("ddp"), data_only, PARAMS)


# --- tensor > 1 splits something ------------------------------------------------------------


class _Unnamed(nn.Module):
    """A flax model as written without partitioning names (no default param_dims match)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, use_bias=False)(nn.tanh(nn.Dense(16)(x)))


def _unnamed_loss(params, batch):
    return jnp.mean((_Unnamed().apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def _unnamed_params():
    return _Unnamed().init(jax.random.key(0), jnp.zeros((1, 8)))["params"]


def test_sequence_parallelism_on_a_model_the_compiler_partitions_is_one_error():
    """Its activations between blocks would stay whole: refused, where it used to run without."""
    require_devices(8)
    with pytest.raises(NotSupportedYetError) as info:
        _train("tp_sp", loss=_unnamed_loss, params=_unnamed_params())
    assert info.value.key == "tensor.sequence_parallel" and "\n" not in str(info.value)
    assert "tensor.sequence_parallel = false" in info.value.fix


@pytest.mark.parametrize("name", ["tp", "fsdp_tp", "hsdp_tp"])
def test_a_tensor_axis_that_splits_no_parameter_is_refused_before_compiling(name):
    """Every parameter would be replicated over tensor, each tensor device repeating the work."""
    require_devices(8)
    with pytest.raises(ShardingError) as info:
        _train(name, loss=_unnamed_loss, params=_unnamed_params())
    message = str(info.value)
    assert "split none of the 3 parameters (Dense_0/kernel, Dense_1/bias, Dense_1/kernel)" in message
    assert "over tensor=2" in message and "\n" not in message
    assert "logical names" in info.value.fix and "param_dims" in info.value.fix
    assert "mesh.tensor = 1" in info.value.fix and "tensor.allow_replicated = true" in info.value.fix


def test_allow_replicated_runs_the_unnamed_model_and_equals_its_twin():
    require_devices(8)
    plan = plan_from_dict(
        {
            "mesh": {"data": -1, "tensor": 2},
            "tensor": {"allow_replicated": True},
            "batch": {"micro_batch_size": 2},
        }
    )
    optimizer = optax.chain(record_gradients(), optax.sgd(0.1))
    params = _unnamed_params()
    train = make_train_step(_unnamed_loss, optimizer, plan, build_mesh(plan), params)
    twin, exact = (make_reference_step(_unnamed_loss, optimizer, plan, dtype=d) for d in (None, "float64"))
    batches = [_batch(train, i) for i in range(3)]
    report = compare_with_twin(tuple(train), twin, params, batches, exact=exact)
    assert_matches_twin(report, params=True)
    assert report.losses[-1] < report.losses[0]
    assert train.traces == 1


def test_tensor_blocks_on_whole_weights_are_refused_even_when_replicated_is_allowed():
    """Blocks sum partial results over tensor: on whole weights each term would count twice."""
    require_devices(8)
    plan = load_plan("tp").replace(tensor=load_plan("tp").tensor.__class__(allow_replicated=True))

    @tensor.uses_tensor_blocks
    def loss(p, b):
        return jnp.mean(tensor.mlp(b["x"][:, None, :], p["a"], p["b"], tp=tensor.tensor_axis(plan)) ** 2)

    with pytest.raises(ShardingError, match=r"split none of the 2 parameters \(a, b\)") as info:
        make_train_step(
            loss, optax.sgd(0.1), plan, build_mesh(plan), {"a": jnp.ones((8, 4)), "b": jnp.ones((4, 8))}
        )
    assert "allow_replicated" not in info.value.fix


# --- the state and the loss the step is called with -------------------------------------------


def test_a_state_of_another_plan_names_the_leaf_and_both_layouts():
    require_devices(8)
    zero3, ddp = _train("zero3", optax.adam(1e-2)), _train("ddp", optax.adam(1e-2))
    ddp.init(PARAMS)
    with pytest.raises(ArgumentError) as info:
        ddp.step(zero3.init(PARAMS), _batch(ddp))
    assert info.value.key == "state.params['w']"
    assert "P('fsdp', None) over mesh data=1, stage=1, fsdp=8" in info.value.message
    assert "P(None, None) over mesh data=8" in info.value.message and "another plan" in info.value.message


def test_a_state_of_another_optimizer_names_both_optimizer_states():
    require_devices(8)
    adam, sgd = _train("ddp", optax.adam(1e-2)), _train("ddp", optax.sgd(0.1))
    state = sgd.init(PARAMS)
    with pytest.raises(ArgumentError) as info:
        sgd.step(adam.init(PARAMS), _batch(sgd))
    assert info.value.key == "state.opt_state"
    assert "is (ScaleByAdamState, EmptyState), this step's is (EmptyState, EmptyState)" in info.value.message
    sgd.step(state, _batch(sgd))  # the right state still runs, compiled once
    assert sgd.traces == 1


def test_a_state_of_another_model_is_refused_without_a_second_compile():
    require_devices(8)
    train = _train("ddp")
    state, _ = train.step(train.init(PARAMS), _batch(train))
    narrow = {"w": jnp.zeros((4, 1))}
    other = _train("ddp", params=narrow).init(narrow)
    with pytest.raises(ArgumentError, match=r"is float32\[4, 1\], this step's is float32\[8, 1\]") as info:
        train.step(other, _batch(train))
    assert info.value.key == "state.params['w']"
    train.step(state, _batch(train, 1))
    assert train.traces == 1


def test_something_that_is_not_a_state_is_refused():
    train = _train("ddp")
    with pytest.raises(ArgumentError, match="the state is a dict, not a TrainState"):
        train.step(PARAMS, _batch(train))


def test_a_loss_that_is_not_a_scalar_names_its_shape():
    require_devices(8)
    train = _train("ddp", loss=lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2)
    state = train.init(PARAMS)
    with pytest.raises(ArgumentError) as info:
        train.step(state, _batch(train))
    assert info.value.key == "loss_fn"
    assert "returned an array float32[8, 1]" in info.value.message and "scalar" in info.value.message
    assert "jnp.mean" in info.value.fix
