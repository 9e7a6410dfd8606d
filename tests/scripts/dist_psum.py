"""Two-process check run by tests/test_launch.py under `torsh-jax launch -n 2 --devices-per-process 2`.

Each process loads its half of an 8x3 batch, builds the global array with
global_batch_from_local, and checks a cross-process psum, a jitted sum and an
all-gather against the values computed on one host. Prints one line per check;
exits non-zero on any mismatch.
"""

from __future__ import annotations

import logging
import sys

import numpy as np

from torsh_jax.distributed import global_batch_from_local, initialize, local_batch_slice
from torsh_jax.errors import ShardingError

GLOBAL_ROWS, FEATURES = 8, 3


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"FAILED: {what}", flush=True)
        sys.exit(3)
    print(f"ok {what}", flush=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    env = initialize(timeout_s=60)

    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    check(jax.process_count() == 2 and jax.process_index() == env.process_id, "process layout")
    check(jax.device_count() == 4 and jax.local_device_count() == 2, "2 processes x 2 devices")

    full_x = np.arange(GLOBAL_ROWS * FEATURES, dtype=np.float32).reshape(GLOBAL_ROWS, FEATURES)
    full_y = np.arange(GLOBAL_ROWS, dtype=np.int32) * 10
    rows = local_batch_slice(GLOBAL_ROWS, process_index=env.process_id, process_count=env.num_processes)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
    batch = global_batch_from_local({"x": full_x[rows], "y": full_y[rows]}, mesh=mesh, spec=P("data"))
    check(batch["x"].shape == (GLOBAL_ROWS, FEATURES) and batch["y"].shape == (GLOBAL_ROWS,), "global shapes")

    def shard_sum(x):
        return jax.lax.psum(x.sum(), "data")

    psum = jax.jit(jax.shard_map(shard_sum, mesh=mesh, in_specs=P("data"), out_specs=P()))
    total = float(np.asarray(psum(batch["x"]).addressable_data(0)))
    print(f"psum {total}", flush=True)
    check(total == float(full_x.sum()), f"psum across processes == {float(full_x.sum())}")

    gathered = multihost_utils.process_allgather(batch["y"], tiled=True)
    check(np.array_equal(np.asarray(gathered), full_y), "all-gather equals the global batch")

    try:
        global_batch_from_local({"x": np.zeros((3, FEATURES), np.float32)}, mesh=mesh, spec=P("data"))
    except ShardingError as err:
        print(f"sharding error: {err}", flush=True)
        check(err.key == "x" and "(3, 3)" in str(err), "ShardingError names the leaf and its shape")
    else:
        check(False, "3 local rows over 2 local devices must raise ShardingError")


if __name__ == "__main__":
    main()
