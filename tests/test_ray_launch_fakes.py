"""``launch --ray``'s driver and rank actor against a stand-in for Ray (no cluster, no Ray import).

The stand-in answers ``wait``/``get``/``kill`` and the placement-group calls the
driver makes; each actor method returns a :class:`Ref` scripted by the test.
"""

from __future__ import annotations

import io
import signal
import threading
import time
from types import SimpleNamespace

import pytest

import torsh_jax.distributed.ray_launch as ray_launch
from torsh_jax.distributed.launcher import Attempt
from torsh_jax.distributed.ray_actor import RankProcess
from torsh_jax.errors import DistributedError


class RayError(Exception):
    pass


class RayActorError(RayError):
    pass


class WorkerCrashedError(RayError):
    pass


class GetTimeoutError(RayError, TimeoutError):
    pass


class RayTaskError(RayError):
    def __init__(self, message: str, cause: Exception | None = None):
        super().__init__(message)
        self.cause = cause


class Ref:
    """A task's result: ``value`` (or ``error`` raised by ``get``); ``ready=False``: ``wait`` does not see
    it done, ``get`` still returns it; ``hangs``: it never completes."""

    def __init__(self, value=None, *, ready=True, error=None, hangs=False):
        self.value, self.ready, self.error, self.hangs = value, ready and not hangs, error, hangs


class FakeRay:
    exceptions = SimpleNamespace(
        RayError=RayError,
        RayActorError=RayActorError,
        WorkerCrashedError=WorkerCrashedError,
        GetTimeoutError=GetTimeoutError,
    )

    def __init__(self, *, group_ready=True, kill_error=None):
        self.group = SimpleNamespace(ready=lambda: Ref(hangs=not group_ready))
        self.removed: list = []
        self.kill_error = kill_error
        self.util = SimpleNamespace(
            placement_group=lambda bundles, strategy: self.group, remove_placement_group=self.removed.append
        )

    def wait(self, refs, *, num_returns, timeout):
        ready = [ref for ref in refs if ref.ready][:num_returns]
        if len(ready) < num_returns:
            time.sleep(timeout)
        return ready, [ref for ref in refs if ref not in ready]

    def get(self, refs, timeout=None):
        if isinstance(refs, list):
            return [self.get(ref, timeout) for ref in refs]
        if refs.error is not None:
            raise refs.error
        if refs.hangs:
            time.sleep(min(timeout or 1.0, 1.0))
            raise GetTimeoutError("timed out")
        return refs.value

    def kill(self, actor, *, no_restart):
        if self.kill_error is not None:
            raise self.kill_error


class Method:
    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args, **kwargs):
        return self.answer(*args, **kwargs)


class Actor:
    """A rank's actor whose polls answer ``polls`` in turn, then ``([], None)`` not yet ready."""

    def __init__(self, *polls: Ref, start: Ref | None = None):
        answers = iter(polls)
        self.poll = Method(lambda wait_s: next(answers, Ref(([], None), ready=False)))
        self.stop = Method(lambda grace_s: Ref(([], 0)))
        self.start = Method(lambda *args, **kwargs: start or Ref(None))
        self.coordinator = Method(lambda: Ref(("10.0.0.1", 1234)))


def make_job(ray: FakeRay) -> ray_launch._RayJob:
    return ray_launch._RayJob(
        ray=ray,
        argv=["t.py"],
        devices=None,
        gpus=None,
        extra_env={},
        verbose=False,
        grace_period_s=0.1,
        exit_grace_s=60.0,
        timeout_s=None,
        deadline=None,
        out=io.StringIO(),
        err=io.StringIO(),
    )


def test_rank_process_that_cannot_start_raises_naming_the_rank(tmp_path):
    rank, caught = RankProcess(), []

    def start():
        try:
            rank.start(
                ["t.py"], overlay={"TORSH_JAX_PROCESS_ID": "3"}, defaults={}, cwd=str(tmp_path / "gone")
            )
        except DistributedError as err:
            caught.append(err)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "start() blocked on a subprocess that never started"
    [err] = caught
    assert err.key.startswith("rank 3 on ") and "cannot start t.py in" in err.message
    assert "FileNotFoundError" in err.message and "shared file system" in err.fix


def test_actor_start_error_is_reraised_naming_the_rank():
    cause = DistributedError("cannot start t.py in /x: FileNotFoundError", key="rank 1 on n2", fix="f")
    failed = Ref(error=RayTaskError("Traceback ...\nDistributedError: ...", cause=cause))
    job = make_job(FakeRay())
    with pytest.raises(DistributedError) as caught:
        job._start_ranks([Actor(), Actor(start=failed)], attempt=0)
    assert str(caught.value) == str(cause)


def test_actors_that_never_start_time_out(monkeypatch):
    monkeypatch.setattr(ray_launch, "START_TIMEOUT_S", 0.3)
    job = make_job(FakeRay())
    with pytest.raises(DistributedError, match="did not start within 0.3 s"):
        job._start_ranks([Actor(), Actor(start=Ref(hangs=True))], attempt=0)


def test_signal_during_placement_stops_the_attempt_and_removes_the_group():
    ray = FakeRay(group_ready=False)
    job = make_job(ray)
    threading.Timer(0.3, setattr, (job, "received_signal", signal.SIGTERM)).start()
    began = time.monotonic()
    assert job.attempt(0, 2) == Attempt(code=128 + signal.SIGTERM)
    assert time.monotonic() - began < 5 and ray.removed == [ray.group]
    assert "[launch] got SIGTERM; stopping all processes" in job.err.getvalue()


def test_last_lines_of_a_poll_in_flight_are_relayed_when_a_rank_fails():
    failed = Ref(([("err", "Traceback (most recent call last):"), ("err", "ValueError: boom")], 1))
    in_flight = Ref(([("err", "RuntimeError: peer gone")], None), ready=False)
    job = make_job(FakeRay())
    assert job._supervise([Actor(failed), Actor(in_flight)]) == Attempt(code=1, failed_rank=0)
    assert "[rank 1] RuntimeError: peer gone" in job.err.getvalue().splitlines()


def test_ray_task_error_of_a_poll_names_the_rank():
    broken = Ref(error=RayTaskError("Traceback (most recent call last):\n  ...\nOwnerDiedError: gone"))
    job = make_job(FakeRay())
    assert job._supervise([Actor(), Actor(broken)]) == Attempt(code=1, failed_rank=1)
    assert "[launch] rank 1: its Ray actor failed (RayTaskError): OwnerDiedError: gone" in job.err.getvalue()


def test_stop_that_raises_still_restores_signal_handlers_and_removes_the_group(monkeypatch):
    ray = FakeRay(kill_error=RuntimeError("kill failed"))
    job = make_job(ray)
    monkeypatch.setattr(job, "_create_actors", lambda group, count: [Actor(Ref(([], 0)))])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="kill failed"):
        job.attempt(0, 1)
    assert ray.removed == [ray.group] and signal.getsignal(signal.SIGTERM) is before
