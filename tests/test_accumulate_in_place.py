"""Accumulating without a pipeline: each layer's gradient is added into the step's sum in place."""

from __future__ import annotations

import collections

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_matches_twin, mlp_model, mlp_params, mlp_step_peak, twin_report

from torsh_jax.demo.model import LMConfig, synthetic_tokens
from torsh_jax.plan import plan_from_dict
from torsh_jax.runtime.accumulate import local_gradients
from torsh_jax.runtime.layered import as_model, layered_loss
from torsh_jax.runtime.precision import cast_tree
from torsh_jax.runtime.sink import accumulate_into, sinks_layers

# layers large beside the embedding and head, as in a real model (4 x 2 x 128 x 512 against 2 x 64 x 128)
HEAVY = LMConfig(vocab=64, d_model=128, heads=2, head_dim=64, mlp=512, layers=4, seq_len=8)


@pytest.mark.parametrize("zero", [0, 1])
def test_accumulated_micro_steps_add_each_layers_gradient_into_the_sum(zero):
    """DDP and ZeRO-1 (reduced once a step) hold one sum of the layers' gradients, not the sum
    and each micro-step's whole gradient: 4 micro-steps peak within a quarter of the layers'
    float32 gradient of one micro-step's peak."""
    plan = lambda acc: plan_from_dict(
        {"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": zero},
         "batch": {"micro_batch_size": 2, "accumulation_steps": acc}}
    )  # fmt: skip
    layers_gradient = HEAVY.layers * 2 * HEAVY.d_model * HEAVY.mlp * 4  # float32
    assert mlp_step_peak(HEAVY, plan(4), 2) - mlp_step_peak(HEAVY, plan(1), 2) < layers_gradient / 4


def _accumulating(zero: int, precision: dict) -> object:
    return plan_from_dict(
        {"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": zero}, "precision": precision,
         "batch": {"micro_batch_size": 2, "accumulation_steps": 2}}
    )  # fmt: skip


def test_bf16_compute_sums_each_layers_gradient_in_float32_within_stated_tolerance():
    """bf16 compute, the sum in float32 (the layers' gradients cast as each is added in place):
    each loss within one bfloat16 spacing of the bf16 single-device twin's (the loss is computed
    in bfloat16: a last-bit difference of the summands moves it by a spacing, at most ``eps``
    relative), gradients within 0.15 of the twin's."""
    report, _ = twin_report(_accumulating(1, {"compute_dtype": "bfloat16"}), steps=4, mlp=True)
    assert_matches_twin(report)  # a bf16 twin is far from float64: too loose alone, hence:
    assert report.max_loss_rel_err <= float(jnp.finfo(jnp.bfloat16).eps)
    assert report.max_grad_rel_err <= 0.15


def _tied(model):
    """The head also reads the embedding table (a tied embedding): one parameter, two readers."""

    def head(p, h, batch):
        logits = h @ p["head"]["w"] + h @ p["embed"]["table"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return model._replace(head=head, head_keys=("head", "embed"))


def _reads_batch(model):
    """Each layer reads the micro-batch it computes on (a mask from the inputs)."""
    layer = model.layer
    mask = lambda b, h: (b["inputs"][..., None] % 3).astype(h.dtype)
    return model._replace(layer=lambda p, h, b: layer(p, h) * mask(b, h), layer_reads_batch=True)


MODELS = {
    "mlp": lambda m: m,
    "remat": lambda m: m._replace(remat=True),
    "tied": _tied,
    "reads-batch-remat": lambda m: _reads_batch(m)._replace(remat=True),
}


@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("variant", sorted(MODELS))
def test_the_in_place_sum_is_the_plain_sum_bit_for_bit(variant, reduce):
    """The same float32 additions in the same order as summing each micro-step's whole gradient
    (bf16 compute, a loss scale, a parameter no part reads): every gradient and the loss equal bit
    for bit."""
    model = MODELS[variant](mlp_model(HEAVY))
    params = {**mlp_params(HEAVY, jax.random.key(0)), "unread": {"x": jnp.ones(3)}}
    params = cast_tree(params, jnp.bfloat16)
    batch = synthetic_tokens(HEAVY, batch_size=8, seed=0)
    options = {"steps": 4, "reduce": reduce, "loss_scale": jnp.float32(64.0)}
    assert sinks_layers(model, params)
    plain = jax.jit(lambda p, b: local_gradients(layered_loss(model), p, b, **options))(params, batch)
    sunk = jax.jit(lambda p, b: accumulate_into(model, p, b, **options))(params, batch)
    chex.assert_trees_all_equal(sunk, plain)


def test_what_the_in_place_sum_does_not_serve_sums_the_plain_way():
    """A plain loss, a head that reads the stacked layers, and parameters in another container
    than a plain ``dict`` take the plain sum."""
    model, params = mlp_model(HEAVY), mlp_params(HEAVY, jax.random.key(0))
    assert sinks_layers(model, params)
    assert not sinks_layers(as_model(layered_loss(model)), params)
    assert not sinks_layers(model._replace(head_keys=("head", "layers")), params)
    assert not sinks_layers(model, collections.OrderedDict(params))
