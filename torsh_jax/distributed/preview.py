"""``launch --dry-run``: what a launch would start, without starting anything (no JAX import).

For each backend (``local``, ``slurm``, ``ray``) a :class:`LaunchPreview` lists
the command, the coordinator, every rank's layout variables, the plan as
resolved for the devices the job will have, and coordinator variables left
in the environment by an earlier job.

Example:
    >>> preview = preview_local(["train.py"], num_processes=2, devices_per_process=2, port=29500, environ={})
    >>> preview.ranks[1]["env"]["TORSH_JAX_PROCESS_ID"], preview.coordinator, preview.num_devices
    ('1', '127.0.0.1:29500', 4)
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torsh_jax.distributed.env_sources import LAUNCH_VARS, RESTART_VAR
from torsh_jax.distributed.slurm import SLURM_PORT_EXPR, SlurmJob, sbatch_script
from torsh_jax.distributed.stale import stale_coordinator_warnings

__all__ = ["LaunchPreview", "preview_local", "preview_slurm", "preview_ray", "resolve_plan_preview"]

_FREE_PORT = "<free port>"


@dataclass(frozen=True)
class LaunchPreview:
    """What a launch would start.

    Args:
        backend: ``local``, ``slurm`` or ``ray``.
        command: what each rank runs.
        coordinator: ``host:port`` of rank 0's coordinator (placeholders where
            only the cluster knows, e.g. ``<node IP of rank 0>``).
        num_devices: devices in the job (JAX's count; 1 CPU device per process by default).
        num_slices: slices (DCN granules): one per process (per Slurm task under Slurm).
        ranks: per rank: ``rank``, ``node`` and ``env`` (the variables the launch sets).
        warnings: coordinator variables left in this environment.
        plan: with a plan: ``name``, ``devices``, ``mesh`` and ``global_batch``.
        extra: backend details (``sbatch`` script, Ray ``bundles``, ...).
    """

    backend: str
    command: list[str]
    coordinator: str
    num_devices: int
    num_slices: int
    ranks: list[dict]
    warnings: list[str]
    plan: dict | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def with_plan(self, plan_name: str | None) -> LaunchPreview:
        """This preview with ``plan_name`` resolved for its devices (unchanged for ``None``)."""
        if plan_name is None:
            return self
        plan = resolve_plan_preview(plan_name, num_devices=self.num_devices, num_processes=self.num_slices)
        return dataclasses.replace(self, plan=plan)

    def lines(self) -> list[str]:
        """The preview as text lines (the ``--dry-run`` output without ``--json``)."""
        out = [
            f"backend {self.backend}: {len(self.ranks)} process(es), {self.num_devices} device(s), "
            f"coordinator {self.coordinator}",
            f"command: {' '.join(self.command)}",
        ]
        for rank in self.ranks:
            env = " ".join(f"{k}={v}" for k, v in rank["env"].items())
            out.append(f"rank {rank['rank']} (node {rank['node']}): {env}")
        if self.plan is not None:
            mesh = " ".join(f"{axis}={size}" for axis, size in self.plan["mesh"].items())
            out.append(
                f"plan {self.plan['name']} on {self.plan['devices']} devices: mesh {mesh}, "
                f"global batch {self.plan['global_batch']}"
            )
        for key, value in self.extra.items():
            out += [f"{key}:", *value.splitlines()] if isinstance(value, str) else [f"{key}: {value}"]
        return out


def resolve_plan_preview(plan_name: str, /, *, num_devices: int, num_processes: int) -> dict:
    """``plan_name`` resolved for ``num_devices``: ``name``, ``devices``, ``mesh``, ``global_batch``.

    Raises:
        MeshError: the plan's sizes do not fit ``num_devices`` (the message lists sizes that do).
    """
    from torsh_jax.plan.elastic import global_batch_size
    from torsh_jax.plan.io import load_plan
    from torsh_jax.plan.spec import MESH_AXIS_ORDER

    plan = load_plan(plan_name)
    dcn = [getattr(plan.mesh, axis).dcn for axis in MESH_AXIS_ORDER]
    slices = num_processes if -1 in dcn else _product(dcn)  # as runtime.mesh.default_num_slices
    shape = plan.mesh.resolve(num_devices, num_slices=slices).shape
    return {
        "name": plan_name,
        "devices": num_devices,
        "mesh": shape,
        "global_batch": global_batch_size(plan, shape),
    }


def _product(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def _layout_env(rank: int, count: int, coordinator: str, devices: int | None) -> dict[str, str]:
    env = {
        LAUNCH_VARS["coordinator"]: coordinator,
        LAUNCH_VARS["num_processes"]: str(count),
        LAUNCH_VARS["process_id"]: str(rank),
    }
    if devices is not None:
        env[LAUNCH_VARS["devices_per_process"]] = str(devices)
    return {**env, RESTART_VAR: "0"}


def preview_local(
    script_and_args: Sequence[str],
    /,
    *,
    num_processes: int,
    devices_per_process: int | None,
    port: int | None,
    environ: Mapping[str, str],
) -> LaunchPreview:
    """What ``torsh-jax launch -n N`` would start on this host."""
    coordinator = f"127.0.0.1:{_FREE_PORT if port is None else port}"
    ranks = [
        {"rank": r, "node": 0, "env": _layout_env(r, num_processes, coordinator, devices_per_process)}
        for r in range(num_processes)
    ]
    return LaunchPreview(
        backend="local",
        command=[sys.executable, *script_and_args],
        coordinator=coordinator,
        num_devices=num_processes * (devices_per_process or 1),
        num_slices=num_processes,
        ranks=ranks,
        warnings=stale_coordinator_warnings(environ, hostname=socket.gethostname()),
    )


def preview_ray(
    script_and_args: Sequence[str],
    /,
    *,
    address: str,
    num_processes: int,
    devices_per_process: int | None,
    gpus_per_process: int | None,
    environ: Mapping[str, str],
) -> LaunchPreview:
    """What ``torsh-jax launch --ray ADDRESS -n N`` would start (the cluster is not contacted)."""
    coordinator = f"<node IP of rank 0>:{_FREE_PORT}"
    bundle = {"CPU": 1, **({"GPU": gpus_per_process} if gpus_per_process else {})}
    ranks = [
        {
            "rank": r,
            "node": f"bundle {r}",
            "env": _layout_env(r, num_processes, coordinator, devices_per_process),
        }
        for r in range(num_processes)
    ]
    return LaunchPreview(
        backend="ray",
        command=["python", *script_and_args],
        coordinator=coordinator,
        num_devices=num_processes * (devices_per_process or gpus_per_process or 1),
        num_slices=num_processes,
        ranks=ranks,
        warnings=stale_coordinator_warnings(environ, hostname=socket.gethostname()),
        extra={
            "ray": f"address {address}; placement group of {num_processes} bundle(s) {bundle}, "
            "strategy SPREAD; one actor per bundle runs its rank as a subprocess"
        },
    )


def preview_slurm(
    script_and_args: Sequence[str], /, *, job: SlurmJob, environ: Mapping[str, str]
) -> LaunchPreview:
    """What ``torsh-jax launch --slurm`` would submit: the batch script and each task's Slurm variables."""
    port = SLURM_PORT_EXPR if job.port is None else str(job.port)
    coordinator = f"<first host of SLURM_JOB_NODELIST>:{port}"
    per_task = job.gpus_per_node // job.tasks_per_node if job.gpus_per_node else None
    ranks = [
        {
            "rank": r,
            "node": r // job.tasks_per_node,
            "env": {
                "SLURM_PROCID": str(r),
                "SLURM_LOCALID": str(r % job.tasks_per_node),
                "SLURM_NODEID": str(r // job.tasks_per_node),
                "SLURM_NTASKS": str(job.num_tasks),
                "MASTER_ADDR": "<first host of SLURM_JOB_NODELIST>",
                "MASTER_PORT": port,
            },
        }
        for r in range(job.num_tasks)
    ]
    return LaunchPreview(
        backend="slurm",
        command=["srun", "--kill-on-bad-exit=1", sys.executable, *script_and_args],
        coordinator=coordinator,
        num_devices=job.num_tasks * (per_task or 1),
        num_slices=job.num_tasks,
        ranks=ranks,
        warnings=stale_coordinator_warnings(environ, hostname=socket.gethostname()),
        extra={"sbatch": sbatch_script(script_and_args, job=job)},
    )
