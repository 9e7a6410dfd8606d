"""Checkpoint checksums: every single flipped bit changes them, whatever the dtype; the mesh does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.checkpoint.checksum import checksums, mismatched

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint8, jnp.int32, jnp.bool_]


def _values(dtype) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == jnp.bool_:
        return rng.random(96) > 0.5
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return rng.integers(info.min, info.max, 96, endpoint=True).astype(dtype)
    return rng.standard_normal(96).astype(dtype)


def _flip(values: np.ndarray, bit: int) -> np.ndarray:
    if values.dtype == np.bool_:
        flipped = values.copy()
        flipped[17] = ~flipped[17]
        return flipped
    raw = values.view(f"u{values.dtype.itemsize}").copy()
    raw[17] ^= raw.dtype.type(1) << raw.dtype.type(bit)
    return raw.view(values.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_single_flipped_bit_changes_the_checksum(dtype):
    values = _values(dtype)
    bits = 1 if values.dtype == np.bool_ else 8 * values.dtype.itemsize
    saved = checksums({"w": jnp.asarray(values)})
    for bit in range(bits):
        assert mismatched(saved, {"w": jnp.asarray(_flip(values, bit))}) != [], f"bit {bit} went unnoticed"
    assert mismatched(saved, {"w": jnp.asarray(values)}) == []


@pytest.mark.parametrize(
    "spec", [P("fsdp"), P(("data", "fsdp")), P(None, "data"), P("data", "fsdp")], ids=str
)
def test_sharding_and_chunking_do_not_change_the_checksum(spec):
    """Summed per shard and added over the sharded axes only (a replica is not counted twice)."""
    devices = require_devices(8)
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(auto, auto), devices=devices)
    values = jax.random.normal(jax.random.key(0), (16, 24))
    sharded = jax.device_put(values, NamedSharding(mesh, spec))
    key = jax.random.key(3)
    one = checksums({"w": values, "k": key})
    assert checksums({"w": sharded, "k": key}) == one
    assert checksums({"w": sharded.reshape(2, 8, 24), "k": key})["w"] == one["w"]  # interleaved chunks
    [(path, saved, read)] = mismatched(one, {"w": values.at[3, 5].add(1.0), "k": key})
    assert path == "w" and saved == one["w"] != read
