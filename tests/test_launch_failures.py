"""A failing process ends the whole job promptly, and `torsh-jax launch` output stays readable.

Multi-process tests start real processes on 127.0.0.1 (gloo CPU collectives). The 30 s bound
is a correctness property (the job ends instead of hanging), not a benchmark; ``timeout=60`` is
only the guard that turns a hang into a failure.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torsh_jax.cli import launch_cmd
from torsh_jax.distributed.launcher import child_environment, free_port, launch

SCRIPTS = Path(__file__).parent / "scripts"
RAISES = str(SCRIPTS / "dist_rank_raises.py")
#: From the issue: any failing process must end the job within 30 s.
END_BOUND_S = 30.0
HANG_GUARD_S = 60
_LAUNCHER_PREFIXES = ("TORSH_JAX_", "JAX_", "SLURM_", "OMPI_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_")


def clean_environ() -> dict[str, str]:
    """This process's environment without any launcher's variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}


def launch_parser() -> argparse.ArgumentParser:
    """``torsh-jax`` with only the launch command; ``.launch`` is the sub-command's own parser."""
    parser = argparse.ArgumentParser(prog="torsh-jax")
    subparsers = parser.add_subparsers(dest="command", required=True)
    launch_cmd.register(subparsers)
    parser.launch = subparsers.choices["launch"]
    return parser


def rank_lines(text: str, rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


# --- A. a rank that raises ends the job -----------------------------------------------------------


@pytest.mark.slow
def test_raising_rank_ends_launch_job_and_is_named():
    argv = ["launch", "-n", "2", "--devices-per-process", "1", RAISES, "1"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torsh_jax.cli.main", *argv],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < END_BOUND_S, f"the job took {elapsed:.1f} s to end after rank 1 raised"
    failed = rank_lines(done.stderr, 1)
    assert failed[0] == "Traceback (most recent call last):", done.stderr
    assert "RuntimeError: boom from process 1" in failed
    assert "[launch] rank 1 exited with code 1; stopping 1 other process(es)" in done.stderr
    assert done.stderr.splitlines()[-1] == "[launch] job failed: rank 1 exited with code 1 first"


def torchrun_vars(rank: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def slurm_vars(rank: int, port: int) -> dict[str, str]:
    return {
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_ID": "4242",
        "MASTER_PORT": str(port),
    }


LAUNCHERS = {"torchrun": torchrun_vars, "slurm": slurm_vars}


@pytest.mark.slow
@pytest.mark.parametrize("variables", LAUNCHERS.values(), ids=LAUNCHERS.keys())
def test_raising_rank_ends_every_process_without_torsh_launch(variables):
    port = free_port()
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, RAISES, "1"],
            env={**clean_environ(), **variables(rank, port), "TORSH_JAX_DEVICES_PER_PROCESS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        results = [proc.communicate(timeout=HANG_GUARD_S) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # no-op once exited; ends a hung process when the guard fired
    elapsed = time.monotonic() - started
    (_, err0), (_, err1) = results
    assert [proc.returncode for proc in procs] == [1, 1], err0 + err1
    assert elapsed < END_BOUND_S, f"the processes took {elapsed:.1f} s to end after process 1 raised"
    assert "Traceback (most recent call last)" in err1 and "RuntimeError: boom from process 1" in err1
    assert "process 0: stopping because process 1 failed (RuntimeError: boom from process 1)" in err0


OPT_OUT = """
import sys
from torsh_jax.distributed import initialize
initialize(timeout_s=60, fail_fast=False)
print("default excepthook", sys.excepthook is sys.__excepthook__)
"""


@pytest.mark.slow
def test_fail_fast_false_installs_no_excepthook(tmp_path):
    script = tmp_path / "opt_out.py"
    script.write_text(OPT_OUT)
    out = io.StringIO()
    code = launch([str(script)], num_processes=2, devices_per_process=1, output=out, environ=clean_environ())
    assert code == 0, out.getvalue()
    for rank in (0, 1):
        assert "default excepthook True" in rank_lines(out.getvalue(), rank)


HOOK_ONLY = """
import atexit, sys
from torsh_jax.distributed.failfast import install_fail_fast

def previous(exc_type, exc, tb):
    print("previous hook saw", exc_type.__name__, flush=True)
    sys.__excepthook__(exc_type, exc, tb)

sys.excepthook = previous
atexit.register(lambda: print("interpreter shutdown ran", flush=True))
install_fail_fast(1, client=None)
raise ValueError("bad batch")
"""


def test_excepthook_chains_prints_and_skips_interpreter_shutdown():
    done = subprocess.run(
        [sys.executable, "-c", HOOK_ONLY], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert done.returncode == 1
    assert "previous hook saw ValueError" in done.stdout
    assert "ValueError: bad batch" in done.stderr and "Traceback" in done.stderr
    assert "interpreter shutdown ran" not in done.stdout  # os._exit: JAX's blocking shutdown is skipped


PEER_FAILED = """
import time
from torsh_jax.distributed.failfast import FAILED_KEY, install_fail_fast

class Store:
    def key_value_set(self, key, value):
        raise RuntimeError("ALREADY_EXISTS")
    def key_value_try_get(self, key):
        return "0\\tRuntimeError: boom" if key == FAILED_KEY else None

install_fail_fast(1, client=Store())
time.sleep(60)
"""


def test_watcher_ends_process_when_a_peer_failed():
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", PEER_FAILED], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert done.returncode == 1
    assert time.monotonic() - started < END_BOUND_S
    assert "torsh_jax: process 1: stopping because process 0 failed (RuntimeError: boom)" in done.stderr


# --- B. launch output -----------------------------------------------------------------------------

INTERLEAVER = """
import os
for i in range(50):
    os.write(1, b"out-%d-" % i)
    os.write(2, b"err-%d-" % i)
    os.write(1, b"whole\\n")
    os.write(2, b"whole\\n")
"""


def test_stdout_and_stderr_lines_stay_whole_and_prefixed(tmp_path):
    script = tmp_path / "interleave.py"
    script.write_text(INTERLEAVER)
    out, err = io.StringIO(), io.StringIO()
    assert launch([str(script)], num_processes=2, output=out, error_output=err) == 0
    for rank in (0, 1):
        assert rank_lines(out.getvalue(), rank) == [f"out-{i}-whole" for i in range(50)]
        assert rank_lines(err.getvalue(), rank) == [f"err-{i}-whole" for i in range(50)]


CHATTY = """
import os, sys
print("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
      file=sys.stderr)
print("levels", os.environ.get("TF_CPP_MIN_LOG_LEVEL"), os.environ.get("GLOG_minloglevel"))
"""


@pytest.mark.parametrize(
    ("flags", "gloo_lines", "levels"),
    [([], 0, "levels 2 2"), (["--verbose-collectives"], 1, "levels None None")],
    ids=["quiet-by-default", "verbose-collectives"],
)
def test_collectives_logs_are_quiet_unless_asked(tmp_path, capsys, monkeypatch, flags, gloo_lines, levels):
    for name in ("TF_CPP_MIN_LOG_LEVEL", "GLOG_minloglevel"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    args = launch_parser().parse_args(["launch", "-n", "1", *flags, str(script)])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert rank_lines(captured.out, 0) == [levels]
    assert captured.err.count("[Gloo] Rank 0 is connected") == gloo_lines


def test_log_levels_set_by_the_user_win():
    env = child_environment({"TF_CPP_MIN_LOG_LEVEL": "0"}, rank=0, count=2, port=29500, devices=None)
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "0" and env["GLOG_minloglevel"] == "2"


EARLY_AND_LATE = """
import os, sys, time
if os.environ["TORSH_JAX_PROCESS_ID"] == "1":
    print("rank 1 fails first", file=sys.stderr)
    sys.exit(4)
time.sleep(0.3)
sys.exit(5)
"""


def test_first_failing_rank_is_named_not_a_later_one(tmp_path):
    script = tmp_path / "early_and_late.py"
    script.write_text(EARLY_AND_LATE)
    out = io.StringIO()
    code = launch([str(script)], num_processes=2, output=out)
    assert code == 4
    launcher = [line for line in out.getvalue().splitlines() if line.startswith("[launch] ")]
    assert launcher[0] == "[launch] rank 1 exited with code 4; stopping 1 other process(es)"
    assert launcher[-1] == "[launch] job failed: rank 1 exited with code 4 first"


def test_usage_shows_script_args_as_optional():
    usage = " ".join(launch_parser().launch.format_usage().split())
    assert usage.endswith("script [script_args ...]"), usage
    assert "[--verbose-collectives]" in usage
    args = launch_parser().parse_args(["launch", "-n", "2", "train.py"])
    assert args.script == "train.py" and args.script_args == []
    args = launch_parser().parse_args(["launch", "-n", "2", "train.py", "--steps", "3"])
    assert args.script_args == ["--steps", "3"]
