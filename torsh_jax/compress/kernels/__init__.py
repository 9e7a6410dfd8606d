"""Pallas kernels of the compressors (TPU via Mosaic, GPU via Triton, or interpreted).

Only :mod:`torsh_jax.compress.kernels.blockwise` exists: int8, int4 and sign
encode, decode and the fused error-feedback step. Top-k, PowerSGD and the
casts use their ``jnp`` references on every backend.

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.compress.kernels import PLATFORMS
    >>> "interpret" in PLATFORMS
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "PLATFORMS": "torsh_jax.compress.kernels.blockwise",
    "encode": "torsh_jax.compress.kernels.blockwise",
    "decode": "torsh_jax.compress.kernels.blockwise",
    "encode_with_feedback": "torsh_jax.compress.kernels.blockwise",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.compress.kernels", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.compress.kernels.blockwise import PLATFORMS, decode, encode, encode_with_feedback
