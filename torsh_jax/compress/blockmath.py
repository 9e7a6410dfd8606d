"""Per-tile maths of the blockwise quantisers, shared by the reference and the kernels.

Every function takes tiles ``[R, w]`` (``R`` blocks, ``w`` columns of a
block) and uses only elementwise ops, last-dim reductions and integer bit
ops, so the same code runs inside a Pallas kernel body and on whole arrays.
That sharing is what makes the kernels equal the reference bit for bit.

Rounding is ``floor(y + offset)``: ``offset = 0.5`` is round-half-up
(nearest), ``offset ~ U[0, 1)`` is stochastic rounding, unbiased because
``E[floor(y + u)] = y``.

Example:
    >>> import jax.numpy as jnp
    >>> q, s = int8_encode(jnp.array([[1.0, -0.5, 0.25, 0.0]]), 0.5)
    >>> q.tolist(), s.tolist()
    ([[127, -63, 32, 0]], [[0.007874015718698502]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "INT8_LEVELS",
    "INT4_LEVELS",
    "SIGN_PARTS",
    "int8_encode",
    "int8_decode",
    "int4_encode",
    "int4_decode",
    "sign_encode",
    "sign_decode",
    "column_parts",
    "encode_tile",
    "decode_tile",
    "NEAREST",
]

#: Largest int8 magnitude used (symmetric range, -127..127).
INT8_LEVELS = 127
#: Largest int4 magnitude used (symmetric range, -7..7).
INT4_LEVELS = 7
#: A sign block is split into this many column slices, one bit each per byte.
SIGN_PARTS = 8
#: Rounding offset of nearest rounding (round half up).
NEAREST = 0.5

Noise = jax.Array | float


def _absmax(parts: Sequence[jax.Array]) -> jax.Array:
    amax = jnp.max(jnp.abs(parts[0]), axis=-1, keepdims=True)
    for part in parts[1:]:
        amax = jnp.maximum(amax, jnp.max(jnp.abs(part), axis=-1, keepdims=True))
    return amax


def _round_levels(x: jax.Array, scale: jax.Array, levels: int, noise: Noise) -> jax.Array:
    safe = jnp.where(scale > 0, scale, jnp.float32(1.0))
    q = jnp.floor(x / safe + noise)
    return jnp.clip(q, -levels, levels)


def int8_encode(x: jax.Array, noise: Noise) -> tuple[jax.Array, jax.Array]:
    """``x [R, B]`` -> ``(int8 [R, B], scale float32 [R, 1])``, scale = absmax / 127."""
    scale = _absmax([x]) / jnp.float32(INT8_LEVELS)
    q = _round_levels(x, scale, INT8_LEVELS, noise)
    return q.astype(jnp.int32).astype(jnp.int8), scale


def int8_decode(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``int8 [R, B]``, ``[R, 1]`` -> ``float32 [R, B]``."""
    return q.astype(jnp.int32).astype(jnp.float32) * scale


def int4_encode(
    lo: jax.Array, hi: jax.Array, noise_lo: Noise, noise_hi: Noise
) -> tuple[jax.Array, jax.Array]:
    """Block halves ``[R, B/2]`` each -> ``(uint8 [R, B/2], scale [R, 1])``, scale = absmax / 7.

    Byte ``j`` holds element ``j`` in its low nibble and element ``j + B/2``
    in its high nibble (two's complement nibbles).
    """
    scale = _absmax([lo, hi]) / jnp.float32(INT4_LEVELS)
    q_lo = _round_levels(lo, scale, INT4_LEVELS, noise_lo).astype(jnp.int32)
    q_hi = _round_levels(hi, scale, INT4_LEVELS, noise_hi).astype(jnp.int32)
    packed = (q_lo & 0xF) | ((q_hi & 0xF) << 4)
    return packed.astype(jnp.uint8), scale


def _nibble(b: jax.Array) -> jax.Array:
    return ((b & 0xF) ^ 8) - 8


def int4_decode(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``uint8 [R, B/2]``, ``[R, 1]`` -> the two float32 halves ``[R, B/2]``."""
    b = packed.astype(jnp.int32)
    lo = _nibble(b).astype(jnp.float32) * scale
    hi = _nibble(b >> 4).astype(jnp.float32) * scale
    return lo, hi


def sign_encode(parts: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Eight slices ``[R, B/8]`` -> ``(uint8 [R, B/8], scale [R, 1])``, scale = mean |x|.

    Bit ``k`` of byte ``j`` is 1 when element ``k * B/8 + j`` is >= 0.
    """
    total = jnp.sum(jnp.abs(parts[0]), axis=-1, keepdims=True)
    packed = (parts[0] >= 0).astype(jnp.int32)
    for k, part in enumerate(parts[1:], start=1):
        total = total + jnp.sum(jnp.abs(part), axis=-1, keepdims=True)
        packed = packed | ((part >= 0).astype(jnp.int32) << k)
    scale = total / jnp.float32(len(parts) * parts[0].shape[-1])
    return packed.astype(jnp.uint8), scale


def sign_decode(packed: jax.Array, scale: jax.Array) -> list[jax.Array]:
    """``uint8 [R, B/8]``, ``[R, 1]`` -> eight float32 slices ``[R, B/8]`` of ``+-scale``."""
    b = packed.astype(jnp.int32)
    return [jnp.where(((b >> k) & 1) == 1, scale, -scale) for k in range(SIGN_PARTS)]


def column_parts(method: str, block_size: int) -> list[tuple[int, int]]:
    """Column windows of a block that ``method`` reads and writes separately."""
    count = {"int8": 1, "int4": 2, "sign": SIGN_PARTS}[method]
    width = block_size // count
    return [(k * width, width) for k in range(count)]


def encode_tile(
    method: str,
    read: Callable[[int, int], jax.Array],
    *,
    block_size: int,
    noise: Callable[[int, int], jax.Array] | None,
) -> tuple[jax.Array, jax.Array]:
    """Encode a tile of blocks given a column reader.

    Args:
        method: ``int8``, ``int4`` or ``sign``.
        read: ``(col_start, width) -> float32 [R, width]``; a slice of an
            array in the reference, a ref load in a kernel.
        block_size: elements per block.
        noise: ``(col_start, width) -> U[0, 1) [R, width]`` for stochastic
            rounding, ``None`` for nearest.

    Returns:
        ``(values, scale [R, 1])`` as in :class:`~torsh_jax.compress.base.QuantPayload`.
    """
    windows = column_parts(method, block_size)
    parts = [read(start, width) for start, width in windows]
    if method == "sign":
        return sign_encode(parts)
    offsets = [NEAREST if noise is None else noise(start, width) for start, width in windows]
    if method == "int8":
        return int8_encode(parts[0], offsets[0])
    return int4_encode(parts[0], parts[1], offsets[0], offsets[1])


def decode_tile(
    method: str, values: jax.Array, scale: jax.Array, *, block_size: int
) -> list[tuple[int, jax.Array]]:
    """Decode a tile into ``(col_start, float32 [R, width])`` windows of the blocks."""
    starts = [start for start, _ in column_parts(method, block_size)]
    if method == "int8":
        decoded = [int8_decode(values, scale)]
    elif method == "int4":
        decoded = list(int4_decode(values, scale))
    else:
        decoded = sign_decode(values, scale)
    return list(zip(starts, decoded, strict=True))
