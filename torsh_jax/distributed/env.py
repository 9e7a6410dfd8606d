"""Read the process layout of a multi-process job from its environment (no JAX import).

Launchers describe a job with environment variables; :func:`detect_environment`
turns them into one :class:`ProcessEnv`. Sources, in order of precedence:

1. ``torsh_launch``: ``TORSH_JAX_COORDINATOR``, ``TORSH_JAX_NUM_PROCESSES``,
   ``TORSH_JAX_PROCESS_ID`` (set by ``torsh-jax launch``).
2. ``jax``: ``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
   (or a Kubernetes indexed Job's ``JOB_COMPLETION_INDEX``).
3. ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
4. ``openmpi``: ``OMPI_COMM_WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``LOCAL_SIZE``
   plus ``MASTER_ADDR`` and ``MASTER_PORT``.
5. ``slurm``: ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``), ``SLURM_PROCID``,
   ``SLURM_LOCALID``, the node list (the step's first host is the coordinator) and a
   port derived from ``SLURM_JOB_ID``.
6. ``single``: none of the above; one process, no coordinator.

``JAX_COORDINATOR_ADDRESS`` (``host:port``) overrides the coordinator of any
source, and ``JAX_COORDINATOR_PORT`` its port (both as JAX itself reads them).
``TORSH_JAX_DEVICES_PER_PROCESS`` (simulated CPU devices per process) is read for
every source.

Example:
    >>> env = detect_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
    ...                           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    >>> env.kind, env.process_id, env.coordinator_address
    ('torchrun', 1, '10.0.0.1:29500')
    >>> detect_environment({}).kind
    'single'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torsh_jax.distributed.env_sources import JAX_COORDINATOR, LAUNCH_VARS, Draft, Reader, draft_from
from torsh_jax.distributed.hostlist import expand_hostlist, slurm_port
from torsh_jax.errors import DistributedError

__all__ = [
    "EnvKind",
    "KINDS",
    "ProcessEnv",
    "detect_environment",
    "join_host_port",
    "expand_hostlist",
    "slurm_port",
    "LAUNCH_VARS",
]

EnvKind = Literal["torsh_launch", "jax", "torchrun", "openmpi", "slurm", "explicit", "single"]
#: Sources in order of precedence (``explicit``: no launcher, arguments only).
KINDS: tuple[str, ...] = ("torsh_launch", "jax", "torchrun", "openmpi", "slurm", "explicit", "single")

_PORT_OVERRIDE = "JAX_COORDINATOR_PORT"


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process sits in a job.

    Args:
        kind: the source that described the job (see :data:`KINDS`).
        coordinator_address: ``host:port`` of process 0's coordinator service;
            ``None`` for a single process.
        num_processes: processes in the job.
        process_id: this process, in ``[0, num_processes)``.
        local_rank: this process among those on its node.
        local_world_size: processes on this node.
        num_nodes: nodes (hosts) in the job.
        node_rank: this node, in ``[0, num_nodes)``.
        source_vars: environment variables that were read, in reading order.
        devices_per_process: simulated CPU devices per process, when the
            launcher asked for a number.
    """

    kind: EnvKind
    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    node_rank: int
    source_vars: tuple[str, ...]
    devices_per_process: int | None = None

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1

    def initialize_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torsh_jax.distributed.initialize`` that reproduce this layout."""
        kwargs: dict[str, Any] = {"num_processes": self.num_processes, "process_id": self.process_id}
        if self.coordinator_address is not None:
            kwargs["coordinator_address"] = self.coordinator_address
        if self.devices_per_process is not None:
            kwargs["num_cpu_devices"] = self.devices_per_process
        return kwargs

    def describe(self) -> str:
        """One line for logs: source, process, local rank, node, coordinator, variables read."""
        text = (
            f"{self.kind}: process {self.process_id}/{self.num_processes} "
            f"(local {self.local_rank}/{self.local_world_size}, node {self.node_rank}/{self.num_nodes}), "
            f"coordinator {self.coordinator_address or 'none'}"
        )
        if self.devices_per_process is not None:
            text += f", {self.devices_per_process} CPU devices per process"
        return text + f"; read {', '.join(self.source_vars) or 'no variables'}"


def detect_environment(
    environ: Mapping[str, str] | None = None,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ProcessEnv:
    """The process layout described by ``environ`` (default ``os.environ``).

    Explicit arguments win over variables, so a caller may complete or
    correct what a launcher set.

    Args:
        environ: variables to read; ``None`` reads ``os.environ``.
        coordinator_address: ``host:port`` of process 0, overriding the environment.
        num_processes: process count, overriding the environment.
        process_id: this process's id, overriding the environment.

    Returns:
        The validated :class:`ProcessEnv`.

    Raises:
        DistributedError: a variable is malformed, the variables contradict
            each other, or a multi-process job names no coordinator. The error
            names the variable and the export that fixes it.

    Example:
        >>> detect_environment({"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        ...                     "SLURM_NODELIST": "gpu[03-06]", "SLURM_JOB_ID": "4242",
        ...                     "SLURM_NNODES": "4", "SLURM_NODEID": "2"}).coordinator_address
        'gpu03:61586'
    """
    reader = Reader(os.environ if environ is None else environ)
    draft = draft_from(reader)
    draft.devices_per_process = reader.integer(LAUNCH_VARS["devices_per_process"], minimum=1)
    if num_processes is not None:
        draft.num_processes = num_processes
    if process_id is not None:
        draft.process_id = process_id
    if coordinator_address is not None:
        draft.coordinator = coordinator_address
    if draft.kind == "single" and draft.num_processes > 1:
        draft.kind = "explicit"
        draft.coordinator_key, draft.coordinator_fix = (
            "coordinator_address",
            "pass coordinator_address='host:port'",
        )
        draft.rank_key = draft.local_key = "process_id"
    _apply_coordinator_overrides(reader, draft, explicit=coordinator_address is not None)
    return _finish(draft, tuple(reader.read))


def _apply_coordinator_overrides(reader: Reader, draft: Draft, *, explicit: bool) -> None:
    if draft.coordinator is None and draft.host is not None and draft.port is not None:
        draft.coordinator = join_host_port(draft.host, draft.port)
    if explicit:
        return
    jax_address = reader.text(JAX_COORDINATOR) if draft.kind not in ("torsh_launch", "jax") else None
    if jax_address:
        draft.coordinator, draft.coordinator_key = jax_address, JAX_COORDINATOR
    port = reader.port(_PORT_OVERRIDE)
    if port is not None and draft.coordinator is not None:
        draft.coordinator = join_host_port(_split_address(draft.coordinator, key=_PORT_OVERRIDE)[0], port)
    elif port is not None and draft.host is not None:
        draft.coordinator = join_host_port(draft.host, port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 ``host`` in brackets (``[::1]:8476``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _split_address(address: str, *, key: str) -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise DistributedError(
            f"coordinator address must be 'host:port' with a port in 1..65535, got {address!r}",
            key=key,
            fix="use e.g. 10.0.0.1:29500",
        )
    return host, int(port)


def _finish(draft: Draft, source_vars: tuple[str, ...]) -> ProcessEnv:
    count, rank, key = draft.num_processes, draft.process_id, draft.rank_key
    _require(count >= 1, key, f"process count must be >= 1, got {count}")
    _require(0 <= rank < count, key, f"process id {rank} is outside [0, {count})", "ids must run 0..N-1")
    # Unknown processes-per-node: assume this node holds ranks 0..local_rank.
    local_world = draft.local_world_size or min(draft.local_rank + 1, count)
    local_key = draft.local_key
    _require(local_world <= count, local_key, f"{local_world} processes per node but {count} in the job")
    _require(
        0 <= draft.local_rank < local_world,
        local_key,
        f"local rank {draft.local_rank} is outside [0, {local_world}) processes on this node",
    )
    num_nodes = draft.num_nodes or -(-count // local_world)
    node_rank = draft.node_rank if draft.node_rank is not None else min(rank // local_world, num_nodes - 1)
    _require(0 <= node_rank < num_nodes, draft.node_key, f"node rank {node_rank} is outside [0, {num_nodes})")
    coordinator = draft.coordinator if count > 1 else None
    if count > 1:
        if coordinator is None and draft.host is not None:
            raise DistributedError(
                f"{count} processes and coordinator host {draft.host!r} but no port",
                key=draft.port_key,
                fix=draft.port_fix,
            )
        missing = f"{count} processes but no coordinator address"
        _require(coordinator is not None, draft.coordinator_key, missing, draft.coordinator_fix)
        _split_address(coordinator, key=draft.coordinator_key)
    return ProcessEnv(
        kind=draft.kind,  # type: ignore[arg-type]
        coordinator_address=coordinator,
        num_processes=count,
        process_id=rank,
        local_rank=draft.local_rank,
        local_world_size=local_world,
        num_nodes=num_nodes,
        node_rank=node_rank,
        source_vars=source_vars,
        devices_per_process=draft.devices_per_process,
    )


def _require(ok: bool, key: str, message: str, fix: str | None = None) -> None:
    if not ok:
        raise DistributedError(message, key=key, fix=fix)
