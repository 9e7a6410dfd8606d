"""``torsh-jax launch --ray`` on a Ray cluster this module starts on 127.0.0.1 (skipped without Ray).

The cluster (``ray start --head --block``, 4 CPUs, no dashboard, its own temp
directory) is shared by the module's tests and stopped at the end. The
training script is tests/scripts/train_multiprocess.py, as in
tests/test_multiprocess_train.py: under ``launch --ray -n 2
--devices-per-process 2`` it must train as one 4-device process, and a rank
SIGKILLed mid-run with ``--max-restarts 1`` must resume from the newest
checkpoint. After each launch no rank's actor or subprocess may be left.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from test_multiprocess_train import (  # noqa: E402
    REPO,
    RUN_TIMEOUT_S,
    SCRIPT,
    STEPS,
    assert_same_training,
    assert_two_processes_agree,
    child_environ,
    read_result,
)

from torsh_jax.distributed.launcher import free_port  # noqa: E402

pytestmark = pytest.mark.slow
#: A rank's actor process, as Ray names it (``ray::RankProcess``) while the actor lives.
ACTOR_MARK = "RankProcess"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(address, environment, head pid)`` of a one-node Ray cluster on this machine, stopped after
    the module. Ray advertises the host's own address even when asked for 127.0.0.1; nothing of it
    leaves this machine."""
    env = child_environ(tmp_path_factory.mktemp("ray_xla"))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"  # a throw-away cluster on this machine: no token to create or share
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    port = free_port()
    head = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",  # the `ray` command of this interpreter
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=4",
            "--include-dashboard=false",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_port(port, head)
        yield f"127.0.0.1:{port}", env, head.pid
    finally:
        stop_cluster(head)
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_port(port: int, head: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                time.sleep(2.0)  # the raylet registers after the GCS listens
                return
        time.sleep(0.5)
    raise AssertionError(f"the Ray head did not listen on {port} within {timeout_s} s")


def stop_cluster(head: subprocess.Popen) -> None:
    """SIGTERM the head's process group (every Ray process it started is in it), SIGKILL it after 10 s."""
    started = psutil.Process(head.pid).children(recursive=True)
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=3)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait()
    _, alive = psutil.wait_procs(started, timeout=10)
    assert alive == [], f"Ray processes left: {[p.pid for p in alive]}"


def leftovers(head_pid: int, out: Path) -> list[str]:
    """Rank actors of the cluster and processes of the run writing ``out`` still alive after 10 s."""
    found: list[str] = []
    for _ in range(40):
        actors = [p for p in psutil.Process(head_pid).children(recursive=True) if ACTOR_MARK in _cmdline(p)]
        scripts = [p for p in psutil.process_iter() if str(out) in _cmdline(p)]
        found = [_cmdline(p) for p in actors + scripts]
        if not found:
            return []
        time.sleep(0.25)
    return found


def _cmdline(process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # ended meanwhile
        return ""


def launch_ray(address: str, env: dict, out: Path, *script_flags: str, launch_flags=()) -> Run:
    argv = [
        sys.executable,
        "-m",
        "torsh_jax.cli.main",
        "launch",
        "--ray",
        address,
        "-n",
        "2",
        "--devices-per-process",
        "2",
        "--timeout",
        str(RUN_TIMEOUT_S),
        *launch_flags,
        str(SCRIPT),
        "--plan",
        "zero3",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        *script_flags,
    ]
    return start(argv, env, out)


def start(argv: list[str], env: dict, out: Path) -> Run:
    log = out.with_suffix(".log").open("w")
    return Run(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), out)


class Run:
    """A started run and where it writes its results and log."""

    def __init__(self, process: subprocess.Popen, out: Path):
        self.process, self.out = process, out

    def result(self) -> tuple[dict, str]:
        try:
            code = self.process.wait(timeout=RUN_TIMEOUT_S + 60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        log = self.out.with_suffix(".log").read_text()
        assert code == 0, f"exit {code}\n{log}"
        return read_result(self.out), log


@pytest.fixture(scope="module")
def straight(cluster, tmp_path_factory):
    """The Ray run and the single-process run of the same training (started together)."""
    address, env, _ = cluster
    root = tmp_path_factory.mktemp("ray_runs")
    single = [sys.executable, str(SCRIPT), "--plan", "zero3", "--steps", str(STEPS), "--devices", "4"]
    runs = [
        launch_ray(address, env, root / "ray.json"),
        start([*single, "--out", str(root / "one.json")], env, root / "one.json"),
    ]
    (launched, log), (one, _) = (run.result() for run in runs)
    return launched, one, log, root / "ray.json"


def test_two_ray_actors_train_as_one_process(cluster, straight):
    launched, single, log, out = straight
    assert_two_processes_agree(launched)
    assert single["process_count"] == 1 and single["devices"] == 4
    assert_same_training(launched, single)  # losses and gradient norms within 1e-5
    assert "[rank 1] step 2 loss" in log and "[rank 0] step 0 loss" in log
    assert leftovers(cluster[2], out) == []


def test_a_rank_killed_on_ray_restarts_and_resumes_from_the_newest_checkpoint(cluster, straight, tmp_path):
    """Rank 1 SIGKILLs itself in step 2 of 3 once the checkpoint of step 1 is complete; with
    --max-restarts 1 two new actors restore it and finish; the steps after equal the straight run's."""
    address, env, head_pid = cluster
    saving = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "1", "--resume", "--kill-at", "1")
    restarts = ("--max-restarts", "1", "--grace-period", "1")
    recovered, log = launch_ray(address, env, tmp_path / "r.json", *saving, launch_flags=restarts).result()
    assert "[launch] rank 1 was killed by SIGKILL; stopping 1 other process(es)" in log, log
    assert "[launch] restarting on 2 process(es) (restart 1 of 1)" in log
    assert recovered["restart"] == 1 and recovered["start_step"] == 1
    assert_two_processes_agree(recovered)
    assert recovered["losses"] == straight[0]["losses"][1:]
    assert recovered["grad_norms"] == straight[0]["grad_norms"][1:]
    assert 0 < recovered["first_step_time"] - recovered["killed_at"] < 60, "kill to first resumed step"
    assert leftovers(head_pid, tmp_path / "r.json") == []


#: Rank 1 SIGKILLs its actor's process (the subprocess's parent), as if its node were lost.
LOSE_ACTOR = """import os, signal, sys, time
print("started", flush=True)
if os.environ["TORSH_JAX_PROCESS_ID"] == "1":
    time.sleep(1)
    open(sys.argv[1], "w").write(str(time.time()))
    os.kill(os.getppid(), signal.SIGKILL)
time.sleep(120)
"""


def test_a_lost_actor_ends_the_job_quickly_and_is_named(cluster, tmp_path):
    address, env, head_pid = cluster
    script = tmp_path / "lose_actor.py"
    script.write_text(LOSE_ACTOR)
    killed_at = tmp_path / "killed_at"
    argv = [sys.executable, "-m", "torsh_jax.cli.main", "launch", "--ray", address, "-n", "2", str(script)]
    done = subprocess.run(
        [*argv, str(killed_at)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.time() - float(killed_at.read_text())
    assert done.returncode == 1, done.stderr
    assert elapsed < 30, f"the job ended {elapsed:.0f} s after rank 1's actor died"
    assert "[launch] rank 1: its Ray actor died" in done.stderr
    assert "[launch] job failed: rank 1 lost its Ray actor first" in done.stderr
    assert done.stdout.count("started") == 2
    assert leftovers(head_pid, script) == []  # rank 0 stopped; rank 1's script died with its actor
