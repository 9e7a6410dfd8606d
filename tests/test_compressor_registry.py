"""The compressor registry's error bounds hold for every method, and fp8 enters through it alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import SMALL, mlp_model, mlp_params

from torsh_jax.compress import make_compressor
from torsh_jax.compress.collectives import WEIGHT_METHODS
from torsh_jax.demo.model import synthetic_tokens
from torsh_jax.errors import PlanError
from torsh_jax.plan import load_compressor, plan_from_dict
from torsh_jax.plan.compressors import METHODS
from torsh_jax.plan.spec import CompressorSpec
from torsh_jax.runtime.layered import layered_loss

N, BLOCK = 4096, 256
CASES = [(name, "nearest") for name in METHODS] + [
    (n, "stochastic") for n, m in METHODS.items() if m.stochastic
]
#: float32 round-off of scaling and unscaling, per unit of |x| and of the block's absmax
ROUNDOFF = 2.0**-20


def _buffer(seed: int) -> np.ndarray:
    """Gaussian blocks of magnitudes 1e-9 .. 1e2, a block spanning 12 decades, a zero block."""
    rng = np.random.default_rng(seed)
    magnitudes = 10.0 ** rng.uniform(-9, 2, size=(N // BLOCK, 1))
    x = rng.normal(size=(N // BLOCK, BLOCK)) * magnitudes
    x[2] = rng.choice([-1, 1], BLOCK) * 10.0 ** rng.uniform(-10, 2, BLOCK)
    x[3] = 0.0
    return x.reshape(-1).astype(np.float32)


def _round_trip(method: str, rounding: str, x: np.ndarray) -> np.ndarray:
    c = make_compressor(CompressorSpec(method=method, rounding=rounding), implementation="reference")
    key = jax.random.key(3) if rounding == "stochastic" else None
    payload, _ = c.compress(jnp.asarray(x), c.init(N), key=key)
    return np.asarray(c.decompress(payload), np.float64)


@pytest.mark.parametrize(("method", "rounding"), CASES, ids=[f"{m}-{r}" for m, r in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_method_round_trips_within_its_registered_bound(method, rounding, seed):
    """Elementwise: ``|y_i - x_i| <= relative |x_i| + block amax_i + absolute``; PowerSGD: the
    error's 2-norm is at most ``relative`` x the buffer's. Top-k and PowerSGD register
    ``relative = 1``: one step may lose a whole value; only error feedback bounds them over steps."""
    x = _buffer(seed)
    bound = METHODS[method].error_bound(rounding)
    error = np.abs(_round_trip(method, rounding, x) - x)
    if not bound.elementwise:
        assert np.linalg.norm(error) <= bound.relative * np.linalg.norm(x) * (1 + 1e-5)
        return
    amax = np.repeat(np.abs(x.reshape(-1, BLOCK)).max(axis=1), BLOCK)
    allowed = bound.relative * np.abs(x) + bound.block * amax + bound.absolute
    allowed += ROUNDOFF * (np.abs(x) + amax)
    worst = int(np.argmax(error / np.maximum(allowed, 1e-45)))
    assert (error <= allowed).all(), (worst, x[worst], error[worst], allowed[worst])
    if bound.block:  # the bound is tight: some element uses at least a quarter of it
        assert (error > allowed / 4).any()


@pytest.mark.parametrize("method", [name for name, m in METHODS.items() if m.dtype])
def test_float_bounds_are_those_of_the_format(method):
    """The registry is JAX-free; its half-ulp constants agree with ml_dtypes' description."""
    m = METHODS[method]
    info = ml_dtypes.finfo(jnp.dtype(m.dtype))
    assert m.bound.relative == 2.0 ** -(info.nmant + 1)
    assert m.bits == info.bits
    if m.family == "fp8":
        assert m.bound.block == float(info.smallest_subnormal) / 2 / float(info.max)
    if method == "fp16":
        assert (m.bound.absolute, m.bound.max_abs) == (float(info.smallest_subnormal) / 2, float(info.max))


@pytest.mark.parametrize("method", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_payload_is_the_round_to_nearest_even_of_the_scaled_values(method):
    """The payload bytes are ml_dtypes' (round to nearest even) cast of ``x / scale``, with
    ``scale = absmax / fmax`` to an ulp (XLA multiplies by ``1 / fmax``): 1 + 4/256 bytes per element."""
    x = _buffer(5)
    c = make_compressor(CompressorSpec(method=method), implementation="reference")
    payload, _ = c.compress(jnp.asarray(x), ())
    dtype = jnp.dtype(METHODS[method].dtype)
    blocks = x.reshape(-1, BLOCK)
    scales = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(ml_dtypes.finfo(dtype).max)
    sent = np.asarray(payload.scales)
    np.testing.assert_allclose(sent, scales, rtol=2.0**-23)
    expected = (blocks / np.where(sent > 0, sent, 1)).astype(dtype).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(payload.values), expected)
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(payload)) == N + 4 * N // BLOCK


def test_plain_fp8_cast_of_gradients_underflows_and_block_scales_do_not():
    """Gradients of a small language model at a large model's magnitudes (x 1e-3, median ~1e-6):
    a plain e4m3 cast flushes nearly all to zero, the per-block scaled one almost none."""
    params = mlp_params(SMALL, jax.random.key(0))
    loss = layered_loss(mlp_model(SMALL))
    grads = jax.jit(jax.grad(loss))(params, synthetic_tokens(SMALL, batch_size=8, seed=0))
    flat = jnp.concatenate([g.reshape(-1) for g in jax.tree.leaves(grads)]) * 1e-3
    flat = jnp.pad(flat, (0, -flat.shape[0] % BLOCK))
    nonzero = flat != 0
    plain = flat.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    c = make_compressor(load_compressor("fp8_e4m3"), implementation="reference")
    scaled = c.decompress(c.compress(flat, ())[0])
    flushed = lambda y: float(((y == 0) & nonzero).sum() / nonzero.sum())
    assert flushed(plain) > 0.99
    assert flushed(scaled) < 1e-3


def test_plan_validation_accepts_fp8_for_gradients_and_weights():
    plan = plan_from_dict(
        {
            "mesh": {"data": 1, "fsdp": -1},
            "zero": {"stage": 3},
            "compression": [{"axis": "fsdp", "weights": "fp8_e4m3", "gradients": {"method": "fp8_e5m2"}}],
        }
    )
    assert (plan.compression[0].weights.method, plan.compression[0].gradients.method) == (
        "fp8_e4m3",
        "fp8_e5m2",
    )
    assert {"fp8_e4m3", "fp8_e5m2"} <= set(WEIGHT_METHODS)


@pytest.mark.parametrize("method", [name for name, m in METHODS.items() if not m.stochastic])
def test_stochastic_rounding_of_a_method_without_it_names_the_key(method):
    """Before, ``rounding = "stochastic"`` with fp16, sign or fp8 silently rounded to nearest."""
    with pytest.raises(PlanError, match=r"compression\[0\]\.gradients\.rounding: .*no stochastic rounding"):
        plan_from_dict(
            {
                "mesh": {"data": -1},
                "compression": [{"axis": "data", "gradients": {"method": method, "rounding": "stochastic"}}],
            }
        )
