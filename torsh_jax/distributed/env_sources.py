"""Per-launcher readers: environment variables -> a draft of the process layout (no JAX import).

:func:`draft_from` picks the first launcher whose variables are present (the
order of :data:`~torsh_jax.distributed.env.KINDS`) and reads its variables
through a :class:`Reader`, which remembers what it read.

Example:
    >>> reader = Reader({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    >>> draft = draft_from(reader)
    >>> draft.kind, draft.process_id, draft.host, draft.port
    ('torchrun', 1, 'h', 29500)
    >>> reader.read
    ['WORLD_SIZE', 'RANK', 'MASTER_ADDR', 'MASTER_PORT']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from torsh_jax.distributed.hostlist import expand_hostlist, expand_tasks_per_node, slurm_port
from torsh_jax.errors import DistributedError

__all__ = ["LAUNCH_VARS", "RESTART_VAR", "JAX_COORDINATOR", "Reader", "Draft", "draft_from"]

#: Variables ``torsh-jax launch`` sets in each child.
LAUNCH_VARS = {
    "coordinator": "TORSH_JAX_COORDINATOR",
    "num_processes": "TORSH_JAX_NUM_PROCESSES",
    "process_id": "TORSH_JAX_PROCESS_ID",
    "devices_per_process": "TORSH_JAX_DEVICES_PER_PROCESS",
}
#: The attempt number a launched process belongs to (0 first; 1, 2, ... after restarts).
RESTART_VAR = "TORSH_JAX_RESTART"
#: Where JAX itself reads the coordinator ``host:port``.
JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
#: The pod's index in a Kubernetes indexed Job (``completionMode: Indexed``).
_K8S_INDEX = "JOB_COMPLETION_INDEX"


@dataclass
class Reader:
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

    def first_text(self, names: tuple[str, ...]) -> tuple[str, str] | None:
        """The first of ``names`` with a non-empty value, as ``(name, value)``."""
        for name in names:
            raw = self.text(name)
            if raw:
                return name, raw
        return None

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
            raise DistributedError(
                f"must be >= {minimum}, got {value}", key=name, fix=f"export {name}=<integer >= {minimum}>"
            )
        return value

    def port(self, name: str) -> int | None:
        value = self.integer(name, minimum=1)
        if value is not None and value > 65535:
            raise DistributedError(
                f"must be a TCP port in 1..65535, got {value}",
                key=name,
                fix=f"export {name}=<port in 1..65535>",
            )
        return value

    def required(self, name: str, *, minimum: int = 0, why: str) -> int:
        value = self.integer(name, minimum=minimum)
        if value is None:
            raise DistributedError(f"is not set but {why}", key=name, fix=f"export {name}=<integer>")
        return value


@dataclass
class Draft:
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


def draft_from(reader: Reader) -> Draft:
    if any(reader.has(LAUNCH_VARS[k]) for k in ("coordinator", "num_processes", "process_id")):
        return _torsh_launch(reader)
    if reader.has("JAX_NUM_PROCESSES") or reader.has("JAX_PROCESS_ID"):
        return _jax(reader)
    if reader.has("WORLD_SIZE") or reader.has("RANK"):
        return _torchrun(reader)
    if reader.has("OMPI_COMM_WORLD_SIZE") or reader.has("OMPI_COMM_WORLD_RANK"):
        return _openmpi(reader)
    if (reader.has("SLURM_NTASKS") or reader.has("SLURM_STEP_NUM_TASKS")) and reader.has("SLURM_PROCID"):
        return _slurm(reader)
    return Draft(kind="single", num_processes=1, process_id=0, rank_key="process_id", local_key="process_id")


def _torsh_launch(reader: Reader) -> Draft:
    v = LAUNCH_VARS
    count = reader.required(v["num_processes"], minimum=1, why=f"{v['process_id']} is")
    rank = reader.required(v["process_id"], why=f"{v['num_processes']} is")
    return Draft(
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


def _jax(reader: Reader) -> Draft:
    # A Kubernetes indexed Job gives each pod its index, not JAX_PROCESS_ID.
    rank_key = "JAX_PROCESS_ID" if reader.has("JAX_PROCESS_ID") or not reader.has(_K8S_INDEX) else _K8S_INDEX
    return Draft(
        kind="jax",
        num_processes=reader.required("JAX_NUM_PROCESSES", minimum=1, why=f"{rank_key} is"),
        process_id=reader.required(rank_key, why="JAX_NUM_PROCESSES is"),
        coordinator=reader.text(JAX_COORDINATOR),
        coordinator_key=JAX_COORDINATOR,
        coordinator_fix=f"export {JAX_COORDINATOR}=<host of process 0>:<port>",
        rank_key=rank_key,
        local_key=rank_key,
    )


def _torchrun(reader: Reader) -> Draft:
    world = reader.required("WORLD_SIZE", minimum=1, why="RANK is")
    local_world = reader.integer("LOCAL_WORLD_SIZE", minimum=1)
    draft = Draft(
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


def _openmpi(reader: Reader) -> Draft:
    world = reader.required("OMPI_COMM_WORLD_SIZE", minimum=1, why="OMPI_COMM_WORLD_RANK is")
    rank = reader.required("OMPI_COMM_WORLD_RANK", why="OMPI_COMM_WORLD_SIZE is")
    local_size = reader.integer("OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1)
    draft = Draft(
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


def _slurm(reader: Reader) -> Draft:
    # Variables as srun documents them (https://slurm.schedmd.com/srun.html, OUTPUT ENVIRONMENT
    # VARIABLES): the step's own counts and node list (SLURM_STEP_*) first, as a step may use part
    # of the allocation; SLURM_NODEID and SLURM_LOCALID are relative to the step's nodes.
    count_key = "SLURM_STEP_NUM_TASKS" if reader.has("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    ntasks = reader.required(count_key, minimum=1, why="SLURM_PROCID is")
    num_nodes = _first_int(reader, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
    node_rank = reader.integer("SLURM_NODEID")
    draft = Draft(
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


def _first_int(reader: Reader, names: tuple[str, ...]) -> int | None:
    name = next((n for n in names if reader.has(n)), None)
    return None if name is None else reader.integer(name, minimum=1)


def _slurm_first_host(reader: Reader) -> str | None:
    found = reader.first_text(("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if found is None:
        return None
    name, raw = found
    return expand_hostlist(raw, key=name)[0]


def _slurm_local_world_size(reader: Reader, node_rank: int | None, ntasks: int, nodes: int | None) -> int:
    found = reader.first_text(("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if found is not None:
        counts = expand_tasks_per_node(found[1], key=found[0])
        return counts[min(node_rank or 0, len(counts) - 1)]
    per_node = reader.integer("SLURM_NTASKS_PER_NODE", minimum=1)
    if per_node is not None:
        return per_node
    return ntasks // nodes if nodes and ntasks % nodes == 0 else 1
