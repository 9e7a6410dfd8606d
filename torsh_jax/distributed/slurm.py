"""``torsh-jax launch --slurm``: write an ``sbatch`` script that runs a script under ``srun``, and submit it.

The batch script asks for ``nodes`` nodes with ``tasks_per_node`` tasks each
(one task per node holding all its GPUs, or one task per GPU), exports the
coordinator (the first host of ``SLURM_JOB_NODELIST``, expanded by
``scontrol show hostnames``, and a port) as ``MASTER_ADDR``/``MASTER_PORT``,
clears coordinator variables inherited from the submitting shell, and runs
``srun --kill-on-bad-exit=1 python SCRIPT ARGS``: every task's
:func:`torsh_jax.distributed.initialize` then reads ``SLURM_PROCID``,
``SLURM_NTASKS`` and the rest. With ``max_restarts`` the script runs the step
again (a fresh port, ``TORSH_JAX_RESTART`` = the attempt) inside the same allocation.

Example:
    >>> text = sbatch_script(["train.py", "--steps", "10"], job=SlurmJob(nodes=2), python="python3")
    >>> for line in text.splitlines():
    ...     if line.startswith(("#SBATCH --n", "srun")):
    ...         print(line)
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    srun --kill-on-bad-exit=1 python3 train.py --steps 10
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torsh_jax.distributed.env_sources import RESTART_VAR
from torsh_jax.distributed.stale import STALE_COORDINATOR_VARS
from torsh_jax.errors import DistributedError

__all__ = ["SlurmJob", "sbatch_script", "submit_sbatch", "job_name_for", "SLURM_PORT_EXPR"]

#: The coordinator port derived from the job id (JAX's Slurm rule, as :func:`.hostlist.slurm_port`).
SLURM_PORT_EXPR = "$(( SLURM_JOB_ID % 4096 + 61440 ))"
#: Attempt ``attempt``'s derived port: the next one, wrapping inside 61440..65535.
_RESTART_PORT_EXPR = "$(( (SLURM_JOB_ID + attempt) % 4096 + 61440 ))"
#: Seconds ``sbatch`` may take (it hangs while slurmctld is unreachable).
SBATCH_TIMEOUT_S = 60.0
_TIME = re.compile(r"(\d+-)?\d{1,3}(:\d{2}){0,2}")
_NAME = re.compile(r"[A-Za-z0-9_.:+@-]+")


@dataclass(frozen=True)
class SlurmJob:
    """The allocation an ``sbatch`` script asks for.

    Args:
        nodes: nodes (``--nodes``).
        tasks_per_node: processes per node (``--ntasks-per-node``): 1 for one
            process per node with all its GPUs, ``gpus_per_node`` for one per GPU.
        gpus_per_node: GPUs per node; ``None`` asks for none (CPU nodes).
        time: wall-clock limit, ``HH:MM:SS`` (or Slurm's ``D-HH:MM:SS``); ``None``: the partition's.
        partition: ``--partition``; ``None``: the cluster's default.
        account: ``--account``; ``None``: the user's default.
        job_name: ``--job-name``.
        port: coordinator port; ``None`` derives it from the job id. Attempt ``a``
            of a restart uses ``port + a``, which must stay <= 65535.
        max_restarts: run the step again this many times after a failure.
    """

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str = "torsh-jax"
    port: int | None = None
    max_restarts: int = 0

    def __post_init__(self):
        _require(self.nodes >= 1, "--nodes", f"must be >= 1, got {self.nodes}", "pass --nodes 2")
        _require(self.tasks_per_node >= 1, "--tasks-per-node", "must be >= 1", "pass --tasks-per-node 1")
        gpus = self.gpus_per_node
        if gpus is not None:
            _require(gpus >= 1, "--gpus-per-node", f"must be >= 1, got {gpus}", "pass --gpus-per-node 8")
            _require(
                gpus % self.tasks_per_node == 0,
                "--tasks-per-node",
                f"{self.tasks_per_node} tasks do not share {gpus} GPUs per node evenly",
                f"pass --tasks-per-node 1 (one task per node) or {gpus} (one per GPU)",
            )
        if self.time is not None:
            _require(
                bool(_TIME.fullmatch(self.time)),
                "--time",
                f"cannot read {self.time!r}",
                "pass --time HH:MM:SS, e.g. 02:00:00",
            )
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--job-name", self.job_name),
        ):
            if value is not None:
                _require(
                    bool(_NAME.fullmatch(value)),
                    flag,
                    f"{value!r} is not a Slurm name",
                    f"pass {flag} with letters, digits, '-', '_' or '.'",
                )
        if self.port is not None:
            last = self.port + self.max_restarts
            _require(
                last <= 65535,
                "--port",
                f"{self.port} + {self.max_restarts} restarts reaches port {last} > 65535",
                f"pass --port {65535 - self.max_restarts} or lower, or leave --port out",
            )

    @property
    def num_tasks(self) -> int:
        return self.nodes * self.tasks_per_node


def sbatch_script(script_and_args: Sequence[str], /, *, job: SlurmJob, python: str | None = None) -> str:
    """The batch script that runs ``python SCRIPT ARGS`` as ``job.num_tasks`` tasks under ``srun``.

    Args:
        script_and_args: the script path and its arguments.
        job: the allocation.
        python: the interpreter the tasks run (default: this one, ``sys.executable``).

    Returns:
        The script text, to submit with ``sbatch``.
    """
    if not script_and_args:
        raise DistributedError("no script given", key="script", fix="torsh-jax launch --slurm train.py")
    lines = ["#!/bin/bash", *_directives(job), "", "set -euo pipefail", ""]
    lines += [
        "# Left over from the submitting shell (sbatch exports it), these would win over Slurm's variables.",
        f"unset {' '.join(STALE_COORDINATOR_VARS)}",
        "# Coordinator: the allocation's first host, where srun starts task 0 (sed reads all lines:",
        "# `head` would close the pipe early and pipefail would end the script).",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        f"BASE_PORT={SLURM_PORT_EXPR if job.port is None else job.port}",
        "",
    ]
    command = " ".join(shlex.quote(a) for a in [python or sys.executable, *script_and_args])
    srun = f"srun --kill-on-bad-exit=1 {command}"
    if job.max_restarts == 0:
        lines += ['export MASTER_ADDR MASTER_PORT="$BASE_PORT"', srun]
    else:
        port = _RESTART_PORT_EXPR if job.port is None else "$(( BASE_PORT + attempt ))"
        lines += _restart_loop(srun, job.max_restarts, port)
    return "\n".join(lines) + "\n"


def job_name_for(script: str) -> str:
    """A Slurm job name from the script's stem: characters other than ``[A-Za-z0-9_.-]`` become ``_``.

    Example:
        >>> job_name_for("runs/my train (v2).py")
        'my_train__v2_'
    """
    return re.sub(r"[^A-Za-z0-9_.-]", "_", Path(script).stem) or "torsh-jax"


def _directives(job: SlurmJob) -> list[str]:
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.tasks_per_node}",
    ]
    if job.gpus_per_node is not None and job.tasks_per_node == 1:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    elif job.gpus_per_node is not None:  # each task sees only its own GPUs (CUDA_VISIBLE_DEVICES per task)
        directives.append(f"--gpus-per-task={job.gpus_per_node // job.tasks_per_node}")
    directives += [f"--time={job.time}"] * (job.time is not None)
    directives += [f"--partition={job.partition}"] * (job.partition is not None)
    directives += [f"--account={job.account}"] * (job.account is not None)
    directives.append(f"--output={job.job_name}-%j.out")
    return [f"#SBATCH {d}" for d in directives]


def _restart_loop(srun: str, max_restarts: int, port: str) -> list[str]:
    """Run the step up to ``max_restarts + 1`` times; each attempt on ``port`` (a shell expression)."""
    return [
        f"for attempt in $(seq 0 {max_restarts}); do",
        f'    export MASTER_ADDR MASTER_PORT="{port}" {RESTART_VAR}="$attempt"',
        f"    {srun} && exit 0",
        "    code=$?",
        f'    echo "[launch] step failed with code $code (attempt $attempt of {max_restarts})" >&2',
        "done",
        'exit "$code"',
    ]


def submit_sbatch(
    text: str,
    /,
    *,
    directory: Path,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> str:
    """Write ``text`` to ``directory/<job name>.sbatch``, submit it with ``sbatch``; returns Slurm's job id.

    Raises:
        DistributedError: ``sbatch`` is not on ``PATH`` (not a Slurm login node),
            the script cannot be written, ``sbatch`` took over :data:`SBATCH_TIMEOUT_S`
            or refused the script (its message).
    """
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise DistributedError(
            "sbatch is not on PATH (this is not a Slurm login node)",
            key="--slurm",
            fix="run on the cluster's login node, or add --dry-run to print the batch script",
        )
    name = re.search(r"--job-name=(\S+)", text)
    path = directory / f"{name.group(1) if name else 'torsh-jax'}.sbatch"
    _write_script(path, text)
    done = _run_sbatch(run, [sbatch, "--parsable", str(path)])
    if done.returncode != 0:
        message = " ".join((done.stderr or done.stdout).split()) or f"exit code {done.returncode}"
        raise DistributedError(
            f"sbatch refused {path}: {message}",
            key="--slurm",
            fix="correct the flag sbatch names (see --dry-run for the script)",
        )
    return done.stdout.strip().split(";")[0]


def _write_script(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as err:
        raise DistributedError(
            f"cannot write the batch script: {err.strerror or err}",
            key=str(path),
            fix="run from a directory you can write to",
        ) from None


def _run_sbatch(
    run: Callable[..., subprocess.CompletedProcess], argv: list[str]
) -> subprocess.CompletedProcess:
    try:
        return run(argv, capture_output=True, text=True, check=False, timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DistributedError(
            f"sbatch did not answer within {SBATCH_TIMEOUT_S:g} s (slurmctld unreachable?)",
            key="--slurm",
            fix="check the controller with `sinfo`, then submit again",
        ) from None


def _require(ok: bool, key: str, message: str, fix: str) -> None:
    if not ok:
        raise DistributedError(message, key=key, fix=fix)
