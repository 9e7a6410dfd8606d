"""Multi-process start-up and process-local data.

``torsh_jax.distributed.env`` reads launcher variables without importing JAX;
``initialize`` and the batch helpers import JAX and are loaded on first use.

Example:
    >>> from torsh_jax.distributed import detect_environment
    >>> detect_environment({"WORLD_SIZE": "1", "RANK": "0"}).num_processes
    1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "ProcessEnv": "torsh_jax.distributed.env",
    "detect_environment": "torsh_jax.distributed.env",
    "expand_hostlist": "torsh_jax.distributed.env",
    "initialize": "torsh_jax.distributed.init",
    "initialized_environment": "torsh_jax.distributed.init",
    "global_batch_from_local": "torsh_jax.distributed.data",
    "local_batch_slice": "torsh_jax.distributed.data",
    "launch": "torsh_jax.distributed.launcher",
    "ray_launch": "torsh_jax.distributed.ray_launch",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("torsh_jax.distributed", _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.distributed.data import global_batch_from_local, local_batch_slice
    from torsh_jax.distributed.env import ProcessEnv, detect_environment, expand_hostlist
    from torsh_jax.distributed.init import initialize, initialized_environment
    from torsh_jax.distributed.launcher import launch
    from torsh_jax.distributed.ray_launch import ray_launch
