"""Explicit multi-process start-up: detect the launcher, set up CPU collectives, join the job.

Nothing happens on import; call :func:`initialize` once per process, first
thing in ``main``, before any JAX computation (``jax.devices()`` included).

Example:
    >>> from torsh_jax.distributed import initialize
    >>> env = initialize(environ={})  # no launcher variables: one process, no jax.distributed
    >>> env.kind, env.num_processes
    ('single', 1)
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import time
from collections.abc import Mapping, Sequence

import jax

from torsh_jax.distributed.env import ProcessEnv, detect_environment
from torsh_jax.distributed.failfast import install_fail_fast
from torsh_jax.errors import DistributedError

__all__ = ["initialize", "initialized_environment"]

_logger = logging.getLogger("torsh_jax")
_CPU_COLLECTIVES = ("gloo", "mpi")
#: The layout this process joined; set once by :func:`initialize`.
_joined: list[ProcessEnv] = []


def initialize(
    *,
    environ: Mapping[str, str] | None = None,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    num_cpu_devices: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    timeout_s: int = 120,
    cpu_collectives: str = "gloo",
    fail_fast: bool = True,
) -> ProcessEnv:
    """Join the multi-process job this process was started in.

    Reads the launcher's variables (torchrun, Slurm, Open MPI, JAX's own or
    ``torsh-jax launch``; see :func:`~torsh_jax.distributed.env.detect_environment`),
    sets ``jax_cpu_collectives_implementation`` and ``jax_num_cpu_devices``,
    waits for the coordinator and calls ``jax.distributed.initialize``. A
    single-process environment does not call ``jax.distributed`` at all. Logs
    one ``INFO`` line on the ``torsh_jax`` logger saying what was detected.

    A second call with the same resulting layout is a no-op returning the
    same :class:`ProcessEnv`; a second call asking for a different layout
    raises :class:`DistributedError`.

    Args:
        environ: variables to read (default ``os.environ``).
        coordinator_address: ``host:port`` of process 0; overrides the environment.
        num_processes: process count; overrides the environment.
        process_id: this process's id; overrides the environment.
        num_cpu_devices: simulated CPU devices in this process; default: the
            launcher's ``TORSH_JAX_DEVICES_PER_PROCESS``, else JAX's default.
        local_device_ids: accelerator ids this process may use (passed to JAX).
        timeout_s: seconds to wait for the coordinator and for all processes to join.
        cpu_collectives: cross-process collectives on CPU, ``gloo`` or ``mpi``.
        fail_fast: with several processes, make an uncaught exception end the
            job: a ``sys.excepthook`` (chaining the previous one) prints the
            traceback, records the failure in the coordination service and
            calls ``os._exit(1)`` instead of waiting in JAX's shutdown for the
            other processes, and a watcher thread ends this process about a
            second after another process recorded a failure (see
            :mod:`torsh_jax.distributed.failfast`). ``False`` installs neither.

    Returns:
        The layout this process joined.

    Raises:
        DistributedError: the environment is inconsistent or names no
            coordinator, the coordinator cannot be reached within
            ``timeout_s``, its port is taken, or JAX already started.

    Example:
        >>> initialize(environ={}).describe()  # doctest: +ELLIPSIS
        'single: process 0/1 (local 0/1, node 0/1), coordinator none; read no variables'
    """
    _check_choice(cpu_collectives, timeout_s)
    env = detect_environment(
        environ, coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    if num_cpu_devices is not None:
        env = dataclasses.replace(env, devices_per_process=num_cpu_devices)
    if _joined:
        return _repeat_call(_joined[0], env)
    if jax.distributed.is_initialized():
        return _adopt_existing(env, fail_fast=fail_fast)
    _configure_cpu(env, cpu_collectives)
    if env.is_multi_process:
        _join(env, timeout_s=timeout_s, local_device_ids=local_device_ids)
        _install_fail_fast(env, fail_fast=fail_fast)
    _joined.append(env)
    _logger.info("torsh_jax.distributed.initialize: %s", env.describe())
    return env


def initialized_environment() -> ProcessEnv | None:
    """The layout :func:`initialize` joined, or ``None`` before it is called."""
    return _joined[0] if _joined else None


def _check_choice(cpu_collectives: str, timeout_s: int) -> None:
    if cpu_collectives not in _CPU_COLLECTIVES:
        raise DistributedError(
            f"must be one of {list(_CPU_COLLECTIVES)}, got {cpu_collectives!r}",
            key="cpu_collectives",
            fix="use 'gloo' (no MPI installation needed)",
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
        raise DistributedError(
            f"must be an integer >= 1, got {timeout_s!r}",
            key="timeout_s",
            fix="pass timeout_s as a positive number of seconds",
        )


def _repeat_call(joined: ProcessEnv, env: ProcessEnv) -> ProcessEnv:
    same = dataclasses.replace(env, source_vars=joined.source_vars) == joined
    if same:
        _logger.debug("torsh_jax.distributed.initialize: already joined (%s)", joined.describe())
        return joined
    raise DistributedError(
        f"already initialized as [{joined.describe()}]; this call asks for [{env.describe()}]",
        key="initialize",
        fix="call initialize() once per process, with the same arguments everywhere",
    )


def _adopt_existing(env: ProcessEnv, *, fail_fast: bool) -> ProcessEnv:
    """``jax.distributed`` was started outside torsh_jax: accept it when it matches."""
    if (jax.process_count(), jax.process_index()) != (env.num_processes, env.process_id):
        raise DistributedError(
            f"jax.distributed is already running as process {jax.process_index()}/{jax.process_count()}, "
            f"but the environment says {env.process_id}/{env.num_processes}",
            key="initialize",
            fix="call torsh_jax.distributed.initialize() instead of jax.distributed.initialize()",
        )
    if env.is_multi_process:
        _install_fail_fast(env, fail_fast=fail_fast)
    _joined.append(env)
    _logger.info("torsh_jax.distributed.initialize: adopted running jax.distributed (%s)", env.describe())
    return env


def _install_fail_fast(env: ProcessEnv, *, fail_fast: bool) -> None:
    if not fail_fast:
        return
    install_fail_fast(env.process_id, client=_coordination_client())
    _logger.debug("torsh_jax.distributed.initialize: fail-fast excepthook and failure watcher installed")


def _coordination_client():
    """JAX's distributed runtime client (no public accessor; ``None`` if JAX moved it)."""
    from jax._src import distributed as jax_distributed

    return getattr(getattr(jax_distributed, "global_state", None), "client", None)


def _configure_cpu(env: ProcessEnv, cpu_collectives: str) -> None:
    try:
        if env.is_multi_process:
            jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        if env.devices_per_process is not None:
            jax.config.update("jax_num_cpu_devices", env.devices_per_process)
    except RuntimeError as err:
        raise DistributedError(
            f"JAX has already started, so the CPU set-up cannot change ({err})",
            key="num_cpu_devices",
            fix="call initialize() before any JAX computation, jax.devices() included",
        ) from None


def _join(env: ProcessEnv, *, timeout_s: int, local_device_ids: Sequence[int] | None) -> None:
    address = env.coordinator_address
    if address is None:
        raise DistributedError(
            f"{env.num_processes} processes but no coordinator",
            key="coordinator_address",
            fix="set coordinator_address to process 0's host:port, e.g. JAX_COORDINATOR_ADDRESS=host0:1234",
        )
    host, port = _host_port(address)
    started = time.monotonic()
    if env.process_id == 0:
        _check_port_free(port, address)
    else:
        _wait_for_coordinator(host, port, address, timeout_s=timeout_s)
    remaining = max(1, int(timeout_s - (time.monotonic() - started)))
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=env.num_processes,
            process_id=env.process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=remaining,
        )
    except RuntimeError as err:
        raise DistributedError(
            f"jax.distributed.initialize failed: {err}",
            key="initialize",
            fix="call initialize() before any JAX computation, jax.devices() included",
        ) from err


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_port_free(port: int, address: str) -> None:
    """Process 0 serves the coordinator on ``[::]:port``; JAX crashes if it is taken."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((host, port))
            return
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise DistributedError(
                    f"process 0 cannot serve the coordinator: port {port} is in use",
                    key=address,
                    fix="choose another port (MASTER_PORT / JAX_COORDINATOR_PORT / --port) "
                    "or stop the job that holds it",
                ) from None
            # This address family is unavailable here (e.g. IPv6 disabled): try the next.


def _wait_for_coordinator(host: str, port: int, address: str, *, timeout_s: int) -> None:
    """Poll process 0's coordinator; JAX aborts the process when it times out, so check first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"no coordinator answered at {address} within {timeout_s} s ({err})",
                    key=address,
                    fix="start process 0 (it serves the coordinator), check the host/port "
                    "(MASTER_ADDR/MASTER_PORT) and firewalls, or raise timeout_s",
                ) from None
            time.sleep(0.2)
