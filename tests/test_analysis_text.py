"""The HLO text reader on hand-written modules: forms the CPU backend does not print.

Async pairs (GPU/TPU), iota replica groups, group modes, loops without
``known_trip_count`` and typed operands (older printers) are covered here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torsh_jax.analysis import collectives_from_text
from torsh_jax.analysis._groups import axes_for_groups, device_groups, parse_replica_groups
from torsh_jax.analysis._hlo_text import ArrayShape, parse_module, parse_shape, shape_bytes
from torsh_jax.errors import NotSupportedYetError

MESH = {"data": 2, "fsdp": 4}


def _module(body: str, *, header: str = "num_partitions=8", extra: str = "") -> str:
    return f"""HloModule m, is_scheduled=true, {header}

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}
{extra}
ENTRY %main (p: f32[16,4]) -> f32[16,4] {{
  %p = f32[16,4]{{1,0}} parameter(0)
{body}
}}
"""


@pytest.mark.parametrize(
    "text, groups",
    [
        ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("{}", ()),
    ],
    ids=["explicit", "iota", "iota_transposed", "iota_all", "iota_strided", "empty"],
)
def test_parse_replica_groups(text, groups):
    assert parse_replica_groups(text) == groups


@pytest.mark.parametrize(
    "groups, axes",
    [
        ([[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
        ([[0, 1, 2, 3], [4, 5, 6, 7]], ("fsdp",)),
        ([list(range(8))], ("data", "fsdp")),
        ([[0, 4, 1, 5, 2, 6, 3, 7]], ("fsdp", "data")),
        ([[0], [1], [2], [3], [4], [5], [6], [7]], ()),
        ([[0, 1], [2, 3], [4, 5], [6, 7]], ("fsdp",)),  # within fsdp groups: smallest subset holding them
        ([[0, 9]], None),
    ],
    ids=["data", "fsdp", "both", "both_fsdp_major", "single", "partial", "outside"],
)
def test_axes_for_groups(groups, axes):
    assert axes_for_groups(groups, MESH) == axes


def test_size_one_axes_are_ignored():
    assert axes_for_groups([[0, 1, 2, 3]], {"data": 1, "stage": 1, "fsdp": 4, "tensor": 1}) == ("fsdp",)


def test_device_group_modes():
    kw = {"replica_count": 2, "num_partitions": 2}
    assert device_groups(((0, 1),), mode="cross_replica", **kw) == ((0, 2), (1, 3))
    assert device_groups(((0, 1),), mode="cross_partition", **kw) == ((0, 1), (2, 3))
    assert device_groups(((0,),), mode="cross_replica_and_partition", **kw) == ((0, 1),)
    assert device_groups((), mode="flattened_id", **kw) == ((0, 1, 2, 3),)


def test_shapes_and_bytes():
    shape = parse_shape("(f32[16,4]{1,0}, /*index=1*/bf16[3]{0}, s8[], (u8[2,2], s4[3]))")
    assert shape[0] == ArrayShape("f32", (16, 4))
    assert shape_bytes(shape) == 256 + 6 + 1 + 4 + 2


def test_iota_groups_give_axes():
    body = (
        "  ROOT %ar = f32[16,4]{1,0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), "
        "use_global_device_ids=true, to_apply=%add"
    )
    [c] = collectives_from_text(_module(body), axis_sizes=MESH)
    assert (c.kind, c.axes, c.group_size, c.payload_bytes, c.wire_bytes) == ("all-reduce", ("data",), 2, 256,
                                                                              256.0)  # fmt: skip


def test_async_pairs_are_counted_once():
    body = """  %ags = (f32[16,4]{1,0}, f32[64,4]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[64,4]{1,0} all-gather-done(%ags)
  %ars = f32[16,4]{1,0} all-reduce-start(%p), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = f32[16,4]{1,0} all-reduce-done(%ars)
  %cps = (f32[16,4]{1,0}, f32[16,4]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  ROOT %cpd = f32[16,4]{1,0} collective-permute-done(%cps)"""  # noqa: E501
    found = collectives_from_text(_module(body), axis_sizes=MESH)
    summary = [(c.kind, c.opcode, c.axes, c.operand_bytes, c.result_bytes) for c in found]
    assert summary == [
        ("all-gather", "all-gather-start", ("fsdp",), 256, 1024),
        ("all-reduce", "all-reduce-start", ("data", "fsdp"), 256, 256),
        ("collective-permute", "collective-permute-start", ("data",), 256, 256),
    ]


def test_async_wrapped_reduce_scatter_counts_once():
    extra = """
%async_rs (q: f32[16,4]) -> f32[4,4] {
  %q = f32[16,4]{1,0} parameter(0)
  ROOT %rs = f32[4,4]{1,0} reduce-scatter(%q), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}
"""  # noqa: E501
    body = """  %start = ((f32[16,4]{1,0}), f32[4,4]{1,0}) async-start(%p), calls=%async_rs
  ROOT %done = f32[4,4]{1,0} async-done(%start), calls=%async_rs"""
    [c] = collectives_from_text(_module(body, extra=extra), axis_sizes=MESH)
    assert (c.kind, c.axes, c.executions, c.computation, c.payload_bytes) == ("reduce-scatter", ("fsdp",), 1,
                                                                               "async_rs", 256)  # fmt: skip


def _loop(backend_config: str, bound_constants: str) -> str:
    extra = f"""
%body (t: (s32[], f32[16,4])) -> (s32[], f32[16,4]) {{
  %t = (s32[], f32[16,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[16,4]{{1,0}} get-tuple-element(%t), index=1
  %ar = f32[16,4]{{1,0}} all-reduce(%v), channel_id=1, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
  ROOT %out = (s32[], f32[16,4]{{1,0}}) tuple(%i, %ar)
}}

%cond (c: (s32[], f32[16,4])) -> pred[] {{
  %c = (s32[], f32[16,4]{{1,0}}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
{bound_constants}
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}}
"""  # noqa: E501
    body = f"""  %zero = s32[] constant(0)
  %init = (s32[], f32[16,4]{{1,0}}) tuple(%zero, %p)
  %w = (s32[], f32[16,4]{{1,0}}) while(%init), condition=%cond, body=%body{backend_config}
  ROOT %r = f32[16,4]{{1,0}} get-tuple-element(%w), index=1"""
    return _module(body, extra=extra)


@pytest.mark.parametrize(
    "backend_config, constants, trips",
    [
        (', backend_config={"known_trip_count":{"n":"9"}}', "  %n = s32[] constant(6)", 9),
        ("", "  %n = s32[] constant(6)", 6),
        (', backend_config={"known_init_step":{"init":"2","step":"1"}}', "  %n = s32[] constant(6)", 4),
        ("", "  %n = s32[] constant(6)\n  %m = s32[] constant(3)", None),
    ],
    ids=["known_trip_count", "condition_constant", "init_step", "unknown"],
)
def test_loop_trip_counts(backend_config, constants, trips):
    [c] = collectives_from_text(_loop(backend_config, constants), axis_sizes=MESH)
    assert (c.in_loop, c.trip_count, c.executions) == (True, trips, trips or 1)
    assert c.computation == "body"


def test_group_modes_in_modules():
    body = """  %a = f32[16,4]{1,0} all-reduce(%p), channel_id=1, replica_groups={}, to_apply=%add
  %b = f32[16,4]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add
  ROOT %c = f32[16,4]{1,0} all-to-all(%p), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}"""  # noqa: E501
    found = collectives_from_text(_module(body), axis_sizes=MESH)
    assert [(c.axes, c.group_size) for c in found] == [(("data", "fsdp"), 8), ((), 1), (("data",), 2)]
    assert found[1].wire_bytes == 0.0


def test_typed_operands_of_older_printers():
    body = (
        "  ROOT %ag = f32[32,4]{1,0} all-gather(f32[16,4]{1,0} %p), channel_id=1, "
        "replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true"
    )
    [c] = collectives_from_text(_module(body), axis_sizes=MESH)
    assert (c.operand_shapes, c.result_shapes, c.payload_bytes) == (("f32[16,4]",), ("f32[32,4]",), 512)


def test_without_axis_sizes_axes_are_none():
    body = (
        "  ROOT %ar = f32[16,4]{1,0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], "
        "use_global_device_ids=true, to_apply=%add"
    )
    [c] = collectives_from_text(_module(body))
    assert c.axes is None and c.group_size == 4


def test_module_header_facts():
    module = parse_module(
        _module("  ROOT %n = f32[16,4]{1,0} negate(%p)", header="num_partitions=4, replica_count=2")
    )
    assert (module.entry, module.num_partitions, module.replica_count) == ("main", 4, 2)
    assert sorted(module.computations) == ["add", "main"]


@pytest.mark.parametrize(
    "text, match",
    [
        ("ENTRY %main () -> f32[] {}", "HloModule"),
        ("HloModule m\n%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n", "ENTRY"),
        (
            _module("  ROOT %ar = f32[16,4]{1,0} all-reduce(%p), replica_groups=<weird>, to_apply=%add"),
            "replica groups",
        ),
        (_module("  ROOT %x = q7[16,4]{1,0} all-reduce(%p), to_apply=%add"), "q7"),
    ],
    ids=["no_header", "no_entry", "bad_groups", "unknown_type"],
)
def test_unreadable_text_raises(text, match):
    with pytest.raises(NotSupportedYetError, match=match):
        collectives_from_text(text, axis_sizes=MESH)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_axes_for_groups_recovers_any_ordered_axis_subset(data):
    names = ("data", "stage", "fsdp", "tensor")[: data.draw(st.integers(1, 4))]
    shape = {name: data.draw(st.integers(1, 3), label=name) for name in names}
    candidates = [a for a in names if shape[a] > 1]
    if not candidates:
        return
    chosen = data.draw(st.permutations(candidates))[: data.draw(st.integers(1, len(candidates)))]
    ids = np.arange(int(np.prod(list(shape.values())))).reshape(tuple(shape.values()))
    rest = [names.index(a) for a in names if a not in chosen]
    groups = ids.transpose(rest + [names.index(a) for a in chosen]).reshape(
        -1, int(np.prod([shape[a] for a in chosen]))
    )
    shuffled = data.draw(st.permutations(groups.tolist()))
    assert axes_for_groups(shuffled, shape) == tuple(chosen)


def test_a_computation_called_from_two_places_adds_up():
    extra = """
%reduce_grads (g: f32[16,4]) -> f32[16,4] {
  %g = f32[16,4]{1,0} parameter(0)
  ROOT %ar = f32[16,4]{1,0} all-reduce(%g), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
}

%body (t: (s32[], f32[16,4])) -> (s32[], f32[16,4]) {
  %t = (s32[], f32[16,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[16,4]{1,0} get-tuple-element(%t), index=1
  %r = f32[16,4]{1,0} call(%v), to_apply=%reduce_grads
  ROOT %out = (s32[], f32[16,4]{1,0}) tuple(%i, %r)
}

%cond (c: (s32[], f32[16,4])) -> pred[] {
  %c = (s32[], f32[16,4]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}
"""  # noqa: E501
    body = """  %zero = s32[] constant(0)
  %init = (s32[], f32[16,4]{1,0}) tuple(%zero, %p)
  %w = (s32[], f32[16,4]{1,0}) while(%init), condition=%cond, body=%body
  %once = f32[16,4]{1,0} call(%p), to_apply=%reduce_grads
  ROOT %r = f32[16,4]{1,0} get-tuple-element(%w), index=1"""
    [c] = collectives_from_text(_module(body, extra=extra), axis_sizes=MESH)
    assert (c.computation, c.axes, c.executions, c.in_loop) == ("reduce_grads", ("data",), 5, True)
