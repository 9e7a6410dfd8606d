"""Parameter trees as users bring them: leaves that do not split evenly, flax boxes, integer and
bfloat16 leaves."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import require_devices
from flax import nnx
from helpers import assert_matches_twin, recording_optimizer

from torsh_jax.errors import ParameterError, PrecisionWarning, ShardingError
from torsh_jax.plan import load_plan
from torsh_jax.runtime.inspect import inspect_step
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import compare_with_twin


def _tiny_loss(params: dict, batch: jax.Array) -> jax.Array:
    h = jnp.tanh(batch @ params["w"])
    return jnp.mean((h[:, :3] * params["b"]) ** 2) + jnp.mean(h**2)


def _tiny_batches(n: int, size: int) -> list[jax.Array]:
    return [jax.random.normal(jax.random.key(i), (size, 8)) for i in range(n)]


def _twin_report(train, loss, params, batches):
    """``train`` (built with :func:`recording_optimizer`) against its twin and the twin in float64."""
    twin = make_reference_step(loss, recording_optimizer(), train.plan)
    exact = make_reference_step(loss, recording_optimizer(), train.plan, dtype="float64")
    return compare_with_twin(tuple(train), twin, params, batches, exact=exact)


def test_hsdp_int8_with_a_replicated_leaf_stays_close_to_the_twin():
    """``b`` (3,) divides no fsdp size: it stays replicated while ``w`` is sharded and compressed."""
    require_devices(8)
    plan = load_plan("hsdp_int8")
    params = {"w": jax.random.normal(jax.random.key(1), (8, 4)), "b": jnp.ones(3)}
    train = make_train_step(_tiny_loss, recording_optimizer(), plan, build_mesh(plan), params)
    twin = make_reference_step(_tiny_loss, recording_optimizer(), plan)
    report = compare_with_twin(tuple(train), twin, params, _tiny_batches(4, train.global_batch_size))
    assert train.layout.dims == {"w": 0, "b": None}
    assert report.max_grad_rel_err <= 0.1, report
    assert report.max_loss_rel_err <= 3e-3, report


def _norm_model() -> LayeredModel:
    def layer(p, h):
        return jnp.tanh(h @ p["w"]) * (1.0 + p["ln"][:16])

    return LayeredModel(
        embed=lambda p, batch: batch @ p["embed"]["w"],
        layer=layer,
        head=lambda p, h, batch: jnp.mean((h @ p["head"]["w"]) ** 2),
        embed_keys=("embed",),
        head_keys=("head",),
    )


def _norm_loss(params, batch):
    h = batch @ params["embed"]["w"]
    for i in range(params["layers"]["w"].shape[0]):
        h = _norm_model().layer(jax.tree.map(lambda x, i=i: x[i], params["layers"]), h)
    return jnp.mean((h @ params["head"]["w"]) ** 2)


@pytest.mark.parametrize("preset", ["zero3", "hsdp"])
def test_stacked_leaf_divisible_only_on_the_layer_dim_stays_replicated(preset):
    """8 layers and ``layers/ln`` (8, 53): the layer dim is never the ZeRO dim, so ``ln`` is replicated."""
    require_devices(8)
    plan = load_plan(preset)
    keys = iter(jax.random.split(jax.random.key(2), 4))
    params = {
        "embed": {"w": jax.random.normal(next(keys), (8, 16)) * 0.3},
        "layers": {"w": jax.random.normal(next(keys), (8, 16, 16)) * 0.3, "ln": jnp.zeros((8, 53))},
        "head": {"w": jax.random.normal(next(keys), (16, 8)) * 0.3},
    }
    train = make_train_step(_norm_model(), recording_optimizer(), plan, build_mesh(plan), params)
    report = _twin_report(train, _norm_loss, params, _tiny_batches(3, train.global_batch_size))
    assert train.layout.dims["layers"]["ln"] is None
    assert train.layout.dims["layers"]["w"] in (1, 2)
    assert_matches_twin(report)


class _Boxed(nn.Module):
    """A linen MLP whose kernels carry logical axis names (boxed by ``model.init``)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("layers", "mlp")))(x)
        return nn.Dense(1, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(jnp.tanh(h))


def _boxed_loss(params, batch):
    return jnp.mean((_Boxed().apply(params, jnp.tile(batch, (1, 2))) - 1.0) ** 2)


def test_boxed_linen_parameters_train_and_keep_their_logical_names():
    """``model.init`` output (LogicallyPartitioned boxes) goes straight to ``init`` and equals the
    twin; the kernel (16, 8) named (layers, mlp) is sharded on dim 1: a ``layers`` dim never is."""
    require_devices(8)
    plan = load_plan("zero3")
    boxed = _Boxed().init(jax.random.key(0), jnp.ones((1, 16)))
    assert isinstance(boxed["params"]["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    train = make_train_step(_boxed_loss, recording_optimizer(), plan, build_mesh(plan), boxed)
    report = _twin_report(train, _boxed_loss, boxed, _tiny_batches(3, train.global_batch_size))
    assert_matches_twin(report)
    assert train.layout.dims["params"]["Dense_0"]["kernel"] == 1


def test_rules_that_split_a_parameter_over_a_batch_axis_name_the_parameter():
    require_devices(8)
    plan = load_plan("zero3").replace(rules=(("mlp", ("fsdp",)),))
    boxed = _Boxed().init(jax.random.key(0), jnp.ones((1, 16)))
    with pytest.raises(ShardingError, match=r"params/Dense_0/kernel.*batch axis 'fsdp'.*Fix: map"):
        make_train_step(_boxed_loss, optax.sgd(0.1), plan, build_mesh(plan), boxed)


def test_nnx_state_is_accepted_and_returned_as_a_plain_dict():
    require_devices(8)
    graphdef, state = nnx.split(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), nnx.Param)

    def loss(params, batch):
        model_state = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(model_state, params)
        return jnp.mean(nnx.merge(graphdef, model_state)(batch) ** 2)

    plan = load_plan("ddp")
    train = make_train_step(loss, recording_optimizer(), plan, build_mesh(plan), state)
    report = _twin_report(train, loss, state, _tiny_batches(3, train.global_batch_size))
    assert_matches_twin(report)
    assert set(train.init(state).params) == {"kernel", "bias"}


def test_integer_leaf_is_refused_with_its_path():
    plan = load_plan("ddp")
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(3), "tables": {"index": jnp.arange(3)}}
    with pytest.raises(ParameterError, match=r"tables/index.*int32.*only floating"):
        make_train_step(_tiny_loss, optax.sgd(0.1), plan, build_mesh(plan), params)


def test_bfloat16_parameter_cast_is_warned_once_and_noted_in_inspect():
    require_devices(8)
    plan = load_plan("ddp")
    params = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.ones(3)}
    with pytest.warns(PrecisionWarning, match=r"w: bfloat16 is kept as float32"):
        train = make_train_step(_tiny_loss, optax.sgd(0.1), plan, build_mesh(plan), params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = train.init(params)  # once per step object
    assert state.params["w"].dtype == jnp.float32
    batch = _tiny_batches(1, train.global_batch_size)[0]
    assert inspect_step(train, state, batch)["notes"] == [
        "w: bfloat16 is kept as float32 (precision.param_dtype)"
    ]
