"""End the whole job when one process fails (no JAX import; ``initialize()`` installs it).

Once ``jax.distributed`` runs, an uncaught exception does not end the process:
Python prints the traceback, then JAX's shutdown at interpreter exit waits for
the other processes, which wait for this one in their next collective, so the
job hangs until something kills it. :func:`install_fail_fast` changes that:

* a ``sys.excepthook`` (chaining the previous one, which prints the traceback)
  flushes the output, records ``"<process id>\\t<exception>"`` under
  :data:`FAILED_KEY` in the coordination service, and ends the process with
  ``os._exit(1)`` (130 for ``KeyboardInterrupt``), skipping the blocking shutdown;
* a daemon thread polls :data:`FAILED_KEY` every :data:`POLL_S` seconds; when
  another process recorded a failure, it says so on stderr and ends this
  process with ``os._exit(1)`` after :data:`PEER_EXIT_DELAY_S` seconds, so
  the failing process is the first to exit and launchers (``torsh-jax launch``,
  torchrun, srun) name it.

Only the first failure is recorded; a process whose own error follows it (for
example a collective that lost its peer) prints its traceback and names the
process that failed first. ``sys.exit(code)`` is not an uncaught exception and
still runs the normal, blocking shutdown.

Example:
    >>> class Store:  # stands in for the jax.distributed client
    ...     def __init__(self): self.kv = {}
    ...     def key_value_set(self, key, value): self.kv.setdefault(key, value)
    ...     def key_value_try_get(self, key): return self.kv[key]
    >>> store = Store()
    >>> record_failure(store, process_id=1, summary="RuntimeError: boom")
    >>> read_failure(store)
    (1, 'RuntimeError: boom')
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "FAILED_KEY",
    "POLL_S",
    "PEER_EXIT_DELAY_S",
    "FailFast",
    "install_fail_fast",
    "read_failure",
    "record_failure",
]

#: Coordination-service key holding the first failure, ``"<process id>\t<exception>"``.
FAILED_KEY = "torsh_jax/failed"
#: Seconds between two looks at :data:`FAILED_KEY`.
POLL_S = 0.5
#: Seconds a process waits before exiting because another one failed.
PEER_EXIT_DELAY_S = 1.0
#: Longest wait for the coordination service while failing (it may be gone).
_RECORD_TIMEOUT_S = 2.0
_SUMMARY_CHARS = 300

ExceptHook = Callable[..., Any]


class KeyValueClient(Protocol):
    """The part of JAX's distributed runtime client that is used here."""

    def key_value_set(self, key: str, value: str) -> None: ...

    def key_value_try_get(self, key: str) -> str: ...


@dataclass
class FailFast:
    """What :func:`install_fail_fast` installed in this process.

    Args:
        process_id: this process's id.
        client: the coordination-service client, or ``None`` (hook only, no peers told).
        previous_hook: the ``sys.excepthook`` that was replaced and is still called.
        stop: set at interpreter exit to end the watcher.
        watcher: the thread that ends this process when another one failed.
    """

    process_id: int
    client: KeyValueClient | None
    previous_hook: ExceptHook
    stop: threading.Event = field(default_factory=threading.Event)
    watcher: threading.Thread | None = None


def install_fail_fast(process_id: int, *, client: KeyValueClient | None) -> FailFast:
    """Make an uncaught exception in any process end this process, and the job, promptly.

    Args:
        process_id: this process's id in the job.
        client: JAX's coordination-service client; ``None`` installs only the hook
            (the other processes then wait for their launcher or JAX's heartbeat timeout).

    Returns:
        The installed state; the watcher stops itself at interpreter exit.
    """
    state = FailFast(process_id=process_id, client=client, previous_hook=sys.excepthook)
    sys.excepthook = _excepthook(state)
    if client is not None:
        state.watcher = threading.Thread(target=_watch, args=(state,), name="torsh_jax-failfast", daemon=True)
        state.watcher.start()
        # Registered after JAX's own clean-up, so it runs before it (atexit is last-in, first-out).
        atexit.register(_stop_watcher, state)
    return state


def record_failure(client: KeyValueClient, *, process_id: int, summary: str) -> None:
    """Record ``process_id``'s failure under :data:`FAILED_KEY` unless one is recorded already."""
    client.key_value_set(FAILED_KEY, f"{process_id}\t{summary}")


def read_failure(client: KeyValueClient) -> tuple[int, str] | None:
    """The first recorded failure as ``(process id, exception)``, or ``None`` (also when unreachable)."""
    try:
        raw = client.key_value_try_get(FAILED_KEY)
    except Exception:  # NOT_FOUND, or the service is gone: nothing to act on here
        return None
    process, _, summary = str(raw).partition("\t")
    return (int(process), summary) if process.isdigit() else None


def _excepthook(state: FailFast) -> ExceptHook:
    def hook(exc_type, exc, tb) -> None:
        try:
            state.previous_hook(exc_type, exc, tb)
        except Exception:
            traceback.print_exception(exc_type, exc, tb)
        first = _record_or_find_first(state, _summary(exc_type, exc))
        if first is not None and first[0] != state.process_id:
            _say(f"process {state.process_id}: this error follows process {first[0]}'s failure ({first[1]})")
            time.sleep(PEER_EXIT_DELAY_S)
        _hard_exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    return hook


def _summary(exc_type, exc) -> str:
    text = " ".join(f"{exc_type.__name__}: {exc}".split())
    return text[:_SUMMARY_CHARS]


def _record_or_find_first(state: FailFast, summary: str) -> tuple[int, str] | None:
    """Record this failure; return the first recorded one. Bounded in time: the service may be gone."""
    client = state.client
    if client is None:
        return None
    found: list[tuple[int, str] | None] = [None]

    def talk() -> None:
        try:
            record_failure(client, process_id=state.process_id, summary=summary)
        except Exception:  # ALREADY_EXISTS (another process failed first) or the service is gone
            pass
        found[0] = read_failure(client)

    talker = threading.Thread(target=talk, daemon=True)
    talker.start()
    talker.join(_RECORD_TIMEOUT_S)
    return found[0]


def _watch(state: FailFast) -> None:
    while not state.stop.wait(POLL_S):
        failure = read_failure(state.client)
        if failure is None:
            continue
        if failure[0] == state.process_id:
            return  # this process's own hook is already ending it
        _say(f"process {state.process_id}: stopping because process {failure[0]} failed ({failure[1]})")
        time.sleep(PEER_EXIT_DELAY_S)
        _hard_exit(1)


def _stop_watcher(state: FailFast) -> None:
    state.stop.set()
    if state.watcher is not None:
        state.watcher.join(timeout=_RECORD_TIMEOUT_S)


def _say(message: str) -> None:
    print(f"torsh_jax: {message}", file=sys.stderr, flush=True)


def _hard_exit(code: int) -> None:
    """Flush what Python buffered, then exit without interpreter shutdown (no blocking JAX clean-up)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not keep the process alive
            pass
    try:
        logging.shutdown()
    except Exception:
        pass
    os._exit(code)
