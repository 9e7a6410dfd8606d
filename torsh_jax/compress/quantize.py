"""Blockwise quantisers, ``jnp`` reference: int8 and int4 absmax, 1-bit sign.

* ``int8``: per block of ``B`` elements, scale = absmax / 127, values in
  -127..127; nearest rounding is off by at most half a step per element.
* ``int4``: scale = absmax / 7, two values per byte (block halves).
* ``sign``: one bit per element, scale = mean |x| per block (the 1-bit
  Adam family); decodes to ``+-scale``.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.linspace(-1.0, 1.0, 512, dtype=jnp.float32)
    >>> payload = encode(x, method="int8", block_size=256)
    >>> payload.values.dtype, payload.scales.shape
    (dtype('int8'), (2, 1))
    >>> bool(jnp.abs(decode(payload, method="int8", block_size=256) - x).max() <= 0.5 / 127)
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torsh_jax.compress.base import QuantPayload, as_blocks, uniform_noise
from torsh_jax.compress.blockmath import decode_tile, encode_tile

__all__ = ["BLOCKWISE_METHODS", "encode", "decode", "encode_with_feedback", "noise_reader"]

#: Methods handled here.
BLOCKWISE_METHODS = ("int8", "int4", "sign")


def noise_reader(seed: jax.Array | None, *, rows: int, row_start, block_size: int):
    """The ``noise`` argument of :func:`~torsh_jax.compress.blockmath.encode_tile`."""
    if seed is None:
        return None

    def read(col_start: int, width: int) -> jax.Array:
        return uniform_noise(
            seed, rows=rows, cols=width, row_start=row_start, col_start=col_start, row_length=block_size
        )

    return read


def _reader(x_NxB: jax.Array):
    return lambda start, width: x_NxB[:, start : start + width]


def encode(x: jax.Array, /, *, method: str, block_size: int, seed: jax.Array | None = None) -> QuantPayload:
    """Quantise a flat float32 buffer (length a multiple of ``block_size``).

    Args:
        x: ``float32 [n]``.
        method: ``int8``, ``int4`` or ``sign``.
        block_size: elements per scale block.
        seed: ``uint32 [1, 1]`` for stochastic rounding; ``None`` rounds to nearest.
    """
    x_NxB = as_blocks(x, block_size)
    noise = noise_reader(seed, rows=x_NxB.shape[0], row_start=0, block_size=block_size)
    values, scales = encode_tile(method, _reader(x_NxB), block_size=block_size, noise=noise)
    return QuantPayload(values, scales)


def decode(payload: QuantPayload, /, *, method: str, block_size: int) -> jax.Array:
    """Dequantise to a flat float32 buffer."""
    windows = decode_tile(method, payload.values, payload.scales, block_size=block_size)
    parts = [part for _, part in windows]
    x_NxB = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return x_NxB.reshape(-1)


def encode_with_feedback(
    x: jax.Array,
    residual: jax.Array,
    /,
    *,
    method: str,
    block_size: int,
    seed: jax.Array | None = None,
) -> tuple[QuantPayload, jax.Array]:
    """Error-feedback step: quantise ``x + residual``, keep what was lost.

    Returns:
        ``(payload, new_residual)`` with ``new_residual = x + residual - decode(payload)``.
    """
    corrected = as_blocks(x + residual, block_size)
    noise = noise_reader(seed, rows=corrected.shape[0], row_start=0, block_size=block_size)
    read = _reader(corrected)
    values, scales = encode_tile(method, read, block_size=block_size, noise=noise)
    # Window by window, as the fused kernel does, so both compile to the same arithmetic.
    windows = decode_tile(method, values, scales, block_size=block_size)
    lost = [read(start, part.shape[-1]) - part for start, part in windows]
    new_residual = lost[0] if len(lost) == 1 else jnp.concatenate(lost, axis=-1)
    return QuantPayload(values, scales), new_residual.reshape(-1)
