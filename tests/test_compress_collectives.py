"""Compressed collectives in shard_map on 8 simulated devices, against jnp reference maths.

Wire bytes come from the compiled HLO: every collective's result shapes,
weighted by what one device sends in a ring (all-reduce 2(N-1)/N of the
buffer, all-gather and all-to-all (N-1)/N of the result).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from jax.sharding import PartitionSpec as P

from torsh_jax.compress import (
    compressed_all_gather,
    compressed_all_reduce,
    compressed_reduce_scatter,
    init_feedback,
    make_compressor,
    padded_length,
    powersgd,
)
from torsh_jax.errors import CompressionError
from torsh_jax.plan import CompressorSpec

N = 8
SPECS = {
    "int8": CompressorSpec(method="int8"),
    "int8_stochastic": CompressorSpec(method="int8", rounding="stochastic"),
    "int4": CompressorSpec(method="int4"),
    "sign": CompressorSpec(method="sign"),
    "fp16": CompressorSpec(method="fp16"),
    "bf16": CompressorSpec(method="bf16", error_feedback=False),
    "topk": CompressorSpec(method="topk", chunk_size=256, topk_fraction=0.05),
    "powersgd": CompressorSpec(method="powersgd", rank=2),
}


def _mesh(shape=(N,), names=("data",)):
    require_devices(int(np.prod(shape)))
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _global_feedback(spec, length, axis_size, copies):
    fb = init_feedback(spec, length=length, axis_size=axis_size)
    return jax.tree.map(lambda a: jnp.concatenate([a] * copies), fb)


@functools.cache
def _compiled(fn, spec, out_spec):
    """One jitted shard_map per (collective, spec), reused across steps (no recompiles)."""

    def body(x, fb, key):
        return fn(x, fb, spec=spec, axis_name="data", axis_size=N, key=key)

    specs = (P("data"), P("data"), P())
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=specs, out_specs=(out_spec, P("data"))))


REPLICATED = P()


def _run(fn, spec, xs, fb, key=None, *, out_spec=REPLICATED):
    require_devices(N)
    return _compiled(fn, spec, out_spec)(xs.reshape(-1), fb, key)


def _per_device(fb, i):
    return jax.tree.map(lambda a: a[i * (a.shape[0] // N) : (i + 1) * (a.shape[0] // N)], fb)


def _device_key(key, i, phase):
    return None if key is None else jax.random.fold_in(jax.random.fold_in(key, i), phase)


def _compress(c, spec, x, residual, key):
    if spec.error_feedback:
        return c.compress_with_feedback(x, residual, key=key)
    return c.compress(x, (), key=key)[0], residual


def _fixed_order_sum(parts):
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _reference_all_reduce(spec, xs, fbs, key):
    """jnp twin of the two-phase all-reduce (mean) for one step; returns (out, fbs)."""
    c = make_compressor(spec)
    sent = []
    for i in range(N):
        payload, worker = _compress(c, spec, xs[i], fbs[i].worker, _device_key(key, i, 1))
        sent.append(c.decompress(payload).reshape(N, -1))
        fbs[i] = fbs[i]._replace(worker=worker)
    shards = []
    for j in range(N):
        reduced = _fixed_order_sum([sent[i][j] for i in range(N)]) / jnp.float32(N)
        payload, server = _compress(c, spec, reduced, fbs[j].server, _device_key(key, j, 2))
        shards.append(c.decompress(payload))
        fbs[j] = fbs[j]._replace(server=server)
    return jnp.concatenate(shards), fbs


def _reference_topk(spec, xs, fbs):
    c = make_compressor(spec)
    dense = []
    for i in range(N):
        payload, worker = _compress(c, spec, xs[i], fbs[i].worker, None)
        dense.append(c.decompress(payload))
        fbs[i] = fbs[i]._replace(worker=worker)
    return _fixed_order_sum(dense) / jnp.float32(N), fbs


def _reference_powersgd(xs, fbs):
    ms = [(xs[i] + fbs[i].worker).reshape(powersgd.matrix_shape(xs.shape[1])) for i in range(N)]
    p = powersgd.orthonormalise(sum(m @ fbs[0].warm_start for m in ms))
    q_locals = [m.T @ p for m in ms]
    q = sum(q_locals) / N
    fbs = [
        fb._replace(worker=(m - p @ ql.T).reshape(-1), warm_start=q) for fb, m, ql in zip(fbs, ms, q_locals)
    ]
    return (p @ q.T).reshape(-1), fbs


def _reference(spec, xs, fbs, key):
    if spec.method == "topk":
        return _reference_topk(spec, xs, fbs)
    if spec.method == "powersgd":
        return _reference_powersgd(xs, fbs)
    return _reference_all_reduce(spec, xs, fbs, key)


def _inputs(step, n):
    return jax.random.normal(jax.random.key(step), (N, n)) * jnp.linspace(0.1, 2.0, N)[:, None]


@pytest.mark.parametrize("name", list(SPECS))
def test_all_reduce_matches_reference_over_steps(name):
    spec = SPECS[name]
    n = 2048
    fb = _global_feedback(spec, n, N, N)
    fbs = [_per_device(fb, i) for i in range(N)]
    for step in range(3):
        xs, key = _inputs(step, n), jax.random.key(50 + step)
        out, fb = _run(compressed_all_reduce, spec, xs, fb, key)
        expected, fbs = _reference(spec, xs, fbs, key)
        scale = float(jnp.abs(expected).max())
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * scale)
        for i in range(N):
            np.testing.assert_allclose(_per_device(fb, i).worker, fbs[i].worker, rtol=1e-5, atol=1e-5 * scale)
            np.testing.assert_allclose(_per_device(fb, i).server, fbs[i].server, rtol=1e-5, atol=1e-5 * scale)
    assert int(fb.step[0]) == 3
    if spec.method in ("int8", "fp16", "bf16"):  # accurate compressors: close to the true mean
        np.testing.assert_allclose(out, xs.mean(axis=0), atol=0.05 * float(jnp.abs(xs).max()))


@pytest.mark.parametrize("name", ["int8", "int4", "sign", "fp16", "topk", "powersgd"])
def test_reduce_scatter_returns_this_devices_shard(name):
    spec = SPECS[name]
    n = 2048
    fb = _global_feedback(spec, n, N, N)
    xs = _inputs(7, n)
    shards, _ = _run(compressed_reduce_scatter, spec, xs, fb, out_spec=P("data"))
    assert shards.shape == (n,)
    if spec.method == "powersgd":
        fbs = [_per_device(fb, i) for i in range(N)]
        expected, _ = _reference_powersgd(xs, fbs)
    else:
        c = make_compressor(spec)
        fbs = [_per_device(fb, i) for i in range(N)]
        sent = [c.decompress(_compress(c, spec, xs[i], fbs[i].worker, None)[0]) for i in range(N)]
        expected = _fixed_order_sum(sent) / jnp.float32(N)
    np.testing.assert_allclose(shards, expected, rtol=1e-5, atol=1e-6)


def test_error_feedback_identity_through_the_two_phase_all_reduce():
    """sum_t out_t == mean_i sum_t g_i,t - mean_i E_i,T - S_T (S the server residuals, gathered)."""
    spec = SPECS["sign"]
    n = 2048
    fb = _global_feedback(spec, n, N, N)
    total_out, total_in = jnp.zeros(n), jnp.zeros(n)
    for step in range(10):
        xs = _inputs(step, n)
        out, fb = _run(compressed_all_reduce, spec, xs, fb)
        total_out, total_in = total_out + out, total_in + xs.mean(axis=0)
    worker_mean = fb.worker.reshape(N, n).mean(axis=0)
    expected = total_in - worker_mean - fb.server
    np.testing.assert_allclose(total_out, expected, atol=1e-5 * float(jnp.abs(total_in).max()))


@pytest.mark.parametrize("method", ["int8", "int4", "bf16"])
def test_all_gather_of_weights(method):
    spec = CompressorSpec(method=method)
    mesh = _mesh()
    weights = jax.random.normal(jax.random.key(1), (N * 512,))

    def body(shard):
        return compressed_all_gather(shard, spec=spec, axis_name="data", axis_size=N)

    gathered = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))(weights)
    c = make_compressor(spec)
    expected = jnp.concatenate([c.decompress(c.compress(s, ())[0]) for s in weights.reshape(N, -1)])
    np.testing.assert_array_equal(gathered, expected)
    if method == "int8":
        step = jnp.repeat(jnp.abs(weights.reshape(-1, 256)).max(axis=1) / 127, 256)
        assert bool((jnp.abs(gathered - weights) <= 0.5 * step * (1 + 1e-6)).all())


def test_all_gather_rejects_gradient_only_methods():
    with pytest.raises(CompressionError, match="weight"):
        compressed_all_gather(jnp.zeros(256), spec=SPECS["sign"], axis_name="data", axis_size=N)


def test_two_axis_mesh_reduces_over_one_axis():
    """2 x 4 mesh: all-reduce over 'data' (size 2) only; each 'tensor' column keeps its own values."""
    mesh = _mesh((2, 4), ("data", "tensor"))
    spec = SPECS["int8"]
    n = 1024
    xs = jax.random.normal(jax.random.key(3), (2, 4, n))
    fb = jax.tree.map(
        lambda a: jnp.stack([jnp.stack([a] * 4)] * 2), init_feedback(spec, length=n, axis_size=2)
    )

    def body(x, fb):
        out, fb = compressed_all_reduce(
            x.reshape(-1), jax.tree.map(lambda a: a[0, 0], fb), spec=spec, axis_name="data", axis_size=2
        )
        return out[None, None], jax.tree.map(lambda a: a[None, None], fb)

    specs = P("data", "tensor")
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, specs), out_specs=(P(None, "tensor"), specs))
    out, _ = jax.jit(mapped)(xs, fb)
    c = make_compressor(spec)
    for col in range(4):
        sent = [c.decompress(c.compress(xs[i, col], ())[0]).reshape(2, -1) for i in range(2)]
        shards = [(sent[0][j] + sent[1][j]) / jnp.float32(2) for j in range(2)]
        expected = jnp.concatenate([c.decompress(c.compress(s, ())[0]) for s in shards])
        np.testing.assert_allclose(out[0, col], expected, rtol=1e-5, atol=1e-6)


def test_warmup_steps_use_the_plain_reduction():
    spec = CompressorSpec(method="sign", warmup_steps=2)
    n = 2048
    fb = _global_feedback(spec, n, N, N)
    outs = []
    for step in range(3):
        xs = _inputs(step, n)
        out, fb = _run(compressed_all_reduce, spec, xs, fb)
        outs.append((out, xs.mean(axis=0)))
    for out, mean in outs[:2]:
        np.testing.assert_allclose(out, mean, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(outs[2][0] - outs[2][1]).max()) > 1e-3  # compressed from step 2 on


def test_pallas_interpret_collective_equals_reference():
    """The Pallas interpreter types in-kernel iotas as replicated, so shard_map runs without vma checks."""
    spec = CompressorSpec(method="int4", rounding="stochastic")
    n, mesh = 2048, _mesh()
    fb, xs, key = _global_feedback(spec, n, N, N), _inputs(1, n), jax.random.key(2)
    results = []
    for implementation in ("reference", "pallas_interpret"):

        def body(x, fb, key, implementation=implementation):
            return compressed_all_reduce(
                x, fb, spec=spec, axis_name="data", axis_size=N, key=key, implementation=implementation
            )

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P("data"), P()), out_specs=(P(), P("data")), check_vma=False
        )
        results.append(jax.jit(mapped)(xs.reshape(-1), fb, key))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_array_equal(a, b)


# --- bytes on the wire, from the compiled HLO -------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
_DTYPE_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)\("
)
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def wire_bytes(hlo_text: str, group_size: int) -> dict[str, float]:
    """Bytes one device sends per collective kind (ring model) in compiled HLO text."""
    sent: dict[str, float] = {}
    share = (group_size - 1) / group_size
    for match in _COLLECTIVE.finditer(hlo_text):
        shapes, kind = match.groups()
        size = sum(
            _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            for dtype, dims in _SHAPE.findall(shapes)
        )
        factor = {"all-reduce": 2 * share, "reduce-scatter": (group_size - 1), "collective-permute": 1.0}
        sent[kind] = sent.get(kind, 0.0) + size * factor.get(kind, share)
    return sent


def _compiled_text(spec, n):
    mesh = _mesh()
    if spec is None:
        body = lambda x: jax.lax.pmean(x, "data")
        mapped = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P())
        return jax.jit(mapped).lower(jnp.zeros(N * n)).compile().as_text()
    fb = _global_feedback(spec, n, N, N)
    key = jax.random.key(0)

    def body(x, fb, key):
        return compressed_all_reduce(x, fb, spec=spec, axis_name="data", axis_size=N, key=key)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), P()), out_specs=(P(), P("data")))
    return jax.jit(mapped).lower(jnp.zeros(N * n), fb, key).compile().as_text()


def test_wire_byte_parser_on_a_plain_all_reduce():
    sent = wire_bytes(_compiled_text(None, 4096), N)
    assert sent == {"all-reduce": pytest.approx(2 * 7 / 8 * 4096 * 4)}


@pytest.mark.parametrize(
    ("preset", "minimum"),
    [("int8", 3.9), ("int8_stochastic", 3.9), ("int4", 7.7), ("sign", 28.0), ("topk", 15.0), ("bf16", 1.95)],
)
def test_bytes_on_the_wire_against_the_f32_all_reduce(preset, minimum):
    from torsh_jax.plan import load_compressor

    spec = load_compressor(preset)
    n = padded_length(2**18, axis_size=N, spec=spec)
    plain = sum(wire_bytes(_compiled_text(None, n), N).values())
    sent = wire_bytes(_compiled_text(spec, n), N)
    assert "all-reduce" not in sent  # nothing falls back to a float all-reduce
    ratio = plain / sum(sent.values())
    assert ratio >= minimum, (sent, ratio)


def _gather_text(spec, n):
    def body(shard):
        if spec is None:
            return jax.lax.all_gather(shard, "data", tiled=True)
        return compressed_all_gather(shard, spec=spec, axis_name="data", axis_size=N)

    mapped = jax.shard_map(body, mesh=_mesh(), in_specs=P("data"), out_specs=P(), check_vma=False)
    return jax.jit(mapped).lower(jnp.zeros(N * n)).compile().as_text()


def _scatter_text(spec, n):
    def body(x, fb):
        if spec is None:
            return jax.lax.psum_scatter(x, "data", tiled=True), fb
        return compressed_reduce_scatter(x, fb, spec=spec, axis_name="data", axis_size=N)

    probe = spec or CompressorSpec(method="int8")
    fb = _global_feedback(probe, n, N, N)
    specs = (P("data"), P("data"))
    mapped = jax.shard_map(body, mesh=_mesh(), in_specs=specs, out_specs=specs)
    return jax.jit(mapped).lower(jnp.zeros(N * n), fb).compile().as_text()


@pytest.mark.parametrize(("method", "minimum"), [("int8", 3.9), ("int4", 7.7)])
def test_weight_all_gather_bytes(method, minimum):
    spec = CompressorSpec(method=method)
    plain = sum(wire_bytes(_gather_text(None, 2**15), N).values())
    sent = wire_bytes(_gather_text(spec, 2**15), N)
    assert set(sent) == {"all-gather"} and plain / sum(sent.values()) >= minimum


@pytest.mark.parametrize(("method", "minimum"), [("int8", 3.9), ("sign", 28.0)])
def test_gradient_reduce_scatter_bytes(method, minimum):
    spec = CompressorSpec(method=method)
    plain = wire_bytes(_scatter_text(None, 2**15), N)
    sent = wire_bytes(_scatter_text(spec, 2**15), N)
    assert set(sent) == {"all-to-all"}, sent
    assert sum(plain.values()) / sum(sent.values()) >= minimum, (plain, sent)
