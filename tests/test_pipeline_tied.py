"""A tied embedding (the head reads the token table too) against its single-device twin under every
pipeline schedule, the axes the pipeline presets add (ZeRO-2, ZeRO-3 with both gathers, tensor in
``3d``) and without a pipeline; its layers hold leaves of different shapes ([layers, d, f] next to
[layers, f]), which the interleaved schedule stores in chunks. A head reading the stacked layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_matches_twin, mlp_params, shared_twin_runs, twin_plan_key
from test_pipeline import PIPE, momentum, pipeline_plan, zero_pipeline

from torsh_jax import LayeredModel, NotSupportedYetError, load_plan
from torsh_jax import tensor as tp_blocks
from torsh_jax.demo.model import LMConfig, synthetic_tokens
from torsh_jax.runtime.layered import layered_loss
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.verify import compare_with_twin
from torsh_jax.tensor import TensorAxis, tensor_axis

TIED_KEYS = ("head", "embed")  # the head reads its bias and the token table


def tied_mlp() -> LayeredModel:
    """Token table -> residual ``tanh`` MLP layers with a bias -> logits ``h @ table.T + bias``."""
    return LayeredModel(
        embed=lambda p, batch: p["embed"]["table"][batch["inputs"]],
        layer=lambda p, h: h + jnp.tanh(h @ p["w_in"] + p["b_in"]) @ p["w_out"],
        head=lambda p, h, batch: optax.softmax_cross_entropy_with_integer_labels(
            h @ p["embed"]["table"].T + p["head"]["bias"], batch["targets"]
        ).mean(),
        head_keys=TIED_KEYS,
    )


def tied_mlp_params(cfg: LMConfig, key: jax.Array) -> dict:
    """:func:`helpers.mlp_params` without the head matrix; a head bias and a layer bias ``[layers, mlp]``."""
    params = mlp_params(cfg, key)
    k_bias, k_b_in = jax.random.split(jax.random.fold_in(key, 1))
    layers = {**params["layers"], "b_in": 0.1 * jax.random.normal(k_b_in, (cfg.layers, cfg.mlp))}
    head = {"bias": 0.1 * jax.random.normal(k_bias, (cfg.vocab,))}
    return {"embed": params["embed"], "layers": layers, "head": head}


def tied_tensor_mlp(tp: TensorAxis) -> LayeredModel:
    """:func:`tied_mlp` from the tensor blocks: the table's vocabulary rows, the MLP features split
    over ``tensor`` (named so the default rules split them); the head's logits are this device's rows
    of the table (``column(h, table[V_t, D].T)``), so each shard's gradient has both uses."""

    def head(p, h, batch):
        logits = tp_blocks.column(h * p["head"]["scale"], p["embed"]["embedding"].T, tp=tp)
        return tp_blocks.cross_entropy(logits, batch["targets"], tp=tp)

    return LayeredModel(
        embed=lambda p, batch: tp_blocks.embed(batch["inputs"], p["embed"]["embedding"], tp=tp),
        layer=lambda p, h: h + tp_blocks.mlp(h, p["w_in"], p["w_out"], activation=jnp.tanh, tp=tp),
        head=head,
        head_keys=TIED_KEYS,
        tensor_blocks=True,
    )


def tied_tensor_mlp_params(cfg: LMConfig, key: jax.Array) -> dict:
    params = mlp_params(cfg, key)
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (cfg.d_model,))
    embed = {"embedding": params["embed"]["table"]}
    return {"embed": embed, "layers": params["layers"], "head": {"scale": scale}}


def tied_twin_report(plan, *, model: LayeredModel | None = None, steps: int = 3):
    """``model`` (default: the tied MLP, from the tensor blocks when ``plan`` has a tensor axis; 4
    layers) on ``plan`` and on one device (the twin runs shared by the plans with the same twin)."""
    mesh = build_mesh(plan)
    cfg = PIPE  # 4 layers
    if mesh.shape.get("tensor", 1) > 1:
        tp = tensor_axis(plan)
        model, params, name = (
            tied_tensor_mlp(tp),
            tied_tensor_mlp_params(cfg, jax.random.key(0)),
            ("tensor", tp),
        )
    else:
        name = "plain" if model is None else model
        model, params = model or tied_mlp(), tied_mlp_params(cfg, jax.random.key(0))
    train = make_train_step(model, momentum(), plan, mesh, params)
    batches = [synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=i) for i in range(steps)]
    key = ("tied", name, momentum, twin_plan_key(plan))
    loss = layered_loss(model)
    twin, exact = shared_twin_runs(key, loss, loss, momentum, plan, params, batches)
    return compare_with_twin(tuple(train), twin, params, batches, exact=exact)


def cheaper(preset: str, **pipeline) -> object:
    """``preset`` with its pipeline's ``pipeline`` fields replaced (fewer micro-batches compile faster)."""
    plan = load_plan(preset)
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, **pipeline))


#: each preset's schedule and axes on 2 stages x 2 micro-batches (the 4-stage presets unroll 22 to 43
#: ticks and take 2-3 times as long to compile; what is summed where does not depend on the count)
TIED = {
    "gpipe": pipeline_plan("gpipe", stages=2, microbatches=2),
    "1f1b": pipeline_plan("1f1b", stages=2, microbatches=2),
    "interleaved": pipeline_plan("interleaved", stages=2, microbatches=2),  # 2 x 2 chunks of 1 layer
    "zb_h1": pipeline_plan("zb_h1", stages=2, microbatches=2),
    "zero2-pp": zero_pipeline(2),  # fsdp_pp's ZeRO-2
    "zero3-pp-once": zero_pipeline(3, "once"),
    "zero3-pp-per_microbatch": zero_pipeline(3, "per_microbatch"),
    "3d": cheaper("3d", microbatches=2),
    "ddp": load_plan("ddp"),
    "zero3": load_plan("zero3"),  # one layer gathered at a time, the table once for embed and head
}


@pytest.mark.parametrize("name", TIED)
def test_a_tied_embedding_gets_the_sum_of_its_embed_and_head_gradients(name):
    """Losses, gradients and parameters within the twin criterion over 3 steps: the table's gradient
    is the sum of its lookup's and the head's (the head's alone was 68-75 % off)."""
    report = tied_twin_report(TIED[name])
    assert_matches_twin(report, params=True)


def head_reading_layers() -> LayeredModel:
    """:func:`tied_mlp` whose head runs the last layer's ``w_in`` and the first layer's ``w_out`` once
    more before the tied logits: the stacked layers are read by the layers and by the head."""

    def head(p, h, batch):
        h = h + jnp.tanh(h @ p["layers"]["w_in"][-1]) @ p["layers"]["w_out"][0]
        return tied_mlp().head(p, h, batch)

    return tied_mlp()._replace(head=head, head_keys=(*TIED_KEYS, "layers"))


def test_a_head_reading_the_stacked_layers_equals_the_twin_under_zero3():
    """Without a pipeline the stacked layers are one parameter read twice: ZeRO-3 gathers them one
    layer at a time for the scan and whole for the head, and their gradient is the sum."""
    report = tied_twin_report(load_plan("zero3"), model=head_reading_layers())
    assert_matches_twin(report, params=True)


def test_a_head_reading_the_stacked_layers_is_refused_under_a_pipeline():
    """The stacked layers are split over ``stage``; the head on the last stage would see its own only."""
    plan = load_plan("pp_1f1b")
    model = head_reading_layers()
    shapes = jax.eval_shape(lambda: tied_mlp_params(PIPE, jax.random.key(0)))
    with pytest.raises(NotSupportedYetError, match="head reads the stacked layers 'layers'") as info:
        make_train_step(model, optax.sgd(0.1), plan, build_mesh(plan), shapes)
    assert info.value.key == "loss_fn.head_keys" and "mesh.stage = 1" in info.value.fix


def test_a_head_given_the_whole_tree_is_refused_under_a_pipeline():
    """``head_keys=None`` hands the head every parameter, the stacked layers too; under a pipeline
    the embedding's and layers' gradients were dropped (the head's alone came back)."""
    plan = load_plan("pp_1f1b")
    model = tied_mlp()._replace(head_keys=None)
    shapes = jax.eval_shape(lambda: tied_mlp_params(PIPE, jax.random.key(0)))
    with pytest.raises(NotSupportedYetError, match="head reads the stacked layers 'layers'") as info:
        make_train_step(model, optax.sgd(0.1), plan, build_mesh(plan), shapes)
    assert info.value.key == "loss_fn.head_keys"
