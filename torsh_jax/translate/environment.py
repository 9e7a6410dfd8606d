"""Translate a launcher's environment (torchrun, Slurm, Open MPI, JAX) into a plan and a process layout.

Every recognised variable gets a note: ``mapped`` when it decided part of
the layout, ``ignored`` with the reason otherwise. The layout and the
``initialize()`` arguments that reproduce it go to ``result.extras``. The plan
is the default data-parallel plan, with one DCN slice per node.

Example:
    >>> result = translate_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
    ...                                 "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
    ...                                 "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"})
    >>> result.extras["initialize_kwargs"]
    {'num_processes': 4, 'process_id': 3, 'coordinator_address': '10.0.0.1:29500'}
    >>> result.plan.mesh.data.dcn, [n.status for n in result.notes if n.key == "OMP_NUM_THREADS"]
    (2, ['ignored'])
"""

from __future__ import annotations

from collections.abc import Mapping

from torsh_jax.distributed.env import LAUNCH_VARS, ProcessEnv, detect_environment
from torsh_jax.errors import DistributedError, TranslationError
from torsh_jax.plan.spec import AxisSize, MeshSpec, ParallelPlan
from torsh_jax.translate.messages import short_errors
from torsh_jax.translate.result import Notes, TranslationResult

__all__ = ["translate_environment", "RECOGNISED", "IGNORED"]

#: Variables that can decide the layout -> what they become.
RECOGNISED: dict[str, str] = {
    LAUNCH_VARS["coordinator"]: "coordinator_address",
    LAUNCH_VARS["num_processes"]: "num_processes",
    LAUNCH_VARS["process_id"]: "process_id",
    LAUNCH_VARS["devices_per_process"]: "devices_per_process (jax_num_cpu_devices)",
    "JAX_COORDINATOR_ADDRESS": "coordinator_address",
    "JAX_COORDINATOR_PORT": "coordinator port",
    "JAX_NUM_PROCESSES": "num_processes",
    "JAX_PROCESS_ID": "process_id",
    "RANK": "process_id",
    "WORLD_SIZE": "num_processes",
    "LOCAL_RANK": "local_rank",
    "LOCAL_WORLD_SIZE": "local_world_size (num_nodes = WORLD_SIZE / LOCAL_WORLD_SIZE)",
    "GROUP_RANK": "node_rank",
    "MASTER_ADDR": "coordinator host",
    "MASTER_PORT": "coordinator port",
    "TORCHELASTIC_USE_AGENT_STORE": "coordinator port = MASTER_PORT + 1 (torchrun's agent uses MASTER_PORT)",
    "OMPI_COMM_WORLD_SIZE": "num_processes",
    "OMPI_COMM_WORLD_RANK": "process_id",
    "OMPI_COMM_WORLD_LOCAL_RANK": "local_rank",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "local_world_size (node_rank = rank // local size)",
    "SLURM_NTASKS": "num_processes",
    "SLURM_PROCID": "process_id",
    "SLURM_LOCALID": "local_rank",
    "SLURM_NODEID": "node_rank",
    "SLURM_STEP_NUM_NODES": "num_nodes",
    "SLURM_NNODES": "num_nodes",
    "SLURM_JOB_NUM_NODES": "num_nodes",
    "SLURM_STEP_NODELIST": "coordinator host (first node)",
    "SLURM_JOB_NODELIST": "coordinator host (first node)",
    "SLURM_NODELIST": "coordinator host (first node)",
    "SLURM_JOB_ID": "coordinator port (job id % 4096 + 61440, as JAX derives it)",
    "SLURM_STEP_TASKS_PER_NODE": "local_world_size",
    "SLURM_TASKS_PER_NODE": "local_world_size",
    "SLURM_NTASKS_PER_NODE": "local_world_size",
}

#: Variables known to have no effect on the layout here -> why.
IGNORED: dict[str, str] = {
    "TORCHELASTIC_RESTART_COUNT": "restarts are the launcher's business; a restarted job starts afresh",
    "TORCHELASTIC_MAX_RESTARTS": "restarts are the launcher's business",
    "TORCHELASTIC_RUN_ID": "rendezvous id of torchrun's agent; JAX uses its own coordinator",
    "TORCHELASTIC_ERROR_FILE": "torchrun's error reporting; read the launcher's output instead",
    "ROLE_RANK": "torchrun roles are not used; process_id comes from RANK",
    "ROLE_WORLD_SIZE": "torchrun roles are not used; num_processes comes from WORLD_SIZE",
    "ROLE_NAME": "torchrun roles are not used",
    "GROUP_WORLD_SIZE": "num_nodes comes from WORLD_SIZE / LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS": "host threading; XLA sizes its own thread pools",
    "CUDA_VISIBLE_DEVICES": "device visibility is read by JAX's GPU backend itself",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "PyTorch NCCL setting; JAX has its own error handling",
    "OMPI_COMM_WORLD_NODE_RANK": "Open MPI's node-local rank across jobs; local_rank is used",
    "OMPI_UNIVERSE_SIZE": "slots available, not processes started",
    "SLURM_CPUS_PER_TASK": "host threading; XLA sizes its own thread pools",
    "SLURM_JOB_NAME": "label only",
    "SLURM_SUBMIT_DIR": "working directory only",
    "JAX_LOCAL_DEVICE_IDS": "JAX reads it itself in jax.distributed.initialize",
    "JAX_COORDINATOR_BIND_ADDRESS": "JAX reads it itself in jax.distributed.initialize",
    "JAX_PLATFORMS": "backend choice is read by JAX itself",
}

_IGNORED_PREFIXES = {"NCCL_": "NCCL tuning; on GPU, XLA's NCCL reads it itself, on CPU gloo ignores it"}


@short_errors
def translate_environment(environ: Mapping[str, str]) -> TranslationResult:
    """Process layout, ``initialize()`` arguments and a default plan from launcher variables.

    Args:
        environ: the variables, e.g. ``dict(os.environ)`` or a job's ``env`` dump.

    Returns:
        A :class:`TranslationResult` of kind ``env``: one note per recognised
        variable; ``extras`` holds ``kind``, ``num_processes``, ``process_id``,
        ``coordinator_address``, ``local_rank``, ``local_world_size``,
        ``num_nodes``, ``node_rank`` and ``initialize_kwargs``.

    Raises:
        TranslationError: the variables are inconsistent or a multi-process
            job names no coordinator; ``key`` is the variable, ``fix`` the export.
    """
    try:
        env = detect_environment(environ)
    except DistributedError as err:
        raise TranslationError(err.message, key=err.key, fix=err.fix) from None
    notes = _variable_notes(environ, env)
    mesh = MeshSpec()
    if env.num_nodes > 1:
        mesh = MeshSpec(data=AxisSize(ici=-1, dcn=env.num_nodes))
        notes.approximated(
            "num_nodes",
            env.num_nodes,
            f"mesh.data = AxisSize(ici=-1, dcn={env.num_nodes}): one slice per node, data parallel "
            "across nodes; edit the plan for other layouts",
        )
    plan = ParallelPlan(name="env", description=f"data parallel over a {env.kind} job", mesh=mesh)
    return TranslationResult(
        plan=plan, notes=tuple(notes), source="<env>", kind="env", extras=_layout_extras(env)
    )


def _variable_notes(environ: Mapping[str, str], env: ProcessEnv) -> Notes:
    notes = Notes()
    used = set(env.source_vars)
    for name in sorted(environ):
        value = environ[name]
        if name in RECOGNISED and name in used:
            notes.mapped(name, value, RECOGNISED[name])
        elif name in RECOGNISED:
            notes.ignored(name, value, _unused_reason(name, env))
        elif name in IGNORED:
            notes.ignored(name, value, IGNORED[name])
        else:
            prefix = next((p for p in _IGNORED_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                notes.ignored(name, value, _IGNORED_PREFIXES[prefix])
    return notes


def _unused_reason(name: str, env: ProcessEnv) -> str:
    if env.kind == "single":
        return "no complete launcher environment found; running as a single process"
    return f"not needed: the layout comes from the {env.kind} variables ({', '.join(env.source_vars)})"


def _layout_extras(env: ProcessEnv) -> dict:
    return {
        "kind": env.kind,
        "num_processes": env.num_processes,
        "process_id": env.process_id,
        "coordinator_address": env.coordinator_address,
        "local_rank": env.local_rank,
        "local_world_size": env.local_world_size,
        "num_nodes": env.num_nodes,
        "node_rank": env.node_rank,
        "initialize_kwargs": env.initialize_kwargs(),
    }
