"""The host's cores this process may use, and jobs run at once on them (XLA compiles outside the
GIL, so compiles run in parallel threads).

Example:
    >>> from functools import partial
    >>> in_parallel({n: partial(pow, n, 2) for n in range(3)})
    {0: 0, 1: 1, 2: 4}
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["in_parallel", "cpu_share"]


def in_parallel(jobs: dict) -> dict:
    """``{key: job()}``, the jobs run at once on this process's share of the host's cores
    (:func:`cpu_share`; XLA compiles outside the GIL).

    Example:
        >>> from functools import partial
        >>> in_parallel({n: partial(pow, n, 2) for n in range(4)})
        {0: 0, 1: 1, 2: 4, 3: 9}
    """
    workers = max(1, min(len(jobs), cpu_share()))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def cpu_share(environ=None) -> int:
    """The cores this process may run on (its affinity), shared with the job's other processes on
    its host (``local_world_size`` of :func:`~torsh_jax.distributed.env.detect_environment` read
    from ``environ``, default ``os.environ``: a launcher's processes on one machine, one per GPU
    under torchrun or Slurm); at least 1.

    Example:
        >>> cpu_share() >= 1
        True
    """
    from torsh_jax.distributed.env import detect_environment

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = detect_environment(environ)
    return max(1, cores // (env.local_world_size if env.is_multi_process else 1))
