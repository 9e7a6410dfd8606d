"""Half-precision cast compression (Horovod's ``Compression.fp16``), ``jnp`` reference.

The payload carries the half-precision bits as ``uint16``, so collectives
move 2 bytes per element on every backend (the CPU compiler would widen a
bfloat16 collective to float32).

Example:
    >>> import jax.numpy as jnp
    >>> payload = encode(jnp.array([1.0, 0.1], jnp.float32), method="bf16")
    >>> payload.bits.dtype, decode(payload, method="bf16").tolist()
    (dtype('uint16'), [1.0, 0.10009765625])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torsh_jax.compress.base import CastPayload

__all__ = ["CAST_METHODS", "encode", "decode", "encode_with_feedback"]

#: Method name -> payload float dtype.
CAST_METHODS = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


def encode(x: jax.Array, /, *, method: str) -> CastPayload:
    """Round ``float32 [n]`` to half precision (nearest even) and keep the bits."""
    half = x.astype(CAST_METHODS[method])
    return CastPayload(jax.lax.bitcast_convert_type(half, jnp.uint16))


def decode(payload: CastPayload, /, *, method: str) -> jax.Array:
    """The half-precision values as float32."""
    half = jax.lax.bitcast_convert_type(payload.bits, CAST_METHODS[method])
    return half.astype(jnp.float32)


def encode_with_feedback(
    x: jax.Array, residual: jax.Array, /, *, method: str
) -> tuple[CastPayload, jax.Array]:
    """Cast ``x + residual``; the new residual is the rounding error."""
    corrected = x + residual
    payload = encode(corrected, method=method)
    return payload, corrected - decode(payload, method=method)
