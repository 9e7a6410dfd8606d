"""Coordinator variables left in an environment by an earlier job: a known cause of hangs after preemption.

A job restarted from a shell (or an ``sbatch`` that exports the submitting
shell) inherits the variables of the job before it; a stale port or process
count then points the new processes at a coordinator that no longer exists.

Example:
    >>> [line] = stale_coordinator_warnings({"JAX_COORDINATOR_PORT": "1234", "HOME": "/"}, hostname="h1")
    >>> line.split(":")[0], line.split("Fix: ")[1]
    ('JAX_COORDINATOR_PORT=1234 is set', 'unset JAX_COORDINATOR_PORT')
"""

from __future__ import annotations

from collections.abc import Mapping

from torsh_jax.distributed.env_sources import JAX_COORDINATOR, LAUNCH_VARS, RESTART_VAR
from torsh_jax.distributed.hostlist import expand_hostlist
from torsh_jax.errors import DistributedError

__all__ = ["STALE_COORDINATOR_VARS", "stale_coordinator_warnings"]

_LAYOUT = "describes another job's layout and wins over Slurm's variables"
#: Variable -> what it does to a new job's processes.
_EFFECTS: dict[str, str] = {
    "JAX_COORDINATOR_PORT": "it replaces the coordinator port of every process",
    JAX_COORDINATOR: "it replaces the coordinator of torchrun, Open MPI and Slurm processes",
    "COORDINATOR_ADDRESS": "some launchers read it as the coordinator",
    "MASTER_ADDR": "it names the coordinator host of torchrun, Open MPI and Slurm processes",
    "MASTER_PORT": "it names the coordinator port of torchrun, Open MPI and Slurm processes",
    "JAX_NUM_PROCESSES": f"it {_LAYOUT}",
    "JAX_PROCESS_ID": f"it {_LAYOUT}",
    "RANK": f"it {_LAYOUT}",
    "WORLD_SIZE": f"it {_LAYOUT}",
    "LOCAL_RANK": "it describes another job's layout",
    **{name: f"it {_LAYOUT}" for name in LAUNCH_VARS.values()},
    RESTART_VAR: "it tells a script it resumes an earlier attempt",
}
#: Variables a new job should not inherit (a Slurm batch script unsets them).
STALE_COORDINATOR_VARS: tuple[str, ...] = tuple(_EFFECTS)
#: Slurm step variables that make ``initialize()`` read a Slurm layout.
_SLURM_STEP = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_NODEID", "SLURM_LOCALID")


def stale_coordinator_warnings(environ: Mapping[str, str], *, hostname: str) -> list[str]:
    """One line per coordinator variable in ``environ`` that a new job would inherit, with its fix.

    Slurm step variables count as stale when ``hostname`` is not in the
    allocation's node list (``SLURM_JOB_NODELIST``): left from a step that ran elsewhere.
    """
    found = [
        f"{name}={environ[name]} is set: {effect}. Fix: unset {name}"
        for name, effect in _EFFECTS.items()
        if environ.get(name)
    ]
    slurm = [name for name in _SLURM_STEP if name in environ]
    if slurm and not _in_allocation(environ, hostname):
        found.append(
            f"{', '.join(slurm)} set but this host ({hostname}) is not in a Slurm allocation: "
            f"initialize() would read another step's layout. Fix: unset {' '.join(slurm)}"
        )
    return found


def _in_allocation(environ: Mapping[str, str], hostname: str) -> bool:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or not environ.get("SLURM_JOB_ID"):
        return False
    try:
        hosts = expand_hostlist(nodelist, key="SLURM_JOB_NODELIST")
    except DistributedError:
        return False
    return hostname in hosts or hostname.split(".")[0] in hosts
