"""Calls initialize(timeout_s=argv[1]) in a job that cannot start (no process 0, or its port taken).

Exits 7 after printing the DistributedError's key and fix; exits 1 if initialize() returns.
"""

from __future__ import annotations

import sys

from torsh_jax.distributed import initialize
from torsh_jax.errors import DistributedError

try:
    initialize(timeout_s=int(sys.argv[1]))
except DistributedError as err:
    print(f"DistributedError key={err.key} fix={err.fix}", flush=True)
    sys.exit(7)
print("initialize returned although the job cannot start", flush=True)
sys.exit(1)
