"""flax nnx models as their authors write them (tests/flax_blocks.py): a scanned stack of blocks and
an ``nnx.List`` of them, at the top level or one module down, converted with one call
(``from_nnx``) and trained under pipelines and ZeRO-3 equal to their single-device twins."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax import nnx
from flax_blocks import NnxCausalLM, NnxGPT2, NnxLlama, next_token_loss
from helpers import assert_matches_twin
from test_models_linen import CFG, PLANS, _batch, layered_twin_report

from torsh_jax import ModelStructureError, from_nnx
from torsh_jax.runtime.layered import layered_loss

BUILD = {
    "llama-scanned": lambda layers: NnxLlama(CFG.vocab, 16, 4, 2, layers, 24, rngs=nnx.Rngs(0)),
    "gpt2-list": lambda layers: NnxGPT2(CFG.vocab, 16, 2, layers, CFG.seq_len, rngs=nnx.Rngs(0)),
    "llama-scanned-nested": lambda layers: NnxCausalLM(BUILD["llama-scanned"](layers)),
    "gpt2-list-nested": lambda layers: NnxCausalLM(BUILD["gpt2-list"](layers)),
}
BLOCKS = {
    "llama-scanned": "layers",
    "gpt2-list": "blocks",
    "llama-scanned-nested": "transformer/layers",
    "gpt2-list-nested": "transformer/blocks",
}


@functools.cache
def _converted(name: str, layers: int):
    model = BUILD[name](layers)
    return model, from_nnx(model, _batch(2), loss=next_token_loss, blocks=BLOCKS[name])


def _own_loss(model, batch):
    return next_token_loss(model(batch["inputs"]), batch)


@pytest.mark.parametrize("name", BUILD)
def test_one_call_splits_the_model_and_its_parameters_convert_both_ways(name):
    model, layered = _converted(name, 8)
    key = BLOCKS[name]
    assert all(x.shape[0] == 8 for x in jax.tree.leaves(layered.params[key]))
    own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    back = layered.to_flax(layered.params)
    jax.tree.map(np.testing.assert_array_equal, back, own)
    batch = _batch(4, seed=1)
    ours = jax.jit(layered_loss(layered.model))(layered.params, batch)
    np.testing.assert_allclose(ours, nnx.jit(_own_loss)(model, batch), rtol=1e-6)


def test_each_part_reads_the_keys_it_uses():
    _, scanned = _converted("llama-scanned", 2)
    assert scanned.model.embed_keys == ("tok_embeddings",)
    assert set(scanned.model.head_keys) == {"norm", "output"}
    _, listed = _converted("gpt2-list", 2)
    assert set(listed.model.embed_keys) == {"wte", "wpe"} and set(listed.model.head_keys) == {"wte", "ln_f"}
    _, nested = _converted("gpt2-list-nested", 2)  # the decoder's children lifted beside the scale
    assert set(nested.model.embed_keys) == {"transformer/wte", "transformer/wpe"}
    assert set(nested.model.head_keys) == {"transformer/wte", "transformer/ln_f", "logit_scale"}
    _, nested = _converted("llama-scanned-nested", 2)
    assert nested.model.embed_keys == ("transformer/tok_embeddings",)
    assert set(nested.model.head_keys) == {"transformer/norm", "transformer/output", "logit_scale"}


@pytest.mark.parametrize("plan", ["1f1b", "interleaved", "fsdp_pp-zero2", "3d-auto"])
def test_a_scanned_nnx_model_trains_equal_to_its_twin(plan):
    """Losses, gradients and parameters within the twin criterion over 2 steps."""
    require_devices(8)
    assert_matches_twin(_twin_report("llama-scanned", PLANS[plan]), params=True)


def test_a_listed_nnx_model_with_a_tied_embedding_trains_equal_to_its_twin():
    require_devices(8)
    assert_matches_twin(_twin_report("gpt2-list", PLANS["1f1b"]), params=True)


def test_blocks_one_module_down_train_equal_to_their_twin():
    """The list at ``transformer/blocks``, its tied embedding at ``transformer/wte`` read by the
    first stage and the last, the scale beside the decoder by the last."""
    require_devices(8)
    assert_matches_twin(_twin_report("gpt2-list-nested", PLANS["1f1b"]), params=True)


def _computing_in_param_dtype(model):
    """``model`` with its modules' fixed compute dtypes lifted: nnx sets ``Embed.dtype`` (and others)
    to the parameters' float32 when the model is made, and the float64 reference must compute in
    float64 throughout."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and getattr(node, "dtype", None) == jnp.float32:
            node.dtype = None
    return model


@functools.cache
def _in_float64(name: str, layers: int):
    """The float64 run's model of :func:`_converted` (once per worker: the same object keys the
    shared twin runs)."""
    lifted = _computing_in_param_dtype(BUILD[name](layers))
    return from_nnx(lifted, _batch(2), loss=next_token_loss, blocks=BLOCKS[name]).model


def _twin_report(name: str, plan, steps: int = 2):
    _, layered = _converted(name, 4)
    in_float64 = _in_float64(name, 4)
    return layered_twin_report(layered.model, layered.params, plan, steps, in_float64=in_float64)


def test_blocks_it_cannot_find_are_one_error_naming_them():
    model = BUILD["gpt2-list"](2)
    with pytest.raises(ModelStructureError, match="no parameters under 'layers'") as err:
        from_nnx(model, _batch(2), loss=next_token_loss, blocks="layers")
    assert err.value.key == "layers"
    nested = BUILD["gpt2-list-nested"](2)
    with pytest.raises(ModelStructureError, match="no submodule 'decoder' at the top level") as err:
        from_nnx(nested, _batch(2), loss=next_token_loss, blocks="decoder/blocks")
    assert err.value.key == "decoder/blocks"


def test_a_custom_gradient_in_a_scanned_block_is_refused_not_differentiated_otherwise():
    import jax.numpy as jnp

    from torsh_jax import NotSupportedYetError, from_scan

    @jax.custom_vjp
    def clipped(x):
        return x

    clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

    def loss(p, batch):
        h, _ = jax.lax.scan(lambda h, w: (clipped(jnp.tanh(h @ w)), None), p["embed"][batch], p["stack"])
        return jnp.mean(h)

    params = {"embed": jnp.ones((8, 4)), "stack": jnp.ones((3, 4, 4))}
    tokens = jnp.zeros((2,), jnp.int32)
    layered = from_scan(loss, params, tokens, layers="stack")
    with pytest.raises(NotSupportedYetError, match="custom gradient"):
        layered_loss(layered.model)(layered.params, tokens)
