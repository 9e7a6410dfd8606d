"""``torsh-jax launch``: run a script as N local processes, like ``torchrun --standalone``.

Example:
    $ torsh-jax launch -n 2 --devices-per-process 4 train.py --steps 10
    [rank 0] ...
    [rank 1] ...
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
"""


class _UsageFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows the script's arguments as optional, ``script [script_args ...]``, not ``script ...``."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if action.nargs == argparse.REMAINDER:
            return f"[{self._metavar_formatter(action, default_metavar)(1)[0]} ...]"
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
        "-n", "--num-processes", type=count_type(1, MAX_LOCAL_PROCESSES, fix="pass -n 2"), required=True,
        help=f"processes to start on this host (1..{MAX_LOCAL_PROCESSES})",
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
    parser.add_argument("script", help="Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Start the processes described by ``args``; returns the job's exit code."""
    from torsh_jax.distributed.launcher import DEFAULT_EXIT_GRACE_S, launch

    return launch(
        [args.script, *args.script_args],
        num_processes=args.num_processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        timeout_s=args.timeout,
        grace_period_s=args.grace_period,
        exit_grace_s=DEFAULT_EXIT_GRACE_S if args.exit_grace is None else args.exit_grace,
        verbose_collectives=args.verbose_collectives,
        max_restarts=args.max_restarts,
        min_processes=args.min_processes,
    )
