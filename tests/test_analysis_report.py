"""The inspect report of small train steps, next to the plan's theoretical minimum."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from conftest import require_devices
from jax import lax
from jax.sharding import PartitionSpec as P

from torsh_jax.analysis import render_text, summarize, theory

AUTO = jax.sharding.AxisType.Auto
PARAMS = {"w1": (16, 32), "w2": (32, 8)}  # 640 f32 parameters = 2560 bytes
PARAM_BYTES = 4 * sum(a * b for a, b in PARAMS.values())


def _loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w1"]) @ params["w2"])


@pytest.fixture(scope="module")
def mesh():
    require_devices(8)
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AUTO, AUTO))


def _params():
    return {k: jnp.ones(shape, jnp.float32) for k, shape in PARAMS.items()}


def _ddp_step(mesh):
    def step(params, x):
        grads = jax.grad(_loss)(params, x)
        grads = lax.pmean(grads, ("data", "fsdp"))
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    program = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("data", "fsdp"))), out_specs=P(),
                            check_vma=False)  # fmt: skip
    return jax.jit(program).lower(_params(), jnp.ones((64, 16))).compile()


def _zero3_step(mesh):
    """Parameters sharded over fsdp on dim 0, gathered for the loss, grads reduce-scattered."""

    def step(local_params, x):
        def loss(local):
            full = jax.tree.map(lambda p: lax.all_gather(p, "fsdp", tiled=True), local)
            return _loss(full, x)

        local_grads = jax.grad(loss)(local_params)
        local_grads = lax.pmean(local_grads, "data")
        return jax.tree.map(lambda p, g: p - 0.1 * g, local_params, local_grads)

    sharded = P("fsdp")
    program = jax.shard_map(step, mesh=mesh, in_specs=(sharded, P(("data", "fsdp"))), out_specs=sharded,
                            check_vma=False)  # fmt: skip
    return jax.jit(program).lower(_params(), jnp.ones((64, 16))).compile()


def test_ddp_reduces_exactly_the_parameter_bytes(mesh):
    want = theory.ddp(PARAM_BYTES, data_size=8, axes=("data", "fsdp"))
    summary = summarize(_ddp_step(mesh), mesh, theory=want)
    json.dumps(summary)  # JSON-able
    totals = summary["totals"]
    assert set(totals["by_kind"]) == {"all-reduce"}
    assert totals["by_axis"]["data+fsdp"]["payload_bytes"] == PARAM_BYTES
    assert summary["theory"]["payload_ratio_by_kind"] == {"all-reduce": 1.0}
    assert summary["theory"]["wire_ratio"] == pytest.approx(1.0, rel=1e-12)
    assert summary["memory"]["argument_bytes"] == PARAM_BYTES + 8 * 16 * 4


def test_hsdp_zero3_step_against_theory(mesh):
    summary = summarize(_zero3_step(mesh), mesh)
    by_kind = summary["totals"]["by_kind"]
    by_axis = summary["totals"]["by_axis"]
    # The gradient of an all-gather is a reduce-scatter: XLA keeps both, and the data-axis mean
    # runs on the fsdp shards (P / 4).
    assert by_kind["all-gather"]["payload_bytes"] == PARAM_BYTES
    assert by_kind["reduce-scatter"]["payload_bytes"] == PARAM_BYTES
    assert by_axis["data"]["payload_bytes"] == PARAM_BYTES // 4
    assert by_axis["fsdp"]["payload_bytes"] == 2 * PARAM_BYTES
    minimum = theory.hsdp(PARAM_BYTES, data_size=2, fsdp_size=4, stage=3, regather=False)
    assert summary["totals"]["wire_bytes"] == pytest.approx(minimum.wire_bytes, rel=1e-12)


def test_render_text_lists_collectives_totals_and_memory(mesh):
    want = theory.ddp(PARAM_BYTES, data_size=8, axes=("data", "fsdp"))
    text = render_text(summarize(_ddp_step(mesh), mesh, theory=want))
    for expected in ("mesh: data=2 x fsdp=4", "all-reduce", "data+fsdp", "measured / theory", "1.00",
                     "argument", "peak_estimate"):  # fmt: skip
        assert expected in text


def test_bf16_gradient_reduction_is_widened_on_cpu(mesh):
    """Gradients reduced in bf16: the CPU backend sends f32, the unwidened payload is P in bf16."""

    def step(params, x):
        grads = jax.grad(_loss)(params, x)
        grads = jax.tree.map(lambda g: lax.psum(g.astype(jnp.bfloat16), ("data", "fsdp")), grads)
        return jax.tree.map(lambda p, g: p - 0.1 * g.astype(jnp.float32), params, grads)

    program = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(("data", "fsdp"))), out_specs=P(),
                            check_vma=False)  # fmt: skip
    summary = summarize(jax.jit(program).lower(_params(), jnp.ones((64, 16))).compile(), mesh)
    rows = summary["collectives"]
    assert {(r["kind"], r["dtype"], r["widened_from"]) for r in rows} == {("all-reduce", "f32", "bf16")}
    assert summary["totals"]["payload_bytes"] == PARAM_BYTES
    assert summary["totals"]["unwidened_payload_bytes"] == PARAM_BYTES // 2
    assert "f32 (from bf16)" in render_text(summary)


def test_many_operands_are_abbreviated_in_the_table(mesh):
    def step(x):
        return lax.psum([x * i for i in range(6)], "data")

    program = jax.shard_map(step, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=P(("data", "fsdp")),
                            check_vma=False)  # fmt: skip
    summary = summarize(jax.jit(program).lower(jnp.ones((64, 16))).compile(), mesh)
    [row] = summary["collectives"]
    assert len(row["operand_shapes"]) == 6
    assert row["replica_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "+3 more" in render_text(summary)


def test_identical_collectives_share_one_row_counting_their_ops(mesh):
    """Three same-shaped ppermutes in a row: one table row with ``ops`` 3, ``x/step`` 3 (JSON keeps 3)."""

    def step(x):
        for i in range(3):
            x = lax.ppermute(jnp.sin(x) + i, "data", [(0, 1), (1, 0)])
        return x

    program = jax.shard_map(step, mesh=mesh, in_specs=P(("data", "fsdp")), out_specs=P(("data", "fsdp")),
                            check_vma=False)  # fmt: skip
    summary = summarize(jax.jit(program).lower(jnp.ones((64, 16))).compile(), mesh)
    assert [r["kind"] for r in summary["collectives"]] == ["collective-permute"] * 3
    [line] = [line for line in render_text(summary).splitlines() if line.startswith("│ collective-permute")]
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells[6:] == ["3", "3", "top"]


def _zero3_layer_scan(remat: bool):
    """ZeRO-3 over fsdp=8: stacked layers W[L, D, D] sharded on dim 1, gathered one layer per scan step."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AUTO,))

    def step(local_w, x):
        def loss(local_w):
            def layer(h, local_layer):
                return jnp.tanh(h @ lax.all_gather(local_layer, "fsdp", axis=0, tiled=True)), None

            h, _ = lax.scan(jax.checkpoint(layer) if remat else layer, x, local_w)
            return jnp.mean(h)

        return local_w - 0.1 * jax.grad(loss)(local_w)

    program = jax.shard_map(step, mesh=mesh, in_specs=(P(None, "fsdp"), P("fsdp")), out_specs=P(None, "fsdp"),
                            check_vma=False)  # fmt: skip
    return mesh, jax.jit(program).lower(jnp.ones((3, 16, 16)), jnp.ones((64, 16))).compile()


@pytest.mark.parametrize("remat", [False, True], ids=["keep_gathered", "regather"])
def test_zero3_layer_scan_matches_theory_exactly(remat):
    require_devices(8)
    layers, param_bytes = 3, 3 * 16 * 16 * 4
    mesh, compiled = _zero3_layer_scan(remat)
    want = theory.zero(param_bytes, stage=3, fsdp_size=8, regather=remat)
    summary = summarize(compiled, mesh, theory=want)
    gathers = [r for r in summary["collectives"] if r["kind"] == "all-gather"]
    assert all((r["trip_count"], r["executions"]) == (layers, layers) for r in summary["collectives"])
    assert len(gathers) == (2 if remat else 1)
    assert summary["theory"]["payload_ratio_by_kind"] == {"all-gather": 1.0, "reduce-scatter": 1.0}
    assert summary["theory"]["wire_ratio"] == pytest.approx(1.0, rel=1e-12)
    assert summary["memory"]["argument_bytes"] == param_bytes // 8 + 8 * 16 * 4


def test_regathering_lowers_temporary_memory():
    require_devices(8)
    temp_bytes = {}
    for remat in (False, True):
        mesh, compiled = _zero3_layer_scan(remat)
        temp_bytes[remat] = summarize(compiled, mesh)["memory"]["temp_bytes"]
    assert temp_bytes[True] < temp_bytes[False]
