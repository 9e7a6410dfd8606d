"""One rank of a Ray launch: a plain class that Ray runs as an actor (no Ray import here).

The actor starts ``python SCRIPT ARGS`` as a subprocess in a process group of
its own, from a thread that lives as long as the subprocess, so that on Linux
the subprocess gets SIGKILL when the actor's process dies
(:func:`~torsh_jax.distributed.reaper.dying_with_parent`). Output lines are
queued and handed to the driver by :meth:`RankProcess.poll`.

Example:
    >>> import pathlib, tempfile
    >>> script = pathlib.Path(tempfile.mkdtemp()) / "hi.py"
    >>> _ = script.write_text("print('hi')")
    >>> rank = RankProcess()
    >>> rank.start([str(script)], overlay={}, defaults={}, cwd=str(script.parent))
    >>> lines, code = rank.poll(5.0)
    >>> while code is None:
    ...     more, code = rank.poll(5.0); lines += more
    >>> lines, code
    ([('out', 'hi')], 0)
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from torsh_jax.distributed.env_sources import LAUNCH_VARS
from torsh_jax.distributed.reaper import dying_with_parent
from torsh_jax.errors import DistributedError

__all__ = ["RankProcess", "Line"]

#: ``("out" | "err", text)``: one whole output line of the subprocess.
Line = tuple[str, str]
_DONE = ("done", "")


class RankProcess:
    """Runs one rank's subprocess and reports its output lines and exit code."""

    def __init__(self):
        self._lines: queue.Queue = queue.Queue()
        self._process: subprocess.Popen | None = None
        self._started = threading.Event()
        self._start_error: str | None = None
        self._ended = False

    def coordinator(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0's coordinator)."""
        host = _node_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return host, probe.getsockname()[1]

    def start(
        self, argv: Sequence[str], *, overlay: Mapping[str, str], defaults: Mapping[str, str], cwd: str
    ) -> None:
        """Start ``python ARGV``: this process's environment, ``overlay`` set, ``defaults`` unless set.

        Raises:
            DistributedError: the subprocess could not start (no ``cwd`` on this node, exec failed),
                naming the rank (``overlay``'s ``TORSH_JAX_PROCESS_ID``) and the node.
        """
        env = {**os.environ, **overlay}
        for name, value in defaults.items():
            env.setdefault(name, value)
        threading.Thread(target=self._own, args=(list(argv), env, cwd), daemon=True).start()
        self._started.wait()
        if self._start_error is not None:
            rank = overlay.get(LAUNCH_VARS["process_id"], "?")
            raise DistributedError(
                f"cannot start {argv[0] if argv else 'python'} in {cwd}: {self._start_error}",
                key=f"rank {rank} on {_node_address()}",
                fix="make the script and the working directory exist on every node (a shared file system)",
            )

    def _own(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        """Start the subprocess and stay alive until it ends (its parent-death signal follows this thread)."""
        try:
            self._process = subprocess.Popen(
                dying_with_parent([sys.executable, *argv]),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError) as err:  # no such cwd, exec failed
            self._start_error = f"{type(err).__name__}: {err}"
            self._started.set()
            return
        pump = threading.Thread(target=self._pump, args=("err", self._process.stderr), daemon=True)
        pump.start()
        self._started.set()
        self._pump("out", self._process.stdout)
        pump.join()
        self._process.wait()
        _signal_group(self._process.pid, signal.SIGKILL)  # what the subprocess left in its group
        self._lines.put(_DONE)

    def _pump(self, stream_name: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            self._lines.put((stream_name, raw.decode("utf-8", errors="replace").rstrip("\r\n")))
        stream.close()

    def poll(self, wait_s: float) -> tuple[list[Line], int | None]:
        """Output lines so far (waiting up to ``wait_s`` for the first) and the exit code once all is read."""
        lines: list[Line] = []
        if self._ended:
            return lines, self._process.returncode
        deadline = time.monotonic() + wait_s
        while True:
            try:
                item = self._lines.get(timeout=max(deadline - time.monotonic(), 0) if not lines else 0)
            except queue.Empty:
                return lines, None
            if item == _DONE:
                self._ended = True
                return lines, self._process.returncode
            lines.append(item)

    def stop(self, grace_period_s: float) -> tuple[list[Line], int | None]:
        """SIGTERM the subprocess's group, SIGKILL after ``grace_period_s``; then its last lines and code."""
        process = self._process
        if process is not None and process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace_period_s)
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait()
        lines, code = self.poll(2.0)
        return lines, code if code is not None else (None if process is None else process.returncode)

    def signal(self, signum: int) -> None:
        """Forward ``signum`` to the subprocess's group."""
        if self._process is not None and self._process.poll() is None:
            _signal_group(self._process.pid, signum)


def _node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside a Ray worker (tests, doctest): this host
        return "127.0.0.1"


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass
