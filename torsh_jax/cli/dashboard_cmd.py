"""``torsh-jax dashboard DIR [--port 8080] [--host 127.0.0.1]``: a live page over a run's log.

Prints the address on stdout and serves until Ctrl-C. The page updates without reloading as steps
are logged; the server is read-only and serves only files inside ``DIR``.

Example:
    $ torsh-jax demo --plan zero3 --steps 200 --log-dir runs/z3
    $ torsh-jax dashboard runs/z3 --port 8080
"""

from __future__ import annotations

import argparse
import sys

from torsh_jax.cli.args import count_type

__all__ = ["register"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("dashboard", help="serve a live page over a run directory")
    parser.add_argument("run", metavar="DIR", help="run directory (demo --log-dir, RunLog)")
    port = count_type(0, 65535, fix="pass --port 8080")
    parser.add_argument("--port", type=port, default=8080, help="port; 0 picks a free one [8080]")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind [127.0.0.1: this machine only]")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torsh_jax.runlog.dashboard import make_server

    server = make_server(args.run, host=args.host, port=args.port)
    if args.host not in _LOOPBACK:
        print(
            f"torsh-jax dashboard: serving to the network on {args.host}: anyone who reaches it sees the run",
            file=sys.stderr,
        )
    host, port = server.server_address[:2]
    print(f"http://{'[' + host + ']' if ':' in host else host}:{port}/", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0
