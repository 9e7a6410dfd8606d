"""Read the process layout of a multi-process job from its environment (no JAX import).

Launchers describe a job with environment variables; :func:`detect_environment`
turns them into one :class:`ProcessEnv`. Sources, in order of precedence:

1. ``torsh_launch``: ``TORSH_JAX_COORDINATOR``, ``TORSH_JAX_NUM_PROCESSES``,
   ``TORSH_JAX_PROCESS_ID`` (set by ``torsh-jax launch``).
2. ``jax``: ``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.
3. ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
4. ``openmpi``: ``OMPI_COMM_WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``LOCAL_SIZE``
   plus ``MASTER_ADDR`` and ``MASTER_PORT``.
5. ``slurm``: ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, the node list
   (first host is the coordinator) and a port derived from ``SLURM_JOB_ID``.
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

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torsh_jax.errors import DistributedError

__all__ = [
    "EnvKind",
    "KINDS",
    "ProcessEnv",
    "detect_environment",
    "expand_hostlist",
    "slurm_port",
    "LAUNCH_VARS",
]

EnvKind = Literal["torsh_launch", "jax", "torchrun", "openmpi", "slurm", "explicit", "single"]
#: Sources in order of precedence (``explicit``: no launcher, arguments only).
KINDS: tuple[str, ...] = ("torsh_launch", "jax", "torchrun", "openmpi", "slurm", "explicit", "single")

#: Variables ``torsh-jax launch`` sets in each child.
LAUNCH_VARS = {
    "coordinator": "TORSH_JAX_COORDINATOR",
    "num_processes": "TORSH_JAX_NUM_PROCESSES",
    "process_id": "TORSH_JAX_PROCESS_ID",
    "devices_per_process": "TORSH_JAX_DEVICES_PER_PROCESS",
}
_PORT_OVERRIDE = "JAX_COORDINATOR_PORT"
_JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"


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


@dataclass
class _Reader:
    """Reads variables from one mapping and remembers which ones it read."""

    environ: Mapping[str, str]
    read: list[str] = dataclasses.field(default_factory=list)

    def has(self, name: str) -> bool:
        return name in self.environ

    def text(self, name: str) -> str | None:
        if name not in self.environ:
            return None
        if name not in self.read:
            self.read.append(name)
        return self.environ[name].strip()

    def integer(self, name: str, default: int | None = None, *, minimum: int = 0) -> int | None:
        raw = self.text(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise DistributedError(
                f"must be an integer, got {raw!r}", key=name, fix=f"export {name}=<integer>"
            ) from None
        if value < minimum:
            raise DistributedError(f"must be >= {minimum}, got {value}", key=name)
        return value

    def port(self, name: str) -> int | None:
        value = self.integer(name, minimum=1)
        if value is not None and value > 65535:
            raise DistributedError(f"must be a TCP port in 1..65535, got {value}", key=name)
        return value

    def required(self, name: str, *, minimum: int = 0, why: str) -> int:
        value = self.integer(name, minimum=minimum)
        if value is None:
            raise DistributedError(f"is not set but {why}", key=name, fix=f"export {name}=<integer>")
        return value


@dataclass
class _Draft:
    """Fields of a ProcessEnv before overrides and checks."""

    kind: str
    num_processes: int
    process_id: int
    local_rank: int = 0
    local_world_size: int | None = None
    num_nodes: int | None = None
    node_rank: int | None = None
    host: str | None = None
    port: int | None = None
    coordinator: str | None = None
    coordinator_key: str = "MASTER_ADDR"
    coordinator_fix: str = "export MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port>"
    rank_key: str = "RANK"
    local_key: str = "LOCAL_RANK"
    node_key: str = "GROUP_RANK"
    port_key: str = "MASTER_PORT"
    port_fix: str = "export MASTER_PORT=<free port, the same in every process>"
    devices_per_process: int | None = None


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
    reader = _Reader(os.environ if environ is None else environ)
    draft = _draft_from(reader)
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


def _draft_from(reader: _Reader) -> _Draft:
    if any(reader.has(LAUNCH_VARS[k]) for k in ("coordinator", "num_processes", "process_id")):
        return _torsh_launch(reader)
    if reader.has("JAX_NUM_PROCESSES") or reader.has("JAX_PROCESS_ID"):
        return _jax(reader)
    if reader.has("WORLD_SIZE") or reader.has("RANK"):
        return _torchrun(reader)
    if reader.has("OMPI_COMM_WORLD_SIZE") or reader.has("OMPI_COMM_WORLD_RANK"):
        return _openmpi(reader)
    if reader.has("SLURM_NTASKS") and reader.has("SLURM_PROCID"):
        return _slurm(reader)
    return _Draft(kind="single", num_processes=1, process_id=0, rank_key="process_id", local_key="process_id")


def _torsh_launch(reader: _Reader) -> _Draft:
    v = LAUNCH_VARS
    count = reader.required(v["num_processes"], minimum=1, why=f"{v['process_id']} is")
    rank = reader.required(v["process_id"], why=f"{v['num_processes']} is")
    return _Draft(
        kind="torsh_launch",
        num_processes=count,
        process_id=rank,
        local_rank=rank,
        coordinator=reader.text(v["coordinator"]),
        coordinator_key=v["coordinator"],
        coordinator_fix=f"run under `torsh-jax launch` or export {v['coordinator']}=127.0.0.1:<port>",
        rank_key=v["process_id"],
        local_key=v["process_id"],
        local_world_size=count,
    )


def _jax(reader: _Reader) -> _Draft:
    return _Draft(
        kind="jax",
        num_processes=reader.required("JAX_NUM_PROCESSES", minimum=1, why="JAX_PROCESS_ID is"),
        process_id=reader.required("JAX_PROCESS_ID", why="JAX_NUM_PROCESSES is"),
        coordinator=reader.text(_JAX_COORDINATOR),
        coordinator_key=_JAX_COORDINATOR,
        coordinator_fix=f"export {_JAX_COORDINATOR}=<host of process 0>:<port>",
        rank_key="JAX_PROCESS_ID",
        local_key="JAX_PROCESS_ID",
    )


def _torchrun(reader: _Reader) -> _Draft:
    world = reader.required("WORLD_SIZE", minimum=1, why="RANK is")
    local_world = reader.integer("LOCAL_WORLD_SIZE", minimum=1)
    draft = _Draft(
        kind="torchrun",
        num_processes=world,
        process_id=reader.required("RANK", why="WORLD_SIZE is"),
        local_rank=reader.integer("LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=reader.integer("GROUP_RANK"),
        host=reader.text("MASTER_ADDR") or None,
        port=reader.port("MASTER_PORT"),
    )
    if local_world is not None and world % local_world == 0:
        draft.num_nodes = world // local_world
    if draft.port is not None and reader.text("TORCHELASTIC_USE_AGENT_STORE") in ("True", "true", "1"):
        # The torchrun agent already serves its TCPStore on MASTER_PORT; take the next port.
        draft.port += 1
    return draft


def _openmpi(reader: _Reader) -> _Draft:
    world = reader.required("OMPI_COMM_WORLD_SIZE", minimum=1, why="OMPI_COMM_WORLD_RANK is")
    rank = reader.required("OMPI_COMM_WORLD_RANK", why="OMPI_COMM_WORLD_SIZE is")
    local_size = reader.integer("OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1)
    draft = _Draft(
        kind="openmpi",
        num_processes=world,
        process_id=rank,
        local_rank=reader.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_size,
        host=reader.text("MASTER_ADDR") or None,
        port=reader.port("MASTER_PORT"),
        rank_key="OMPI_COMM_WORLD_RANK",
        local_key="OMPI_COMM_WORLD_LOCAL_RANK",
        node_key="OMPI_COMM_WORLD_LOCAL_SIZE",
        coordinator_fix="mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ...",
        port_fix="mpirun -x MASTER_PORT=<free port> ...",
    )
    if local_size is not None and world % local_size == 0:
        # Assumes ranks are placed node by node (mpirun's default --map-by slot).
        draft.num_nodes, draft.node_rank = world // local_size, rank // local_size
    return draft


def _slurm(reader: _Reader) -> _Draft:
    ntasks = reader.required("SLURM_NTASKS", minimum=1, why="SLURM_PROCID is")
    num_nodes = _first_int(reader, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
    node_rank = reader.integer("SLURM_NODEID")
    draft = _Draft(
        kind="slurm",
        num_processes=ntasks,
        process_id=reader.required("SLURM_PROCID", why="SLURM_NTASKS is"),
        local_rank=reader.integer("SLURM_LOCALID", 0),
        num_nodes=num_nodes,
        node_rank=node_rank,
        rank_key="SLURM_PROCID",
        local_key="SLURM_LOCALID",
        node_key="SLURM_NODEID",
        port_key="SLURM_JOB_ID",
        port_fix="export MASTER_PORT=<free port> (inside a Slurm job the port comes from SLURM_JOB_ID)",
        coordinator_key="SLURM_NODELIST",
        coordinator_fix="run the job step with srun (it sets SLURM_STEP_NODELIST) or export MASTER_ADDR",
    )
    draft.local_world_size = _slurm_local_world_size(reader, node_rank, ntasks, num_nodes)
    draft.host = reader.text("MASTER_ADDR") or _slurm_first_host(reader)
    draft.port = reader.port("MASTER_PORT")
    if draft.port is None:
        job_id = reader.integer("SLURM_JOB_ID")
        draft.port = None if job_id is None else slurm_port(job_id)
    return draft


def _first_int(reader: _Reader, names: tuple[str, ...]) -> int | None:
    name = next((n for n in names if reader.has(n)), None)
    return None if name is None else reader.integer(name, minimum=1)


def _slurm_first_host(reader: _Reader) -> str | None:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        raw = reader.text(name)
        if raw:
            return expand_hostlist(raw, key=name)[0]
    return None


def _slurm_local_world_size(reader: _Reader, node_rank: int | None, ntasks: int, nodes: int | None) -> int:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = reader.text(name)
        if raw:
            counts = _expand_tasks_per_node(raw, key=name)
            return counts[min(node_rank or 0, len(counts) - 1)]
    per_node = reader.integer("SLURM_NTASKS_PER_NODE", minimum=1)
    if per_node is not None:
        return per_node
    return ntasks // nodes if nodes and ntasks % nodes == 0 else 1


def _expand_tasks_per_node(raw: str, *, key: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (Slurm's SLURM_TASKS_PER_NODE format)."""
    counts: list[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise DistributedError(f"cannot parse {raw!r} (expected e.g. '2(x3),1')", key=key)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_port(job_id: int) -> int:
    """Coordinator port derived from a Slurm job id, in [61440, 65535].

    Same rule as JAX's Slurm detection (jax/_src/clusters/slurm_cluster.py),
    so processes started by either agree.

    Example:
        >>> slurm_port(4242)
        61586
    """
    return job_id % 2**12 + (65535 - 2**12 + 1)


def expand_hostlist(hostlist: str, *, key: str = "SLURM_NODELIST") -> list[str]:
    """Expand a Slurm compressed host list.

    Example:
        >>> expand_hostlist("node[01-03,07],login2")
        ['node01', 'node02', 'node03', 'node07', 'login2']
        >>> expand_hostlist("r[1-2]-n[1-2]")
        ['r1-n1', 'r1-n2', 'r2-n1', 'r2-n2']
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(hostlist, key=key):
        hosts += _expand_host(item, key=key)
    if not hosts:
        raise DistributedError("is empty", key=key, fix="run inside a Slurm allocation (srun/sbatch)")
    return hosts


def _split_outside_brackets(text: str, *, key: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise DistributedError(f"unbalanced brackets in host list {text!r}", key=key)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise DistributedError(f"unbalanced brackets in host list {text!r}", key=key)
    return [item.strip() for item in [*items, current] if item.strip()]


def _expand_host(item: str, *, key: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, rest = item[: match.start()], item[match.end() :]
    values: list[str] = []
    for part in match.group(1).split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if bounds is None:
            raise DistributedError(f"bad range {part!r} in host list {item!r}", key=key)
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        values += [f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    return [prefix + value + tail for value in values for tail in _expand_host(rest, key=key)]


def _apply_coordinator_overrides(reader: _Reader, draft: _Draft, *, explicit: bool) -> None:
    if draft.coordinator is None and draft.host is not None and draft.port is not None:
        draft.coordinator = _join_host_port(draft.host, draft.port)
    if explicit:
        return
    jax_address = reader.text(_JAX_COORDINATOR) if draft.kind not in ("torsh_launch", "jax") else None
    if jax_address:
        draft.coordinator, draft.coordinator_key = jax_address, _JAX_COORDINATOR
    port = reader.port(_PORT_OVERRIDE)
    if port is not None and draft.coordinator is not None:
        draft.coordinator = _join_host_port(_split_address(draft.coordinator, key=_PORT_OVERRIDE)[0], port)
    elif port is not None and draft.host is not None:
        draft.coordinator = _join_host_port(draft.host, port)


def _join_host_port(host: str, port: int) -> str:
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


def _finish(draft: _Draft, source_vars: tuple[str, ...]) -> ProcessEnv:
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
