"""Chunked top-k sparsification, ``jnp`` reference.

The buffer is cut into chunks of ``chunk_size`` elements; each chunk keeps
its ``k = ceil(topk_fraction * chunk_size)`` largest-magnitude values with
their positions inside the chunk as ``int16``. Every chunk sends the same
number of values, so payloads have static shapes and split evenly over
devices (all-gather or all-to-all by chunk).

Example:
    >>> import jax.numpy as jnp
    >>> payload = encode(jnp.array([0.1, -3.0, 2.0, 0.0], jnp.float32), chunk_size=4, k=2)
    >>> payload.values.tolist(), payload.indices.tolist()
    ([[-3.0, 2.0]], [[1, 2]])
    >>> decode(payload, chunk_size=4).tolist()
    [0.0, -3.0, 2.0, 0.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torsh_jax.compress.base import TopKPayload
from torsh_jax.plan.compressors import kept_per_chunk

__all__ = ["kept_per_chunk", "encode", "decode", "encode_with_feedback"]


def encode(x: jax.Array, /, *, chunk_size: int, k: int) -> TopKPayload:
    """Keep the ``k`` largest magnitudes of every chunk of ``float32 [n]``."""
    x_CxK = x.reshape(-1, chunk_size)
    _, indices = jax.lax.top_k(jnp.abs(x_CxK), k)
    values = jnp.take_along_axis(x_CxK, indices, axis=1)
    return TopKPayload(values, indices.astype(jnp.int16))


def decode(payload: TopKPayload, /, *, chunk_size: int) -> jax.Array:
    """Scatter the kept values back into a dense flat buffer."""
    chunks = payload.values.shape[0]
    rows = jnp.arange(chunks, dtype=jnp.int32)[:, None]
    dense = jnp.zeros((chunks, chunk_size), jnp.float32)
    dense = dense.at[rows, payload.indices.astype(jnp.int32)].set(payload.values)
    return dense.reshape(-1)


def encode_with_feedback(
    x: jax.Array, residual: jax.Array, /, *, chunk_size: int, k: int
) -> tuple[TopKPayload, jax.Array]:
    """Sparsify ``x + residual``; the residual keeps every value not sent."""
    corrected = x + residual
    payload = encode(corrected, chunk_size=chunk_size, k=k)
    return payload, corrected - decode(payload, chunk_size=chunk_size)
