"""When a save or a read fails: one error for the caller, no hang, no heap of tracebacks.

orbax runs a save as several threads and a read as many coroutines. When one part fails
(a directory that cannot be created, a full disk, a truncated array file):

* the save's other commit threads wait for a signal the failed part never sends and, not being
  daemons, keep the process from exiting (:func:`abandon_manager` releases them);
* orbax logs every failed part at ERROR with its traceback, and the other reads and writes are
  left pending, failed or never started, which Python reports one by one as they are collected
  ("Exception ignored in: <coroutine ...>", "Task exception was never retrieved", "Event loop is
  closed", "coroutine ... was never awaited"): hundreds of lines for one fault
  (:func:`quiet_orbax` silences exactly these, while a checkpointer is open or a restore runs).

The failure itself reaches the caller once, as a :class:`~torsh_jax.errors.CheckpointError`.
This relies on orbax 0.12's commit futures (``.ci/constraints.txt`` pins the version).

Example:
    >>> import sys
    >>> hook = sys.unraisablehook
    >>> with quiet_orbax():
    ...     sys.unraisablehook is not hook
    True
    >>> sys.unraisablehook is hook
    True
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import sys
import threading
import types

__all__ = ["abandon_manager", "quiet_orbax"]


def abandon_manager(manager) -> None:
    """Close a manager whose asynchronous save failed, without waiting for it: cancel the save,
    send its waiting commit threads the signals they wait for (they return at once, cancelled,
    writing nothing; the last complete step stays as it was), close what they never started."""
    from orbax.checkpoint._src.futures import future

    async_manager = getattr(getattr(manager, "_checkpointer", None), "_async_manager", None)
    commit_futures = list(getattr(async_manager, "_commit_futures", None) or [])
    threads = [t for f in commit_futures for t in _threads_of(f)]
    operations = {t._operation_id for t in threads}
    with contextlib.suppress(Exception):
        manager._checkpointer.cancel()
    for thread in threading.enumerate():
        if isinstance(thread, future._SignalingThread) and thread._operation_id in operations:
            thread.cancel()
            future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
            threads.append(thread)
    for thread in threads:
        threading.Thread.join(thread, timeout=5)  # (orbax's join re-raises the thread's error)
    _close_unstarted_coroutines([*commit_futures, *threads])
    logging.getLogger("asyncio").addFilter(_ORBAX_TASKS_LEFT)  # some are collected only at exit
    with quiet_orbax():
        with contextlib.suppress(Exception):
            manager.close()
        del commit_futures, threads
        gc.collect()  # the failed writes' tasks, unreferenced now


def _threads_of(commit_future) -> list:
    """The signalling threads behind an orbax commit future (which nests them)."""
    threads = [commit_future._t] if hasattr(commit_future, "_t") else []
    inner = [getattr(commit_future, "_f", None), *(getattr(commit_future, "_futures", None) or [])]
    return threads + [t for f in inner if f is not None for t in _threads_of(f)]


def _close_unstarted_coroutines(roots: list, depth: int = 10) -> None:
    """Close the never-started coroutines that ``roots`` (a cancelled save's futures and threads)
    hold; inner ones (arguments of outer ones) first, before closing the outer frees them."""
    seen: set[int] = set()
    unstarted = []
    frontier = list(roots)
    for _ in range(depth):
        found = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, (type, types.ModuleType)) or _is_module_dict(obj):
                continue
            seen.add(id(obj))
            if inspect.iscoroutine(obj) and inspect.getcoroutinestate(obj) == inspect.CORO_CREATED:
                unstarted.append(obj)
            found.extend(gc.get_referents(obj))
        frontier = found
    for coroutine in reversed(unstarted):
        coroutine.close()


def _is_module_dict(obj) -> bool:
    return isinstance(obj, dict) and "__builtins__" in obj


def _is_async_leftover(unraisable) -> bool:
    closed_loop = isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
        unraisable.exc_value
    )
    return (
        closed_loop or inspect.iscoroutine(unraisable.object) or isinstance(unraisable.object, asyncio.Future)
    )


def _quiet_unraisable(unraisable) -> None:
    if not _is_async_leftover(unraisable):
        _state["previous_hook"](unraisable)


class _Quiet(logging.Filter):
    """orbax's ERROR records (on the ``absl`` logger) go to DEBUG, shown only when DEBUG is on;
    asyncio's reports of leftover tasks are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return not _is_task_leftover(record)
        if record.levelno >= logging.ERROR and "orbax" in record.pathname:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class _OrbaxTasksLeft(logging.Filter):
    """After a save was abandoned: asyncio's reports of the orbax tasks it left, whenever they are
    collected (some only at exit), are dropped; other tasks' reports pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_is_task_leftover(record) and "orbax" in record.getMessage())


def _is_task_leftover(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return "never retrieved" in message or "destroyed but it is pending" in message


_ORBAX_TASKS_LEFT = _OrbaxTasksLeft()
_FILTER = _Quiet()
_LOGGERS = ("absl", "asyncio")
_state: dict = {"holders": 0, "previous_hook": None}
_lock = threading.Lock()


@contextlib.contextmanager
def quiet_orbax():
    """Within the block, and in every thread meanwhile, the noise of a failed orbax save or read
    is silenced (blocks may overlap: the last one to end restores the hooks)."""
    with _lock:
        if not _state["holders"]:
            _state["previous_hook"], sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
            for name in _LOGGERS:
                logging.getLogger(name).addFilter(_FILTER)
        _state["holders"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["holders"] -= 1
            if not _state["holders"]:
                if sys.unraisablehook is _quiet_unraisable:
                    sys.unraisablehook = _state["previous_hook"]
                for name in _LOGGERS:
                    logging.getLogger(name).removeFilter(_FILTER)
