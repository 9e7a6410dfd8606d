"""Start N local processes of one script and supervise them (no JAX import).

Like ``torchrun --standalone``: every child gets a coordinator on
127.0.0.1 and its process id through ``TORSH_JAX_*`` variables, which
:func:`torsh_jax.distributed.initialize` reads. Output lines are prefixed with
``[rank i] ``. When one child fails or is killed, the others get SIGTERM, then
SIGKILL after a grace period, and :func:`launch` returns non-zero.

Example:
    >>> import pathlib, tempfile
    >>> script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
    >>> _ = script.write_text("import os; print('id', os.environ['TORSH_JAX_PROCESS_ID'])")
    >>> import io; out = io.StringIO()
    >>> launch([str(script)], num_processes=2, output=out)
    0
    >>> sorted(out.getvalue().splitlines())
    ['[rank 0] id 0', '[rank 1] id 1']
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from torsh_jax.distributed.env import LAUNCH_VARS
from torsh_jax.errors import DistributedError

__all__ = ["launch", "free_port", "EXIT_TIMEOUT"]

#: Exit code when the whole job exceeds ``timeout_s`` (as coreutils ``timeout``).
EXIT_TIMEOUT = 124
_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def launch(
    script_and_args: Sequence[str],
    /,
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    grace_period_s: float = 5.0,
    output: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run ``python script.py ARGS`` as ``num_processes`` cooperating processes.

    Args:
        script_and_args: the script path and its arguments.
        num_processes: processes to start (ids ``0..N-1``).
        devices_per_process: simulated CPU devices per process
            (``TORSH_JAX_DEVICES_PER_PROCESS``); ``None`` leaves JAX's default.
        port: coordinator port on 127.0.0.1; ``None`` picks a free one.
        timeout_s: stop everything and return 124 after this many seconds.
        grace_period_s: seconds between SIGTERM and SIGKILL when stopping.
        output: where prefixed lines go (default ``sys.stdout``).
        environ: base environment of the children (default ``os.environ``).

    Returns:
        0 when every process exits 0; otherwise the first failure's exit code
        (``128 + signal`` for a killed process), 124 on timeout, or
        ``128 + signal`` when the launcher itself got SIGINT/SIGTERM.

    Raises:
        DistributedError: bad arguments or a missing script.
    """
    _check_arguments(script_and_args, num_processes, devices_per_process, port, timeout_s)
    chosen_port = port if port is not None else free_port()
    base = dict(os.environ if environ is None else environ)
    children = [
        _start_child(script_and_args, rank, num_processes, chosen_port, devices_per_process, base)
        for rank in range(num_processes)
    ]
    supervisor = _Supervisor(children, output or sys.stdout, grace_period_s)
    return supervisor.run(timeout_s)


def _check_arguments(
    script_and_args: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    port: int | None,
    timeout_s: float | None,
) -> None:
    if not script_and_args:
        raise DistributedError("no script given", key="script", fix="torsh-jax launch -n 2 train.py")
    script = Path(script_and_args[0])
    if not script.is_file():
        raise DistributedError("script not found", key=str(script), fix="pass the path of a Python file")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise DistributedError(f"must be >= 1, got {num_processes!r}", key="num_processes")
    if devices_per_process is not None and devices_per_process < 1:
        raise DistributedError(f"must be >= 1, got {devices_per_process}", key="devices_per_process")
    if port is not None and not 1 <= port <= 65535:
        raise DistributedError(f"must be in 1..65535, got {port}", key="port")
    if timeout_s is not None and timeout_s <= 0:
        raise DistributedError(f"must be > 0 seconds, got {timeout_s}", key="timeout")


@dataclass
class _Child:
    rank: int
    process: subprocess.Popen
    pump: threading.Thread | None = None


def _start_child(
    script_and_args: Sequence[str],
    rank: int,
    count: int,
    port: int,
    devices: int | None,
    base: dict[str, str],
) -> _Child:
    env = dict(base)
    env[LAUNCH_VARS["coordinator"]] = f"127.0.0.1:{port}"
    env[LAUNCH_VARS["num_processes"]] = str(count)
    env[LAUNCH_VARS["process_id"]] = str(rank)
    env.pop(LAUNCH_VARS["devices_per_process"], None)
    if devices is not None:
        env[LAUNCH_VARS["devices_per_process"]] = str(devices)
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        [sys.executable, *script_and_args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # own process group: stopping it reaches grandchildren too
    )
    return _Child(rank=rank, process=process)


@dataclass
class _Supervisor:
    children: list[_Child]
    output: TextIO
    grace_period_s: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    received_signal: int | None = None

    def run(self, timeout_s: float | None) -> int:
        for child in self.children:
            child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
            child.pump.start()
        previous = self._install_signal_handlers()
        try:
            code = self._watch(timeout_s)
        finally:
            self._stop_all()
            self._restore_signal_handlers(previous)
            for child in self.children:
                if child.pump is not None:
                    child.pump.join(timeout=2.0)
        return code

    def _watch(self, timeout_s: float | None) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.received_signal is not None:
                self._say(f"got {signal.Signals(self.received_signal).name}; stopping all processes")
                return 128 + self.received_signal
            codes = [child.process.poll() for child in self.children]
            failed = next((c for c, code in zip(self.children, codes, strict=True) if code), None)
            if failed is not None:
                return self._report_failure(failed)
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                self._say(f"timeout after {timeout_s} s; stopping all processes")
                return EXIT_TIMEOUT
            time.sleep(_POLL_S)

    def _report_failure(self, failed: _Child) -> int:
        code = failed.process.returncode
        if code < 0:
            how, exit_code = f"was killed by {signal.Signals(-code).name}", 128 - code
        else:
            how, exit_code = f"exited with code {code}", code
        running = sum(child.process.poll() is None for child in self.children)
        self._say(f"rank {failed.rank} {how}; stopping {running} other process(es)")
        return exit_code

    def _stop_all(self) -> None:
        live = [c for c in self.children if c.process.poll() is None]
        for child in live:
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_period_s
        while any(c.process.poll() is None for c in live) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for child in live:
            if child.process.poll() is None:
                self._say(f"rank {child.rank} ignored SIGTERM for {self.grace_period_s} s; sending SIGKILL")
                _signal_group(child.process, signal.SIGKILL)
        for child in live:
            child.process.wait()

    def _pump(self, child: _Child) -> None:
        stream = child.process.stdout
        if stream is None:
            return
        for raw in iter(stream.readline, b""):
            self._write(f"[rank {child.rank}] {raw.decode('utf-8', errors='replace').rstrip()}")
        stream.close()

    def _say(self, message: str) -> None:
        self._write(f"[launch] {message}")

    def _write(self, line: str) -> None:
        with self.lock:
            self.output.write(line + "\n")
            self.output.flush()

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    def _restore_signal_handlers(self, previous: dict[int, object]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, _frame) -> None:
        self.received_signal = signum
        for child in self.children:
            if child.process.poll() is None:
                _signal_group(child.process, signum)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
