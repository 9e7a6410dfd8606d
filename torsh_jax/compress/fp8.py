"""8-bit float compression with one float32 scale per block (``fp8_e4m3``, ``fp8_e5m2``), ``jnp`` reference.

Per block of ``B`` values: ``scale = absmax / fmax`` (448 for e4m3, 57344 for e5m2), the
values ``x / scale`` rounded to nearest-even in the 8-bit format and sent as their ``uint8``
bits, so one byte per element plus 4 per block crosses the wire (``B = 256``: 3.94x fewer bytes
than float32). The error of one round trip is at most half an ulp of the scaled value,
``2**-(t+1) |x|`` with ``t`` mantissa bits (e4m3: 1/16, e5m2: 1/8), plus half the format's
smallest subnormal times the scale (e4m3: ``amax * 2.2e-6``, e5m2: ``amax * 1.3e-10``).

Why one scale per block: a plain cast underflows. Gradients of the demo transformer (3.7M
parameters, a batch of 8 x 128 Zipf-distributed tokens) have a median ``|g|`` of 7.8e-4; cast to
e4m3 (smallest subnormal 2**-9 = 2e-3) 55% of them become 0, and at the magnitudes of a large
model's gradients (the same x 1e-3, median 7.8e-7) 100% of them (e5m2: 93%). Scaled, e4m3 flushes
to zero / leaves in its imprecise subnormal range: one scale per fused gradient buffer 0.23% /
3.7% of the values (a buffer holds parameters whose gradients differ 100x, the smallest ones fall
below the range), one per parameter 0.02% / 0.26%, one per block of 256 values 0.00% / 0.02%, at
any magnitude (the error is relative to the block's absmax). The buffer's relative 2-norm error is
then 0.026 (e4m3) and 0.052 (e5m2; no value leaves its range, but one mantissa bit fewer), so
``fp8_e4m3`` is the one to use for gradients and weights; ``fp8_e5m2`` wins only in blocks whose
values span more than 2**17 (e4m3 flushes values below ``2.2e-6`` of the block's absmax, e5m2
below ``1.3e-10``). A block never spans two parameters
(:func:`~torsh_jax.compress.factory.leaf_unit`), as for int8, so the scale is at least as local
as a per-parameter one, in int8's wire format and byte theory (one float32 per 256 values: +1.6%
bytes); a per-parameter scale would need a table of scales per buffer, whose size depends on
which parameters share it. ``tests/test_compressor_registry.py`` checks the plain cast against the
block scales on a small model's gradients at a large model's magnitudes.

There are no Pallas kernels: the encode is one fused elementwise XLA loop, and Triton converts
to fp8 only on GPUs of compute capability 8.9 and later.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([1e-6, -3e-5, 2e-4, 0.0] * 64, jnp.float32)
    >>> payload = encode(x, method="fp8_e4m3", block_size=256)
    >>> payload.values.dtype, payload.scales.shape
    (dtype('uint8'), (1, 1))
    >>> [f"{v:.3g}" for v in decode(payload, method="fp8_e4m3")[:4].tolist()]
    ['1e-06', '-2.86e-05', '0.0002', '0']
    >>> x[:3].astype(jnp.float8_e4m3fn).astype(jnp.float32).tolist()  # a plain cast: all flushed
    [0.0, -0.0, 0.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torsh_jax.compress.base import QuantPayload, as_blocks
from torsh_jax.plan.compressors import METHODS

__all__ = ["encode", "decode", "encode_with_feedback"]


def _format(method: str) -> jnp.dtype:
    """The 8-bit float dtype of ``method`` (the registry's ``dtype``)."""
    return jnp.dtype(METHODS[method].dtype)


def _encode_blocks(x_NxB: jax.Array, method: str) -> QuantPayload:
    dtype = _format(method)
    fmax = jnp.float32(jnp.finfo(dtype).max)
    scales = jnp.max(jnp.abs(x_NxB), axis=-1, keepdims=True) / fmax
    safe = jnp.where(scales > 0, scales, jnp.float32(1.0))
    # float32 rounding of x / scale may pass fmax by an ulp; e4m3fn has no infinity (it would be NaN)
    scaled = jnp.clip(x_NxB / safe, -fmax, fmax)
    return QuantPayload(jax.lax.bitcast_convert_type(scaled.astype(dtype), jnp.uint8), scales)


def _decode_blocks(payload: QuantPayload, method: str) -> jax.Array:
    values = jax.lax.bitcast_convert_type(payload.values, _format(method))
    return values.astype(jnp.float32) * payload.scales


def encode(x: jax.Array, /, *, method: str, block_size: int) -> QuantPayload:
    """``float32 [n]`` (``n`` a multiple of ``block_size``) -> ``uint8 [N, B]`` bits and
    ``float32 [N, 1]`` scales."""
    return _encode_blocks(as_blocks(x, block_size), method)


def decode(payload: QuantPayload, /, *, method: str) -> jax.Array:
    """The scaled 8-bit values as a flat float32 buffer."""
    return _decode_blocks(payload, method).reshape(-1)


def encode_with_feedback(
    x: jax.Array, residual: jax.Array, /, *, method: str, block_size: int
) -> tuple[QuantPayload, jax.Array]:
    """Encode ``x + residual``; the new residual is what the round trip lost."""
    corrected = as_blocks(x + residual, block_size)
    payload = _encode_blocks(corrected, method)
    return payload, (corrected - _decode_blocks(payload, method)).reshape(-1)
