"""Shared pieces of the compressors: the ``Compressor`` triple, payloads, blocks, noise.

A compressor is a triple of pure functions in optax style:

* ``init(length) -> state``: compressor state for a flat buffer (PowerSGD's
  warm-start matrix; ``()`` for stateless compressors);
* ``compress(x, state, /, *, key=None) -> (payload, state)``;
* ``decompress(payload, /) -> x``.

Payloads are NamedTuples of integer arrays plus float32 scales, so they
cross the wire as integers. Every blockwise compressor works on the view
``x_NxB = x.reshape(-1, block_size)``: one scale per row.

Stochastic rounding draws its uniform numbers from a counter-based hash of
``(seed, element index)``, so a Pallas kernel and the ``jnp`` reference see
the very same numbers without materialising them.

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.compress.base import uniform_noise
    >>> u = uniform_noise(jnp.uint32(7), rows=2, cols=4, row_start=0, col_start=0, row_length=4)
    >>> u.shape, bool(((u >= 0) & (u < 1)).all())
    ((2, 4), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from torsh_jax.errors import CompressionError
from torsh_jax.typing import PyTree

__all__ = [
    "Compressor",
    "QuantPayload",
    "CastPayload",
    "TopKPayload",
    "PowerSGDPayload",
    "Payload",
    "as_blocks",
    "check_flat",
    "seed_from_key",
    "uniform_noise",
    "vary_like",
]

Payload = Any


class Compressor(NamedTuple):
    """A compressor as pure functions (see module docstring).

    Attributes:
        init: ``length -> state``.
        compress: ``(x, state, /, *, key=None) -> (payload, state)``.
        decompress: ``(payload, /) -> x`` (float32, flat).
        compress_with_feedback: optional fused step
            ``(x, residual, /, *, key=None) -> (payload, new_residual)`` with
            ``new_residual = x + residual - decompress(payload)``; ``None``
            when the compressor has no fused form.
    """

    init: Callable[[int], PyTree]
    compress: Callable[..., tuple[Payload, PyTree]]
    decompress: Callable[[Payload], jax.Array]
    compress_with_feedback: Callable[..., tuple[Payload, jax.Array]] | None = None


class QuantPayload(NamedTuple):
    """Blockwise quantised values.

    Attributes:
        values: ``int8 [N, B]`` (int8), ``uint8 [N, B/2]`` (int4, low nibble =
            first half of the block) or ``uint8 [N, B/8]`` (sign, bit ``k`` of
            byte ``j`` = element ``k*B/8 + j``).
        scales: ``float32 [N, 1]``, one per block.
    """

    values: jax.Array
    scales: jax.Array


class CastPayload(NamedTuple):
    """A narrow float's bits as unsigned integers of its width, ``uint16 [n]`` for fp16/bf16."""

    bits: jax.Array


class TopKPayload(NamedTuple):
    """The ``k`` largest-magnitude values of every chunk.

    Attributes:
        values: ``float32 [C, k]``.
        indices: ``int16 [C, k]``, positions inside the chunk.
    """

    values: jax.Array
    indices: jax.Array


class PowerSGDPayload(NamedTuple):
    """Low-rank factors: ``M ~= p @ q.T`` with ``M`` the buffer as a matrix.

    Attributes:
        p: ``float32 [rows, r]`` with orthonormal columns.
        q: ``float32 [cols, r]``.
    """

    p: jax.Array
    q: jax.Array


def check_flat(x: jax.Array, *, multiple: int, where: str) -> None:
    """Raise :class:`CompressionError` unless ``x`` is flat float32 of length ``k * multiple``."""
    if x.ndim != 1 or x.dtype != jnp.float32:
        raise CompressionError(
            f"expects a flat float32 buffer, got {x.dtype}{list(x.shape)}",
            key=where,
            fix="flatten and cast the gradient bucket to float32 first",
        )
    if x.shape[0] % multiple:
        raise CompressionError(
            f"length {x.shape[0]} is not a multiple of {multiple}",
            key=where,
            fix="pad the buffer to compress.padded_length(n, axis_size=..., spec=...)",
        )


def as_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """View a flat buffer as ``[N, block_size]`` (one scale per row)."""
    return x.reshape(-1, block_size)


def seed_from_key(key: jax.Array | None) -> jax.Array:
    """A ``uint32 [1, 1]`` seed for the noise hash (``0`` without a key)."""
    if key is None:
        return jnp.zeros((1, 1), jnp.uint32)
    return jax.random.bits(key, (1, 1), jnp.uint32)


def vary_like(value: jax.Array, like: jax.Array) -> jax.Array:
    """Type ``value`` as varying over the shard_map axes ``like`` varies over (no data movement)."""
    missing = jax.typeof(like).mat.varying - jax.typeof(value).mat.varying
    return jax.lax.pcast(value, tuple(sorted(missing)), to="varying") if missing else value


def _mix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser (public-domain constants)."""
    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> jnp.uint32(13))
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> jnp.uint32(16))


def uniform_noise(
    seed: jax.Array, *, rows: int, cols: int, row_start: Any, col_start: int, row_length: int
) -> jax.Array:
    """Uniform ``float32 [rows, cols]`` in ``[0, 1)`` for a window of a ``[N, row_length]`` grid.

    Element ``(i, j)`` of the window is the global element
    ``(row_start + i) * row_length + col_start + j``; its number depends only
    on that index and ``seed``, so any tiling gives the same numbers.

    Args:
        seed: ``uint32`` scalar or ``[1, 1]`` array.
        rows, cols: window shape.
        row_start: first row of the window (may be traced, e.g. a grid index).
        col_start: first column of the window.
        row_length: elements per row of the whole grid.
    """
    row = jax.lax.broadcasted_iota(jnp.uint32, (rows, cols), 0)
    col = jax.lax.broadcasted_iota(jnp.uint32, (rows, cols), 1)
    row = row + jnp.asarray(row_start).astype(jnp.uint32)
    index = row * jnp.uint32(row_length) + (col + jnp.uint32(col_start))
    h = _mix32(index * jnp.uint32(0x9E3779B9) + jnp.asarray(seed, jnp.uint32))
    mantissa = (h >> jnp.uint32(8)).astype(jnp.int32).astype(jnp.float32)
    return mantissa * jnp.float32(2.0**-24)
