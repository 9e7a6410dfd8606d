"""Cast to a narrower float (``fp16``: Horovod's ``Compression.fp16``; ``bf16``), ``jnp`` reference.

The format is the registry's ``dtype``. The payload carries the float's bits as
the unsigned integer of its width (``uint16``), so collectives move 2 bytes
per element on every backend (the CPU compiler would widen a bfloat16
collective to float32).

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
from torsh_jax.plan.compressors import METHODS

__all__ = ["encode", "decode", "encode_with_feedback"]


def _format(method: str) -> jnp.dtype:
    """The narrow float dtype of ``method`` (the registry's ``dtype``)."""
    return jnp.dtype(METHODS[method].dtype)


def _bits(dtype: jnp.dtype) -> jnp.dtype:
    """The unsigned integer of the same width, which carries the float's bits on the wire."""
    return jnp.dtype(f"uint{8 * dtype.itemsize}")


def encode(x: jax.Array, /, *, method: str) -> CastPayload:
    """Round ``float32 [n]`` to the narrower float (nearest even) and keep the bits."""
    narrow = x.astype(_format(method))
    return CastPayload(jax.lax.bitcast_convert_type(narrow, _bits(narrow.dtype)))


def decode(payload: CastPayload, /, *, method: str) -> jax.Array:
    """The narrow float values as float32."""
    return jax.lax.bitcast_convert_type(payload.bits, _format(method)).astype(jnp.float32)


def encode_with_feedback(
    x: jax.Array, residual: jax.Array, /, *, method: str
) -> tuple[CastPayload, jax.Array]:
    """Cast ``x + residual``; the new residual is the rounding error."""
    corrected = x + residual
    payload = encode(corrected, method=method)
    return payload, corrected - decode(payload, method=method)
