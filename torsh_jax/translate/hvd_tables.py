"""What each Horovod / Open MPI launch flag and ``HOROVOD_*`` variable means here.

Sources: horovod/runner/launch.py (``parse_args``: flag names and arities),
horovod/runner/common/util/config_parser.py (flag -> ``HOROVOD_*`` variable,
``--fusion-threshold-mb`` x 1024 x 1024 bytes), docs/tensor-fusion.rst
(default fusion buffer 128 MB) and the Open MPI ``mpirun`` manual.

A flag spec is ``(nargs, role)``: ``role`` names a handler in
:mod:`torsh_jax.translate.horovod`, or is ``"ignored: <reason>"``.

Example:
    >>> HOROVODRUN_FLAGS["-np"]
    (1, 'num_proc')
    >>> env_role("HOROVOD_WITH_PYTORCH")[:7]
    'ignored'
"""

from __future__ import annotations

import re

__all__ = [
    "HOROVODRUN_FLAGS",
    "MPIRUN_FLAGS",
    "HOROVOD_ENV",
    "HOROVOD_DEFAULT_FUSION_BYTES",
    "env_role",
    "lookup_flag",
]

#: Horovod's default fusion buffer: 128 MiB (docs/tensor-fusion.rst).
HOROVOD_DEFAULT_FUSION_BYTES = 128 * 1024 * 1024

_LAUNCH = "ignored: launcher or transport setting; JAX's distributed start-up replaces it"
_TUNE = "ignored: Horovod runtime tuning; XLA schedules the compiled collectives"
_ELASTIC = "ignored: elastic membership is not modelled; the plan fixes the world size (resume from a checkpoint to change it)"  # noqa: E501
_LOG = "ignored: logging or profiling output; no effect on training"
_INFO = "ignored: prints information and exits; no training"
_ALLGATHER = "ignored: allgather algorithm choice; data-parallel gradients use the reduction"

HOROVODRUN_FLAGS: dict[str, tuple[int, str]] = {
    "-np": (1, "num_proc"),
    "--num-proc": (1, "num_proc"),
    "-H": (1, "hosts"),
    "--hosts": (1, "hosts"),
    "-hostfile": (1, "hostfile"),
    "--hostfile": (1, "hostfile"),
    "--fusion-threshold-mb": (1, "fusion_mb"),
    "--hierarchical-allreduce": (0, "hier_on"),
    "--no-hierarchical-allreduce": (0, "hier_off"),
    "--slots-per-host": (1, "slots"),
    "--cycle-time-ms": (1, _TUNE),
    "--cache-capacity": (1, _TUNE),
    "--hierarchical-allgather": (0, _ALLGATHER),
    "--no-hierarchical-allgather": (0, "ignored: allgather algorithm choice; the default"),
    "--autotune": (0, _TUNE),
    "--no-autotune": (0, _TUNE),
    "--autotune-log-file": (1, _TUNE),
    "--autotune-warmup-samples": (1, _TUNE),
    "--autotune-steps-per-sample": (1, _TUNE),
    "--autotune-bayes-opt-max-samples": (1, _TUNE),
    "--autotune-gaussian-process-noise": (1, _TUNE),
    "--min-np": (1, _ELASTIC),
    "--min-num-proc": (1, _ELASTIC),
    "--max-np": (1, _ELASTIC),
    "--max-num-proc": (1, _ELASTIC),
    "--host-discovery-script": (1, _ELASTIC),
    "--elastic-timeout": (1, _ELASTIC),
    "--reset-limit": (1, _ELASTIC),
    "--blacklist-cooldown-range": (2, _ELASTIC),
    "--timeline-filename": (1, _LOG),
    "--timeline-mark-cycles": (0, _LOG),
    "--no-timeline-mark-cycles": (0, _LOG),
    "--no-stall-check": (0, _LOG),
    "--stall-check": (0, _LOG),
    "--stall-check-warning-time-seconds": (1, _LOG),
    "--stall-check-shutdown-time-seconds": (1, _LOG),
    "--log-level": (1, _LOG),
    "--log-with-timestamp": (0, _LOG),
    "--log-without-timestamp": (0, _LOG),
    "--log-hide-timestamp": (0, _LOG),
    "--no-log-hide-timestamp": (0, _LOG),
    "-prefix-timestamp": (0, _LOG),
    "--prefix-output-with-timestamp": (0, _LOG),
    "--output-filename": (1, _LOG),
    "--verbose": (0, _LOG),
    "-v": (0, _INFO),
    "--version": (0, _INFO),
    "-cb": (0, _INFO),
    "--check-build": (0, _INFO),
    "--disable-cache": (0, _LAUNCH),
    "--start-timeout": (1, _LAUNCH),
    "--network-interfaces": (1, _LAUNCH),
    "--network-interface": (1, _LAUNCH),
    "--config-file": (1, "config_file"),
    "-p": (1, _LAUNCH),
    "--ssh-port": (1, _LAUNCH),
    "-i": (1, _LAUNCH),
    "--ssh-identity-file": (1, _LAUNCH),
    "--mpi-threads-disable": (0, _LAUNCH),
    "--no-mpi-threads-disable": (0, _LAUNCH),
    "--mpi-args": (1, _LAUNCH),
    "--tcp": (0, _LAUNCH),
    "--binding-args": (1, _LAUNCH),
    "--num-nccl-streams": (1, _TUNE),
    "--thread-affinity": (1, _TUNE),
    "--gloo-timeout-seconds": (1, _LAUNCH),
    "--gloo": (0, _LAUNCH),
    "--mpi": (0, _LAUNCH),
    "--jsrun": (0, _LAUNCH),
}

_MPI = "ignored: Open MPI launch or transport setting; JAX's distributed start-up replaces it"
_PLACE = "ignored: process placement; the plan assumes one process per device"

MPIRUN_FLAGS: dict[str, tuple[int, str]] = {
    "-np": (1, "num_proc"),
    "-n": (1, "num_proc"),
    "-c": (1, "num_proc"),
    "--np": (1, "num_proc"),
    "-H": (1, "hosts"),
    "-host": (1, "hosts"),
    "--host": (1, "hosts"),
    "-hostfile": (1, "hostfile"),
    "--hostfile": (1, "hostfile"),
    "-machinefile": (1, "hostfile"),
    "--machinefile": (1, "hostfile"),
    "-x": (1, "env"),
    "-mca": (2, "mca"),
    "--mca": (2, "mca"),
    "-gmca": (2, "mca"),
    "--gmca": (2, "mca"),
    "-bind-to": (1, _PLACE),
    "--bind-to": (1, _PLACE),
    "-map-by": (1, _PLACE),
    "--map-by": (1, _PLACE),
    "-rank-by": (1, _PLACE),
    "--rank-by": (1, _PLACE),
    "-npernode": (1, _PLACE),
    "--npernode": (1, _PLACE),
    "-N": (1, _PLACE),
    "-ppn": (1, _PLACE),
    "--oversubscribe": (0, _PLACE),
    "-oversubscribe": (0, _PLACE),
    "--allow-run-as-root": (0, _MPI),
    "-allow-run-as-root": (0, _MPI),
    "-tag-output": (0, _LOG),
    "--tag-output": (0, _LOG),
    "-timestamp-output": (0, _LOG),
    "--timestamp-output": (0, _LOG),
    "-report-bindings": (0, _LOG),
    "--report-bindings": (0, _LOG),
    "--display-map": (0, _LOG),
    "-display-map": (0, _LOG),
    "-wdir": (1, _MPI),
    "--wdir": (1, _MPI),
    "-wd": (1, _MPI),
    "--prefix": (1, _MPI),
    "-prefix": (1, _MPI),
    "-v": (0, _LOG),
    "--verbose": (0, _LOG),
    "-q": (0, _LOG),
    "--quiet": (0, _LOG),
}

#: ``HOROVOD_*`` variables: role (as for flags) by name.
HOROVOD_ENV: dict[str, str] = {
    "HOROVOD_FUSION_THRESHOLD": "fusion_bytes",
    "HOROVOD_CPU_FUSION_THRESHOLD": "cpu_fusion_bytes",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "hier_env",
    "HOROVOD_HIERARCHICAL_ALLGATHER": _ALLGATHER,
    "HOROVOD_CYCLE_TIME": _TUNE,
    "HOROVOD_CACHE_CAPACITY": _TUNE,
    "HOROVOD_AUTOTUNE": _TUNE,
    "HOROVOD_AUTOTUNE_LOG": _TUNE,
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": _TUNE,
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": _TUNE,
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": _TUNE,
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": _TUNE,
    "HOROVOD_NUM_NCCL_STREAMS": _TUNE,
    "HOROVOD_CCL_BGT_AFFINITY": _TUNE,
    "HOROVOD_THREAD_AFFINITY": _TUNE,
    "HOROVOD_BATCH_D2D_MEMCOPIES": _TUNE,
    "HOROVOD_ENABLE_ASYNC_COMPLETION": _TUNE,
    "HOROVOD_DISABLE_GROUP_FUSION": _TUNE,
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": _TUNE,
    "HOROVOD_TIMELINE": _LOG,
    "HOROVOD_TIMELINE_MARK_CYCLES": _LOG,
    "HOROVOD_STALL_CHECK_DISABLE": _LOG,
    "HOROVOD_STALL_CHECK_TIME_SECONDS": _LOG,
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": _LOG,
    "HOROVOD_LOG_LEVEL": _LOG,
    "HOROVOD_LOG_HIDE_TIME": _LOG,
    "HOROVOD_MPI_THREADS_DISABLE": _LAUNCH,
    "HOROVOD_GLOO_TIMEOUT_SECONDS": _LAUNCH,
    "HOROVOD_START_TIMEOUT": _LAUNCH,
    "HOROVOD_ELASTIC_TIMEOUT": _ELASTIC,
    "HOROVOD_CONTROLLER": _LAUNCH,
    "HOROVOD_CPU_OPERATIONS": _LAUNCH,
    "HOROVOD_GLOO_IFACE": _LAUNCH,
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": _LAUNCH,
    "HOROVOD_GLOO_RENDEZVOUS_PORT": _LAUNCH,
    "HOROVOD_IFACE": _LAUNCH,
    "HOROVOD_HOSTNAME": _LAUNCH,
    "HOROVOD_DYNAMIC_PROCESS_SETS": "ignored: enables the process-set API; uses are noted",
    "HOROVOD_RANK": "ignored: set per process by the launcher",
    "HOROVOD_SIZE": "ignored: set per process by the launcher; the world size comes from -np",
    "HOROVOD_LOCAL_RANK": "ignored: set per process by the launcher",
    "HOROVOD_LOCAL_SIZE": "ignored: set per process by the launcher",
    "HOROVOD_CROSS_RANK": "ignored: set per process by the launcher",
    "HOROVOD_CROSS_SIZE": "ignored: set per process by the launcher",
}

_BUILD = re.compile(
    r"^HOROVOD_(WITH|WITHOUT)_\w+$|^HOROVOD_(GPU|GPU_\w+|BUILD_\w+|\w+_HOME|\w+_LINK|CMAKE\w*)$"
)


def env_role(name: str) -> str | None:
    """Role of environment variable ``name``; None for an unknown ``HOROVOD_*`` name."""
    if name in HOROVOD_ENV:
        return HOROVOD_ENV[name]
    if _BUILD.match(name):
        return "ignored: Horovod build-time setting (pip install); no effect at run time"
    if name.startswith("HOROVOD_"):
        return None
    if name.startswith("NCCL_") or name.startswith("UCX_") or name.startswith("OMPI_"):
        return "ignored: communication-library transport tuning; XLA picks its own collectives"
    if name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        return "ignored: device visibility; the world size comes from the launch (-np) or --world-size"
    return "ignored: not a Horovod setting; the training processes receive it unchanged"


def lookup_flag(table: dict[str, tuple[int, str]], token: str) -> tuple[str, int, str] | None:
    """``(flag, nargs, role)`` for ``token``; unambiguous ``--`` prefixes are accepted
    (argparse does the same for horovodrun)."""
    if token in table:
        return (token, *table[token])
    if token.startswith("--") and table is HOROVODRUN_FLAGS:
        matches = [f for f in table if f.startswith(token)]
        if len(matches) == 1:
            return (matches[0], *table[matches[0]])
    return None
