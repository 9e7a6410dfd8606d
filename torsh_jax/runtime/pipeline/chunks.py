"""Layer-chunk storage: the stacked layers ``[layers, ...]`` stored as ``[chunks, layers / chunks, ...]``
under an interleaved pipeline, so that each stage holds exactly its chunks.

Example:
    >>> import jax.numpy as jnp
    >>> chunk_layers({"layers": {"w": jnp.zeros((8, 3))}}, "layers", 2)["layers"]["w"].shape
    (2, 4, 3)
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from torsh_jax.plan.roles import Roles
from torsh_jax.plan.spec import ParallelPlan

__all__ = ["layer_chunks", "chunk_layers", "unchunk_layers"]


def layer_chunks(plan: ParallelPlan, roles: Roles) -> int:
    """Chunks the stored stacked layers are split into: ``virtual_stages`` under an interleaved
    pipeline, else 1.

    Interleaving puts layer chunk ``c * p + s`` on stage ``s``: a strided split of
    the layer dim that no ``PartitionSpec`` of ``[layers, ...]`` expresses. Stored
    as ``[v, layers / v, ...]`` (a reshape: the values keep their order) and
    split ``P(None, 'stage')``, stage ``s`` holds exactly its ``v`` chunks, so no
    parameter moves between stages in a step.
    """
    pipe = plan.pipeline
    interleaved = roles.stage_axis is not None and pipe.schedule == "interleaved"
    return pipe.virtual_stages if interleaved else 1


def chunk_layers(params: dict, key: str, chunks: int) -> dict:
    """``params`` with the stacked layers ``[layers, ...]`` under ``key`` stored as ``[chunks,
    layers / chunks, ...]`` (arrays or ``ShapeDtypeStruct`` s; ``chunks == 1``: unchanged)."""
    return _reshape_layers(params, key, chunks, lambda s: (chunks, s[0] // chunks, *s[1:]))


def unchunk_layers(params: dict, key: str, chunks: int) -> dict:
    """Inverse of :func:`chunk_layers`: the stacked layers back as ``[layers, ...]``."""
    return _reshape_layers(params, key, chunks, lambda s: (s[0] * s[1], *s[2:]))


def _reshape_layers(params: dict, key: str, chunks: int, new_shape: Callable) -> dict:
    if chunks == 1:
        return params

    def one(x):
        shape = new_shape(x.shape)
        return (
            jax.ShapeDtypeStruct(shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.reshape(shape)
        )

    return {**params, key: jax.tree.map(one, params[key])}
