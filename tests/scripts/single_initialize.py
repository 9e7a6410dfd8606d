"""initialize() in a one-process environment: no jax.distributed, idempotent, typed errors.

Prints one `ok ...` line per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import sys

from torsh_jax.distributed import initialize, initialized_environment
from torsh_jax.errors import DistributedError


def check(ok: bool, what: str) -> None:
    print(("ok " if ok else "FAILED: ") + what, flush=True)
    if not ok:
        sys.exit(3)


def expect_error(call, key: str, what: str) -> None:
    try:
        call()
    except DistributedError as err:
        check(err.key == key and bool(err.fix), f"{what} (key={err.key})")
    else:
        check(False, what)


def main() -> None:
    check(initialized_environment() is None, "nothing joined before initialize()")
    expect_error(
        lambda: initialize(environ={"WORLD_SIZE": "2", "RANK": "1"}), "MASTER_ADDR", "missing MASTER_ADDR"
    )
    expect_error(lambda: initialize(environ={}, cpu_collectives="nccl"), "cpu_collectives", "bad collectives")
    check(initialized_environment() is None, "failed calls join nothing")

    env = initialize(environ={}, num_cpu_devices=3)
    import jax

    check(env.kind == "single" and not jax.distributed.is_initialized(), "single process: no jax.distributed")
    check(jax.device_count() == 3, "num_cpu_devices=3 gives 3 CPU devices")
    check(initialize(environ={}, num_cpu_devices=3) is env, "second identical call is a no-op")
    expect_error(lambda: initialize(environ={}, num_cpu_devices=5), "initialize", "second different call")


if __name__ == "__main__":
    main()
