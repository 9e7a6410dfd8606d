"""Gradient and weight compression: compressors, error feedback, compressed collectives.

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.compress import padded_length
    >>> from torsh_jax.plan import CompressorSpec
    >>> padded_length(5000, axis_size=8, spec=CompressorSpec(method="int4"))
    6144
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CastPayload": "torsh_jax.compress.base",
    "Compressor": "torsh_jax.compress.base",
    "PowerSGDPayload": "torsh_jax.compress.base",
    "QuantPayload": "torsh_jax.compress.base",
    "TopKPayload": "torsh_jax.compress.base",
    "compressed_all_gather": "torsh_jax.compress.collectives",
    "compressed_all_reduce": "torsh_jax.compress.collectives",
    "compressed_reduce_scatter": "torsh_jax.compress.collectives",
    "IMPLEMENTATIONS": "torsh_jax.compress.factory",
    "make_compressor": "torsh_jax.compress.factory",
    "needs_key": "torsh_jax.compress.factory",
    "padded_length": "torsh_jax.compress.factory",
    "FeedbackState": "torsh_jax.compress.feedback",
    "init_feedback": "torsh_jax.compress.feedback",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.compress", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.compress.base import CastPayload, Compressor, PowerSGDPayload, QuantPayload, TopKPayload
    from torsh_jax.compress.collectives import (
        compressed_all_gather,
        compressed_all_reduce,
        compressed_reduce_scatter,
    )
    from torsh_jax.compress.factory import IMPLEMENTATIONS, make_compressor, needs_key, padded_length
    from torsh_jax.compress.feedback import FeedbackState, init_feedback
