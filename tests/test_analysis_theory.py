"""Theoretical minimum bytes per plan: pure arithmetic, checked against hand-computed numbers."""

from __future__ import annotations

import pytest

from torsh_jax.analysis import theory
from torsh_jax.errors import PlanError
from torsh_jax.plan import AxisSize, MeshSpec, ParallelPlan, PrecisionSpec, ZeroSpec

P = 8_000_000  # parameter bytes (2M f32 parameters)


@pytest.mark.parametrize(
    "kind, n, expected",
    [
        ("all-reduce", 8, 2 * 1024 * 7 / 8),
        ("reduce-scatter", 4, 768.0),
        ("all-gather", 4, 768.0),
        ("all-to-all", 2, 512.0),
        ("collective-permute", 4, 1024.0),
        ("all-reduce", 1, 0.0),
    ],
)
def test_ring_wire_bytes(kind, n, expected):
    assert theory.ring_wire_bytes(kind, 1024, n) == expected


def test_ddp():
    t = theory.ddp(P, data_size=8)
    assert t.payload_bytes_by_kind == {"all-reduce": P}
    assert t.wire_bytes == 2 * P * 7 / 8


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_move_the_same_bytes_as_ddp(stage):
    t = theory.zero(P, stage=stage, fsdp_size=4)
    assert t.payload_bytes_by_kind == {"reduce-scatter": P, "all-gather": P}
    assert t.wire_bytes == theory.ddp(P, data_size=4).wire_bytes


def test_zero_3_gathers_twice_in_compute_dtype():
    t = theory.zero(P, stage=3, fsdp_size=4, compute_param_bytes=P // 2)
    assert t.payload_bytes_by_kind == {"all-gather": P, "reduce-scatter": P}
    assert t.wire_bytes == (P + P) * 3 / 4
    once = theory.zero(P, stage=3, fsdp_size=4, compute_param_bytes=P // 2, regather=False)
    assert once.payload_bytes_by_kind["all-gather"] == P // 2


def test_hsdp():
    t = theory.hsdp(P, data_size=2, fsdp_size=4, stage=2)
    assert t.payload_bytes_by_axis == {"fsdp": 2 * P, "data": P // 4}
    assert t.wire_bytes == P * 3 / 4 + 2 * (P / 4) / 2 + P * 3 / 4


def test_plan_theory_picks_the_strategy():
    ddp = ParallelPlan()
    zero3 = ParallelPlan(
        mesh=MeshSpec(data=AxisSize(), fsdp=AxisSize(ici=-1)),
        zero=ZeroSpec(stage=3),
        precision=PrecisionSpec(compute_dtype="bfloat16"),
    )
    hsdp = ParallelPlan(mesh=MeshSpec(data=AxisSize(dcn=2), fsdp=AxisSize(ici=4)), zero=ZeroSpec(stage=1))
    assert theory.plan_theory(ddp, param_count=1000, num_devices=8).wire_bytes == 2 * 4000 * 7 / 8
    t3 = theory.plan_theory(zero3, param_count=1000, num_devices=8)
    assert t3.payload_bytes_by_kind == {"all-gather": 2 * 2000, "reduce-scatter": 4000}
    th = theory.plan_theory(hsdp, param_count=1000, num_devices=8, num_slices=2)
    assert th.payload_bytes_by_axis == {"fsdp": 8000, "data": 1000}


@pytest.mark.parametrize(
    "stage, expected",
    [(0, 400 + 400 + 800), (1, 400 + 400 + 200), (2, 400 + 100 + 200), (3, 100 + 100 + 200)],
)
def test_memory_per_device(stage, expected):
    assert theory.theoretical_memory_per_device(400, 800, 400, stage, 4).total_bytes == expected


def test_memory_rounds_uneven_shards_up():
    assert theory.theoretical_memory_per_device(10, 0, 0, 3, 4).param_bytes == 3


@pytest.mark.parametrize(
    "call, key",
    [
        (lambda: theory.zero(P, stage=4, fsdp_size=4), "zero.stage"),
        (lambda: theory.ddp(P, data_size=0), "data_size"),
        (lambda: theory.hsdp(P, data_size=2, fsdp_size=4, stage=0), "zero.stage"),
    ],
)
def test_invalid_arguments(call, key):
    with pytest.raises(PlanError, match=key):
        call()


def test_zero3_gathers_parameters_outside_the_layers_once_per_step_under_accumulation():
    """Layers: per micro-step and again in the backward pass; the rest: once (a loop-invariant gather)."""
    t = theory.zero(P, stage=3, fsdp_size=4, regather=0.75, micro_steps=4, hoisted=0.25)
    assert t.payload_bytes_by_kind["all-gather"] == round(0.75 * P) * 4 * 2 + round(0.25 * P)
    assert t.payload_bytes_by_kind["reduce-scatter"] == P * 4
    single = theory.zero(P, stage=3, fsdp_size=4, regather=0.75, hoisted=0.25)
    assert single.payload_bytes_by_kind["all-gather"] == P + round(0.75 * P)


@pytest.mark.parametrize("layers", [1, 3])
def test_megatron_blocks_counts(layers):
    s = 4096
    plain = theory.megatron_blocks(s, tensor_size=4, layers=layers)
    assert plain.count_by_kind == {"all-reduce": 4 * layers + 2}
    sp = theory.megatron_blocks(s, tensor_size=4, layers=layers, sequence_parallel=True, recomputed=True)
    assert sp.count_by_kind == {"all-gather": 6 * layers + 2, "reduce-scatter": 5 * layers + 2}
    # sequence parallelism moves the same ring bytes as the all-reduces it replaces (Korthikanti et al.)
    same = theory.megatron_blocks(s, tensor_size=4, layers=layers, sequence_parallel=True)
    assert same.wire_bytes == pytest.approx(plain.wire_bytes)
    recomputed = theory.megatron_blocks(s, tensor_size=4, layers=layers, recomputed=True, micro_steps=2)
    assert recomputed.count_by_kind == {"all-reduce": 2 * (5 * layers + 2)}
