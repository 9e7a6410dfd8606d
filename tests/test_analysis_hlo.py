"""Collectives read from compiled shard_map programs on 8 simulated CPU devices.

Each program places known collectives; the parser must find exactly those, with
their mesh axes, element type, bytes per device and executions per call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torsh_jax.analysis import Collective, collectives
from torsh_jax.errors import MeshError

AUTO = jax.sharding.AxisType.Auto
ROWS = 16  # rows per device of the (8 * ROWS, 4) input


@pytest.fixture(scope="module")
def mesh_2x4() -> Mesh:
    require_devices(8)
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AUTO, AUTO))


@pytest.fixture(scope="module")
def mesh_8() -> Mesh:
    require_devices(8)
    return jax.make_mesh((8,), ("data",), axis_types=(AUTO,))


def _compile(fn, mesh: Mesh, *args, in_specs=None, out_specs=None):
    all_axes = P(tuple(mesh.axis_names))
    program = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs if in_specs is not None else all_axes,
        out_specs=out_specs if out_specs is not None else all_axes,
        check_vma=False,
    )
    return jax.jit(program).lower(*args).compile()


def _only(found: list[Collective]) -> Collective:
    assert len(found) == 1, [(c.kind, c.axes) for c in found]
    return found[0]


def _ring(i: int, n: int) -> list[tuple[int, int]]:
    return [(j, (j + i) % n) for j in range(n)]


# (id, fn, kind, axes, group size, operand bytes, result bytes) for a f32[16, 4] shard (256 bytes).
CASES = [
    ("psum_data", lambda x: lax.psum(x, "data"), "all-reduce", ("data",), 2, 256, 256),
    ("psum_fsdp", lambda x: lax.psum(x, "fsdp"), "all-reduce", ("fsdp",), 4, 256, 256),
    ("psum_both", lambda x: lax.psum(x, ("data", "fsdp")), "all-reduce", ("data", "fsdp"), 8, 256, 256),
    ("psum_scatter_fsdp", lambda x: lax.psum_scatter(x, "fsdp", tiled=True), "reduce-scatter",
     ("fsdp",), 4, 256, 64),
    ("psum_scatter_both", lambda x: lax.psum_scatter(x, ("data", "fsdp"), tiled=True), "reduce-scatter",
     ("data", "fsdp"), 8, 256, 32),
    ("all_gather_data", lambda x: lax.all_gather(x, "data", tiled=True), "all-gather", ("data",), 2,
     256, 512),
    ("all_gather_fsdp_data", lambda x: lax.all_gather(x, ("fsdp", "data"), tiled=True), "all-gather",
     ("fsdp", "data"), 8, 256, 2048),
    ("all_to_all_fsdp", lambda x: lax.all_to_all(x, "fsdp", 0, 0, tiled=True), "all-to-all", ("fsdp",), 4,
     256, 256),
    ("ppermute_fsdp", lambda x: lax.ppermute(x, "fsdp", _ring(1, 4)), "collective-permute", ("fsdp",), 4,
     256, 256),
    ("ppermute_data", lambda x: lax.ppermute(x, "data", _ring(1, 2)), "collective-permute", ("data",), 2,
     256, 256),
]  # fmt: skip


@pytest.mark.parametrize(
    "fn, kind, axes, group_size, operand_bytes, result_bytes",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_single_collective_f32(mesh_2x4, fn, kind, axes, group_size, operand_bytes, result_bytes):
    compiled = _compile(fn, mesh_2x4, jnp.ones((8 * ROWS, 4), jnp.float32))
    c = _only(collectives(compiled, mesh_2x4))
    assert (c.kind, c.axes, c.dtype, c.group_size) == (kind, axes, "f32", group_size)
    assert (c.operand_bytes, c.result_bytes) == (operand_bytes, result_bytes)
    assert (c.executions, c.in_loop, c.trip_count) == (1, False, None)


def test_wire_and_payload_bytes_follow_ring_formulas(mesh_2x4):
    def program(x):
        return (
            lax.psum(x, "fsdp"),
            lax.psum_scatter(x, "fsdp", tiled=True),
            lax.all_gather(x, "fsdp", tiled=True),
            lax.all_to_all(x, "fsdp", 0, 0, tiled=True),
            lax.ppermute(x, "fsdp", _ring(1, 4)),
        )

    specs = P(("data", "fsdp"))
    compiled = _compile(program, mesh_2x4, jnp.ones((8 * ROWS, 4)), out_specs=(specs,) * 5)
    by_kind = {c.kind: c for c in collectives(compiled, mesh_2x4)}
    assert sorted(by_kind) == sorted(["all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                                      "collective-permute"])  # fmt: skip
    payload = {kind: c.payload_bytes for kind, c in by_kind.items()}
    wire = {kind: c.wire_bytes for kind, c in by_kind.items()}
    assert payload == {"all-reduce": 256, "reduce-scatter": 256, "all-gather": 1024, "all-to-all": 256,
                       "collective-permute": 256}  # fmt: skip
    assert wire == {"all-reduce": 2 * 256 * 3 / 4, "reduce-scatter": 256 * 3 / 4, "all-gather": 1024 * 3 / 4,
                    "all-to-all": 256 * 3 / 4, "collective-permute": 256.0}  # fmt: skip


def test_int8_collectives_stay_int8(mesh_2x4):
    x = jnp.ones((8 * ROWS, 4), jnp.int8)
    for fn, kind, nbytes in [
        (lambda v: lax.psum(v, "fsdp"), "all-reduce", 64),
        (lambda v: lax.all_to_all(v, "fsdp", 0, 0, tiled=True), "all-to-all", 64),
        (lambda v: lax.all_gather(v, "data", tiled=True), "all-gather", 128),
    ]:
        c = _only(collectives(_compile(fn, mesh_2x4, x), mesh_2x4))
        assert (c.kind, c.dtype, c.payload_bytes) == (kind, "s8", nbytes)


@pytest.mark.parametrize(
    "fn",
    [
        lambda v: lax.psum(v, "fsdp"),
        lambda v: lax.all_gather(v, "fsdp", tiled=True),
        lambda v: lax.psum_scatter(v, "fsdp", tiled=True),
        lambda v: lax.ppermute(v, "fsdp", _ring(1, 4)),
        lambda v: lax.all_to_all(v, "fsdp", 0, 0, tiled=True),
    ],
    ids=["psum", "all_gather", "psum_scatter", "ppermute", "all_to_all"],
)
def test_cpu_widens_bf16_collectives_to_f32(mesh_2x4, fn):
    """The CPU backend runs bf16 collectives in f32: twice the bytes of the bf16 data."""
    x = jnp.ones((8 * ROWS, 4), jnp.bfloat16)
    c = _only(collectives(_compile(fn, mesh_2x4, x), mesh_2x4))
    assert c.dtype == "f32"
    assert c.operand_bytes == ROWS * 4 * 4  # the bf16[16, 4] shard sent as f32
    assert c.widened_from == "bf16"
    assert c.unwidened_payload_bytes * 2 == c.payload_bytes


def test_combined_all_reduce_lists_both_operands(mesh_2x4):
    """Two psums over the same axes in one call become one tuple all-reduce."""

    def program(x):
        return lax.psum((x, 2 * x), "data")

    specs = P(("data", "fsdp"))
    compiled = _compile(program, mesh_2x4, jnp.ones((8 * ROWS, 4)), out_specs=(specs, specs))
    c = _only(collectives(compiled, mesh_2x4))
    assert (c.kind, c.axes, c.dtype) == ("all-reduce", ("data",), "f32")
    assert c.operand_shapes == ("f32[16,4]", "f32[16,4]")
    assert c.payload_bytes == 512


def test_scan_body_collective_runs_trip_count_times(mesh_2x4):
    def program(x):
        def body(carry, _):
            return lax.psum(carry, "data") * 0.5, None

        return lax.scan(body, x, None, length=7)[0]

    c = _only(collectives(_compile(program, mesh_2x4, jnp.ones((8 * ROWS, 4))), mesh_2x4))
    assert (c.kind, c.axes, c.in_loop, c.trip_count, c.executions) == ("all-reduce", ("data",), True, 7, 7)
    assert c.payload_bytes_per_step == 7 * 256
    assert c.wire_bytes_per_step == 7 * 256.0


def test_loop_invariant_collective_is_hoisted_out_of_the_scan(mesh_2x4):
    """XLA moves an all-gather of a value the body does not change out of the loop: it runs once."""

    def program(x, y):
        def body(carry, _):
            gathered = lax.all_gather(y, "fsdp", tiled=True)
            return carry + gathered.sum(), None

        return lax.scan(body, x, None, length=6)[0]

    specs = (P(("data", "fsdp")), P("fsdp"))
    compiled = _compile(program, mesh_2x4, jnp.ones((8 * ROWS, 4)), jnp.ones((8, 4)), in_specs=specs)
    c = _only(collectives(compiled, mesh_2x4))
    assert (c.kind, c.in_loop, c.executions) == ("all-gather", False, 1)


def test_nested_scans_multiply_executions(mesh_8):
    def program(x):
        def inner(carry, _):
            return lax.ppermute(carry, "data", _ring(1, 8)), None

        def outer(carry, _):
            return lax.scan(inner, carry, None, length=3)[0] + 1.0, None

        return lax.scan(outer, x, None, length=4)[0]

    c = _only(collectives(_compile(program, mesh_8, jnp.ones((8 * ROWS, 4))), mesh_8))
    assert (c.kind, c.axes, c.trip_count, c.executions) == ("collective-permute", ("data",), 3, 12)


def test_collectives_inside_and_outside_a_loop(mesh_8):
    def program(x):
        def body(carry, _):
            return lax.psum_scatter(carry, "data", tiled=True).repeat(8, axis=0), None

        looped = lax.scan(body, x, None, length=5)[0]
        return lax.all_gather(looped[:2], "data", tiled=True)

    compiled = _compile(program, mesh_8, jnp.ones((8 * ROWS, 4)))
    found = {c.kind: c for c in collectives(compiled, mesh_8)}
    assert sorted(found) == ["all-gather", "reduce-scatter"]
    assert (found["reduce-scatter"].executions, found["reduce-scatter"].payload_bytes) == (5, 256)
    assert (found["all-gather"].executions, found["all-gather"].in_loop) == (1, False)
    assert found["all-gather"].payload_bytes == 8 * 2 * 4 * 4


def test_axes_follow_a_permuted_device_order():
    """Replica groups name positions in the program's device order, not device ids."""
    devices = np.array(require_devices(8))[::-1].reshape(2, 4)
    mesh = Mesh(devices, ("data", "fsdp"), axis_types=(AUTO, AUTO))
    c = _only(collectives(_compile(lambda x: lax.psum(x, "data"), mesh, jnp.ones((8 * ROWS, 4))), mesh))
    assert c.axes == ("data",)
    assert c.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_gspmd_inserted_all_reduce_is_found(mesh_2x4):
    """A sharded contraction without shard_map: XLA adds the all-reduce itself."""
    from jax.sharding import NamedSharding

    a = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh_2x4, P("data", "fsdp")))
    w = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh_2x4, P("fsdp", None)))
    compiled = jax.jit(jnp.matmul).lower(a, w).compile()
    c = _only(collectives(compiled, mesh_2x4))
    assert (c.kind, c.axes, c.dtype, c.payload_bytes) == ("all-reduce", ("fsdp",), "f32", 8 * 8 * 4)


def test_wrong_mesh_size_is_an_error(mesh_2x4):
    small = jax.make_mesh((4,), ("data",), axis_types=(AUTO,), devices=jax.devices()[:4])
    compiled = _compile(lambda x: lax.psum(x, "fsdp"), mesh_2x4, jnp.ones((8 * ROWS, 4)))
    with pytest.raises(MeshError, match="8 devices but the mesh has 4"):
        collectives(compiled, small)


def test_three_axis_mesh_orders_axes_as_the_groups_do():
    require_devices(8)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AUTO,) * 3)

    def program(x):
        return lax.psum(x, ("data", "tensor")), lax.all_gather(x, ("tensor", "data"), tiled=True)

    specs = P(("data", "fsdp", "tensor"))
    compiled = _compile(program, mesh, jnp.ones((8 * ROWS, 4)), out_specs=(specs, specs))
    found = {c.kind: c for c in collectives(compiled, mesh)}
    assert found["all-reduce"].axes == ("data", "tensor")
    assert found["all-gather"].axes == ("tensor", "data")
    assert found["all-gather"].replica_groups == ((0, 4, 1, 5), (2, 6, 3, 7))


def test_abstract_mesh_is_accepted(mesh_2x4):
    compiled = _compile(lambda x: lax.psum(x, "data"), mesh_2x4, jnp.ones((8 * ROWS, 4)))
    assert _only(collectives(compiled, mesh_2x4.abstract_mesh)).axes == ("data",)
