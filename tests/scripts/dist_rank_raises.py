"""Process ``argv[1]`` raises RuntimeError right after initialize(); the others wait in a collective.

Run by tests/test_launch_failures.py under ``torsh-jax launch -n 2`` and as two
processes started with torchrun's or Slurm's variables. Without initialize()'s
fail-fast excepthook the failing process would block in JAX's shutdown and the
others in their collective.
"""

from __future__ import annotations

import sys

import numpy as np

from torsh_jax.distributed import initialize


def main() -> None:
    failing = int(sys.argv[1])
    env = initialize(timeout_s=60)
    print(f"started {env.process_id}", flush=True)
    if env.process_id == failing:
        raise RuntimeError(f"boom from process {failing}")
    from jax.experimental import multihost_utils

    while True:  # blocks: the failing process never joins
        multihost_utils.process_allgather(np.ones(2, np.float32))


if __name__ == "__main__":
    main()
