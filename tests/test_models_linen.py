"""Flax linen models as their authors write them (tests/flax_blocks.py), converted with one call
(``from_linen``) and trained under pipelines and ZeRO-3 equal to their single-device twins."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import require_devices
from flax_blocks import GPT2, Llama, next_token_loss
from helpers import assert_matches_twin, shared_twin_runs, twin_plan_key
from test_pipeline import momentum, pipeline_plan, zero_pipeline
from test_pipeline_tied import cheaper

from torsh_jax import ModelStructureError, NotSupportedYetError, from_linen, load_plan
from torsh_jax.demo.model import LMConfig, synthetic_tokens
from torsh_jax.runtime.inspect import inspect_step, tensor_split
from torsh_jax.runtime.layered import layered_loss
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.verify import compare_with_twin

CFG = LMConfig(vocab=64, seq_len=8)
#: 8 blocks where the model is only converted; 4 (one per chunk of 2 stages x 2 chunks) where it
#: trains: what is summed where does not depend on the count, and compiling scales with it
MODELS = {
    "gpt2-tied": GPT2(vocab=64, d_model=16, heads=2, layers=8, max_len=8),
    "llama-gqa": Llama(vocab=64, d_model=16, heads=4, kv_heads=2, layers=8, hidden=24),
}
TRAINED = {
    "gpt2-tied": GPT2(vocab=64, d_model=16, heads=2, layers=4, max_len=8),
    "llama-gqa": Llama(vocab=64, d_model=16, heads=4, kv_heads=2, layers=4, hidden=24),
}
LAYER_KEYS = {"gpt2-tied": "blocks", "llama-gqa": "layers"}


def _batch(rows: int, seed: int = 0) -> dict:
    return synthetic_tokens(CFG, batch_size=rows, seed=seed)


@functools.cache
def _converted(name: str, trained: bool = False):
    """The model (8 blocks; ``trained``: 4), its parameters and its conversion (once per worker)."""
    module = (TRAINED if trained else MODELS)[name]
    example = _batch(2)
    params = module.init(jax.random.key(0), example["inputs"])["params"]
    return module, params, from_linen(module, params, example, loss=next_token_loss, blocks=LAYER_KEYS[name])


@pytest.mark.parametrize("name", MODELS)
def test_one_call_splits_the_model_and_its_parameters_convert_both_ways(name):
    module, params, layered = _converted(name)
    key = LAYER_KEYS[name]
    assert layered.layers_key == key and layered.period == 1 and len(layered.block_names) == 8
    leaves = jax.tree.leaves(layered.params[key])
    assert all(x.shape[0] == 8 for x in leaves)
    back = layered.to_flax(layered.params)
    assert jax.tree.structure(back) == jax.tree.structure(dict(params))
    jax.tree.map(np.testing.assert_array_equal, back, dict(params))
    batch = _batch(4, seed=1)
    ours = jax.jit(layered_loss(layered.model))(layered.params, batch)
    theirs = jax.jit(lambda p, b: next_token_loss(module.apply({"params": p}, b["inputs"]), b))(params, batch)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_a_tied_embedding_is_read_by_the_embedding_and_the_head():
    _, _, tied = _converted("gpt2-tied")
    assert set(tied.model.embed_keys) == {"wte", "wpe"} and set(tied.model.head_keys) == {"wte", "ln_f"}
    _, _, untied = _converted("llama-gqa")
    assert untied.model.embed_keys == ("tok_embeddings",)
    assert set(untied.model.head_keys) == {"norm", "output"}


def _twin_report(name: str, plan, steps: int = 2, trained: bool = True, train=None):
    _, _, layered = _converted(name, trained=trained)
    return layered_twin_report(layered.model, layered.params, plan, steps, train=train)


def layered_twin_report(
    model, params, plan, steps: int = 2, *, in_float64=None, batch_of=lambda b: b, train=None
):
    """``model`` on ``plan`` against its single-device twin and a float64 run (of ``in_float64``, a
    model computing in its parameters' dtype, when ``model`` does not), on ``batch_of`` the token
    batches. The twin runs are shared by the plans with the same twin (``shared_twin_runs``: the
    models and ``batch_of`` are part of the key, so pass the same objects to share). ``train``: the
    step of ``model`` on ``plan`` with :func:`momentum` a test already made and inspected (its
    program traced and compiled once)."""
    train = train or make_train_step(model, momentum(), plan, build_mesh(plan), params)
    batches = [batch_of(_batch(train.global_batch_size, seed=i)) for i in range(steps)]
    exact_model = in_float64 or model
    key = ("layered", model, exact_model, batch_of, momentum, twin_plan_key(plan))
    loss, exact_loss = layered_loss(model), layered_loss(exact_model)
    twin, exact = shared_twin_runs(key, loss, exact_loss, momentum, plan, params, batches)
    return compare_with_twin(tuple(train), twin, params, batches, exact=exact)


def _with_auto_tensor_rules(plan):
    return plan.replace(tensor=dataclasses.replace(plan.tensor, rules="auto"))


#: each pipeline preset's schedule and axes on 2 stages x 2 micro-batches (what is summed where does
#: not depend on the counts; tests/test_pipeline_tied.py), and ZeRO-3 gathering one layer at a time.
#: The pipelines' global batch is 16 (micro-batches of 2 examples on 4 data ranks): one twin run
#: serves them all (helpers.shared_twin_runs)
PAIRS = {"micro_batch_size": 4}
PLANS = {
    "1f1b": pipeline_plan("1f1b", stages=2, microbatches=2, batch=PAIRS),
    "interleaved": pipeline_plan("interleaved", stages=2, microbatches=2, batch=PAIRS),
    "fsdp_pp-zero2": zero_pipeline(2),
    "zero3": load_plan("zero3"),
    # data 2 x stage 2 x tensor 2; the compiler splits the layers over tensor by Megatron's rules
    "3d-auto": _with_auto_tensor_rules(cheaper("3d", microbatches=2)),
}
#: GPT-2 (tied) under the pipelines, Llama (grouped-query attention) under ZeRO-3's layer gathers; the
#: nnx models (tests/test_models_nnx.py) run the same plans


TWIN_CASES = [("gpt2-tied", "1f1b"), ("gpt2-tied", "interleaved"), ("gpt2-tied", "fsdp_pp-zero2")]
TWIN_CASES += [("gpt2-tied", "3d-auto")]
TWIN_CASES += [("llama-gqa", "zero3")]


@pytest.mark.parametrize("name,plan", TWIN_CASES, ids=[f"{n}-{p}" for n, p in TWIN_CASES])
def test_a_converted_model_trains_equal_to_its_twin(name, plan):
    """Losses, gradients and parameters within the twin criterion over 2 steps (the tied table's
    gradient is the sum of its lookup's and the head's, on whichever stages hold them)."""
    require_devices(8)
    assert_matches_twin(_twin_report(name, PLANS[plan]), params=True)


class _Odd(nn.Module):
    """Three blocks with a projection before each (``widths``: its width)."""

    widths: tuple = (8, 8, 8)

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 8, name="embed")(tokens)
        for i, width in enumerate(self.widths):
            x = x + nn.Dense(8, name=f"blocks_{i}")(nn.Dense(width, name=f"pre_{i}")(x))
        return nn.Dense(64, name="head")(x)


class _Masked(nn.Module):
    """Blocks that take a mask made by the model: one for all (``tokens > 0``), or with
    ``per_block`` one each (``tokens > 0``, ``tokens > 32``)."""

    per_block: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 8, name="embed")(tokens)
        for i in range(2):
            keep = (tokens > 32 * i * self.per_block)[..., None].astype(x.dtype)
            x = _MaskedBlock(name=f"blocks_{i}")(x, keep)
        return nn.Dense(64, name="head")(x)


class _PerBlockFlag(nn.Module):
    """Each block given a value of its own (``scale=1``, ``scale=2``)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 8, name="embed")(tokens)
        for i in range(2):
            x = _ScaledBlock(name=f"blocks_{i}")(x, scale=i + 1)
        return nn.Dense(64, name="head")(x)


class _ScaledBlock(nn.Module):
    @nn.compact
    def __call__(self, x, scale):
        return x + scale * nn.Dense(8)(x)


class _MaskedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, keep):
        return x + keep * nn.Dense(8)(x)


def test_a_model_that_does_not_split_is_one_error_naming_the_child():
    example = _batch(2)
    params = _Odd().init(jax.random.key(0), example["inputs"])["params"]
    with pytest.raises(ModelStructureError, match="pre_1 is called between the blocks") as err:
        from_linen(_Odd(), params, example, loss=next_token_loss)
    assert err.value.key == "pre_1"
    wider = _Odd((8, 8, 16))
    wider_params = wider.init(jax.random.key(0), example["inputs"])["params"]
    with pytest.raises(ModelStructureError, match="blocks_2 differs from blocks_0") as err:
        from_linen(wider, wider_params, example, loss=next_token_loss)
    assert err.value.key == "blocks_2"
    with pytest.raises(ModelStructureError, match="no parameters named layers_0") as err:
        from_linen(_Odd(), params, example, loss=next_token_loss, blocks="layers")
    own = _Masked(per_block=True).init(jax.random.key(0), example["inputs"])["params"]
    with pytest.raises(ModelStructureError, match="given different arrays") as err:
        from_linen(_Masked(per_block=True), own, example, loss=next_token_loss)
    assert err.value.key == "blocks_0"
    with pytest.raises(NotSupportedYetError, match="blocks_1 is given other arguments") as err:
        from_linen(_PerBlockFlag(), own, example, loss=next_token_loss)
    assert err.value.key == "blocks_1"


def test_blocks_given_a_mask_made_from_the_batch_compute_it_in_each_layer():
    """The converted loss equals the model's (``from_linen`` checks it on the example; here on
    another batch whose mask differs)."""
    example = _batch(2)
    params = _Masked().init(jax.random.key(0), example["inputs"])["params"]
    layered = from_linen(_Masked(), params, example, loss=next_token_loss)
    assert layered.model.layer_reads_batch
    batch = _batch(4, seed=3)
    batch["inputs"] = np.where(np.arange(CFG.seq_len) < 3, 0, batch["inputs"])  # masked positions
    own = next_token_loss(_Masked().apply({"params": params}, batch["inputs"]), batch)
    np.testing.assert_allclose(layered_loss(layered.model)(layered.params, batch), own, rtol=1e-6)


#: the stacked parameters (one leading layer dim) and what Megatron splits over ``tensor``
MEGATRON_SPLIT = {
    "gpt2-tied": {
        "blocks/attn/query/kernel": [2],  # [layers, d, heads, head_dim]: column-parallel by heads
        "blocks/attn/query/bias": [1],
        "blocks/attn/out/kernel": [1],  # [layers, heads, head_dim, d]: row-parallel
        "blocks/attn/out/bias": [],
        "blocks/c_fc/kernel": [2],  # [layers, d, 4d]: column-parallel
        "blocks/c_fc/bias": [1],
        "blocks/c_proj/kernel": [1],  # [layers, 4d, d]: row-parallel
        "blocks/c_proj/bias": [],
        "blocks/ln_1/scale": [],
        "wte/embedding": [0],  # [vocab, d]: vocabulary-parallel
        "wpe/embedding": [],  # [positions, d]: not the vocabulary (the default rules would split it)
        "ln_f/scale": [],
    },
    "llama-gqa": {
        "layers/wq/kernel": [2],  # [layers, d, 4 heads, head_dim]
        "layers/wk/kernel": [2],  # [layers, d, 2 key-value heads, head_dim]
        "layers/wv/kernel": [2],
        "layers/wo/kernel": [1],  # [layers, heads, head_dim, d]
        "layers/w1/kernel": [2],  # gate and up: column-parallel
        "layers/w3/kernel": [2],
        "layers/w2/kernel": [1],  # down: row-parallel
        "layers/attention_norm/scale": [],
        "tok_embeddings/embedding": [0],
        "output/kernel": [1],  # [d, vocab]
        "norm/scale": [],
    },
}
AUTO_CASES = [("gpt2-tied", "tp"), ("llama-gqa", "tp"), ("llama-gqa", "fsdp_tp")]
#: activations per block XLA:CPU all-reduces beyond Megatron's count: the input gradients of the
#: column-parallel projections that read one input, reduced one by one instead of summed first (GPT-2:
#: query, key and value, 2 more; Llama: those and its gate and up projections, 3 more)
CPU_EXTRA_PER_BLOCK = {"gpt2-tied": 2, "llama-gqa": 3}


@pytest.mark.parametrize("name,preset", AUTO_CASES, ids=[f"{n}-{p}" for n, p in AUTO_CASES])
def test_auto_rules_split_a_nameless_model_as_megatron_does_and_it_equals_its_twin(name, preset):
    """The models have no partitioning names: ``tensor.rules = "auto"`` splits their attention by
    heads and their MLP by features (column then row), their tables by vocabulary; inspect reports
    each. On CPU the tensor bytes are Megatron's plus the separate q/k/v gradient reductions."""
    require_devices(8)
    plan = _with_auto_tensor_rules(load_plan(preset))
    _, _, layered = _converted(name, trained=True)
    train = make_train_step(layered.model, momentum(), plan, build_mesh(plan), layered.params)
    split = tensor_split(train)  # what inspect reports, from the layout: no compile needed
    assert {path: split[path] for path in MEGATRON_SPLIT[name]} == MEGATRON_SPLIT[name]
    if preset == "tp":
        summary = inspect_step(train, train.abstract_state(), _batch(train.global_batch_size))
        assert summary["tensor_split"] == split
        rows = train.global_batch_size // 4
        extra = 4 * CPU_EXTRA_PER_BLOCK[name] * _activation_bytes(rows)
        assert _tensor_activation_bytes(summary) == _megatron_bytes(rows) + extra
    assert_matches_twin(_twin_report(name, plan, train=train), params=True)


@pytest.mark.parametrize("name", MODELS)
def test_on_a_tpu_target_the_auto_split_model_sends_megatrons_count_exactly(name):
    """Compiled for v5e-8 by libtpu, the same ``tp`` step's tensor collectives carry Megatron's bytes:
    the TPU compiler sums the query, key and value input gradients before one all-reduce."""
    from torsh_jax.demo.run import batch_like
    from torsh_jax.targets import compile_for_target, missing_compiler, parse_target, target_devices

    if (missing := missing_compiler("v5e-8")) is not None:
        pytest.skip(missing)
    target = parse_target("v5e-8")
    plan = _with_auto_tensor_rules(load_plan("tp"))
    _, _, layered = _converted(name, trained=True)
    shapes = jax.eval_shape(lambda: layered.params)
    train = make_train_step(layered.model, momentum(), plan, build_mesh(plan, target_devices(target)), shapes)
    batch = batch_like(_batch(1), train.global_batch_size)
    compiled = compile_for_target(train, batch, target=target).compiled
    summary = inspect_step(train, train.abstract_state(), batch, compiled=compiled)
    assert _tensor_activation_bytes(summary) == _megatron_bytes(train.global_batch_size // 4)


def _tensor_activation_bytes(summary: dict) -> int:
    """Bytes the step's ``tensor`` collectives carry, less the step's scalar sums (under 64 bytes)."""
    tensor = [c for c in summary["collectives"] if c["axes"] == ["tensor"] and c["payload_bytes"] >= 64]
    return sum(c["payload_bytes"] * c["executions"] for c in tensor)


def _activation_bytes(rows: int) -> int:
    return rows * CFG.seq_len * 16 * 4  # [rows, T, d] float32


def _megatron_bytes(rows: int) -> int:
    """Megatron's count for the 4 blocks (Shoeybi et al. 2019: two all-reduces of the activations per
    block forward, two backward; the vocabulary-parallel embedding, head and loss)."""
    from torsh_jax.analysis.theory import megatron_blocks

    theory = megatron_blocks(
        _activation_bytes(rows), tensor_size=2, layers=4, token_bytes=rows * CFG.seq_len * 4
    )
    return sum(c.payload_bytes * c.count for c in theory.collectives)


def test_auto_rules_leave_a_dim_the_tensor_axis_does_not_divide_replicated():
    from torsh_jax.runtime.tensor_names import auto_param_dims

    layers = {"norm": np.zeros((2, 8)), "wk": np.zeros((2, 8, 3, 4)), "up": np.zeros((2, 8, 12))}
    named = dict(auto_param_dims({"layers": layers}, "layers", tensor=2))
    assert named["^layers/wk$"] == ("layers", "embed", "", "kv")  # 3 key heads over 2 devices
    assert named["^layers/up$"] == ("layers", "embed", "mlp")


@pytest.mark.slow
def test_the_pp_1f1b_preset_trains_the_8_block_model_equal_to_its_twin():
    """The preset's mesh and schedule (data 2 x stage 4) on the model as converted: 2 blocks per
    stage, at 4 micro-batches (its 8 unroll twice the ticks and compile in twice the time; the
    stage edges and sums are the same)."""
    require_devices(8)
    plan = cheaper("pp_1f1b", microbatches=4)
    assert_matches_twin(_twin_report("gpt2-tied", plan, trained=False), params=True)


class _HelperBlock(nn.Module):
    """A block calling a method of its own (seen by the interceptor as another call of the block)."""

    def setup(self):
        self.dense = nn.Dense(8)

    def project(self, x):
        return self.dense(x)

    def __call__(self, x):
        return x + self.project(x)


class _WithHelpers(nn.Module):
    def setup(self):
        self.embed = nn.Embed(64, 8)
        self.blocks = [_HelperBlock() for _ in range(2)]

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(x)


def test_a_block_calling_its_own_methods_is_still_one_block():
    example = _batch(2)
    params = _WithHelpers().init(jax.random.key(0), example["inputs"])["params"]
    layered = from_linen(_WithHelpers(), params, example, loss=next_token_loss)
    assert layered.block_names == ("blocks_0", "blocks_1")
    assert layered.params["blocks"]["dense"]["kernel"].shape == (2, 8, 8)
