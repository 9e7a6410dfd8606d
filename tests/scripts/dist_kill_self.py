"""Run under `torsh-jax launch -n 2`: process 1 kills itself with SIGKILL after start-up,
process 0 keeps running cross-process collectives until the launcher stops it."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from torsh_jax.distributed import initialize


def main() -> None:
    env = initialize(timeout_s=60)
    import jax
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("started")
    print("started", flush=True)
    if env.process_id == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # blocks in a collective once the peer is gone
        multihost_utils.process_allgather(np.ones(2, np.float32))
        time.sleep(0.1)
        _ = jax.process_count()


if __name__ == "__main__":
    main()
