"""The state layout answers for every preset without a loss function, and holds what the step holds."""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest
from conftest import require_devices
from helpers import SMALL, model_for

from torsh_jax.demo.model import synthetic_tokens
from torsh_jax.plan import load_plan
from torsh_jax.plan.presets import names
from torsh_jax.runtime.inspect import inspect_step
from torsh_jax.runtime.layout import state_layout
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step

#: pp_gpipe, pp_1f1b, pp_zb_h1 and fsdp_pp lay out their state as 3d does (layers split over stage) without
#: tensor, with data or fsdp (and compile the longest schedules); their steps are twin-tested in
#: tests/test_pipeline.py, which also checks the layout of an interleaved state (layers in chunks)
PIPELINE_ONLY = ("pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_zb_h1", "fsdp_pp")
PRESETS = [name for name in names("meshes") if name not in PIPELINE_ONLY]
#: 4 layers for the pipeline presets (up to 4 stages), small activations (their compile time grows with ticks)
PIPELINED = dataclasses.replace(SMALL, layers=4, d_model=16, head_dim=8, mlp=32, seq_len=8)


def _largest_shard(x: jax.Array) -> int:
    return max(shard.data.nbytes for shard in x.addressable_shards)


def _held_bytes(state) -> dict[str, int]:
    """Bytes per device of each state field, read from the arrays' shards."""
    return {
        part: sum(_largest_shard(x) for x in jax.tree.leaves(value))
        for part, value in state._asdict().items()
    }


def _fewest_microbatches(plan):
    """``plan``, pipelined over m = p micro-batches: the layout does not depend on m, and 3d's step
    compiles in half the time at m = p (half the ticks of its m = 2p)."""
    stages = plan.mesh.stage.ici * plan.mesh.stage.dcn
    if stages <= 1 or plan.pipeline.microbatches <= stages:
        return plan
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, microbatches=stages))


@pytest.mark.parametrize("preset", PRESETS)
def test_layout_of_every_preset_equals_what_the_step_holds(preset):
    require_devices(8)
    plan = _fewest_microbatches(load_plan(preset))
    mesh = build_mesh(plan)
    cfg = SMALL if plan.mesh.stage.ici * plan.mesh.stage.dcn == 1 else PIPELINED  # layers split over stages
    model, init = model_for(plan, cfg)
    params = init(cfg, jax.random.key(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    optimizer = optax.adamw(1e-3)
    layout = state_layout(plan, mesh, abstract, optimizer)  # no loss function

    train = make_train_step(model, optimizer, plan, mesh, params)
    state = train.init(params)
    assert jax.tree.map(lambda x: x.sharding, state) == layout.shardings()
    assert layout.bytes_per_device() == _held_bytes(state)
    typed = lambda x: (x.shape, x.dtype, x.sharding)
    assert jax.tree.map(typed, train.abstract_state()) == jax.tree.map(typed, state)

    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    report = inspect_step(train, train.abstract_state(), batch)  # lowered for shapes: what it holds
    reported = report["state_bytes_per_device"]
    assert reported == {**_held_bytes(state), "total": sum(_held_bytes(state).values())}
    batch_bytes = sum(_largest_shard(x) for x in jax.tree.leaves(train.shard_batch(batch)))
    assert report["memory"]["argument_bytes"] == reported["total"] + batch_bytes
