"""Google DeepMind's Griffin (``recurrentgemma``, linen, from PyPI) as its authors wrote it:
converted with one call and pipelined equal to its single-device twin.

Griffin keeps its blocks as ``blocks.0 ... blocks.5`` (recurrent, recurrent, attention, repeated),
gives each the token positions (``segment_pos``) besides the hidden state, returns ``x, cache`` from
each, wraps them in ``nn.remat`` and reads its embedding table back for the logits (tied). The
package pins an older numpy; CI installs it beside the environment without its dependencies."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax_blocks import next_token_loss
from helpers import assert_matches_twin
from test_models_linen import CFG, _batch, layered_twin_report
from test_pipeline import pipeline_plan

from torsh_jax import from_linen

griffin = pytest.importorskip("recurrentgemma.jax", reason="recurrentgemma is not installed")
common = pytest.importorskip("recurrentgemma.common")


@pytest.fixture(autouse=True)
def _standard_promotion():
    """Griffin mixes bfloat16 constants into float32 (its embedding's scale), which the suite's
    strict promotion refuses; its users run with JAX's standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _model():
    recurrent, attention = common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION
    config = common.GriffinConfig(
        vocab_size=CFG.vocab, width=16, mlp_expanded_width=32, num_heads=2, lru_width=16,
        attention_window_size=CFG.seq_len, block_types=(recurrent, recurrent, attention) * 2,
        embeddings_scale_by_sqrt_dim=True, logits_soft_cap=30.0,
    )  # fmt: skip
    return griffin.Griffin(config)


def _with_positions(batch: dict) -> dict:
    """The batch with token positions, as jax arrays (Griffin checks its arguments' types)."""
    rows, length = batch["inputs"].shape
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    return jax.tree.map(jnp.asarray, {**batch, "positions": positions})


def _inputs(batch):
    """Tokens and positions; no cache in, logits and no cache out (Griffin's training call)."""
    return batch["inputs"], batch["positions"], None, True, False


def _loss(output, batch):
    logits, _ = output
    return next_token_loss(logits, batch)


@functools.cache
def _converted():
    module = _model()
    example = _with_positions(_batch(2))
    params = module.init(jax.random.key(0), example["inputs"], example["positions"])["params"]
    return module, params, from_linen(module, params, example, loss=_loss, blocks="blocks", inputs=_inputs)


def test_griffin_converts_one_period_per_layer_with_its_positions_read_by_each_layer():
    module, params, layered = _converted()
    assert layered.block_names == tuple(f"blocks.{i}" for i in range(6)) and layered.period == 3
    assert layered.model.layer_reads_batch  # segment_pos
    assert set(layered.model.embed_keys) == {"embedder"}
    assert set(layered.model.head_keys) == {"embedder", "final_norm"}  # the tied table
    jax.tree.map(np.testing.assert_array_equal, layered.to_flax(layered.params), dict(params))


def test_griffin_trains_under_1f1b_equal_to_its_twin():
    """2 stages x 2 micro-batches: one period (recurrent, recurrent, attention) per stage."""
    require_devices(8)
    _, _, layered = _converted()
    plan = pipeline_plan("1f1b", stages=2, microbatches=2)
    report = layered_twin_report(layered.model, layered.params, plan, batch_of=_with_positions)
    assert_matches_twin(report, params=True)
