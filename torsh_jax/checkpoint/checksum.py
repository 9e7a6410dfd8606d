"""Checksums of the arrays a checkpoint holds: their bits summed as ``uint32`` words, modulo 2**32.

A save records one checksum per array; a restore recomputes them on what it
read. Flipping any single bit changes its word by ``+-2**k`` and so the sum,
which orbax's zarr chunks (uncompressible data is stored raw) would otherwise
pass through unnoticed. The sums run on the devices, over the arrays where
they are sharded, and do not depend on the mesh, the order of the reduction
or on how the stacked layers are chunked: a checkpoint verifies on any plan it
restores onto.

Example:
    >>> import jax.numpy as jnp
    >>> checksums({"w": jnp.ones(2), "n": jnp.int32(3)})
    {'n': 3, 'w': 2130706432}
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.runtime.specs import path_str
from torsh_jax.typing import PyTree

__all__ = ["checksums", "mismatched"]


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bits as ``uint32`` values (one per 1-, 2- or 4-byte element, two per 8-byte one)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fold(words: jax.Array) -> jax.Array:
    """The wrapping sum of ``words`` (any shape): halves added elementwise until small, which
    vectorises where a plain integer reduction does not (XLA's CPU backend: 9x faster)."""
    words = words.reshape(-1)
    while words.size > 4096:
        half = words.size // 2
        words = jnp.concatenate([words[:half] + words[half : 2 * half], words[2 * half :]])
    return jnp.sum(words, dtype=jnp.uint32)


def _spec_axes(spec: P) -> tuple[str, ...]:
    named = [entry for entry in spec if entry is not None]
    return tuple(a for entry in named for a in ((entry,) if isinstance(entry, str) else entry))


def _placement(x: Any) -> tuple | None:
    """``(mesh, spec)`` of an array sharded over named mesh axes, else ``None`` (one device, or
    replicated: every device holds the whole array)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and _spec_axes(sharding.spec):
        return sharding.mesh, sharding.spec
    return None


def _sum(x: jax.Array, placement: tuple | None) -> jax.Array:
    """The checksum of one array, summed shard by shard where it lives (no array moves)."""
    if placement is None:
        return _fold(_words(x))
    mesh, spec = placement
    per_shard = lambda block: jax.lax.psum(_fold(block), _spec_axes(spec))
    return jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=P())(_words(x))


@functools.partial(jax.jit, static_argnums=1)
def _sums(leaves: list, placements: tuple) -> list:
    return [_sum(x, placement) for x, placement in zip(leaves, placements)]


def checksums(tree: PyTree) -> dict[str, int]:
    """``{parameter path: checksum}`` of every array leaf of ``tree`` (every process gets the same)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = [leaf for _, leaf in flat]
    sums = _sums(leaves, tuple(_placement(x) for x in leaves))
    return {path_str(path): _to_int(value) for (path, _), value in sorted(zip(flat, sums), key=_by_path)}


def _by_path(item) -> str:
    return path_str(item[0][0])


def _to_int(value: jax.Array) -> int:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = value.addressable_data(0)
    return int(np.asarray(value))


def mismatched(saved: dict[str, int], read: PyTree) -> list[tuple[str, int, int]]:
    """``[(path, saved, read)]`` of the arrays in ``read`` whose checksum differs from ``saved``
    (arrays ``saved`` has no checksum for are not checked)."""
    got = checksums(read)
    return [(path, saved[path], got[path]) for path in got if path in saved and saved[path] != got[path]]
