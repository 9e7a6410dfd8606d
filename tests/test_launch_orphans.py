"""No process of a `torsh-jax launch` job outlives it: not when the launcher is killed with SIGKILL,
not when one rank never exits after another finished.

Each rank is a tiny script that starts a child of its own and prints both pids, so every test
checks the ranks and their children.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torsh_jax.cli import launch_cmd
from torsh_jax.distributed.launcher import EXIT_TIMEOUT, launch
from torsh_jax.errors import DistributedError

#: From the issue: after the launcher is killed, no rank (nor a child of one) is alive within 5 s.
ORPHAN_BOUND_S = 5.0
#: Guard against a hang; a correct run ends well before it.
HANG_GUARD_S = 60

WITH_CHILD = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("pids", os.getpid(), child.pid, flush=True)
if os.environ["TORSH_JAX_PROCESS_ID"] in os.environ.get("FINISHING_RANKS", "").split(","):
    sys.exit(0)
time.sleep(120)
"""


def write_script(tmp_path: Path) -> str:
    path = tmp_path / "with_child.py"
    path.write_text(WITH_CHILD)
    return str(path)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (ended, not yet reaped by its new parent) counts as ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): signal 0 only says the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def pids_of(lines: list[str]) -> list[int]:
    return [int(pid) for line in lines if "] pids " in line for pid in line.split()[-2:]]


def lines_until_ranks_ready(launcher: subprocess.Popen) -> list[str]:
    """The launcher's output lines up to the one where both ranks and their children printed pids."""
    lines: list[str] = []
    while len(pids_of(lines)) < 4:
        line = launcher.stdout.readline()
        assert line, "the launcher ended before its ranks were ready:\n" + "".join(lines)
        lines.append(line)
    return lines


def wait_until_dead(pids: list[int], bound_s: float) -> list[int]:
    """The pids still alive after ``bound_s`` seconds (checked every 50 ms)."""
    deadline = time.monotonic() + bound_s
    alive = [pid for pid in pids if is_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if is_alive(pid)]
    return alive


def kill_leftovers(pids: list[int]) -> None:
    """Test clean-up: ends what a failing run left behind."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkill_of_the_launcher_ends_every_rank_and_its_children(tmp_path):
    code = (
        "import sys; from torsh_jax.distributed.launcher import launch; "
        f"sys.exit(launch([{write_script(tmp_path)!r}], num_processes=2))"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = lines_until_ranks_ready(launcher)
        pids = pids_of(lines)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=HANG_GUARD_S)
        survivors = wait_until_dead(pids, ORPHAN_BOUND_S)
        assert survivors == [], f"alive {ORPHAN_BOUND_S} s after the launcher was killed: {survivors}"
        rest, _ = launcher.communicate(timeout=HANG_GUARD_S)  # the reaper shares the launcher's stderr
        assert "[launch] the launcher ended; killed rank(s) 0, 1" in rest.splitlines(), rest
    finally:
        launcher.kill()
        kill_leftovers(pids_of(lines))
        launcher.stdout.close()


def children_of(pid: int) -> list[int]:
    """Linux: the pids whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_ranks_die_with_the_launcher_even_when_the_reaper_dies_with_it(tmp_path):
    """The second guard alone: the kernel's parent-death signal ends the ranks (not their children)."""
    code = (
        "import sys; from torsh_jax.distributed.launcher import launch; "
        f"sys.exit(launch([{write_script(tmp_path)!r}], num_processes=2))"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        lines = lines_until_ranks_ready(launcher)
        ranks = pids_of(lines)[::2]
        (reaper,) = set(children_of(launcher.pid)) - set(ranks)
        os.kill(reaper, signal.SIGKILL)
        launcher.send_signal(signal.SIGKILL)
        assert wait_until_dead(ranks, ORPHAN_BOUND_S) == []
    finally:
        launcher.kill()
        kill_leftovers(pids_of(lines))
        launcher.stdout.close()


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="torsh-jax")
    launch_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_rank_still_running_after_another_finished_is_named_and_stopped(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FINISHING_RANKS", "0,2")
    grace = 1.0
    started = time.monotonic()
    flags = ["--exit-grace", str(grace), "--grace-period", "1", "--max-restarts", "1"]
    code = run_cli(["launch", "-n", "3", *flags, write_script(tmp_path)])
    elapsed = time.monotonic() - started
    captured = capsys.readouterr()
    try:
        assert code == EXIT_TIMEOUT, captured.err
        assert elapsed < grace + 5.0, f"launch took {elapsed:.1f} s with --exit-grace {grace}"
        launcher = [line for line in captured.err.splitlines() if line.startswith("[launch] ")]
        assert len(launcher) == 1, captured.err  # one line, and no restart: the job's work ended
        assert launcher[0].startswith("[launch] rank 1 still running ") and "stopping it" in launcher[0]
        assert " after rank 0 exited 0" in launcher[0] or " after rank 2 exited 0" in launcher[0]
        # every rank and every child of a rank is gone once launch returns, also the children of
        # the ranks that exited 0 (their process group is swept when they end)
        assert [pid for pid in pids_of(captured.out.splitlines()) if is_alive(pid)] == []
        assert len(pids_of(captured.out.splitlines())) == 6
    finally:
        kill_leftovers(pids_of(captured.out.splitlines()))


def test_ranks_that_all_finish_within_the_exit_grace_succeed(tmp_path):
    script = tmp_path / "staggered.py"
    script.write_text("import os, time\ntime.sleep(0.5 * int(os.environ['TORSH_JAX_PROCESS_ID']))\n")
    out = io.StringIO()
    assert launch([str(script)], num_processes=2, exit_grace_s=3.0, output=out) == 0, out.getvalue()
    assert "[launch]" not in out.getvalue()


@pytest.mark.parametrize("grace", [0.0, -1.0, float("nan")], ids=["zero", "negative", "nan"])
def test_exit_grace_must_be_positive(tmp_path, grace):
    script = tmp_path / "noop.py"
    script.write_text("")
    with pytest.raises(DistributedError) as info:
        launch([str(script)], num_processes=1, exit_grace_s=grace)
    assert info.value.key == "exit_grace" and "--exit-grace" in info.value.fix
