"""Start N local processes of one script and supervise them (no JAX import).

Like ``torchrun --standalone``: every child gets a coordinator on
127.0.0.1 and its process id through ``TORSH_JAX_*`` variables, which
:func:`torsh_jax.distributed.initialize` reads. Each child's stdout and stderr
are read line by line in threads and written whole, prefixed ``[rank i] ``
(stdout lines to ``output``, stderr lines to ``error_output``); gloo/XLA C++
log chatter is quieted unless ``verbose_collectives``. When one child fails or
is killed, the others get SIGTERM, then SIGKILL after a grace period, and
:func:`launch` returns the code of the child that ended first with a failure,
naming its rank. A child still running ``exit_grace_s`` seconds after another
one exited 0 is named and stopped the same way. Each child leads a process group
of its own; what a child leaves in its group is killed when it ends, and every
group is killed when the launcher dies, even by SIGKILL
(:mod:`torsh_jax.distributed.reaper`).

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
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from torsh_jax.distributed.env import LAUNCH_VARS, join_host_port
from torsh_jax.distributed.env_sources import RESTART_VAR
from torsh_jax.distributed.reaper import Reaper, dying_with_parent
from torsh_jax.errors import DistributedError

__all__ = [
    "launch",
    "free_port",
    "child_environment",
    "is_collectives_chatter",
    "EXIT_TIMEOUT",
    "DEFAULT_EXIT_GRACE_S",
    "RESTART_VAR",
    "QUIET_LOG_LEVELS",
    "Attempt",
    "run_attempts",
    "how_it_ended",
    "check_launch_arguments",
]

#: Exit code when the whole job exceeds ``timeout_s`` (as coreutils ``timeout``), or a
#: process is still running ``exit_grace_s`` after another one exited 0.
EXIT_TIMEOUT = 124
#: Seconds the other processes get to exit once one exited 0.
DEFAULT_EXIT_GRACE_S = 60.0
#: The first element of ``script_and_args`` that runs the next as a module (``python -m``).
MODULE_FLAG = "-m"
#: Child variables that quiet XLA/TSL (absl) and glog C++ logs to errors (unless already set).
QUIET_LOG_LEVELS = {"TF_CPP_MIN_LOG_LEVEL": "2", "GLOG_minloglevel": "2"}
#: gloo prints one such line per process when its collectives connect, whatever the log level.
_CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
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
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S,
    output: TextIO | None = None,
    error_output: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
    verbose_collectives: bool = False,
    max_restarts: int = 0,
    min_processes: int | None = None,
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
        exit_grace_s: once a process exited 0, the others must exit within this
            many seconds; those still running are then named and stopped, and
            :func:`launch` returns 124 (no restart: the job's work ended).
        output: where the children's prefixed stdout lines go (default ``sys.stdout``).
        error_output: where their prefixed stderr lines and the launcher's own
            ``[launch] `` lines go (default: ``output`` when given, else ``sys.stderr``).
        environ: base environment of the children (default ``os.environ``).
        verbose_collectives: keep gloo/XLA C++ INFO and WARNING logs; by default
            the children get :data:`QUIET_LOG_LEVELS` (unless ``environ`` sets
            them) and gloo's per-connection lines are dropped.
        max_restarts: when a process fails, stop the others and start all of
            them again, up to this many times (each attempt gets a fresh port
            and ``TORSH_JAX_RESTART`` = the attempt number, 0 first). The script
            resumes itself, e.g. from its newest checkpoint. A timeout or a
            signal to the launcher ends the job without restarting.
        min_processes: with restarts, each restart drops the process that
            failed (as if its host were lost) while more than this many are
            left; the script re-resolves its plan for the devices present
            (:func:`torsh_jax.checkpoint.continue_plan`). ``None``: every
            restart starts all ``num_processes`` again.

    Returns:
        0 when every process exits 0; otherwise the exit code of the process
        that failed first (``128 + signal`` for a killed process), 124 on
        timeout or a process still running ``exit_grace_s`` after another one
        finished, or ``128 + signal`` when the launcher itself got SIGINT/SIGTERM.

    Raises:
        DistributedError: bad arguments or a missing script.
    """
    check_launch_arguments(
        script_and_args,
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        port=port,
        timeout_s=timeout_s,
        grace_period_s=grace_period_s,
        exit_grace_s=exit_grace_s,
        max_restarts=max_restarts,
        min_processes=min_processes,
    )
    base = os.environ if environ is None else environ
    out = sys.stdout if output is None else output
    err = error_output if error_output is not None else (sys.stderr if output is None else output)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    reaper = Reaper.start()  # before the first process: none may outlive the launcher
    say = _Supervisor(out, err, grace_period_s, reaper)._say

    def attempt_once(attempt: int, count: int) -> Attempt:
        chosen_port = port if port is not None else free_port()
        layout = {"count": count, "port": chosen_port, "devices": devices_per_process}
        envs = [
            {**child_environment(base, rank=rank, verbose_collectives=verbose_collectives, **layout),
             RESTART_VAR: str(attempt)}
            for rank in range(count)
        ]  # fmt: skip
        supervisor = _Supervisor(
            out, err, grace_period_s, reaper, exit_grace_s, verbose_collectives=verbose_collectives
        )
        code = supervisor.run(script_and_args, envs, timeout_s, deadline)
        failed = supervisor.first_failure
        return Attempt(code=code, failed_rank=None if failed is None else failed.rank)

    try:
        return run_attempts(
            attempt_once,
            num_processes=num_processes,
            max_restarts=max_restarts,
            min_processes=min_processes,
            say=say,
        )
    finally:
        reaper.close()


@dataclass(frozen=True)
class Attempt:
    """How one start of all processes ended: the job's exit code and the rank that failed first
    (``None``: all exited 0, or the job was stopped by a timeout or a signal: no restart)."""

    code: int
    failed_rank: int | None = None


def run_attempts(
    attempt_once: Callable[[int, int], Attempt],
    /,
    *,
    num_processes: int,
    max_restarts: int,
    min_processes: int | None,
    say: Callable[[str], None],
) -> int:
    """Run ``attempt_once(attempt, count)`` until it succeeds, is stopped or restarts run out.

    The restart rule every backend shares: after a failure, start again (up to
    ``max_restarts`` times), each time one process fewer (the failed one, as if
    its host were lost) while more than ``min_processes`` are left; ``None``
    keeps ``num_processes``. Returns the last attempt's exit code.

    Example:
        >>> codes = iter([Attempt(1, failed_rank=1), Attempt(0)])
        >>> run_attempts(lambda attempt, count: next(codes), num_processes=2, max_restarts=1,
        ...              min_processes=1, say=print)
        restarting on 1 process(es) (rank 1 dropped, restart 1 of 1)
        0
    """
    _check_restarts(max_restarts, min_processes, num_processes)
    fewest = num_processes if min_processes is None else min_processes
    count = num_processes
    for attempt in range(max_restarts + 1):
        result = attempt_once(attempt, count)
        if result.code == 0 or result.failed_rank is None or attempt == max_restarts:
            return result.code  # done, timed out, stopped by a signal, or out of restarts
        next_count = max(fewest, count - 1)
        lost = f"rank {result.failed_rank} dropped, " if next_count < count else ""
        say(f"restarting on {next_count} process(es) ({lost}restart {attempt + 1} of {max_restarts})")
        count = next_count
    return result.code


def check_launch_arguments(
    script_and_args: Sequence[str],
    /,
    *,
    num_processes: int,
    devices_per_process: int | None,
    port: int | None,
    timeout_s: float | None,
    grace_period_s: float,
    exit_grace_s: float,
    max_restarts: int,
    min_processes: int | None,
) -> None:
    """Check what every launch backend takes (see :func:`launch`) before anything starts.

    Raises:
        DistributedError: naming the argument (``num_processes``, ``port``, ...) and its fix.
    """
    _check_arguments(script_and_args, num_processes, devices_per_process, port, timeout_s)
    _check_seconds(grace_period_s, key="grace_period", zero_ok=True, default=5.0)
    _check_seconds(exit_grace_s, key="exit_grace", zero_ok=False, default=DEFAULT_EXIT_GRACE_S)
    _check_restarts(max_restarts, min_processes, num_processes)


def _check_seconds(value: float, *, key: str, zero_ok: bool, default: float) -> None:
    """``value`` must be a number of seconds > 0 (>= 0 with ``zero_ok``); NaN is refused."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not (value >= 0 if zero_ok else value > 0):
        bound = ">= 0" if zero_ok else "> 0"
        flag = "--" + key.replace("_", "-")
        raise DistributedError(
            f"must be {bound} seconds, got {value!r}",
            key=key,
            fix=f"pass {flag} as a number of seconds {bound} (default {default:g})",
        )


def _check_restarts(max_restarts: int, min_processes: int | None, num_processes: int) -> None:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise DistributedError(
            f"must be an integer >= 0, got {max_restarts!r}",
            key="max_restarts",
            fix="pass --max-restarts as 0 or more",
        )
    if min_processes is None:
        return
    if isinstance(min_processes, bool) or not isinstance(min_processes, int):
        raise DistributedError(f"must be an integer, got {min_processes!r}", key="min_processes",
                               fix=f"pass --min-processes in 1..{num_processes}")  # fmt: skip
    if not 1 <= min_processes <= num_processes:
        raise DistributedError(
            f"must be in 1..{num_processes} (the -n processes started), got {min_processes}",
            key="min_processes",
            fix=f"pass --min-processes in 1..{num_processes}, with --max-restarts 1 or more",
        )


def _check_module(named: Sequence[str]) -> None:
    """``python -m`` can find the module ``named[0]`` (its parent packages are imported to look)."""
    import importlib.util

    try:
        found = bool(named) and importlib.util.find_spec(named[0]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise DistributedError(
            "module not found" if named else "no module given",
            key=named[0] if named else "-m",
            fix="pass -m and an importable module, e.g. -m torsh_jax calibrate",
        )


def _check_arguments(
    script_and_args: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    port: int | None,
    timeout_s: float | None,
) -> None:
    if not script_and_args:
        raise DistributedError("no script given", key="script", fix="torsh-jax launch -n 2 train.py")
    if script_and_args[0] == MODULE_FLAG:
        _check_module(script_and_args[1:2])
    elif not Path(script_and_args[0]).is_file():
        raise DistributedError(
            "script not found", key=script_and_args[0], fix="pass the path of a Python file (or -m MODULE)"
        )
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise DistributedError(
            f"must be >= 1, got {num_processes!r}",
            key="num_processes",
            fix="pass -n/--num-processes as a positive integer",
        )
    if devices_per_process is not None and devices_per_process < 1:
        raise DistributedError(
            f"must be >= 1, got {devices_per_process}",
            key="devices_per_process",
            fix="pass --devices-per-process as a positive integer",
        )
    if port is not None and not 1 <= port <= 65535:
        raise DistributedError(
            f"must be in 1..65535, got {port}",
            key="port",
            fix="pass --port in 1..65535, or leave it out to pick a free port",
        )
    if timeout_s is not None and not timeout_s > 0:  # NaN too
        raise DistributedError(
            f"must be > 0 seconds, got {timeout_s}",
            key="timeout",
            fix="pass --timeout as a positive number of seconds",
        )


@dataclass
class _Child:
    rank: int
    process: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)


def child_environment(
    base: Mapping[str, str],
    *,
    rank: int,
    count: int,
    port: int,
    devices: int | None,
    verbose_collectives: bool = False,
    host: str = "127.0.0.1",
) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` plus the ``TORSH_JAX_*`` layout variables.

    The coordinator is ``host:port`` (rank 0's host; an IPv6 address in brackets).

    Unless ``verbose_collectives``, ``TF_CPP_MIN_LOG_LEVEL`` and ``GLOG_minloglevel``
    default to ``2`` (XLA/gloo C++ errors only; a value already in ``base`` wins).

    Example:
        >>> env = child_environment({}, rank=1, count=2, port=29500, devices=None)
        >>> env["TORSH_JAX_COORDINATOR"], env["TORSH_JAX_PROCESS_ID"], env["TF_CPP_MIN_LOG_LEVEL"]
        ('127.0.0.1:29500', '1', '2')
    """
    env = dict(base)
    env[LAUNCH_VARS["coordinator"]] = join_host_port(host, port)
    env[LAUNCH_VARS["num_processes"]] = str(count)
    env[LAUNCH_VARS["process_id"]] = str(rank)
    env.pop(LAUNCH_VARS["devices_per_process"], None)
    if devices is not None:
        env[LAUNCH_VARS["devices_per_process"]] = str(devices)
    env["PYTHONUNBUFFERED"] = "1"
    if not verbose_collectives:
        for name, level in QUIET_LOG_LEVELS.items():
            env.setdefault(name, level)
    return env


def is_collectives_chatter(line: str) -> bool:
    """Whether ``line`` is a gloo/XLA start-up line that ``launch`` drops unless asked to be verbose.

    Example:
        >>> is_collectives_chatter("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number ...")
        True
        >>> is_collectives_chatter("step 3 loss 1.25")
        False
    """
    return _CHATTER.match(line) is not None


def _start_child(script_and_args: Sequence[str], rank: int, env: dict[str, str]) -> _Child:
    process = subprocess.Popen(
        dying_with_parent([sys.executable, *script_and_args]),  # Linux: SIGKILL when this thread ends
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # own process group: stopping it reaches grandchildren too
    )
    return _Child(rank=rank, process=process)


@dataclass
class _Supervisor:
    output: TextIO
    error_output: TextIO
    grace_period_s: float
    reaper: Reaper
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S
    verbose_collectives: bool = False
    children: list[_Child] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    exits: queue.Queue = field(default_factory=queue.Queue)
    received_signal: int | None = None
    first_failure: _Child | None = None

    def run(
        self,
        script_and_args: Sequence[str],
        envs: list[dict[str, str]],
        timeout_s: float | None,
        deadline: float | None = None,
    ) -> int:
        """Start one child per environment, supervise them, stop them all; returns the exit code."""
        previous = self._install_signal_handlers()  # first: a signal must never orphan children
        try:
            for rank, env in enumerate(envs):
                self.children.append(_start_child(script_and_args, rank, env))
                if not self.reaper.adopt(self.children[-1].process.pid, rank=rank):
                    self._say(f"the reaper process is gone: rank {rank} would outlive a killed launcher")
                self._start_threads(self.children[-1])
            code = self._watch(timeout_s, deadline)
        finally:
            self._stop_all()
            self._restore_signal_handlers(previous)
            for child in self.children:
                for thread in child.threads:
                    thread.join(timeout=2.0)
        if self.first_failure is not None:
            self._say(f"job failed: rank {self.first_failure.rank} {_how(self.first_failure)} first")
        return code

    def _start_threads(self, child: _Child) -> None:
        targets = (
            (self._pump, (child, child.process.stdout, self.output)),
            (self._pump, (child, child.process.stderr, self.error_output)),
            (self._wait, (child,)),
        )
        for target, args in targets:
            thread = threading.Thread(target=target, args=args, daemon=True)
            thread.start()
            child.threads.append(thread)

    def _wait(self, child: _Child) -> None:
        _wait_unreaped(child.process)
        _signal_group(child.process, signal.SIGKILL)  # what the process left in its group
        self.reaper.release(child.process.pid)
        child.process.wait()
        self.exits.put(child)  # in the order the processes ended

    def _watch(self, timeout_s: float | None, deadline: float | None = None) -> int:
        """Wait for the children until ``deadline`` (monotonic); ``timeout_s`` is what the user asked for."""
        if deadline is None and timeout_s is not None:
            deadline = time.monotonic() + timeout_s
        running = len(self.children)
        finished: tuple[_Child, float] | None = None  # the first process that exited 0, and when
        while running:
            if self.received_signal is not None:
                self._say(f"got {signal.Signals(self.received_signal).name}; stopping all processes")
                return 128 + self.received_signal
            if deadline is not None and time.monotonic() > deadline:
                self._say(f"timeout after {timeout_s} s; stopping all processes")
                return EXIT_TIMEOUT
            late = self._late(finished)
            if late:
                return self._report_late(late, finished[0])
            try:
                ended = self.exits.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if self.received_signal is not None:
                continue  # ended by the signal forwarded to it: reported as such on the next turn
            if ended.process.returncode != 0:
                return self._report_failure(ended)
            running -= 1
            finished = finished or (ended, time.monotonic())
        return 0

    def _late(self, finished: tuple[_Child, float] | None) -> list[int]:
        """Ranks still running ``exit_grace_s`` after ``finished`` exited 0 (none before then)."""
        if finished is None or time.monotonic() <= finished[1] + self.exit_grace_s:
            return []
        return [child.rank for child in self.children if child.process.poll() is None]

    def _report_late(self, late: list[int], finished: _Child) -> int:
        which = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
        self._say(
            f"{which} still running {self.exit_grace_s:g} s after rank {finished.rank} exited 0; "
            f"stopping {'it' if len(late) == 1 else 'them'} (--exit-grace)"
        )
        return EXIT_TIMEOUT

    def _report_failure(self, failed: _Child) -> int:
        self.first_failure = failed
        code = failed.process.returncode
        running = sum(child.process.returncode is None for child in self.children)
        self._say(f"rank {failed.rank} {_how(failed)}; stopping {running} other process(es)")
        return 128 - code if code < 0 else code

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

    def _pump(self, child: _Child, stream, sink: TextIO) -> None:
        """Copy ``stream`` to ``sink`` one whole line at a time, each prefixed ``[rank N] ``."""
        if stream is None:
            return
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if self.verbose_collectives or not is_collectives_chatter(line):
                self._write(sink, f"[rank {child.rank}] {line}")
        stream.close()

    def _say(self, message: str) -> None:
        self._write(self.error_output, f"[launch] {message}")

    def _write(self, sink: TextIO, line: str) -> None:
        with self.lock:  # one lock for both sinks: lines never interleave, even on one terminal
            sink.write(line + "\n")
            sink.flush()

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


def _how(child: _Child) -> str:
    return how_it_ended(child.process.returncode)


def how_it_ended(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL`` (a negative ``returncode``: the signal).

    Example:
        >>> how_it_ended(-9), how_it_ended(1), how_it_ended(-40)
        ('was killed by SIGKILL', 'exited with code 1', 'was killed by signal 40')
    """
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a real-time or otherwise unnamed signal
        return f"was killed by signal {-returncode}"


def _wait_unreaped(process: subprocess.Popen) -> None:
    """Wait until ``process`` ends but leave it unreaped: its pid, the id of its process group,
    cannot be reused meanwhile, so signalling the group reaches only what the process left there."""
    if not hasattr(os, "waitid"):  # a platform without it: the group's remaining members hold its id
        process.wait()
        return
    try:
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped already by a poll() from another thread
        pass


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
