"""``torsh-jax checkpoint list|show``: what a checkpoint directory holds.

With ``--json``, ``list`` prints one JSON object per step directory and ``show`` one JSON object,
each on one line (docs/cli.md, Output).

Example:
    $ torsh-jax checkpoint list runs/ckpt
    $ torsh-jax checkpoint show runs/ckpt --step 200 --json
"""

from __future__ import annotations

import argparse

from torsh_jax.cli.args import count_type

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "checkpoint", help="list checkpoints, or show one (steps, plan, bytes, shardings)"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "list", help="every step directory: step, bytes on disk, complete/unreadable/incomplete/damaged"
    )
    listing.add_argument("directory", help="checkpoint directory (demo --checkpoint-dir)")
    listing.add_argument("--json", action="store_true", help="print one JSON object per line")
    listing.set_defaults(func=run_list, starts_jax=True)
    show = actions.add_parser("show", help="one step: plan, mesh, items, bytes, parameter shardings")
    show.add_argument("directory", help="checkpoint directory (demo --checkpoint-dir)")
    show.add_argument("--step", type=count_type(0, 2**62, fix="pass --step S (see checkpoint list)"),
                      default=None, help="step to show [newest complete]")  # fmt: skip
    show.add_argument("--json", action="store_true", help="print a JSON object on one line")
    show.set_defaults(func=run_show, starts_jax=True)


_STATUS_TEXT = {
    "incomplete": "incomplete (a save was interrupted)",
    "damaged": "damaged (could not be read; set aside, not restored or kept)",
}


def _status_text(entry: dict) -> str:
    if entry["status"] == "unreadable":
        return f"unreadable ({entry['reason']})"
    return _STATUS_TEXT.get(entry["status"], entry["status"])


def run_list(args: argparse.Namespace) -> int:
    from torsh_jax.checkpoint.describe import list_checkpoints
    from torsh_jax.cli.output import print_json
    from torsh_jax.units import format_bytes

    found = list_checkpoints(args.directory)
    if args.json:
        for entry in found:
            print_json(entry)
        return 0
    if not found:
        print(f"{args.directory}: no checkpoints")
    for entry in found:
        print(f"step {entry['step']:>8}  {format_bytes(entry['bytes_on_disk']):>11}  {_status_text(entry)}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    from torsh_jax.checkpoint.describe import show_checkpoint
    from torsh_jax.cli.output import print_json
    from torsh_jax.units import format_bytes

    shown = show_checkpoint(args.directory, step=args.step)
    if args.json:
        print_json(shown)
        return 0
    for note in shown["skipped"]:
        print(note)
    print(f"step {shown['step']} ({shown['path']})")
    print(f"mesh: {shown['mesh']}  items: {', '.join(shown['items'] or [])}")
    print(f"state: {format_bytes(shown['state_bytes'])}  on disk: {format_bytes(shown['bytes_on_disk'])}")
    print(
        f"data position: {shown['data_position']}  rng: {'saved' if shown['has_rng'] else 'none'}  "
        f"checksums: {shown['checksummed_arrays']} arrays"
    )
    print("parameters:")
    for path, info in shown["params"].items():
        print(f"  {path}  {info['dtype']}{info['shape']}  {info['partition_spec']}")
    print("plan:")
    print("  " + "\n  ".join(shown["plan"].strip().splitlines()))
    return 0
