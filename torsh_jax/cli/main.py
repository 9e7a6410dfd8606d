"""``torsh-jax`` entry point: one sub-command per module in :data:`COMMANDS`.

Each command module has ``register(subparsers)``, which adds its parser and
sets ``func``, and ``starts_jax`` where the command starts JAX's backend (on a host
without TPUs, libtpu's environment is given first:
:func:`~torsh_jax.targets.libtpu_env.quiet_without_tpus`); heavy imports (JAX)
happen inside ``func`` so that commands such as ``translate`` stay instant.

Example:
    >>> build_parser().parse_args(["inspect", "--plan", "zero3"]).plan
    'zero3'
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from torsh_jax.cli.args import OneLineParser, flag_error
from torsh_jax.errors import TorshError

__all__ = ["main", "build_parser", "COMMANDS"]

#: Exit code of a process ended by SIGPIPE in a shell (128 + 13).
_SIGPIPE_EXIT = 141

#: Command modules, in the order ``--help`` lists them.
COMMANDS = (
    "torsh_jax.cli.demo_cmd",
    "torsh_jax.cli.checkpoint_cmd",
    "torsh_jax.cli.inspect_cmd",
    "torsh_jax.cli.launch_cmd",
    "torsh_jax.cli.plan_cmd",
    "torsh_jax.cli.calibrate_cmd",
    "torsh_jax.cli.translate_cmd",
    "torsh_jax.cli.report_cmd",
    "torsh_jax.cli.dashboard_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="torsh-jax",
        description="Parallel training on JAX: run, inspect and translate parallel plans.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from torsh_jax import __version__

    return __version__


def _quiet_closed_stdout() -> int:
    """The reader of stdout went away (``| head``): end quietly, as other tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit must not raise again
    except (OSError, ValueError):
        pass
    return _SIGPIPE_EXIT


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; unknown arguments are reported by the (sub-)command they were given to."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub-)command ``args`` chose (``checkpoint show``, ``demo``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None):
            return _innermost(action.choices[getattr(args, action.dest)], args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code. Errors are one line ending in ``Fix: ...``."""
    parser = build_parser()
    args = _parse(parser, argv)
    if getattr(args, "starts_jax", False):  # before its backend starts: libtpu's start-up quiet
        from torsh_jax.targets.libtpu_env import quiet_without_tpus

        quiet_without_tpus()
    try:
        return int(args.func(args) or 0)
    except TorshError as err:  # a library parameter's name shown as the flag that set it
        err = flag_error(err, _innermost(parser, args))
        print(f"torsh-jax {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _quiet_closed_stdout()
    except KeyboardInterrupt:
        print(f"torsh-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
