"""PowerSGD low-rank compression with warm start (Vogels et al., NeurIPS 2019), ``jnp`` reference.

The flat buffer is viewed as a matrix ``M [rows, cols]`` (``cols`` the
largest divisor of ``n`` not above ``sqrt(n)``). One power-iteration step
per call, starting from the previous ``Q`` (warm start):

``P = M Q``, ``P <- orthonormalise(P)``, ``Q = M^T P``, ``M ~= P Q^T``.

Across workers, ``P`` and ``Q`` are averaged with all-reduces between the
steps (see :mod:`torsh_jax.compress.collectives`); since ``M -> P Q^T`` is
linear in ``Q`` for a fixed ``P``, the mean of the workers' approximations
is ``P mean(Q)^T``.

Example:
    >>> import jax.numpy as jnp
    >>> matrix_shape(4096)
    (64, 64)
    >>> q = initial_q(4096, rank=2)
    >>> m = jnp.outer(jnp.arange(64.0), jnp.ones(64)).reshape(-1).astype(jnp.float32)
    >>> payload, q = encode(m, q)
    >>> bool(jnp.allclose(decode(payload), m, atol=1e-3))
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torsh_jax.compress.base import PowerSGDPayload
from torsh_jax.plan.compressors import matrix_shape

__all__ = ["matrix_shape", "initial_q", "orthonormalise", "encode", "decode", "encode_with_feedback"]

#: Fixed key of the initial ``Q``: every worker must start from the same matrix.
_INIT_SEED = 0x5EED


def q_shape(length: int, *, rank: int) -> tuple[int, int]:
    """``Q``'s shape for a buffer of ``length``: ``[cols, rank]``, the rank at most the matrix's."""
    rows, cols = matrix_shape(length)
    return cols, min(rank, rows, cols)


def initial_q(length: int, *, rank: int) -> jax.Array:
    """Standard-normal ``Q [cols, rank]`` from a fixed key (identical on every worker)."""
    return jax.random.normal(jax.random.key(_INIT_SEED), q_shape(length, rank=rank), jnp.float32)


def orthonormalise(p: jax.Array) -> jax.Array:
    """Orthonormal columns spanning those of ``p`` (reduced QR)."""
    q, _ = jnp.linalg.qr(p)
    return q


def _matrix(x: jax.Array) -> jax.Array:
    return x.reshape(matrix_shape(x.shape[0]))


def encode(x: jax.Array, q: jax.Array, /) -> tuple[PowerSGDPayload, jax.Array]:
    """One warm-started power step on one worker: ``(payload, next_q)``."""
    m = _matrix(x)
    p = orthonormalise(m @ q)
    q_next = m.T @ p
    return PowerSGDPayload(p, q_next), q_next


def decode(payload: PowerSGDPayload, /) -> jax.Array:
    """``P Q^T`` as a flat buffer."""
    return (payload.p @ payload.q.T).reshape(-1)


def encode_with_feedback(
    x: jax.Array, residual: jax.Array, q: jax.Array, /
) -> tuple[PowerSGDPayload, jax.Array, jax.Array]:
    """Compress ``x + residual``: ``(payload, new_residual, next_q)``."""
    corrected = x + residual
    payload, q_next = encode(corrected, q)
    return payload, corrected - decode(payload), q_next
