"""Collective overlap from the scheduled HLO: the parser on written HLO (each async form, loops,
synchronous collectives), and a ZeRO-3 step and its GSPMD counterpart compiled for a TPU v5e-16
(compile-only devices; skipped where ``libtpu`` is absent)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import load_common

from torsh_jax.analysis._hlo_text import element_bits
from torsh_jax.analysis.hlo import collectives
from torsh_jax.analysis.overlap import EXPOSED, OVERLAPPED, collective_overlap, collectives_once
from torsh_jax.demo.model import LMConfig, init_params, layered_model
from torsh_jax.errors import MeshError
from torsh_jax.plan import plan_from_dict
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.targets import missing_compiler, target_devices

TARGET = "v5e-16"
#: 4 layers, small widths (a TPU compile of the step takes about 20 s here).
CFG = LMConfig(vocab=512, d_model=128, heads=2, head_dim=64, mlp=512, layers=4, seq_len=64)

_GATHER = "channel_id={c}, replica_groups=[1,4]<=[4], dimensions={{0}}, use_global_device_ids=true"
_REDUCE = "channel_id={c}, replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add"
#: start; fusion; done (overlapped) / start; done (exposed) / a synchronous all-reduce (exposed),
#: the first inside a scan of 3 iterations.
SNIPPET = f"""HloModule m, is_scheduled=true, num_partitions=4
%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}
%matmul (x: f32[8,16], w: f32[16,32]) -> f32[8,32] {{
  %x = f32[8,16]{{1,0}} parameter(0)
  %w = f32[16,32]{{1,0}} parameter(1)
  ROOT %d = f32[8,32]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
%body (c: (s32[], f32[4,32], f32[8,16])) -> (s32[], f32[4,32], f32[8,16]) {{
  %c = (s32[], f32[4,32]{{1,0}}, f32[8,16]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %p = f32[4,32]{{1,0}} get-tuple-element(%c), index=1
  %x = f32[8,16]{{1,0}} get-tuple-element(%c), index=2
  %w = f32[16,32]{{1,0}} constant({{...}})
  %ag = (f32[4,32]{{1,0}}, f32[16,32]{{1,0}}) all-gather-start(%p), {_GATHER.format(c=1)}
  %f = f32[8,32]{{1,0}} fusion(%x, %w), kind=kOutput, calls=%matmul
  %g = f32[16,32]{{1,0}} all-gather-done(%ag)
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,32]{{1,0}}, f32[8,16]{{1,0}}) tuple(%n, %p, %x)
}}
%cond (c: (s32[], f32[4,32], f32[8,16])) -> pred[] {{
  %c = (s32[], f32[4,32]{{1,0}}, f32[8,16]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}}
ENTRY %main (p: f32[4,32], x: f32[8,16], q: f32[64]) -> f32[64] {{
  %p = f32[4,32]{{1,0}} parameter(0)
  %x = f32[8,16]{{1,0}} parameter(1)
  %q = f32[64]{{0}} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,32]{{1,0}}, f32[8,16]{{1,0}}) tuple(%zero, %p, %x)
  %loop = (s32[], f32[4,32]{{1,0}}, f32[8,16]{{1,0}}) while(%init), condition=%cond, body=%body
  %rs = ((f32[64]{{0}}), f32[16]{{0}}) async-start(%q), calls=%scatter
  %rd = f32[16]{{0}} async-done(%rs)
  %ar = f32[16]{{0}} all-reduce(%rd), {_REDUCE.format(c=3)}
  ROOT %out = f32[64]{{0}} broadcast(%ar), dimensions={{}}
}}
%scatter (q: f32[64]) -> f32[16] {{
  %q = f32[64]{{0}} parameter(0)
  ROOT %r = f32[16]{{0}} reduce-scatter(%q), {_REDUCE.format(c=2)}, dimensions={{0}}
}}
"""


def test_written_schedule_pairs_starts_with_dones_and_measures_what_is_between():
    report = collective_overlap(SNIPPET, axis_sizes={"fsdp": 4})
    by_kind = {o.collective.kind: o for o in report.collectives}
    assert sorted(by_kind) == ["all-gather", "all-reduce", "reduce-scatter"]
    gather, scatter, reduce = by_kind["all-gather"], by_kind["reduce-scatter"], by_kind["all-reduce"]
    assert (gather.start, gather.done, gather.status) == ("ag", "g", OVERLAPPED)
    assert (gather.compute_ops, gather.compute_flops, gather.compute_bytes) == (
        1,
        2 * 8 * 32 * 16,
        8 * 32 * 4,
    )
    assert gather.collective.executions == 3 and gather.collective.axes == ("fsdp",)
    assert (scatter.start, scatter.done, scatter.status, scatter.compute_ops) == ("rs", "rd", EXPOSED, 0)
    assert (reduce.is_async, reduce.status) == (False, EXPOSED)
    # payload bytes per step: the gather 3 x 2 KiB (overlapped), the scatter 256 B, the all-reduce 64 B
    assert report.fraction() == pytest.approx(6144 / (6144 + 256 + 64))
    assert report.by_kind()["all-gather"]["fraction"] == 1.0 and report.scheduled


TPU_FORM = """HloModule m, is_scheduled=true, num_partitions=4
%start_c (p: bf16[4,32]) -> (bf16[4,32], bf16[16,32], u32[]) {
  %p = bf16[4,32]{1,0} parameter(0)
  %ag = bf16[16,32]{1,0} all-gather(%p), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  ROOT %cc = (bf16[4,32]{1,0}, bf16[16,32]{1,0}, u32[]) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}
%carry_c (b: bf16[4,32], o: bf16[16,32], u: u32[], x: bf16[8,16], w: bf16[16,16]) -> (bf16[8,16], bf16[4,32], bf16[16,32], u32[]) {
  %b = bf16[4,32]{1,0} parameter(0)
  %o = bf16[16,32]{1,0} parameter(1)
  %u = u32[] parameter(2)
  %x = bf16[8,16]{1,0} parameter(3)
  %w = bf16[16,16]{1,0} parameter(4)
  %ag = bf16[16,32]{1,0} all-gather(%b), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %y = bf16[8,16]{1,0} convolution(%x, %w), dim_labels=bf_io->bf
  ROOT %t = (bf16[8,16]{1,0}, bf16[4,32]{1,0}, bf16[16,32]{1,0}, u32[]) tuple(%y, %b, %ag, %u)
}
%done_c (b: bf16[4,32], o: bf16[16,32], u: u32[]) -> bf16[16,32] {
  %b = bf16[4,32]{1,0} parameter(0)
  %o = bf16[16,32]{1,0} parameter(1)
  %u = u32[] parameter(2)
  %ag = bf16[16,32]{1,0} all-gather(%b), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  ROOT %cc = bf16[16,32]{1,0} custom-call(%b, %o, %ag, %u), custom_call_target="AsyncCollectiveDone"
}
ENTRY %main (p: bf16[4,32], x: bf16[8,16], w: bf16[16,16]) -> (bf16[16,32], bf16[8,16]) {
  %p = bf16[4,32]{1,0} parameter(0)
  %x = bf16[8,16]{1,0} parameter(1)
  %w = bf16[16,16]{1,0} parameter(2)
  %s = (bf16[4,32]{1,0}, bf16[16,32]{1,0}, u32[]) fusion(%p), kind=kCustom, calls=%start_c
  %s0 = bf16[4,32]{1,0} get-tuple-element(%s), index=0
  %s1 = bf16[16,32]{1,0} get-tuple-element(%s), index=1
  %s2 = u32[] get-tuple-element(%s), index=2
  %c = (bf16[8,16]{1,0}, bf16[4,32]{1,0}, bf16[16,32]{1,0}, u32[]) fusion(%s0, %s1, %s2, %x, %w), kind=kOutput, calls=%carry_c
  %y = bf16[8,16]{1,0} get-tuple-element(%c), index=0
  %c1 = bf16[4,32]{1,0} get-tuple-element(%c), index=1
  %c2 = bf16[16,32]{1,0} get-tuple-element(%c), index=2
  %c3 = u32[] get-tuple-element(%c), index=3
  %d = bf16[16,32]{1,0} fusion(%c1, %c2, %c3), kind=kCustom, calls=%done_c
  ROOT %out = (bf16[16,32]{1,0}, bf16[8,16]{1,0}) tuple(%d, %y)
}
"""  # noqa: E501


def test_tpu_async_collective_fusions_are_one_collective_overlapping_the_fusion_that_carries_it():
    [gather] = collective_overlap(TPU_FORM, axis_sizes={"fsdp": 4}).collectives
    assert (gather.collective.kind, gather.start, gather.done, gather.status) == (
        "all-gather",
        "s",
        "d",
        OVERLAPPED,
    )
    # the carrier's convolution (8x16 @ 16x16) and its own output, not the collective buffers it passes on
    assert (gather.compute_ops, gather.compute_flops, gather.compute_bytes) == (
        1,
        2 * 8 * 16 * 16,
        8 * 16 * 2,
    )
    assert gather.collective.payload_bytes == 16 * 32 * 2


#: A collective pipelined across loop iterations: the body finishes the gather started in the previous
#: iteration (its buffer arrives through the loop carry), computes, and starts the next one.
PIPELINED = """HloModule m, is_scheduled=true, num_partitions=4
%body (c: (s32[], (f32[4,32], f32[16,32]), f32[8,8])) -> (s32[], (f32[4,32], f32[16,32]), f32[8,8]) {
  %c = (s32[], (f32[4,32]{1,0}, f32[16,32]{1,0}), f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %inflight = (f32[4,32]{1,0}, f32[16,32]{1,0}) get-tuple-element(%c), index=1
  %x = f32[8,8]{1,0} get-tuple-element(%c), index=2
  %g = f32[16,32]{1,0} all-gather-done(%inflight)
  %y = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %p = f32[4,32]{1,0} slice(%g), slice={[0:4], [0:32]}
  %next = (f32[4,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  %z = f32[8,8]{1,0} tanh(%y)
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], (f32[4,32]{1,0}, f32[16,32]{1,0}), f32[8,8]{1,0}) tuple(%n, %next, %z)
}
%cond (c: (s32[], (f32[4,32], f32[16,32]), f32[8,8])) -> pred[] {
  %c = (s32[], (f32[4,32]{1,0}, f32[16,32]{1,0}), f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}
ENTRY %main (a: s32[], s: (f32[4,32], f32[16,32]), x: f32[8,8]) -> f32[8,8] {
  %a = s32[] parameter(0)
  %s = (f32[4,32]{1,0}, f32[16,32]{1,0}) parameter(1)
  %x = f32[8,8]{1,0} parameter(2)
  %init = (s32[], (f32[4,32]{1,0}, f32[16,32]{1,0}), f32[8,8]{1,0}) tuple(%a, %s, %x)
  %w = (s32[], (f32[4,32]{1,0}, f32[16,32]{1,0}), f32[8,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,8]{1,0} get-tuple-element(%w), index=2
}
"""  # noqa: E501


def test_a_collective_pipelined_across_iterations_overlaps_the_ops_around_the_loop_edge():
    [gather] = collective_overlap(PIPELINED).collectives
    assert (gather.start, gather.done, gather.wraps_loop, gather.status) == ("next", "g", True, OVERLAPPED)
    # after the start: tanh (64 elements); before the done in the next iteration: nothing; the dot and
    # the slice sit between the done and the start, so they do not count
    assert (gather.compute_ops, gather.compute_flops, gather.compute_bytes) == (1, 0, 8 * 8 * 4)
    assert gather.collective.executions == 5 and gather.collective.axes is None


def test_collectives_in_a_loop_body_and_outside_are_summed_apart():
    # the pipelined gather in the loop body overlaps; a synchronous all-reduce after the loop does not
    text = PIPELINED.replace(
        "  ROOT %out = f32[8,8]{1,0} get-tuple-element(%w), index=2",
        "  %o = f32[8,8]{1,0} get-tuple-element(%w), index=2\n"
        "  ROOT %out = f32[8,8]{1,0} all-reduce(%o), channel_id=2, replica_groups=[1,4]<=[4], "
        "use_global_device_ids=true, to_apply=%cond",
    )
    report = collective_overlap(text)
    assert {(o.collective.kind, o.in_loop) for o in report.collectives} == {
        ("all-gather", True),
        ("all-reduce", False),
    }
    places = report.to_dict()["by_place"]
    assert (places["in_loops"]["fraction"], places["outside_loops"]["fraction"]) == (1.0, 0.0)
    assert places["in_loops"]["bytes"] == 5 * 16 * 32 * 4  # five iterations of the gathered f32[16,32]


def test_a_mesh_of_another_size_is_refused():
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
    with pytest.raises(MeshError, match="runs on 4 devices but the mesh has 8"):
        collective_overlap(SNIPPET, mesh)


def _tpu_devices() -> list[jax.Device]:
    missing = missing_compiler(TARGET)
    if missing is not None:
        pytest.skip(missing)
    return target_devices(TARGET)


def _token_shapes(batch_size: int) -> dict:
    tokens = jax.ShapeDtypeStruct((batch_size, CFG.seq_len), jnp.int32)
    return {"inputs": tokens, "targets": tokens}


def _train_step(plan, mesh, model, params):
    return make_train_step(model, optax.adamw(1e-3), plan, mesh, params)


@functools.cache
def _zero3_on_tpu():
    """(compiled ZeRO-3 step with the next layer prefetched on v5e-16, its mesh, global batch size)."""
    plan = plan_from_dict({"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": 3, "prefetch_layers": 1}})
    mesh = build_mesh(plan, _tpu_devices())
    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    train = _train_step(plan, mesh, layered_model(CFG), shapes)
    compiled = train.lower(train.abstract_state(), _token_shapes(train.global_batch_size)).compile()
    return compiled, mesh, train.global_batch_size


def test_zero3_on_tpu_gathers_every_layer_weight_once_forward_and_once_backward():
    compiled, mesh, _ = _zero3_on_tpu()
    report = collective_overlap(compiled, mesh)
    pairs = [o for o in report.collectives if o.is_async]
    assert pairs and all(o.done is not None for o in pairs), "async starts without their done"
    fraction = report.fraction()
    assert 0.0 <= fraction <= 1.0
    # each stacked weight matrix is gathered once in the forward and once in the (rematerialised)
    # backward pass; with the next layer prefetched, the forward loop gathers layers 1..L-1 and the
    # backward loop layers L-3..0, the other three gathers are outside the loops (the TPU compiler
    # gathers the norm scales by all-reduce)
    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    matrices = [math.prod(x.shape[1:]) for x in jax.tree.leaves(shapes["layers"]) if x.ndim >= 3]
    in_scan = [
        o for o in report.collectives if o.collective.kind == "all-gather" and o.collective.executions > 1
    ]
    gathered = sorted(
        (o.collective.result_bytes * 8 // element_bits(o.collective.dtype), o.collective.executions)
        for o in in_scan
    )
    expected = sorted([(m, CFG.layers - 1) for m in matrices] + [(m, CFG.layers - 2) for m in matrices])
    assert gathered == expected, (gathered, expected)
    assert any(o.status == OVERLAPPED for o in in_scan)
    assert {o.collective.axes for o in report.collectives} == {("fsdp",)}
    print(f"zero3 v5e-16 ({CFG.layers} layers, d_model {CFG.d_model}): overlapped fraction {fraction:.3f}")


def test_tpu_collectives_are_counted_once_not_once_per_fusion_that_carries_them():
    """libtpu copies an async collective into the compute fusions that carry it (same channel id):
    the inspect report's list counts it once, as the overlap report does."""
    compiled, mesh, _ = _zero3_on_tpu()
    every, once = collectives(compiled, mesh), collectives_once(compiled, mesh)
    entries = collective_overlap(compiled, mesh).collectives
    assert len(once) == len(entries) < len(every)
    assert sum(c.payload_bytes_per_step for c in once) == sum(o.bytes_per_step for o in entries)


def test_gspmd_fsdp_gathered_step_on_tpu_is_measured_the_same_way():
    _, mesh, batch_size = _zero3_on_tpu()
    optimizer = optax.adamw(1e-3)
    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    jitted, _ = load_common()._baseline_functions(
        layered_model(CFG), optimizer, shapes, mesh, kind="fsdp_gathered", key=CFG
    )
    state = jax.eval_shape(lambda p: (p, optimizer.init(p)), shapes)
    with jax.numpy_dtype_promotion("standard"):  # the plain-jit baseline mixes Python floats and ints
        compiled = jitted.lower(state, _token_shapes(batch_size)).compile()
    report = collective_overlap(compiled, mesh)
    assert [o for o in report.collectives if o.is_async], "GSPMD's program has no async collective"
    assert 0.0 <= report.fraction() <= 1.0
    print(f"jit_fsdp_gathered v5e-16: overlapped fraction {report.fraction():.3f}")
