"""Mesh building and parameter shardings on 8 simulated devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import require_devices
from helpers import SMALL, assert_matches_twin
from jax.sharding import PartitionSpec as P

from torsh_jax.demo.model import init_params, loss_fn, synthetic_tokens
from torsh_jax.errors import MeshError, PlanError, ShardingError
from torsh_jax.plan import AxisSize, MeshSpec, ParallelPlan, load_plan, plan_from_dict
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.specs import logical_dims, param_specs
from torsh_jax.runtime.step import make_train_step


def test_single_slice_mesh_axes_and_types():
    mesh = build_mesh(
        ParallelPlan(mesh=MeshSpec(data=AxisSize(ici=2), fsdp=AxisSize(ici=4))), require_devices(8)
    )
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 4, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_simulated_two_slice_mesh_keeps_slices_contiguous():
    mesh = build_mesh(load_plan("ddp_2slice"), require_devices(8))
    ids = [[d.id for d in row.flat] for row in mesh.devices.reshape(2, 4)]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_wrong_device_count_lists_factorisations():
    plan = plan_from_dict({"mesh": {"data": 3}})
    with pytest.raises(MeshError) as err:
        build_mesh(plan, require_devices(8))
    assert "data=8" in str(err.value)


def test_tensor_rules_and_divisibility():
    plan = ParallelPlan(mesh=MeshSpec(data=AxisSize(ici=4), tensor=AxisSize(ici=2)))
    mesh = build_mesh(plan, require_devices(8))
    specs = param_specs(init_params(SMALL, jax.random.key(0)), plan, mesh)
    assert specs["layers"]["wq"] == P(None, None, "tensor", None)
    assert specs["layers"]["w_out"] == P(None, "tensor", None)
    assert specs["layers"]["attn_norm"] == P(None, None)
    bad = {"layers": {"wq": jnp.zeros((2, 32, 3, 16))}}
    with pytest.raises(ShardingError) as err:
        param_specs(bad, plan, mesh)
    message = str(err.value)
    assert "layers/wq" in message and "(2, 32, 3, 16)" in message and "tensor=2" in message


def test_param_dims_rank_mismatch_names_the_path():
    with pytest.raises(ShardingError, match="layers/wq"):
        logical_dims("layers/wq", jnp.zeros((3, 4)), ParallelPlan())


def test_indivisible_batch_names_the_leaf():
    plan = load_plan("ddp")
    params = init_params(SMALL, jax.random.key(0))
    train = make_train_step(
        loss_fn(SMALL), optax.sgd(0.1), plan, build_mesh(plan, require_devices(8)), params
    )
    state = train.init(params)
    with pytest.raises(ShardingError) as err:
        train.step(state, synthetic_tokens(SMALL, batch_size=60, seed=0))
    assert "batch/" in str(err.value) and "64" in str(err.value)


def test_a_pipeline_over_a_plain_loss_is_refused_with_the_fix():
    plan = plan_from_dict({"mesh": {"data": 4, "stage": 2}})
    shapes = jax.eval_shape(lambda: init_params(SMALL, jax.random.key(0)))
    with pytest.raises(PlanError, match="needs a LayeredModel") as info:
        make_train_step(loss_fn(SMALL), optax.sgd(0.1), plan, build_mesh(plan, require_devices(8)), shapes)
    assert info.value.key == "loss_fn" and "mesh.stage = 1" in info.value.fix


def _linen_params():
    import flax.linen as nn

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            w_in = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            w_out = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
            h = jnp.tanh(x @ self.param("w_in", w_in, (16, 32)))
            return h @ self.param("w_out", w_out, (32, 16))

    return Mlp(), Mlp().init(jax.random.key(0), jnp.ones((1, 16)))["params"]


def _nnx_params():
    """The ``nnx.State`` of one layer whose weight is named ``("embed", "mlp")``."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((16, 32)), out_sharding=("embed", "mlp"), eager_sharding=False)

    return nnx.state(Layer(), nnx.Param)


def test_flax_linen_and_nnx_metadata_give_specs():
    plan = ParallelPlan(mesh=MeshSpec(data=AxisSize(ici=4), tensor=AxisSize(ici=2)))
    mesh = build_mesh(plan, require_devices(8))
    _, boxed = _linen_params()
    assert param_specs(boxed, plan, mesh) == {"w_in": P(None, "tensor"), "w_out": P("tensor", None)}

    state = _nnx_params()
    assert param_specs(state, plan, mesh)["w"] == P(None, "tensor")


def test_an_nnx_state_unboxes_to_its_pure_dict_with_no_deprecation_warning():
    """flax 0.12 deprecates ``nnx.State``'s own methods (``State.to_pure_dict`` warns); the runtime
    takes a user's ``nnx.State`` through ``nnx.to_pure_dict``, so training one warns nothing."""
    import warnings

    from torsh_jax.runtime.params import unbox

    state = _nnx_params()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        plain, rules = unbox(state)
    assert jax.tree.map(jnp.shape, plain) == {"w": (16, 32)} and rules


def test_flax_metadata_drives_zero3_of_unboxed_params():
    """Annotations carried over with param_dims_from_metadata shard the unboxed parameters."""
    import flax.linen as nn

    from torsh_jax.runtime.fsdp import shard_dims
    from torsh_jax.runtime.specs import param_dims_from_metadata

    model, boxed = _linen_params()
    plan = plan_from_dict({"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": 3}})
    plan = plan.replace(param_dims=param_dims_from_metadata(boxed) + plan.param_dims)
    params = nn.unbox(boxed)
    mesh = build_mesh(plan, require_devices(8))
    assert shard_dims(params, plan, mesh) == {"w_in": 1, "w_out": 0}

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    from torsh_jax.runtime.twin import make_reference_step
    from torsh_jax.runtime.verify import compare_with_twin, record_gradients

    optimizer = optax.chain(record_gradients(), optax.sgd(0.1))
    train = make_train_step(loss, optimizer, plan, mesh, params)
    x = jax.random.normal(jax.random.key(1), (train.global_batch_size, 16))
    batches = [{"x": x, "y": jnp.sin(x)}] * 3
    twin, exact = (make_reference_step(loss, optimizer, plan, dtype=d) for d in (None, "float64"))
    report = compare_with_twin(tuple(train), twin, params, batches, exact=exact)
    assert_matches_twin(report, params=True)
