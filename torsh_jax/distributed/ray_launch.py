"""``torsh-jax launch --ray``: run a script as N processes on a Ray cluster, with ``launch``'s rules.

One actor per process, each in a bundle of its own of a placement group
spread over the nodes (``SPREAD``); the actor runs ``python SCRIPT ARGS`` as a
subprocess whose environment carries the layout (``TORSH_JAX_COORDINATOR`` =
rank 0's node address and a port free there, ``TORSH_JAX_NUM_PROCESSES``,
``TORSH_JAX_PROCESS_ID``, ``TORSH_JAX_RESTART``), so
:func:`torsh_jax.distributed.initialize` reads it as under the local launcher.
Output lines come back prefixed ``[rank N] ``. A rank that fails, or whose
actor dies (its node lost), stops the others and is named; restarts and
shrinking follow :func:`~torsh_jax.distributed.launcher.run_attempts`, each
attempt with new actors in a new placement group. Ray is imported only here,
on first use (``pip install 'torsh-jax[ray]'``).

Example (on a machine of a running cluster):
    $ torsh-jax launch --ray auto -n 2 --devices-per-process 2 train.py --steps 10

or from Python, ``ray_launch(["train.py", "--steps", "10"], num_processes=2)``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from torsh_jax.distributed.launcher import (
    DEFAULT_EXIT_GRACE_S,
    EXIT_TIMEOUT,
    MODULE_FLAG,
    QUIET_LOG_LEVELS,
    RESTART_VAR,
    Attempt,
    check_launch_arguments,
    child_environment,
    how_it_ended,
    is_collectives_chatter,
    run_attempts,
)
from torsh_jax.errors import DistributedError

__all__ = ["ray_launch", "import_ray", "EXIT_ACTOR_LOST"]

#: Exit code of a rank whose Ray actor died (its node or worker process was lost).
EXIT_ACTOR_LOST = 1
#: What :meth:`_RayJob._collect` returns for a lost actor (no process returns it).
_LOST = 1 << 16
#: Seconds to wait for the placement group's bundles before giving up.
PLACEMENT_TIMEOUT_S = 120.0
#: Seconds to wait for the actors to answer and start their subprocesses.
START_TIMEOUT_S = 120.0
#: Seconds to wait for a poll still in flight when the ranks are stopped (a poll waits ``_POLL_S``).
_DRAIN_S = 2.0
_POLL_S = 0.2


class _Interrupted(Exception):
    """SIGINT or SIGTERM came while the launch was setting up."""


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`DistributedError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise DistributedError(
            "Ray is not installed", key="--ray", fix="pip install 'torsh-jax[ray]'"
        ) from None
    return ray


def ray_launch(
    script_and_args: Sequence[str],
    /,
    *,
    num_processes: int,
    address: str | None = None,
    devices_per_process: int | None = None,
    gpus_per_process: int | None = None,
    timeout_s: float | None = None,
    grace_period_s: float = 5.0,
    exit_grace_s: float = DEFAULT_EXIT_GRACE_S,
    max_restarts: int = 0,
    min_processes: int | None = None,
    environ: Mapping[str, str] | None = None,
    output: TextIO | None = None,
    error_output: TextIO | None = None,
    verbose_collectives: bool = False,
) -> int:
    """Run ``python script.py ARGS`` as ``num_processes`` Ray actors' subprocesses; returns the exit code.

    Args:
        script_and_args: the script (a path every node can read, e.g. on a
            shared file system) and its arguments.
        num_processes: processes (actors) to start.
        address: the cluster, as ``ray.init`` takes it (``"auto"``,
            ``"ray://head:10001"``, ``"10.0.0.1:6379"``); ``None``: the one
            ``ray.init()`` finds or starts. Ignored when Ray is already initialized.
        devices_per_process: simulated CPU devices per process.
        gpus_per_process: GPUs in each process's bundle (Ray sets ``CUDA_VISIBLE_DEVICES``).
        timeout_s, grace_period_s, exit_grace_s, max_restarts, min_processes,
        verbose_collectives: as :func:`torsh_jax.distributed.launcher.launch`.
        environ: variables set in every process on top of its worker's
            environment (default: none).
        output: where the prefixed stdout lines go (default ``sys.stdout``).
        error_output: stderr lines and ``[launch] `` lines (default ``sys.stderr``).

    Returns:
        As :func:`~torsh_jax.distributed.launcher.launch`; a rank whose actor
        died counts as exiting with :data:`EXIT_ACTOR_LOST`.

    Raises:
        DistributedError: bad arguments, Ray missing, no cluster at
            ``address``, or resources for the bundles missing.
    """
    check_launch_arguments(
        script_and_args,
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        port=None,
        timeout_s=timeout_s,
        grace_period_s=grace_period_s,
        exit_grace_s=exit_grace_s,
        max_restarts=max_restarts,
        min_processes=min_processes,
    )
    if gpus_per_process is not None and (isinstance(gpus_per_process, bool) or gpus_per_process < 1):
        raise DistributedError(
            f"must be >= 1, got {gpus_per_process!r}", key="gpus_per_process", fix="pass --gpus-per-process 1"
        )
    ray = import_ray()
    started_here = _connect(ray, address)
    job = _RayJob(
        ray=ray,
        argv=_argv(script_and_args),
        devices=devices_per_process,
        gpus=gpus_per_process,
        extra_env=dict(environ or {}),
        verbose=verbose_collectives,
        grace_period_s=grace_period_s,
        exit_grace_s=exit_grace_s,
        timeout_s=timeout_s,
        deadline=None if timeout_s is None else time.monotonic() + timeout_s,
        out=sys.stdout if output is None else output,
        err=error_output if error_output is not None else (sys.stderr if output is None else output),
    )
    try:
        return run_attempts(
            job.attempt,
            num_processes=num_processes,
            max_restarts=max_restarts,
            min_processes=min_processes,
            say=job.say,
        )
    finally:
        if started_here:
            ray.shutdown()


def _connect(ray: Any, address: str | None) -> bool:
    """``ray.init`` unless already initialized; whether this call did it."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except ConnectionError as err:
        raise DistributedError(
            f"no Ray cluster at {address or 'auto'}: {' '.join(str(err).split())[:200]}",
            key="--ray",
            fix="start one with `ray start --head`, or pass --ray ADDRESS (head:6379 or ray://head:10001)",
        ) from None
    return True


@dataclass
class _RayJob:
    """The attempts of one Ray launch: each creates actors, supervises them and removes them."""

    ray: Any
    argv: list[str]
    devices: int | None
    gpus: int | None
    extra_env: dict[str, str]
    verbose: bool
    grace_period_s: float
    exit_grace_s: float
    timeout_s: float | None
    deadline: float | None
    out: TextIO
    err: TextIO
    lock: threading.Lock = field(default_factory=threading.Lock)
    received_signal: int | None = None

    def say(self, message: str) -> None:
        self._write(self.err, f"[launch] {message}")

    def _write(self, sink: TextIO, line: str) -> None:
        with self.lock:
            sink.write(line + "\n")
            sink.flush()

    def attempt(self, attempt: int, count: int) -> Attempt:
        """Start ``count`` actors (attempt number ``attempt``), supervise them, remove them."""
        bundle = {"CPU": 1, **({"GPU": self.gpus} if self.gpus else {})}
        group = self.ray.util.placement_group([bundle] * count, strategy="SPREAD")
        try:
            previous = _install_signal_handlers(self._on_signal)
            try:
                return self._run(group, bundle, count, attempt)
            finally:
                _restore_signal_handlers(previous)
        finally:
            self.ray.util.remove_placement_group(group)

    def _run(self, group: Any, bundle: dict, count: int, attempt: int) -> Attempt:
        """Place, create and start the actors, supervise them; stop them whatever happens."""
        actors: list[Any] = []
        try:
            self._wait_ready(group, count, bundle)
            actors = self._create_actors(group, count)
            self._start_ranks(actors, attempt)
            return self._supervise(actors)
        except _Interrupted:
            return self._signalled()
        finally:
            self._stop(actors)

    def _get(self, refs: Any, *, timeout_s: float) -> Any:
        """``ray.get(refs)``, waited for in ``_POLL_S`` slices so that a signal is seen meanwhile.

        Raises:
            _Interrupted: SIGINT or SIGTERM came.
            TimeoutError: not all of ``refs`` ready within ``timeout_s``.
        """
        waiting = list(refs) if isinstance(refs, list) else [refs]
        deadline = time.monotonic() + timeout_s
        while waiting:
            if self.received_signal is not None:
                raise _Interrupted
            if time.monotonic() > deadline:
                raise TimeoutError
            _, waiting = self.ray.wait(waiting, num_returns=len(waiting), timeout=_POLL_S)
        return self.ray.get(refs)

    def _wait_ready(self, group: Any, count: int, bundle: dict) -> None:
        try:
            self._get(group.ready(), timeout_s=PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            raise DistributedError(
                f"{count} bundles of {bundle} not placed within {PLACEMENT_TIMEOUT_S:g} s",
                key="--ray",
                fix="lower -n or --gpus-per-process, or add nodes to the cluster (`ray status` shows them)",
            ) from None

    def _create_actors(self, group: Any, count: int) -> list[Any]:
        """One actor per bundle of ``group``, bundle ``i`` for rank ``i``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from torsh_jax.distributed.ray_actor import RankProcess

        remote = self.ray.remote(RankProcess)
        return [
            remote.options(
                num_cpus=1,
                num_gpus=self.gpus or 0,
                max_concurrency=2,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(count)
        ]

    def _start_ranks(self, actors: list[Any], attempt: int) -> None:
        """Ask rank 0's actor for the coordinator, then start every rank's subprocess."""
        try:
            host, port = self._get(actors[0].coordinator.remote(), timeout_s=START_TIMEOUT_S)
            defaults = {} if self.verbose else QUIET_LOG_LEVELS
            starts = []
            for rank, actor in enumerate(actors):
                layout = child_environment(
                    self.extra_env,
                    rank=rank,
                    count=len(actors),
                    port=port,
                    devices=self.devices,
                    verbose_collectives=True,
                    host=host,
                )
                overlay = {**layout, RESTART_VAR: str(attempt)}
                starts.append(
                    actor.start.remote(self.argv, overlay=overlay, defaults=defaults, cwd=os.getcwd())
                )
            self._get(starts, timeout_s=START_TIMEOUT_S)
        except TimeoutError:
            raise DistributedError(
                f"the ranks' actors did not start within {START_TIMEOUT_S:g} s",
                key="--ray",
                fix="check the cluster with `ray status`; lower -n if its nodes are busy",
            ) from None
        except self.ray.exceptions.RayError as err:
            raise _start_error(err) from None

    def _supervise(self, actors: list[Any]) -> Attempt:
        """Relay output until all ranks exited 0, one failed, time ran out or a signal came."""
        pending = {actor.poll.remote(_POLL_S): rank for rank, actor in enumerate(actors)}
        try:
            return self._watch(actors, pending)
        finally:
            self._drain(pending)

    def _watch(self, actors: list[Any], pending: dict) -> Attempt:
        """:meth:`_supervise`'s loop; ``pending`` holds the polls in flight (poll ref -> rank)."""
        finished: tuple[int, float] | None = None  # the first rank that exited 0, and when
        while pending:
            stopped = self._stopped(finished, pending)
            if stopped is not None:
                return stopped
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                rank = pending.pop(ref)
                code = self._collect(ref, rank)
                if code is None:
                    pending[actors[rank].poll.remote(_POLL_S)] = rank
                elif code != 0:
                    return self._report_failure(rank, code, running=len(pending))
                else:
                    finished = finished or (rank, time.monotonic())
        return Attempt(code=0)

    def _drain(self, pending: dict) -> None:
        """Relay the lines of polls still in flight (they may hold a rank's last lines, a traceback)."""
        deadline = time.monotonic() + _DRAIN_S  # for all of them: a stuck actor costs no more
        for ref, rank in pending.items():
            try:
                lines, _ = self.ray.get(ref, timeout=max(deadline - time.monotonic(), 0))
            except self.ray.exceptions.RayError:  # the actor is gone, or the poll is stuck
                continue
            self._relay(rank, lines)

    def _collect(self, ref: Any, rank: int) -> int | None:
        """Write a poll's lines; its exit code (a negative one for a signal), or ``None`` while running."""
        try:
            lines, code = self.ray.get(ref)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.WorkerCrashedError) as err:
            self.say(f"rank {rank}: its Ray actor died ({type(err).__name__}): node or worker lost")
            return _LOST
        except self.ray.exceptions.RayError as err:  # RayTaskError, ObjectLostError, OwnerDiedError, ...
            self.say(f"rank {rank}: its Ray actor failed ({type(err).__name__}): {_last_line(err)}")
            return _LOST
        self._relay(rank, lines)
        return code

    def _relay(self, rank: int, lines: list[tuple[str, str]]) -> None:
        for stream, text in lines:
            if self.verbose or not is_collectives_chatter(text):
                self._write(self.out if stream == "out" else self.err, f"[rank {rank}] {text}")

    def _signalled(self) -> Attempt:
        self.say(f"got {signal.Signals(self.received_signal).name}; stopping all processes")
        return Attempt(code=128 + self.received_signal)

    def _stopped(self, finished: tuple[int, float] | None, pending: dict) -> Attempt | None:
        if self.received_signal is not None:
            return self._signalled()
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.say(f"timeout after {self.timeout_s} s; stopping all processes")
            return Attempt(code=EXIT_TIMEOUT)
        if finished is not None and time.monotonic() > finished[1] + self.exit_grace_s:
            late = ", ".join(str(rank) for rank in sorted(pending.values()))
            self.say(
                f"rank(s) {late} still running {self.exit_grace_s:g} s after rank {finished[0]} "
                "exited 0; stopping (--exit-grace)"
            )
            return Attempt(code=EXIT_TIMEOUT)
        return None

    def _report_failure(self, rank: int, code: int, *, running: int) -> Attempt:
        how = "lost its Ray actor" if code == _LOST else how_it_ended(code)
        self.say(f"rank {rank} {how}; stopping {running} other process(es)")
        self.say(f"job failed: rank {rank} {how} first")
        exit_code = EXIT_ACTOR_LOST if code == _LOST else 128 - code if code < 0 else code
        return Attempt(code=exit_code, failed_rank=rank)

    def _stop(self, actors: list[Any]) -> None:
        """Stop every rank's subprocess (SIGTERM, then SIGKILL), relay its last lines, kill the actors."""
        stops = {actor.stop.remote(self.grace_period_s): rank for rank, actor in enumerate(actors)}
        for ref, rank in stops.items():
            try:
                lines, _ = self.ray.get(ref, timeout=self.grace_period_s + 10)
                self._relay(rank, lines)
            except Exception:  # the actor is gone already, or stuck: killed below either way
                pass
        for actor in actors:
            self.ray.kill(actor, no_restart=True)

    def _on_signal(self, signum: int, _frame) -> None:
        self.received_signal = signum


def _start_error(err: Exception) -> DistributedError:
    """A failed start: the actor's own :class:`DistributedError` (naming the rank), or Ray's last line."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, DistributedError):
        return DistributedError(cause.message, key=cause.key, fix=cause.fix)
    return DistributedError(
        f"an actor did not start: {_last_line(err)}",
        key="--ray",
        fix="install torsh-jax[ray] (this version) on every node of the cluster",
    )


def _last_line(err: Exception) -> str:
    """The last non-empty line of ``err``'s message (where Ray puts the cause), at most 200 characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:200]


def _install_signal_handlers(handler) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _argv(script_and_args: Sequence[str]) -> list[str]:
    """What each actor runs after ``python``: the script by its absolute path (the actors' working
    directory may differ), or ``-m MODULE`` as given."""
    if script_and_args[0] == MODULE_FLAG:
        return list(script_and_args)
    return [os.path.abspath(script_and_args[0]), *script_and_args[1:]]
