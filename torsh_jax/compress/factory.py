"""Build a :class:`~torsh_jax.compress.base.Compressor` from a ``CompressorSpec``.

``implementation`` picks the code path:

* ``"reference"``: pure ``jnp`` (XLA-compiled); the CPU fast path;
* ``"pallas"``: Pallas kernels on TPU (Mosaic) and GPU (Triton) for the
  blockwise methods (int8, int4, sign); other methods and other backends
  fall back to the reference;
* ``"pallas_interpret"``: the same kernels in the Pallas interpreter (tests).

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.plan import CompressorSpec
    >>> c = make_compressor(CompressorSpec(method="int8"))
    >>> payload, state = c.compress(jnp.ones(512, jnp.float32), c.init(512))
    >>> payload.values.dtype, c.decompress(payload).shape
    (dtype('int8'), (512,))
    >>> padded_length(1000, axis_size=8, spec=CompressorSpec(method="int8"))
    2048
"""

from __future__ import annotations

import functools

import jax

from torsh_jax.compress import cast, powersgd, quantize, topk
from torsh_jax.compress.base import Compressor, check_flat, seed_from_key
from torsh_jax.errors import CompressionError
from torsh_jax.plan.spec import CompressorSpec

__all__ = ["IMPLEMENTATIONS", "make_compressor", "padded_length", "length_unit", "needs_key"]

#: Values of ``implementation``.
IMPLEMENTATIONS = ("reference", "pallas", "pallas_interpret")
#: Blocks per kernel row tile that :func:`padded_length` aligns large buffers to.
_KERNEL_ROWS = 32


def _check_method(spec: CompressorSpec) -> None:
    if spec.method == "none":
        raise CompressionError(
            "method 'none' has no compressor",
            key="compression.method",
            fix="use the plain collective (jax.lax.psum / psum_scatter / all_gather) for uncompressed axes",
        )


def length_unit(spec: CompressorSpec) -> int:
    """Elements per scale block (per chunk for top-k)."""
    return spec.chunk_size if spec.method == "topk" else spec.block_size


def padded_length(n: int, /, *, axis_size: int, spec: CompressorSpec) -> int:
    """Smallest valid buffer length >= ``n`` for the collectives.

    A multiple of ``axis_size * block_size`` (``chunk_size`` for top-k); for
    the blockwise methods (which have kernels) and buffers longer than 32
    such units, a multiple of 32 units, so that every device's shard tiles
    into kernel row tiles of 32 blocks.
    """
    unit = axis_size * length_unit(spec)
    if spec.method in quantize.BLOCKWISE_METHODS and n > _KERNEL_ROWS * unit:
        unit *= _KERNEL_ROWS
    return max(1, -(-n // unit)) * unit


def needs_key(spec: CompressorSpec) -> bool:
    """True when compression draws random numbers (stochastic int8/int4)."""
    return spec.rounding == "stochastic" and spec.method in ("int8", "int4")


def _seed(spec: CompressorSpec, key: jax.Array | None):
    if not needs_key(spec):
        return None
    if key is None:
        raise CompressionError(
            f"{spec.method} with stochastic rounding needs a PRNG key",
            key="compression.rounding",
            fix="pass key=jax.random.key(step) (a fresh key every step)",
        )
    return seed_from_key(key)


def _kernel_platform(implementation: str) -> str | None:
    if implementation == "pallas_interpret":
        return "interpret"
    if implementation == "pallas":
        backend = jax.default_backend()
        return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(backend)
    return None


def _blockwise(spec: CompressorSpec, implementation: str) -> Compressor:
    options = {"method": spec.method, "block_size": spec.block_size}
    platform = _kernel_platform(implementation)
    if platform is None:
        encode, decode, fused = quantize.encode, quantize.decode, quantize.encode_with_feedback
    else:
        from torsh_jax.compress.kernels import blockwise

        encode = functools.partial(blockwise.encode, platform=platform)
        decode = functools.partial(blockwise.decode, platform=platform)
        fused = functools.partial(blockwise.encode_with_feedback, platform=platform)

    def compress(x, state, /, *, key=None):
        check_flat(x, multiple=spec.block_size, where="compression.block_size")
        return encode(x, seed=_seed(spec, key), **options), state

    def compress_with_feedback(x, residual, /, *, key=None):
        check_flat(x, multiple=spec.block_size, where="compression.block_size")
        return fused(x, residual, seed=_seed(spec, key), **options)

    return Compressor(lambda length: (), compress, lambda p: decode(p, **options), compress_with_feedback)


def _cast(spec: CompressorSpec) -> Compressor:
    def compress(x, state, /, *, key=None):
        check_flat(x, multiple=1, where="compression.method")
        return cast.encode(x, method=spec.method), state

    def compress_with_feedback(x, residual, /, *, key=None):
        return cast.encode_with_feedback(x, residual, method=spec.method)

    return Compressor(
        lambda length: (), compress, lambda p: cast.decode(p, method=spec.method), compress_with_feedback
    )


def _topk(spec: CompressorSpec) -> Compressor:
    options = {
        "chunk_size": spec.chunk_size,
        "k": topk.kept_per_chunk(chunk_size=spec.chunk_size, fraction=spec.topk_fraction),
    }

    def compress(x, state, /, *, key=None):
        check_flat(x, multiple=spec.chunk_size, where="compression.chunk_size")
        return topk.encode(x, **options), state

    def compress_with_feedback(x, residual, /, *, key=None):
        check_flat(x, multiple=spec.chunk_size, where="compression.chunk_size")
        return topk.encode_with_feedback(x, residual, **options)

    def decompress(payload):
        return topk.decode(payload, chunk_size=spec.chunk_size)

    return Compressor(lambda length: (), compress, decompress, compress_with_feedback)


def _powersgd(spec: CompressorSpec) -> Compressor:
    def compress(x, q, /, *, key=None):
        check_flat(x, multiple=1, where="compression.method")
        return powersgd.encode(x, q)

    return Compressor(
        lambda length: powersgd.initial_q(length, rank=spec.rank), compress, powersgd.decode, None
    )


def make_compressor(spec: CompressorSpec, /, *, implementation: str = "reference") -> Compressor:
    """The compressor ``spec`` describes.

    Args:
        spec: the compressor settings.
        implementation: ``reference``, ``pallas`` or ``pallas_interpret``.

    Raises:
        CompressionError: ``spec.method == "none"`` or an unknown implementation.
    """
    _check_method(spec)
    if implementation not in IMPLEMENTATIONS:
        raise CompressionError(
            f"unknown implementation {implementation!r}",
            key="implementation",
            fix=f"use one of {list(IMPLEMENTATIONS)}",
        )
    if spec.method in quantize.BLOCKWISE_METHODS:
        return _blockwise(spec, implementation)
    if spec.method in cast.CAST_METHODS:
        return _cast(spec)
    if spec.method == "topk":
        return _topk(spec)
    return _powersgd(spec)
