"""Ranks end with their launcher, however it ends (no JAX import; stdlib only).

``launch`` starts each rank as the leader of a process group of its own, so one signal to the
group reaches the rank and the processes it started. Two guards stop the groups when the
launcher itself dies without stopping them (SIGKILL, a crash, the OOM killer):

* :class:`Reaper`, a small process in a session of its own, started before the first rank. The
  launcher tells it through a pipe which groups run. When the launcher ends, the kernel closes
  the pipe; the reaper reads end of file, sends SIGKILL to every group still listed, says so
  on stderr in one line and exits. A launcher that ends normally has released every group, so
  its reaper exits without a signal. This works on every POSIX system (Linux and macOS).
* :func:`dying_with_parent` (Linux only): the rank starts through this file, which asks the
  kernel (``PR_SET_PDEATHSIG``) for SIGKILL when the launcher thread that started it ends, then
  execs the rank's command in the same process. The second line, should the reaper be killed
  together with the launcher; it reaches the rank only, not its children. (No Python code runs
  between fork and exec in the launcher, which may be a multithreaded JAX program.)

A process that leaves its rank's group (``setsid``, ``start_new_session=True``) escapes both.

Example:
    >>> reaper = Reaper.start()
    >>> reaper.adopt(12345, rank=0)   # a rank's process group id, as launch would pass it
    True
    >>> reaper.release(12345)
    >>> reaper.close()
    0
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence

__all__ = ["Reaper", "dying_with_parent"]

#: ``prctl`` option: the signal a process gets when its parent thread ends (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
#: First argument of this file run as a command: arm the death signal, then exec the rest.
_EXEC = "exec"
#: Longest wait for the reaper to exit once the launcher closed its pipe.
_CLOSE_TIMEOUT_S = 5.0


class Reaper:
    """The launcher's side of the reaper process: ``adopt`` a group when a rank starts,
    ``release`` it once the rank ended and its group was swept, ``close`` at the end."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self._lock = threading.Lock()  # ranks are adopted and released from several threads

    @classmethod
    def start(cls) -> Reaper:
        """Start the reaper process (isolated mode: it imports nothing outside the stdlib)."""
        process = subprocess.Popen(
            [sys.executable, "-I", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # not reached by a signal to the launcher's process group
        )
        return cls(process)

    def adopt(self, pgid: int, /, *, rank: int) -> bool:
        """List process group ``pgid`` (rank ``rank``); ``False`` when the reaper is gone."""
        return self._send(f"+ {pgid} {rank}\n")

    def release(self, pgid: int, /) -> None:
        """Forget ``pgid``: its rank ended and nothing of its group is left to stop."""
        self._send(f"- {pgid}\n")

    def close(self) -> int:
        """Close the pipe (the reaper stops the groups still listed) and wait; its exit code."""
        with self._lock:
            try:
                self.process.stdin.close()
            except OSError:  # the reaper was gone already
                pass
        try:
            return self.process.wait(timeout=_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def _send(self, line: str) -> bool:
        with self._lock:
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
            except (OSError, ValueError):  # broken pipe: the reaper was killed; closed: after close()
                return False
        return True


def dying_with_parent(command: Sequence[str], /) -> list[str]:
    """``command`` run so that it gets SIGKILL when the thread that starts it ends (Linux).

    Elsewhere ``command`` unchanged (macOS has no such call; the reaper alone guards the ranks).

    Example:
        >>> dying_with_parent(["python", "train.py"])[-2:]
        ['python', 'train.py']
    """
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", __file__, _EXEC, str(os.getpid()), *command]


def _arm_and_exec(parent: int, command: list[str]) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher ended before the call above took effect
        os.kill(os.getpid(), signal.SIGKILL)
    os.execv(command[0], command)


def serve(commands: Iterable[bytes]) -> list[str]:
    """The reaper's loop: follow ``+ PGID RANK`` and ``- PGID`` lines until end of file, then
    SIGKILL every group still listed; returns the ranks whose group still had processes."""
    groups: dict[int, str] = {}
    for raw in commands:
        words = raw.decode(errors="replace").split()
        if len(words) < 2 or not words[1].isdigit():
            continue  # a line cut short by the launcher's death
        if words[0] == "+":
            groups[int(words[1])] = words[2] if len(words) > 2 else "?"
        elif words[0] == "-":
            groups.pop(int(words[1]), None)
    return [rank for pgid, rank in groups.items() if _kill_group(pgid)]


def _kill_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _main() -> None:
    if sys.argv[1:2] == [_EXEC]:
        _arm_and_exec(int(sys.argv[2]), sys.argv[3:])
    killed = serve(sys.stdin.buffer)
    if killed:
        try:
            print(
                f"[launch] the launcher ended; killed rank(s) {', '.join(killed)}",
                file=sys.stderr,
                flush=True,
            )
        except OSError:  # nobody reads the launcher's stderr any more
            pass


if __name__ == "__main__":
    _main()
