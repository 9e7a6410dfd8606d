"""Gradient and weight compression: compressors, error feedback, compressed collectives.

Example:
    >>> from torsh_jax.compress import make_compressor, padded_length
    >>> from torsh_jax.plan import CompressorSpec
    >>> padded_length(5000, axis_size=8, spec=CompressorSpec(method="int4"))
    6144
"""

from torsh_jax.compress.base import (
    CastPayload,
    Compressor,
    PowerSGDPayload,
    QuantPayload,
    TopKPayload,
)
from torsh_jax.compress.collectives import (
    compressed_all_gather,
    compressed_all_reduce,
    compressed_reduce_scatter,
)
from torsh_jax.compress.factory import IMPLEMENTATIONS, make_compressor, needs_key, padded_length
from torsh_jax.compress.feedback import FeedbackState, init_feedback

__all__ = [
    "CastPayload",
    "Compressor",
    "FeedbackState",
    "IMPLEMENTATIONS",
    "PowerSGDPayload",
    "QuantPayload",
    "TopKPayload",
    "compressed_all_gather",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "init_feedback",
    "make_compressor",
    "needs_key",
    "padded_length",
]
