"""The compressor registry: method name -> how it is built, its wire format and how it reduces.

This module is data only (no JAX), so plan validation and the byte theory read the same table
as the compressors. A new compressor is one entry here (plus its encode/decode module; a new
``family`` also needs its builder in :mod:`torsh_jax.compress.factory`).

Example:
    >>> METHODS["int8"].payload_bytes(4096, block_size=256), METHODS["bf16"].payload_bytes(4096)
    (4160, 8192)
    >>> [name for name, m in METHODS.items() if m.weights]
    ['fp16', 'bf16', 'int8', 'int4']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Method", "METHODS", "WEIGHT_METHODS", "method_names"]


@dataclass(frozen=True)
class Method:
    """One compression method.

    Attributes:
        family: the builder in :mod:`torsh_jax.compress.factory`: ``blockwise`` (one float32 scale
            per ``block_size`` values, Pallas kernels), ``cast`` (a narrower float), ``topk`` or
            ``powersgd``.
        bits: payload bits per element; ``None`` when the size depends on the settings
            (top-k's fraction, PowerSGD's rank).
        all_reduce: ``two_phase`` (compress, all-to-all, sum, re-compress, all-gather; a worker
            and a server residual), ``sparse_gather`` (all-gather the kept values) or
            ``low_rank`` (PowerSGD's two small all-reduces).
        weights: whether it may compress weight all-gathers (ZeRO-3).
        stochastic: whether ``rounding = "stochastic"`` draws random numbers.
    """

    family: Literal["blockwise", "cast", "topk", "powersgd"]
    bits: int | None
    all_reduce: Literal["two_phase", "sparse_gather", "low_rank"] = "two_phase"
    weights: bool = False
    stochastic: bool = False

    @property
    def blockwise(self) -> bool:
        """Scaled per block of ``block_size`` values (which never spans two parameters)."""
        return self.family == "blockwise"

    def payload_bytes(self, elements: int, /, *, block_size: int = 256) -> int | None:
        """Bytes of the payload of ``elements`` values (whole blocks); ``None``: depends on settings."""
        if self.bits is None:
            return None
        scales = 4 * (elements // block_size) if self.blockwise else 0
        return elements * self.bits // 8 + scales


#: Method name -> :class:`Method`; ``none`` (no compression) is not a method.
METHODS: dict[str, Method] = {
    "fp16": Method("cast", 16, weights=True),
    "bf16": Method("cast", 16, weights=True),
    "int8": Method("blockwise", 8, weights=True, stochastic=True),
    "int4": Method("blockwise", 4, weights=True, stochastic=True),
    "sign": Method("blockwise", 1),
    "topk": Method("topk", None, all_reduce="sparse_gather"),
    "powersgd": Method("powersgd", None, all_reduce="low_rank"),
}

#: Methods usable for weight all-gathers.
WEIGHT_METHODS = tuple(name for name, method in METHODS.items() if method.weights)


def method_names() -> tuple[str, ...]:
    """``compression.method`` values: ``none`` and every registered method."""
    return ("none", *METHODS)
