"""A linen model laid out as Hugging Face's Flax Llama (blocks at ``model/layers/0 ...``, flat
``q_proj`` kernels): converted with one call, pipelined, and tensor-split by the ``hf_llama``
``param_dims`` preset equal to its twin."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import require_devices
from flax_blocks import HFConfig, HFLlamaForCausalLM, next_token_loss
from helpers import assert_matches_twin
from test_models_linen import (
    _activation_bytes,
    _batch,
    _megatron_bytes,
    _tensor_activation_bytes,
    _with_auto_tensor_rules,
    layered_twin_report,
)
from test_pipeline import momentum, pipeline_plan

from torsh_jax import ModelStructureError, from_linen, load_plan
from torsh_jax.errors import ShardingError
from torsh_jax.plan.io import load_param_dims, plan_from_dict
from torsh_jax.runtime.inspect import inspect_step, tensor_split
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step

MODEL = HFLlamaForCausalLM(HFConfig(vocab=64, d_model=16, heads=4, kv_heads=2, layers=4, hidden=24))


@functools.cache
def _converted():
    example = _batch(2)
    params = MODEL.init(jax.random.key(0), example["inputs"])["params"]
    return params, from_linen(MODEL, params, example, loss=next_token_loss, blocks="model/layers")


def test_blocks_below_the_top_level_are_lifted_and_convert_back_exactly():
    params, layered = _converted()
    assert layered.block_names == tuple(f"model/layers/{i}" for i in range(4))
    assert layered.model.embed_keys == ("model/embed_tokens",)
    assert set(layered.model.head_keys) == {"model/norm", "lm_head"}
    assert layered.params["model/layers"]["self_attn"]["q_proj"]["kernel"].shape == (4, 16, 16)
    back = layered.to_flax(layered.params)
    assert jax.tree.structure(back) == jax.tree.structure(dict(params))
    jax.tree.map(np.testing.assert_array_equal, back, dict(params))


def test_a_missing_module_on_the_way_to_the_blocks_is_named():
    params, _ = _converted()
    with pytest.raises(ModelStructureError, match="no submodule 'decoder' at model") as err:
        from_linen(MODEL, params, _batch(2), loss=next_token_loss, blocks="model/decoder/layers")
    assert err.value.key == "model/decoder/layers"


def test_the_lifted_model_trains_equal_to_its_twin_under_a_pipeline():
    require_devices(8)
    _, layered = _converted()
    plan = pipeline_plan("1f1b", stages=2, microbatches=2)
    assert_matches_twin(layered_twin_report(layered.model, layered.params, plan), params=True)


#: what the ``hf_llama`` preset splits over ``tensor`` (dims of the stacked parameters); ``auto``
#: alone leaves the square ``q_proj`` and ``o_proj`` [d, d] replicated (their role is not in their shape)
HF_LLAMA_SPLIT = {
    "model/layers/self_attn/q_proj/kernel": [2],
    "model/layers/self_attn/k_proj/kernel": [2],
    "model/layers/self_attn/v_proj/kernel": [2],
    "model/layers/self_attn/o_proj/kernel": [1],
    "model/layers/mlp/gate_proj/kernel": [2],
    "model/layers/mlp/up_proj/kernel": [2],
    "model/layers/mlp/down_proj/kernel": [1],
    "model/layers/input_layernorm/scale": [],
    "model/embed_tokens/embedding": [0],
    "lm_head/kernel": [1],
    "model/norm/scale": [],
}


def _tp(param_dims=None):
    plan = load_plan("tp")
    return plan.replace(param_dims=load_param_dims(param_dims)) if param_dims else plan


def _step(plan):
    _, layered = _converted()
    return make_train_step(layered.model, momentum(), plan, build_mesh(plan), layered.params)


def _tensor_split(plan):
    train = _step(plan)
    return train, inspect_step(train, train.abstract_state(), _batch(train.global_batch_size))


def test_the_hf_llama_preset_splits_the_model_as_megatron_does_and_it_equals_its_twin():
    """Megatron's split from the names, the square projections included; on CPU the tensor bytes
    are Megatron's plus the separate q/k/v and gate/up input-gradient reductions (3 activations
    per block, as for the auto-split Llama)."""
    require_devices(8)
    auto = tensor_split(_step(_with_auto_tensor_rules(_tp())))  # the layout's, no compile needed
    assert auto["model/layers/self_attn/q_proj/kernel"] == []
    assert auto["model/layers/self_attn/o_proj/kernel"] == []
    plan = _tp("hf_llama")
    train, summary = _tensor_split(plan)
    split = summary["tensor_split"]
    assert {path: split[path] for path in HF_LLAMA_SPLIT} == HF_LLAMA_SPLIT
    rows = train.global_batch_size // 4
    assert _tensor_activation_bytes(summary) == _megatron_bytes(rows) + 4 * 3 * _activation_bytes(rows)
    _, layered = _converted()
    assert_matches_twin(layered_twin_report(layered.model, layered.params, plan, train=train), params=True)


def test_a_preset_entry_names_a_blocks_own_parameter_and_a_stacked_one():
    """The leading ``...`` of a preset entry is the stacked layer dim when there is one."""
    from torsh_jax.runtime.specs import logical_dims

    plan = plan_from_dict({"param_dims": "hf_llama"})
    stacked = jax.ShapeDtypeStruct((4, 16, 24), np.float32)
    own = jax.ShapeDtypeStruct((16, 24), np.float32)
    assert logical_dims("model/layers/mlp/up_proj/kernel", stacked, plan) == ("layers", "embed", "mlp")
    assert logical_dims("model/layers/0/mlp/up_proj/kernel", own, plan) == ("embed", "mlp")
    with pytest.raises(ShardingError, match="name 2 dims"):
        logical_dims("lm_head/kernel", stacked, plan)


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "gemma"])
def test_every_param_dims_preset_loads_and_names_known_logical_dims(name):
    entries = load_param_dims(name)
    rules = {logical for logical, _ in load_plan("tp").rules}
    assert entries and all(d in rules | {"...", ""} for _, dims in entries for d in dims)
