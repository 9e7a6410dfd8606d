"""Build a :class:`~torsh_jax.compress.base.Compressor` from a ``CompressorSpec``.

``implementation`` picks the code path of the methods with kernels (int8, int4,
sign: ``kernels`` in the registry; the others always run their reference):

* ``"auto"``: the Pallas kernels when the devices are TPUs or GPUs, the
  ``jnp`` reference on CPU;
* ``"reference"``: pure ``jnp`` (XLA-compiled);
* ``"pallas"``: the Pallas kernels: Mosaic on TPU, Triton on GPU, the Pallas
  interpreter on CPU;
* ``"pallas_interpret"``: the kernels in the Pallas interpreter on any device.

The devices are those of the mesh being traced (inside ``shard_map``), else
the default backend's.

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

from torsh_jax.compress import cast, fp8, powersgd, quantize, topk
from torsh_jax.compress.base import Compressor, check_flat, seed_from_key
from torsh_jax.errors import CompressionError
from torsh_jax.plan.compressors import METHODS
from torsh_jax.plan.spec import CompressorSpec

__all__ = [
    "IMPLEMENTATIONS",
    "make_compressor",
    "padded_length",
    "length_unit",
    "leaf_unit",
    "needs_key",
    "kernel_platform",
]

#: Values of ``implementation``.
IMPLEMENTATIONS = ("auto", "reference", "pallas", "pallas_interpret")
#: Kernel lowering of each device platform that has one.
_KERNEL_PLATFORMS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}
#: Blocks per kernel row tile that :func:`padded_length` aligns large buffers to.
_KERNEL_ROWS = 32


def _check_method(spec: CompressorSpec) -> None:
    if spec.method == "none":
        raise CompressionError(
            "method 'none' has no compressor",
            key="compression.method",
            fix="use the plain collective (jax.lax.psum / psum_scatter / all_gather) for uncompressed axes",
        )


def _is(spec: CompressorSpec, **facts: object) -> bool:
    """Whether ``spec``'s method is registered with these facts (``none`` has none)."""
    method = METHODS.get(spec.method)
    return method is not None and all(getattr(method, name) == value for name, value in facts.items())


def length_unit(spec: CompressorSpec) -> int:
    """Elements per scale block (per chunk for top-k)."""
    return spec.chunk_size if _is(spec, family="topk") else spec.block_size


def leaf_unit(spec: CompressorSpec) -> int:
    """Elements each parameter's part of a buffer is padded to, so that no scale block holds two
    parameters: ``block_size`` for the methods with block scales (int8, int4, sign, fp8), else 1.

    A block's scale comes from its largest value; a block shared by a large-gradient weight and
    a small bias would quantise the bias in steps of the weight's size.

    Example:
        >>> leaf_unit(CompressorSpec(method="int8", block_size=256)), leaf_unit(CompressorSpec(method="topk"))
        (256, 1)
    """
    return spec.block_size if _is(spec, block_scales=True) else 1


def padded_length(n: int, /, *, axis_size: int, spec: CompressorSpec) -> int:
    """Smallest valid buffer length >= ``n`` for the collectives.

    A multiple of ``axis_size * block_size`` (``chunk_size`` for top-k); for
    the methods with kernels (int8, int4, sign) and buffers longer than 32
    such units, a multiple of 32 units, so that every device's shard tiles
    into kernel row tiles of 32 blocks.
    """
    unit = axis_size * length_unit(spec)
    if _is(spec, kernels=True) and n > _KERNEL_ROWS * unit:
        unit *= _KERNEL_ROWS
    return max(1, -(-n // unit)) * unit


def needs_key(spec: CompressorSpec) -> bool:
    """True when compression draws random numbers (stochastic int8/int4)."""
    return spec.rounding == "stochastic" and _is(spec, stochastic=True)


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


def _device_platform() -> str:
    """Platform of the devices of the mesh being traced, else of the default backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def kernel_platform(implementation: str, device_platform: str) -> str | None:
    """The kernel lowering ``implementation`` runs on ``device_platform`` (``None``: the reference).

    Example:
        >>> [kernel_platform(i, "cpu") for i in ("auto", "reference", "pallas")]
        [None, None, 'interpret']
        >>> [kernel_platform(i, "tpu") for i in ("auto", "reference", "pallas")]
        ['tpu', None, 'tpu']
    """
    if implementation == "pallas_interpret":
        return "interpret"
    if implementation == "pallas":
        return _KERNEL_PLATFORMS.get(device_platform, "interpret")
    if implementation == "auto":
        return _KERNEL_PLATFORMS.get(device_platform)
    return None


def _blockwise(spec: CompressorSpec, implementation: str) -> Compressor:
    options = {"method": spec.method, "block_size": spec.block_size}
    platform = kernel_platform(implementation, _device_platform())
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


def _cast(spec: CompressorSpec, implementation: str) -> Compressor:
    def compress(x, state, /, *, key=None):
        check_flat(x, multiple=1, where="compression.method")
        return cast.encode(x, method=spec.method), state

    def compress_with_feedback(x, residual, /, *, key=None):
        return cast.encode_with_feedback(x, residual, method=spec.method)

    return Compressor(
        lambda length: (), compress, lambda p: cast.decode(p, method=spec.method), compress_with_feedback
    )


def _fp8(spec: CompressorSpec, implementation: str) -> Compressor:
    options = {"method": spec.method, "block_size": spec.block_size}

    def compress(x, state, /, *, key=None):
        check_flat(x, multiple=spec.block_size, where="compression.block_size")
        return fp8.encode(x, **options), state

    def compress_with_feedback(x, residual, /, *, key=None):
        check_flat(x, multiple=spec.block_size, where="compression.block_size")
        return fp8.encode_with_feedback(x, residual, **options)

    return Compressor(
        lambda length: (), compress, lambda p: fp8.decode(p, method=spec.method), compress_with_feedback
    )


def _topk(spec: CompressorSpec, implementation: str) -> Compressor:
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


def _powersgd(spec: CompressorSpec, implementation: str) -> Compressor:
    def compress(x, q, /, *, key=None):
        check_flat(x, multiple=1, where="compression.method")
        return powersgd.encode(x, q)

    return Compressor(
        lambda length: powersgd.initial_q(length, rank=spec.rank), compress, powersgd.decode, None
    )


#: :attr:`~torsh_jax.plan.compressors.Method.family` -> ``(spec, implementation) -> Compressor``
#: (only the blockwise family has kernels; the others run their reference on every device).
_FAMILIES = {"blockwise": _blockwise, "cast": _cast, "fp8": _fp8, "topk": _topk, "powersgd": _powersgd}


def make_compressor(spec: CompressorSpec, /, *, implementation: str = "auto") -> Compressor:
    """The compressor ``spec`` describes.

    Args:
        spec: the compressor settings.
        implementation: ``auto``, ``reference``, ``pallas`` or ``pallas_interpret`` (module docstring).

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
    return _FAMILIES[METHODS[spec.method].family](spec, implementation)
