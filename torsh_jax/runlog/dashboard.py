"""A live page over a run directory: ``serve(DIR, port=8080)`` (``torsh-jax dashboard DIR``).

The page is the report's, and a script asks the server every half second for the parts that
changed (``/api/parts?after=N`` answers ``{"steps": n, "parts": {id: html} | null}``), so a new step
shows without reloading. Read-only: only ``GET`` and ``HEAD`` are answered, nothing is written,
and ``/files/PATH`` serves regular files inside the run directory only (the profile's traces);
any path that resolves outside it, a directory, or another method is refused, and the page lists
only traces it serves. Bound to 127.0.0.1 unless told otherwise (an IPv6 host such as ``::1``
binds IPv6); on a loopback address a request whose ``Host`` is not ``127.0.0.1``, ``localhost`` or
``[::1]`` with the server's port is refused (403: DNS rebinding), and a malformed ``after`` is a 400.

Routes: ``/`` (the page), ``/api/parts?after=N``, ``/api/steps?after=N`` (the step records after
step ``N`` as JSON), ``/files/PATH``.

Example:
    >>> import tempfile
    >>> server = make_server(tempfile.mkdtemp(), port=0)  # serve_forever() answers until shutdown()
    >>> server.server_address[0]
    '127.0.0.1'
    >>> server.server_close()
"""

from __future__ import annotations

import errno
import ipaddress
import json
import mimetypes
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from torsh_jax.errors import RunLogError
from torsh_jax.runlog import files
from torsh_jax.runlog.page import live_parts, page, run_body
from torsh_jax.runlog.read import Run, read_run, read_steps

__all__ = ["make_server", "POLL_MS"]

#: How often the page asks for new parts.
POLL_MS = 500

_SCRIPT = """
let seen = Number(document.body.dataset.steps);
async function poll() {
  try {
    const answer = await fetch('/api/parts?after=' + seen, {cache: 'no-store'});
    const data = await answer.json();
    if (data.parts) {
      for (const [id, html] of Object.entries(data.parts)) {
        const part = document.getElementById(id);
        if (part) part.innerHTML = html;
      }
      seen = data.steps;
      document.body.dataset.steps = String(seen);
    }
    const now = new Date().toLocaleTimeString();
    document.getElementById('live').textContent = 'live: ' + seen + ' steps, checked ' + now;
  } catch (err) {
    document.getElementById('live').textContent = 'live: server not answering (' + err + ')';
  }
  setTimeout(poll, POLL_MS);
}
setTimeout(poll, POLL_MS);
"""


def _run_or_none(path: Path) -> Run | None:
    """The run, or ``None`` before its ``run.json`` exists (a malformed file raises RunLogError)."""
    return read_run(path) if (path / files.RUN_FILE).is_file() else None


def _page(path: Path) -> str:
    run = _run_or_none(path) or Run(path, {"plan": f"(waiting for {files.RUN_FILE})"})
    body = run_body(run, href=_file_link(path))
    steps = len(run.steps)
    live = '<p id="live" class="note">live</p>'
    html = page(
        f"torsh-jax dashboard {path.name}", live + body, script=_SCRIPT.replace("POLL_MS", str(POLL_MS))
    )
    return html.replace("<body>", f'<body data-steps="{steps}">', 1)


def _parts(path: Path, after: int) -> dict:
    run = _run_or_none(path)
    if run is None or len(run.steps) == after:
        return {"steps": after if run is None else len(run.steps), "parts": None}
    return {"steps": len(run.steps), "parts": live_parts(run, href=_file_link(path))}


def _file_link(root: Path):
    """A file of the run as this server's ``/files/`` address (``None`` for one ``/files/`` refuses:
    a symbolic link out of the run)."""

    def link(target: Path) -> str | None:
        inside = _inside(root, target.relative_to(root).as_posix())
        return None if inside is None else "/files/" + quote(inside.relative_to(root).as_posix())

    return link


def _inside(root: Path, relative: str) -> Path | None:
    """The regular file ``relative`` names under ``root``, or ``None`` if it is elsewhere or not a file."""
    if "\\" in relative or "\x00" in relative:
        return None
    target = (root / relative).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        return None
    return target


class _Handler(BaseHTTPRequestHandler):
    root: Path  # set on the subclass make_server builds
    hosts: frozenset[str] | None  # the Host headers answered (None: any), set by make_server
    server_version = "torsh-jax-dashboard"

    def log_message(self, format: str, *args) -> None:  # the terminal stays quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data) -> None:
        self._send(HTTPStatus.OK, json.dumps(data, allow_nan=False).encode(), "application/json")

    def _refuse(self, status: int, why: str) -> None:
        self._send(status, why.encode(), "text/plain; charset=utf-8")

    def do_GET(self) -> None:
        if self.hosts is not None and (self.headers.get("Host") or "").lower() not in self.hosts:
            self._refuse(HTTPStatus.FORBIDDEN, "this server answers only its own loopback address")
            return
        url = urlsplit(self.path)
        try:
            after = int(parse_qs(url.query).get("after", ["0"])[0])
        except ValueError:
            self._refuse(HTTPStatus.BAD_REQUEST, "after must be a step number, e.g. ?after=12")
            return
        try:
            self._route(url.path, after)
        except RunLogError as err:  # a malformed run file: its one line, not a traceback
            self._refuse(HTTPStatus.INTERNAL_SERVER_ERROR, str(err))

    def _route(self, path: str, after: int) -> None:
        if path == "/":
            self._send(HTTPStatus.OK, _page(self.root).encode(), "text/html; charset=utf-8")
        elif path == "/api/parts":
            self._json(_parts(self.root, after))
        elif path == "/api/steps":
            self._json(read_steps(self.root, after=after))
        elif path == "/favicon.ico":  # browsers ask; no icon, and no console error
            self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
        elif path.startswith("/files/"):
            self._file(unquote(path.removeprefix("/files/")))
        else:
            self._refuse(HTTPStatus.NOT_FOUND, "not found")

    do_HEAD = do_GET

    def _file(self, relative: str) -> None:
        target = _inside(self.root, relative)
        if target is None:
            self._refuse(HTTPStatus.NOT_FOUND, "not a file of this run")
            return
        kind = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        self._send(HTTPStatus.OK, target.read_bytes(), kind)

    def _read_only(self) -> None:
        self._refuse(HTTPStatus.METHOD_NOT_ALLOWED, "read-only: GET and HEAD only")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _read_only


def make_server(
    directory: str | Path, /, *, host: str = "127.0.0.1", port: int = 8080
) -> ThreadingHTTPServer:
    """A server of ``directory``'s live page (``port`` 0: any free port; ``server.server_address``).

    Raises:
        RunLogError: ``directory`` is not a directory, or the port cannot be bound.
    """
    root = Path(directory).resolve()
    if not root.is_dir():
        raise RunLogError(f"{directory} is not a directory", key="DIR", fix="pass the --log-dir of a run")
    handler = type("Handler", (_Handler,), {"root": root, "hosts": None})
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server = type("Server", (ThreadingHTTPServer,), {"address_family": family})((host, port), handler)
    except OSError as err:
        raise _listen_error(host, port, err) from None
    server.daemon_threads = True
    handler.hosts = _loopback_hosts(*server.server_address[:2])
    return server


def _loopback_hosts(address: str, port: int) -> frozenset[str] | None:
    """The Host headers a loopback server answers (others may be DNS rebinding); ``None`` elsewhere."""
    if not ipaddress.ip_address(address).is_loopback:
        return None
    names = ("127.0.0.1", "localhost", "[::1]")
    return frozenset(f"{name}:{port}" for name in names) | (frozenset(names) if port == 80 else frozenset())


def _listen_error(host: str, port: int, err: OSError) -> RunLogError:
    why = f"cannot listen on {host}:{port}: {err.strerror or err}"
    if err.errno == errno.EADDRINUSE and port != 0:
        return RunLogError(why, key="--port", fix=f"pass --port {port + 1}, or --port 0 for a free port")
    return RunLogError(why, key="--host", fix="pass --host 127.0.0.1 (or ::1), or an address of this machine")
