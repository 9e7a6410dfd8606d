"""Models as their authors wrote them, converted for pipelines and layer-at-a-time ZeRO-3.

Example:
    >>> from torsh_jax.models import from_linen
    >>> from_linen.__name__
    'from_linen'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "from_linen": "torsh_jax.models.linen",
    "from_nnx": "torsh_jax.models.nnx",
    "from_scan": "torsh_jax.models.scanned",
    "FlaxLayers": "torsh_jax.models.blocks",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.models", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.models.blocks import FlaxLayers
    from torsh_jax.models.linen import from_linen
    from torsh_jax.models.nnx import from_nnx
    from torsh_jax.models.scanned import from_scan
