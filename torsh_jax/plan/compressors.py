"""The compressor registry: method name -> how it is built, its wire format, how it reduces, its error.

This module is data only (no JAX), so plan validation and the byte theory read the same table
as the compressors. A new method is one entry here and a preset file (``compression/*.toml``);
a method of a new ``family`` also needs its encode/decode module and builder in
:mod:`torsh_jax.compress` (``factory._FAMILIES``). The registry cannot live in
:mod:`torsh_jax.compress`: that package imports the plan (``CompressorSpec``), and the plan's
validation reads this table, so the plan layer holds it.

Example:
    >>> METHODS["int8"].payload_bytes(4096, block_size=256), METHODS["fp8_e4m3"].payload_bytes(4096)
    (4160, 4160)
    >>> [name for name, m in METHODS.items() if m.weights]
    ['fp16', 'bf16', 'fp8_e4m3', 'fp8_e5m2', 'int8', 'int4']
    >>> METHODS["int8"].error_bound("nearest").block == 1 / 254
    True
    >>> kept_per_chunk(chunk_size=4096, fraction=0.01), matrix_shape(4096)
    (41, (64, 64))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ErrorBound",
    "Method",
    "METHODS",
    "WEIGHT_METHODS",
    "method_names",
    "kept_per_chunk",
    "matrix_shape",
]


@dataclass(frozen=True)
class ErrorBound:
    """The largest error of one compress/decompress round trip of a flat float32 buffer.

    Elementwise (``elementwise=True``), for every element ``i`` with ``|x_i| <= max_abs``::

        |decode(encode(x))_i - x_i| <= relative * |x_i| + block * amax_i + absolute

    with ``amax_i`` the largest magnitude of the scale block holding ``i``; otherwise over the
    whole buffer: ``||decode(encode(x)) - x||_2 <= relative * ||x||_2``. Float32 round-off of the
    scaling (a few ``2**-24`` of ``|x_i|`` and ``amax_i``) comes on top.

    Attributes:
        relative, block, absolute: the three terms above.
        elementwise: per element (above) or for the buffer's 2-norm.
        max_abs: values above it overflow (``fp16``: 65504); the bound holds below it.
        note: what the bound means for training.
    """

    relative: float = 0.0
    block: float = 0.0
    absolute: float = 0.0
    elementwise: bool = True
    max_abs: float = math.inf
    note: str = ""


def _float_bound(mantissa_bits: int, smallest_subnormal: float, fmax: float, *, scaled: bool) -> ErrorBound:
    """Round to nearest in a float format: half an ulp, ``2**-(t+1) |y|`` for normal ``y``, half
    the smallest subnormal below; scaled per block by ``amax / fmax`` that floor is relative to
    ``amax``."""
    half_ulp = 2.0 ** -(mantissa_bits + 1)
    if scaled:
        floor = smallest_subnormal / 2 / fmax
        return ErrorBound(relative=half_ulp, block=floor, note="half an ulp of the scaled value")
    return ErrorBound(relative=half_ulp, absolute=smallest_subnormal / 2, max_abs=fmax, note="half an ulp")


@dataclass(frozen=True)
class Method:
    """One compression method.

    Attributes:
        family: the builder in :mod:`torsh_jax.compress.factory`: ``blockwise`` (integer levels
            or signs with one float32 scale per block), ``cast`` (a narrower float), ``fp8`` (an
            8-bit float with one float32 scale per block), ``topk`` or ``powersgd``.
        bits: payload bits per element; ``None`` when the size depends on the settings
            (top-k's fraction, PowerSGD's rank).
        bound: :class:`ErrorBound` of one round trip with nearest rounding.
        dtype: the float format of the ``cast`` and ``fp8`` families (a ``jax.numpy`` dtype name).
        block_scales: one float32 scale per ``block_size`` values (a block never spans two
            parameters: :func:`torsh_jax.compress.factory.leaf_unit`).
        kernels: has Pallas kernels (``compression.implementation`` chooses them or the reference).
        all_reduce: ``two_phase`` (compress, all-to-all, sum, re-compress, all-gather; a worker
            and a server residual), ``sparse_gather`` (all-gather the kept values) or
            ``low_rank`` (PowerSGD's two small all-reduces).
        weights: whether it may compress weight all-gathers (ZeRO-3).
        stochastic: whether ``rounding = "stochastic"`` draws random numbers.
    """

    family: Literal["blockwise", "cast", "fp8", "topk", "powersgd"]
    bits: int | None
    bound: ErrorBound
    dtype: str | None = None
    block_scales: bool = False
    kernels: bool = False
    all_reduce: Literal["two_phase", "sparse_gather", "low_rank"] = "two_phase"
    weights: bool = False
    stochastic: bool = False

    def payload_bytes(self, elements: int, /, *, block_size: int = 256) -> int | None:
        """Bytes of the payload of ``elements`` values (whole blocks); ``None``: depends on settings."""
        if self.bits is None:
            return None
        scales = 4 * (elements // block_size) if self.block_scales else 0
        return elements * self.bits // 8 + scales

    def error_bound(self, rounding: str = "nearest") -> ErrorBound:
        """:attr:`bound`, doubled for stochastic rounding (an error below one step, not half)."""
        if rounding == "stochastic" and self.stochastic:
            b = self.bound
            return dataclasses.replace(b, relative=2 * b.relative, block=2 * b.block, absolute=2 * b.absolute)
        return self.bound


def _blockwise(bits: int, block: float, **facts) -> Method:
    return Method(
        "blockwise",
        bits,
        ErrorBound(block=block, note="half a step"),
        block_scales=True,
        kernels=True,
        **facts,
    )


#: Method name -> :class:`Method`; ``none`` (no compression) is not a method.
METHODS: dict[str, Method] = {
    # Float constants: (mantissa bits, smallest subnormal, largest finite) of the format.
    "fp16": Method(
        "cast", 16, _float_bound(10, 2.0**-24, 65504.0, scaled=False), dtype="float16", weights=True
    ),
    "bf16": Method(
        "cast",
        16,
        # XLA on CPU flushes float32 subnormals: below 2**-126 a value may become 0.
        ErrorBound(relative=2.0**-8, absolute=2.0**-126, max_abs=3.3895e38, note="half an ulp"),
        dtype="bfloat16",
        weights=True,
    ),
    "fp8_e4m3": Method(
        "fp8",
        8,
        _float_bound(3, 2.0**-9, 448.0, scaled=True),
        dtype="float8_e4m3fn",
        block_scales=True,
        weights=True,
    ),
    "fp8_e5m2": Method(
        "fp8",
        8,
        _float_bound(2, 2.0**-16, 57344.0, scaled=True),
        dtype="float8_e5m2",
        block_scales=True,
        weights=True,
    ),
    "int8": _blockwise(8, 1 / 254, weights=True, stochastic=True),  # absmax / 127 levels
    "int4": _blockwise(4, 1 / 14, weights=True, stochastic=True),  # absmax / 7 levels
    # |x - sign(x) mean|x|| <= max(|x|, mean|x|) <= amax
    "sign": Method(
        "blockwise",
        1,
        ErrorBound(block=1.0, note="up to the block's absmax"),
        block_scales=True,
        kernels=True,
    ),
    "topk": Method(
        "topk",
        None,
        ErrorBound(
            relative=1.0,
            note="a dropped value is lost whole in one step (kept ones are exact); error feedback "
            "sends it later, so only the sum over steps is bounded",
        ),
        all_reduce="sparse_gather",
    ),
    "powersgd": Method(
        "powersgd",
        None,
        ErrorBound(
            relative=1.0,
            elementwise=False,
            note="P Q^T projects the buffer onto P's columns, so the error's norm is at most the "
            "buffer's; no per-element bound in one step, error feedback bounds the sum over steps",
        ),
        all_reduce="low_rank",
    ),
}

#: Methods usable for weight all-gathers.
WEIGHT_METHODS = tuple(name for name, method in METHODS.items() if method.weights)


def method_names() -> tuple[str, ...]:
    """``compression.method`` values: ``none`` and every registered method."""
    return ("none", *METHODS)


def kept_per_chunk(*, chunk_size: int, fraction: float) -> int:
    """Values top-k keeps per chunk: ``ceil(fraction * chunk_size)``, at least 1 (the size of its
    payload, so it lives beside the registry; :mod:`torsh_jax.compress.topk` encodes with it)."""
    return max(1, min(chunk_size, math.ceil(fraction * chunk_size - 1e-9)))


@functools.lru_cache(maxsize=4096)
def matrix_shape(length: int) -> tuple[int, int]:
    """``(rows, cols)`` of PowerSGD's matrix view of a flat buffer of ``length``: ``cols`` the largest
    divisor of ``length`` not above its square root (:mod:`torsh_jax.compress.powersgd`)."""
    cols = next(d for d in range(math.isqrt(length), 0, -1) if length % d == 0)
    return length // cols, cols
