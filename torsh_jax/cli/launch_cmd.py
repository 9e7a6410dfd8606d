"""``torsh-jax launch``: run a script as N processes: on this host (like ``torchrun --standalone``),
on a Ray cluster (``--ray``) or as a Slurm batch job (``--slurm``); ``--dry-run`` shows what would start.

Example:
    $ torsh-jax launch -n 2 --devices-per-process 4 train.py --steps 10
    [rank 0] ...
    [rank 1] ...
    $ torsh-jax launch --slurm --nodes 2 --gpus-per-node 8 --tasks-per-node 8 --dry-run train.py
"""

from __future__ import annotations

import argparse

from torsh_jax.cli.args import MAX_DEVICES, count_type

__all__ = ["register", "run"]

#: Most processes ``launch`` starts on one host.
MAX_LOCAL_PROCESSES = 1024

_EPILOG = """\
Each process gets TORSH_JAX_COORDINATOR=127.0.0.1:PORT, TORSH_JAX_NUM_PROCESSES,
TORSH_JAX_PROCESS_ID and (with --devices-per-process) TORSH_JAX_DEVICES_PER_PROCESS;
torsh_jax.distributed.initialize() reads them. Output lines are kept whole and
prefixed [rank N] (stdout to stdout, stderr to stderr). If any process fails, the
others are stopped and the exit code is that of the rank that failed first, which
the last [launch] line names. With --max-restarts R all processes are started
again (fresh port, TORSH_JAX_RESTART=1, 2, ...) up to R times; a script that
resumes from its newest checkpoint (demo --resume) then finishes the job. With
--min-processes M a restart drops the process that failed (its host is taken as
lost) while more than M are left: the job continues on fewer devices, the plan is
re-resolved for them and the global batch kept (demo --resume does this).
Once a process exited 0, the others get --exit-grace seconds to exit; those still
running are then named, stopped and the exit code is 124. Each process leads a
process group of its own: what it leaves there is killed when it ends, and all
groups are killed when the launcher dies, even by SIGKILL.

--ray [ADDRESS] runs each process in a Ray actor of its own (one placement-group
bundle each, spread over the nodes), with the same rules. --slurm writes an sbatch
script (--nodes, --tasks-per-node, --gpus-per-node, --time, --partition, --account, --job-name)
whose srun tasks initialize() reads, and submits it. --dry-run prints what would
start (each rank's variables, the coordinator, with --plan the plan resolved for
the job's devices) and warns about coordinator variables left in the environment.
"""


class _UsageFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows the script's arguments as optional, ``script [script_args ...]``, not ``script ...``.
    The script is parsed as optional (argparse would list the script's arguments as required when
    it is missing) and checked by :func:`_check_script`: shown as required."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if action.nargs == argparse.REMAINDER:
            return f"[{self._metavar_formatter(action, default_metavar)(1)[0]} ...]"
        if action.dest == "script":
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a script as N local processes (like torchrun --standalone)",
        description="Run `python SCRIPT ARGS` as N processes on 127.0.0.1 and supervise them.",
        epilog=_EPILOG,
        formatter_class=_UsageFormatter,
    )
    parser.add_argument(
        "-n", "--num-processes", type=count_type(1, MAX_LOCAL_PROCESSES, fix="pass -n 2"), default=None,
        help=f"processes to start (1..{MAX_LOCAL_PROCESSES}); required except with --slurm",
    )  # fmt: skip
    parser.add_argument(
        "--devices-per-process", type=count_type(1, MAX_DEVICES, fix="pass --devices-per-process 4"),
        default=None, help="simulated CPU devices in each process",
    )  # fmt: skip
    parser.add_argument("--port", type=count_type(1, 65535, fix="leave --port out to pick a free port"),
                        default=None, help="coordinator port (default: a free one)")  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop everything and exit 124 after this many seconds"
    )
    parser.add_argument(
        "--grace-period", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping"
    )
    parser.add_argument(
        "--exit-grace", type=float, default=None, metavar="SECONDS",
        help="once a process exited 0, stop those still running after this many seconds, "
        "naming them, and exit 124 [60]",
    )  # fmt: skip
    parser.add_argument(
        "--max-restarts", type=count_type(0, 1000, fix="pass --max-restarts 1"), default=0,
        help="when a process fails, stop the others and start all again, up to this many times; "
        "TORSH_JAX_RESTART holds the attempt number and the script resumes itself [0]",
    )  # fmt: skip
    parser.add_argument(
        "--min-processes", type=count_type(1, MAX_LOCAL_PROCESSES, fix="pass --min-processes 1"),
        default=None, help="a restart drops the process that failed while more than this many are "
        "left; the script re-resolves its plan for the devices present [-n: always restart all]",
    )  # fmt: skip
    parser.add_argument(
        "--verbose-collectives",
        action="store_true",
        help="keep gloo/XLA C++ INFO and WARNING logs (default: TF_CPP_MIN_LOG_LEVEL=2 and "
        "GLOG_minloglevel=2 unless set, and gloo's per-connection lines dropped)",
    )
    _add_backend_arguments(parser)
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run SCRIPT as a module, python -m SCRIPT (like python's and torchrun's -m): "
        "-m torsh_jax calibrate",
    )
    parser.add_argument("script", nargs="?", help="Python script to run (with -m: the module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(func=run)


def _ray_address(text: str) -> str:
    """``--ray``'s value; a Python file there is the script read as the address (``-n 2 --ray train.py``)."""
    if text.endswith(".py"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is the script, read as the Ray address. Fix: write --ray auto {text} (or --ray first)"
        )
    return text


def _add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        default=None,
        type=_ray_address,
        metavar="ADDRESS",
        help="run on a Ray cluster (ADDRESS as ray.init takes it; default: auto). Put it before -n "
        "or give ADDRESS, or the script is read as the address. Needs pip install 'torsh-jax[ray]'",
    )
    where.add_argument(
        "--slurm", action="store_true", help="write an sbatch script running srun and submit it"
    )
    parser.add_argument(
        "--gpus-per-process",
        type=count_type(1, 1024, fix="pass --gpus-per-process 1"),
        default=None,
        help="--ray: GPUs in each process's bundle",
    )
    parser.add_argument(
        "--nodes", type=count_type(1, 100_000, fix="pass --nodes 2"), default=1, help="--slurm: nodes [1]"
    )
    parser.add_argument(
        "--tasks-per-node",
        type=count_type(1, 1024, fix="pass --tasks-per-node 1"),
        default=1,
        help="--slurm: processes per node: 1 (each with all the node's GPUs) or --gpus-per-node [1]",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=count_type(1, 1024, fix="pass --gpus-per-node 8"),
        default=None,
        help="--slurm: GPUs per node [none]",
    )
    parser.add_argument("--time", default=None, help="--slurm: time limit HH:MM:SS [the partition's]")
    parser.add_argument("--partition", default=None, help="--slurm: partition [the cluster's default]")
    parser.add_argument("--account", default=None, help="--slurm: account to charge [your default]")
    parser.add_argument(
        "--job-name", default=None, help="--slurm: job name [the script's name, other characters as _]"
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would start; start nothing")
    parser.add_argument(
        "--plan", default=None, help="--dry-run: also resolve this plan for the job's devices"
    )
    parser.add_argument("--json", action="store_true", help="--dry-run: print the preview as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Start (or with ``--dry-run`` describe) the processes described by ``args``; returns the exit code."""
    _check_script(args)
    _check_combination(args)
    if not args.slurm:
        _check_supervision(args)
    if args.dry_run:
        return _dry_run(args)
    if args.slurm:
        return _submit_slurm(args)
    if args.ray is not None:
        return _run_ray(args)
    return _run_local(args)


def _supervision(args: argparse.Namespace) -> dict:
    """The keyword arguments that the local and the Ray launch share."""
    from torsh_jax.distributed.launcher import DEFAULT_EXIT_GRACE_S

    return {
        "num_processes": args.num_processes,
        "devices_per_process": args.devices_per_process,
        "timeout_s": args.timeout,
        "grace_period_s": args.grace_period,
        "exit_grace_s": DEFAULT_EXIT_GRACE_S if args.exit_grace is None else args.exit_grace,
        "verbose_collectives": args.verbose_collectives,
        "max_restarts": args.max_restarts,
        "min_processes": args.min_processes,
    }


def _check_script(args: argparse.Namespace) -> None:
    """A script (or module) to run; its arguments are optional."""
    from torsh_jax.errors import DistributedError

    if args.script is None:
        raise DistributedError(
            "no script to run", key="script", fix="pass a Python file, or -m MODULE (-m torsh_jax)"
        )


def _check_supervision(args: argparse.Namespace) -> None:
    """The checks ``launch`` and ``ray_launch`` make, made before ``--dry-run`` too."""
    from torsh_jax.distributed.launcher import check_launch_arguments

    options = {k: v for k, v in _supervision(args).items() if k != "verbose_collectives"}
    check_launch_arguments(_command(args), port=args.port, **options)


def _command(args: argparse.Namespace) -> list[str]:
    """What each process runs after ``python``: the script and its arguments, or ``-m MODULE ...``."""
    from torsh_jax.distributed.launcher import MODULE_FLAG

    script = [args.script, *args.script_args]
    return [MODULE_FLAG, *script] if args.module else script


def _run_local(args: argparse.Namespace) -> int:
    from torsh_jax.distributed.launcher import launch

    return launch(_command(args), port=args.port, **_supervision(args))


def _run_ray(args: argparse.Namespace) -> int:
    from torsh_jax.distributed.ray_launch import ray_launch

    script = _command(args)
    return ray_launch(script, address=args.ray, gpus_per_process=args.gpus_per_process, **_supervision(args))


def _slurm_job(args: argparse.Namespace):
    from torsh_jax.distributed.slurm import SlurmJob, job_name_for

    return SlurmJob(
        nodes=args.nodes,
        tasks_per_node=args.tasks_per_node,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name or job_name_for(args.script),
        port=args.port,
        max_restarts=args.max_restarts,
    )


def _submit_slurm(args: argparse.Namespace) -> int:
    from pathlib import Path

    from torsh_jax.distributed.slurm import sbatch_script, submit_sbatch

    text = sbatch_script(_command(args), job=_slurm_job(args))
    job_id = submit_sbatch(text, directory=Path.cwd())
    print(f"submitted Slurm job {job_id}", flush=True)
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    import os
    import sys

    from torsh_jax.cli.output import print_json
    from torsh_jax.distributed import preview

    script = _command(args)
    if args.slurm:
        found = preview.preview_slurm(script, job=_slurm_job(args), environ=os.environ)
    else:
        common = {"num_processes": args.num_processes, "devices_per_process": args.devices_per_process}
        if args.ray is not None:
            found = preview.preview_ray(script, address=args.ray, gpus_per_process=args.gpus_per_process,
                                        environ=os.environ, **common)  # fmt: skip
        else:
            found = preview.preview_local(script, port=args.port, environ=os.environ, **common)
    found = found.with_plan(args.plan)
    if args.json:
        print_json(found.as_dict())
        return 0
    print("\n".join(found.lines()), flush=True)
    for warning in found.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


#: Flags that only one backend reads: flag -> (attribute, the backends that read it).
_BACKEND_ONLY = {
    "--gpus-per-process": ("gpus_per_process", ("ray",)),
    "--nodes": ("nodes", ("slurm",)),
    "--tasks-per-node": ("tasks_per_node", ("slurm",)),
    "--gpus-per-node": ("gpus_per_node", ("slurm",)),
    "--time": ("time", ("slurm",)),
    "--partition": ("partition", ("slurm",)),
    "--account": ("account", ("slurm",)),
    "--job-name": ("job_name", ("slurm",)),
    "--port": ("port", ("local", "slurm")),
    "--min-processes": ("min_processes", ("local", "ray")),
    "--devices-per-process": ("devices_per_process", ("local", "ray")),
    "--timeout": ("timeout", ("local", "ray")),
    "--grace-period": ("grace_period", ("local", "ray")),
    "--exit-grace": ("exit_grace", ("local", "ray")),
    "--verbose-collectives": ("verbose_collectives", ("local", "ray")),
}
_DEFAULTS = {"nodes": 1, "tasks_per_node": 1, "grace_period": 5.0, "verbose_collectives": False}


def _check_combination(args: argparse.Namespace) -> None:
    """Flags that the chosen backend does not read, and a missing -n, are errors naming the flag."""
    from torsh_jax.errors import DistributedError

    backend = "slurm" if args.slurm else "ray" if args.ray is not None else "local"
    for flag, (attribute, backends) in _BACKEND_ONLY.items():
        if backend not in backends and getattr(args, attribute) not in (None, _DEFAULTS.get(attribute)):
            where = " or ".join(f"--{b}" if b != "local" else "a local launch" for b in backends)
            raise DistributedError(f"is read only by {where}", key=flag, fix=f"remove {flag}")
    if backend != "slurm" and args.num_processes is None:
        raise DistributedError("is required (processes to start)", key="-n/--num-processes", fix="pass -n 2")
    if backend == "slurm" and args.num_processes is not None:
        raise DistributedError(
            "is --nodes x --tasks-per-node under --slurm",
            key="-n/--num-processes",
            fix="remove -n; pass --nodes and --tasks-per-node",
        )
    if args.devices_per_process is not None and args.gpus_per_process is not None:
        raise DistributedError(
            "--devices-per-process (simulated CPU devices) with GPUs",
            key="--gpus-per-process",
            fix="pass only one of the two",
        )
    for flag, value in (("--plan", args.plan), ("--json", args.json)):
        if value and not args.dry_run:
            raise DistributedError(
                "is read only with --dry-run", key=flag, fix=f"add --dry-run or remove {flag}"
            )
