"""Pallas kernels: bit-exact against the reference in interpret mode, and cross-platform lowering.

Lowering for TPU (Mosaic) and GPU (Triton) runs on this CPU-only machine via
``jax.jit(f).trace(...).lower(lowering_platforms=...)``. It catches Pallas-level
errors (block shapes, ops without a lowering rule); Mosaic's layout passes and
Triton's PTX compilation run later, inside XLA on the device, and are not
exercised here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from torsh_jax.compress import make_compressor, quantize
from torsh_jax.compress.base import seed_from_key
from torsh_jax.compress.kernels import blockwise
from torsh_jax.errors import CompressionError
from torsh_jax.plan import CompressorSpec

METHODS = ("int8", "int4", "sign")
CASES = [
    (m, r) for m in METHODS for r in ("nearest", "stochastic") if not (m == "sign" and r == "stochastic")
]
IDS = [f"{m}-{r}" for m, r in CASES]
#: Lengths: one tile of 8 blocks, a 2-step grid of 256 blocks, and 24 blocks (tile of 8, 3 steps).
LENGTHS = (8 * 256, 512 * 256, 24 * 256)


def _inputs(n: int):
    k1, k2, k3 = jax.random.split(jax.random.key(n), 3)
    x = jax.random.normal(k1, (n,)) * jnp.exp(jax.random.uniform(k2, (n,), minval=-3.0, maxval=3.0))
    x = x.at[256:512].set(0.0)
    residual = jax.random.normal(k3, (n,)) * 0.01
    return x, residual


def _seed(rounding: str):
    return seed_from_key(jax.random.key(11)) if rounding == "stochastic" else None


def _equal(a, b):
    for left, right in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert left.dtype == right.dtype and left.shape == right.shape
        np.testing.assert_array_equal(np.asarray(left), np.asarray(right))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("method", "rounding"), CASES, ids=IDS)
def test_encode_is_bit_exact(method, rounding, n):
    x, _ = _inputs(n)
    opts = {"method": method, "block_size": 256}
    ref = jax.jit(functools.partial(quantize.encode, **opts))(x, seed=_seed(rounding))
    kernel = jax.jit(functools.partial(blockwise.encode, platform="interpret", **opts))(
        x, seed=_seed(rounding)
    )
    _equal(ref, kernel)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("method", METHODS)
def test_decode_is_bit_exact(method, n):
    x, _ = _inputs(n)
    opts = {"method": method, "block_size": 256}
    payload = quantize.encode(x, **opts)
    ref = jax.jit(functools.partial(quantize.decode, **opts))(payload)
    kernel = jax.jit(functools.partial(blockwise.decode, platform="interpret", **opts))(payload)
    _equal(ref, kernel)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("method", "rounding"), CASES, ids=IDS)
def test_fused_feedback_step_is_bit_exact(method, rounding, n):
    x, residual = _inputs(n)
    opts = {"method": method, "block_size": 256}
    ref = jax.jit(functools.partial(quantize.encode_with_feedback, **opts))(x, residual, seed=_seed(rounding))
    fused = functools.partial(blockwise.encode_with_feedback, platform="interpret", **opts)
    kernel = jax.jit(fused)(x, residual, seed=_seed(rounding))
    _equal(ref, kernel)


def test_stochastic_kernel_differs_between_keys_and_matches_per_key():
    x, _ = _inputs(2048)
    opts = {"method": "int8", "block_size": 256, "platform": "interpret"}
    a = blockwise.encode(x, seed=seed_from_key(jax.random.key(1)), **opts)
    b = blockwise.encode(x, seed=seed_from_key(jax.random.key(2)), **opts)
    assert int((a.values != b.values).sum()) > 100


@pytest.mark.parametrize("method", METHODS)
def test_make_compressor_implementations_agree(method):
    """Under jit (as in a train step) every implementation gives the same bits."""
    spec = CompressorSpec(method=method)
    x, residual = _inputs(4096)

    def run(implementation):
        c = make_compressor(spec, implementation=implementation)
        payload = jax.jit(lambda x: c.compress(x, ())[0])(x)
        fused = jax.jit(c.compress_with_feedback)(x, residual)
        return payload, fused, jax.jit(c.decompress)(payload)

    reference = run("reference")
    _equal(reference, run("pallas_interpret"))
    _equal(reference, run("pallas"))  # on CPU: the kernels in the interpreter
    _equal(reference, run("auto"))  # on CPU: the reference


def test_rows_per_tile():
    blocks = (1, 8, 24, 256, 512, 96, 6, 12, 262, 16514)
    gpu = [1, 8, 8, 256, 256, 32, 2, 4, 2, 2]
    assert [blockwise.rows_per_tile(n, platform="gpu") for n in blocks] == gpu
    # Mosaic: a multiple of 8 rows, or all of them up to 256 (16,514 blocks, a 150 M model's
    # gradient shard over 8 devices, in one tile overflowed v5e's 16 MiB of scoped VMEM)
    tpu = [1, 8, 8, 256, 256, 32, 6, 12, 256, 256]
    assert [blockwise.rows_per_tile(n, platform="tpu") for n in blocks] == tpu


@pytest.mark.parametrize(("method", "rounding"), CASES, ids=IDS)
def test_a_shorter_last_tile_is_bit_exact(method, rounding):
    """262 blocks under Mosaic: a tile of 256 and one of 6, whose rows past the end are not
    written."""
    x, residual = _inputs(262 * 256)
    opts = {"method": method, "block_size": 256}
    ref = quantize.encode_with_feedback(x, residual, seed=_seed(rounding), **opts)
    fused = blockwise.encode_with_feedback(x, residual, seed=_seed(rounding), platform="interpret", **opts)
    _equal(ref, fused)
    _equal(quantize.decode(ref[0], **opts), blockwise.decode(ref[0], platform="interpret", **opts))


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_buffers_of_few_blocks_lower_for_accelerators(platform):
    """A shard of 6 blocks (a small model's gradient bucket on 8 devices): Mosaic takes it as one tile
    of 6 rows, Triton as tiles of 2."""
    lowering_platform, marker = PLATFORMS[platform]
    for name, (fn, args) in _kernel_functions("int8", "nearest", platform, blocks=6).items():
        assert marker in _lower(fn, args, lowering_platform), name


def test_buffers_of_few_blocks_are_bit_exact_in_one_tile():
    x, residual = _inputs(6 * 256)
    opts = {"method": "int8", "block_size": 256}
    ref = quantize.encode_with_feedback(x, residual, **opts)
    _equal(ref, blockwise.encode_with_feedback(x, residual, platform="interpret", **opts))
    _equal(quantize.decode(ref[0], **opts), blockwise.decode(ref[0], platform="interpret", **opts))


# --- cross-platform lowering ------------------------------------------------------------------

#: platform -> (jax lowering platform, marker of the kernel's custom call in the StableHLO)
PLATFORMS = {"tpu": ("tpu", "tpu_custom_call"), "gpu": ("cuda", "triton")}


def _kernel_functions(method: str, rounding: str, platform: str, *, blocks: int = 64):
    n = blocks * 256
    x, residual = _inputs(n)
    seed = _seed(rounding)
    opts = {"method": method, "block_size": 256, "platform": platform}
    payload = quantize.encode(x, method=method, block_size=256)
    return {
        "encode": (functools.partial(blockwise.encode, seed=seed, **opts), (x,)),
        "decode": (functools.partial(blockwise.decode, **opts), (payload,)),
        "feedback": (functools.partial(blockwise.encode_with_feedback, seed=seed, **opts), (x, residual)),
    }


def _lower(fn, args, lowering_platform: str) -> str:
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(lowering_platform,)).as_text()
    except ImportError as err:  # the jaxlib build lacks this platform's Pallas lowering
        pytest.skip(f"{lowering_platform} Pallas lowering unavailable in this jaxlib: {err}")


@pytest.mark.parametrize("platform", list(PLATFORMS))
@pytest.mark.parametrize(("method", "rounding"), CASES, ids=IDS)
def test_kernels_lower_for_accelerators(method, rounding, platform):
    lowering_platform, marker = PLATFORMS[platform]
    for name, (fn, args) in _kernel_functions(method, rounding, platform).items():
        text = _lower(fn, args, lowering_platform)
        assert marker in text, f"{name}: no {marker} custom call in the lowered module"


def test_a_platform_without_a_lowering_is_one_error():
    """Mosaic GPU is not a platform of these kernels (module docstring): a typed error naming the
    ones there are, before anything is traced."""
    with pytest.raises(CompressionError, match="unknown kernel platform 'mosaic_gpu'.*tpu.*gpu.*interpret"):
        blockwise.encode(jnp.zeros(1024), method="int8", block_size=256, platform="mosaic_gpu")


def test_unsupported_block_is_caught_by_gpu_lowering():
    """Triton needs power-of-two tiles: a block of 384 is rejected at lowering, on this CPU machine."""
    x = jnp.zeros(16 * 384)
    fn = functools.partial(blockwise.encode, method="int8", block_size=384, platform="gpu")
    with pytest.raises(ValueError, match="power of 2"):
        jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",))
