"""``torsh-jax`` entry point: one sub-command per module in :data:`COMMANDS`.

Each command module has ``register(subparsers)``, which adds its parser and
sets ``func``; heavy imports (JAX) happen inside ``func`` so that commands
such as ``translate`` stay instant.

Example:
    $ torsh-jax --help
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torsh_jax.errors import TorshError

__all__ = ["main", "build_parser", "COMMANDS"]

#: Command modules, in the order ``--help`` lists them.
COMMANDS = (
    "torsh_jax.cli.demo_cmd",
    "torsh_jax.cli.inspect_cmd",
    "torsh_jax.cli.launch_cmd",
    "torsh_jax.cli.translate_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torsh-jax",
        description="Parallel training on JAX: run, inspect and translate parallel plans.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TorshError as err:
        print(f"torsh-jax {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
