"""``torsh-jax`` entry point: one sub-command per module in :data:`COMMANDS`.

Each command module has ``register(subparsers)``, which adds its parser and
sets ``func``; heavy imports (JAX) happen inside ``func`` so that commands
such as ``translate`` stay instant.

Example:
    >>> build_parser().parse_args(["inspect", "--plan", "zero3"]).plan
    'zero3'
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

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
    "torsh_jax.cli.translate_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TorshError as err:
        print(f"torsh-jax {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _quiet_closed_stdout()
    except KeyboardInterrupt:
        print(f"torsh-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
