"""Reference compressors: round-trip bounds, unbiased stochastic rounding, error feedback, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torsh_jax.compress import (
    compressed_all_reduce,
    init_feedback,
    make_compressor,
    padded_length,
    powersgd,
    topk,
)
from torsh_jax.errors import CompressionError
from torsh_jax.plan import CompressorSpec, load_compressor
from torsh_jax.plan.presets import find

METHODS = ("fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd")
PRESETS = ("int8", "int8_stochastic", "int4", "sign", "fp16", "bf16", "topk", "powersgd")


def _buffer(seed: int, n: int = 4096) -> jax.Array:
    """Gaussian values with a different magnitude per block, and one all-zero block."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    magnitudes = jnp.exp(jax.random.uniform(k2, (n // 256, 1), minval=-6.0, maxval=3.0))
    x = (jax.random.normal(k1, (n // 256, 256)) * magnitudes).at[1].set(0.0)
    return x.reshape(-1)


def _steps(x: jax.Array, levels: int) -> jax.Array:
    """Quantisation step per element: absmax / levels of its block."""
    blocks = x.reshape(-1, 256)
    return jnp.repeat(jnp.max(jnp.abs(blocks), axis=1) / levels, 256)


@pytest.mark.parametrize(("method", "levels"), [("int8", 127), ("int4", 7)], ids=["int8", "int4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nearest_round_trip_within_half_a_step(method, levels, seed):
    x = _buffer(seed)
    c = make_compressor(CompressorSpec(method=method))
    payload, _ = c.compress(x, ())
    error = jnp.abs(c.decompress(payload) - x)
    bound = _steps(x, levels) * 0.5 * (1 + 1e-6) + 1e-30
    assert bool((error <= bound).all()), float((error / bound).max())
    assert float(jnp.abs(c.decompress(payload)[256:512]).max()) == 0.0  # zero block stays zero


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_payload_dtypes_and_shapes(method):
    c = make_compressor(CompressorSpec(method=method))
    payload, _ = c.compress(_buffer(0), ())
    width = 256 if method == "int8" else 128
    assert payload.values.dtype == (jnp.int8 if method == "int8" else jnp.uint8)
    assert payload.values.shape == (16, width)
    assert payload.scales.dtype == jnp.float32 and payload.scales.shape == (16, 1)


@pytest.mark.parametrize(("method", "levels"), [("int8", 127), ("int4", 7)], ids=["int8", "int4"])
def test_stochastic_rounding_error_below_one_step(method, levels):
    x = _buffer(3)
    c = make_compressor(CompressorSpec(method=method, rounding="stochastic"))
    payload, _ = c.compress(x, (), key=jax.random.key(5))
    error = jnp.abs(c.decompress(payload) - x)
    assert bool((error <= _steps(x, levels) * (1 + 1e-6)).all())


@pytest.mark.parametrize(("method", "levels"), [("int8", 127), ("int4", 7)], ids=["int8", "int4"])
def test_stochastic_rounding_is_unbiased(method, levels):
    """Mean of K stochastic round trips is within 5 standard errors of x (step / 2 / sqrt(K))."""
    x = _buffer(4, n=1024)
    c = make_compressor(CompressorSpec(method=method, rounding="stochastic"))
    keys = jax.random.split(jax.random.key(9), 4000)
    decoded = jax.jit(jax.vmap(lambda k: c.decompress(c.compress(x, (), key=k)[0])))(keys)
    mean = decoded.mean(axis=0)
    bound = 5 * _steps(x, levels) * 0.5 / np.sqrt(len(keys)) + 1e-30
    assert bool((jnp.abs(mean - x) <= bound).all())
    # Nearest rounding is biased on the same values: the test can tell the two apart.
    nearest = make_compressor(CompressorSpec(method=method))
    biased = jnp.abs(nearest.decompress(nearest.compress(x, ())[0]) - x) > bound
    assert int(biased.sum()) > 100


def test_sign_decodes_to_plus_minus_mean_abs():
    x = _buffer(6)
    c = make_compressor(CompressorSpec(method="sign"))
    payload, _ = c.compress(x, ())
    assert payload.values.dtype == jnp.uint8 and payload.values.shape == (16, 32)
    scale = jnp.repeat(jnp.abs(x.reshape(-1, 256)).mean(axis=1), 256)
    expected = jnp.where(x >= 0, scale, -scale)
    np.testing.assert_allclose(c.decompress(payload), expected, rtol=1e-6)


@pytest.mark.parametrize(("method", "dtype"), [("fp16", jnp.float16), ("bf16", jnp.bfloat16)])
def test_cast_matches_astype(method, dtype):
    x = _buffer(7)
    c = make_compressor(CompressorSpec(method=method))
    payload, _ = c.compress(x, ())
    assert payload.bits.dtype == jnp.uint16
    np.testing.assert_array_equal(c.decompress(payload), x.astype(dtype).astype(jnp.float32))


def test_topk_keeps_the_largest_of_every_chunk():
    spec = CompressorSpec(method="topk", topk_fraction=0.01, chunk_size=1024)
    x = _buffer(8)
    c = make_compressor(spec)
    payload, _ = c.compress(x, ())
    k = topk.kept_per_chunk(chunk_size=1024, fraction=0.01)
    assert k == 11 and payload.indices.dtype == jnp.int16 and payload.values.shape == (4, k)
    dense = c.decompress(payload).reshape(4, 1024)
    chunks = x.reshape(4, 1024)
    for row in range(4):
        kept = np.flatnonzero(np.asarray(dense[row]))
        expected = np.argsort(-np.abs(np.asarray(chunks[row])))[:k]
        assert set(kept) == set(expected)
        np.testing.assert_array_equal(dense[row, kept], chunks[row, kept])


def test_powersgd_recovers_a_low_rank_matrix():
    rows, cols = powersgd.matrix_shape(4096)
    assert (rows, cols) == (64, 64)
    k1, k2 = jax.random.split(jax.random.key(0))
    m = (jax.random.normal(k1, (64, 2)) @ jax.random.normal(k2, (2, 64))).reshape(-1)
    c = make_compressor(CompressorSpec(method="powersgd", rank=2))
    q = c.init(4096)
    payload, q = c.compress(m, q)
    np.testing.assert_allclose(payload.p.T @ payload.p, jnp.eye(2), atol=1e-5)
    np.testing.assert_allclose(c.decompress(payload), m, atol=1e-4 * float(jnp.abs(m).max()))


@pytest.mark.parametrize("method", METHODS)
def test_error_feedback_identity(method):
    """sum of transmitted updates == sum of true gradients - final residual (float precision)."""
    spec = CompressorSpec(method=method, rank=2, chunk_size=512)
    c = make_compressor(spec)
    n = 4096
    residual, state = jnp.zeros(n), c.init(n)
    sent, true = jnp.zeros(n), jnp.zeros(n)
    for step in range(12):
        g = _buffer(100 + step, n)
        if method == "powersgd":
            payload, residual, state = powersgd.encode_with_feedback(g, residual, state)
        else:
            payload, residual = c.compress_with_feedback(g, residual)
        sent, true = sent + c.decompress(payload), true + g
    scale = float(jnp.abs(true).max())
    np.testing.assert_allclose(sent, true - residual, rtol=0, atol=1e-5 * scale)
    assert float(jnp.abs(residual).max()) > 0  # something was lost and fed back


def test_method_none_points_to_the_plain_collective():
    spec = CompressorSpec(method="none")
    with pytest.raises(CompressionError, match="plain collective|psum"):
        make_compressor(spec)
    with pytest.raises(CompressionError, match="plain collective"):
        init_feedback(spec, length=2048, axis_size=8)
    with pytest.raises(CompressionError, match="psum"):
        compressed_all_reduce(jnp.zeros(2048), None, spec=spec, axis_name="data", axis_size=8)


def test_stochastic_without_key_is_an_error():
    c = make_compressor(CompressorSpec(method="int8", rounding="stochastic"))
    with pytest.raises(CompressionError, match="key"):
        c.compress(jnp.zeros(256), ())


def test_bad_inputs_are_errors():
    c = make_compressor(CompressorSpec(method="int8"))
    with pytest.raises(CompressionError, match="padded_length"):
        c.compress(jnp.zeros(300), ())
    with pytest.raises(CompressionError, match="float32"):
        c.compress(jnp.zeros((2, 256)), ())
    with pytest.raises(CompressionError, match="implementation"):
        make_compressor(CompressorSpec(method="int8"), implementation="cuda")
    with pytest.raises(CompressionError, match="multiple"):
        init_feedback(CompressorSpec(method="int8"), length=1000, axis_size=8)


@pytest.mark.parametrize("n", [1, 1000, 2048, 2049, 65536, 70000, 10**6])
@pytest.mark.parametrize("method", ["int8", "topk"])
def test_padded_length(n, method):
    spec = CompressorSpec(method=method)
    unit = 8 * (spec.chunk_size if method == "topk" else spec.block_size)
    padded = padded_length(n, axis_size=8, spec=spec)
    assert padded >= n and padded % unit == 0
    assert padded - n < (32 * unit if method == "int8" else unit)
    if method == "int8" and n > 32 * unit:  # kernel row tiles of 32 blocks per device shard
        assert (padded // 8 // 256) % 32 == 0


def test_feedback_state_shapes():
    fb = init_feedback(CompressorSpec(method="int4"), length=4096, axis_size=8)
    assert (fb.worker.shape, fb.server.shape, fb.step.shape) == ((4096,), (512,), (1,))
    fb = init_feedback(CompressorSpec(method="topk", chunk_size=512), length=4096, axis_size=8)
    assert fb.server.shape == (0,)
    fb = init_feedback(CompressorSpec(method="int8", error_feedback=False), length=4096, axis_size=8)
    assert fb.worker.shape == (0,) and fb.server.shape == (0,)
    fb = init_feedback(CompressorSpec(method="powersgd", rank=4), length=4096, axis_size=8)
    assert fb.warm_start.shape == (64, 4)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_build(name):
    assert find("compression", name).suffix == ".toml"
    spec = load_compressor(name)
    c = make_compressor(spec)
    n = padded_length(5000, axis_size=8, spec=spec)
    payload, _ = c.compress(_buffer(1, n), c.init(n), key=jax.random.key(0))
    assert c.decompress(payload).shape == (n,)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.floats(
            min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_subnormal=False, width=32
        ),
        min_size=256,
        max_size=256,
    ),
    method=st.sampled_from(["int8", "int4"]),
)
def test_half_step_bound_on_arbitrary_blocks(values, method):
    x = jnp.asarray(values, jnp.float32)
    x = jnp.where(jnp.abs(x) < 1e-30, 0.0, x)  # keep scales clear of the subnormal range
    levels = 127 if method == "int8" else 7
    c = make_compressor(CompressorSpec(method=method))
    error = jnp.abs(c.decompress(c.compress(x, ())[0]) - x)
    step = jnp.max(jnp.abs(x)) / levels
    assert bool((error <= step * 0.5 * (1 + 1e-6)).all())
