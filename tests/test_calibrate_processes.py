"""``torsh-jax calibrate`` started as the processes of a job (``torsh-jax launch``, 2 × 2 devices
on 127.0.0.1 over gloo): each process's devices measured as one machine's, the link across the
processes as ``dcn``; process 0 writes the file and ``plan`` reads it as 2 slices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_multiprocess_train import REPO, child_environ

from torsh_jax.cli.main import main
from torsh_jax.planner.machine import Machine

pytestmark = pytest.mark.slow

#: the smallest demo model (calibrate compiles some 60 programs in each process)
MODEL = "demo:d_model=32,layers=2,vocab=32,seq_len=8"
TIMEOUT_S = 300


def test_calibrate_over_launched_processes_measures_the_link_across_them(tmp_path, capsys):
    out = tmp_path / "machine.json"
    launch = [sys.executable, "-m", "torsh_jax.cli.main", "launch", "-n", "2", "--devices-per-process", "2"]
    calibrate = ["-m", "torsh_jax", "calibrate", "--model", MODEL, "--repeats", "1", "-o", str(out)]
    calibrate += ["--global-batch", "16"]  # 4 examples per device at most: the rates at 1, 2 and 4
    done = subprocess.run(
        [*launch, "--timeout", str(TIMEOUT_S), *calibrate],
        cwd=REPO,
        env=child_environ(tmp_path / "xla"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S + 30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    spoke = [line for line in done.stdout.splitlines() if "GFLOP/s per device" in line]
    assert len(spoke) == 1 and spoke[0].startswith("[rank 0]") and "across 2 processes" in spoke[0]
    machine = Machine.load(out)
    assert (machine.devices, machine.slices) == (4, 2)
    assert machine.link("dcn") is not machine.link("ici") and machine.link("dcn").bytes_per_s > 0
    assert (machine.link("ici").medium, machine.link("dcn").medium) == ("shared memory", "loopback")
    assert machine.flops_per_s > 0 and "in 2 processes" in machine.source
    # process 0's own devices, measured as one process's are
    assert machine.link("ici").bytes_per_s > 0 and machine.update_bytes_per_s > 0
    assert machine.recompute_cost > 0  # a recomputing step's time over a plain one's
    assert set(machine.chunk_recompute_costs) == {2}  # the same with 2 layers recomputed as one chunk
    assert set(machine.chunk_gradient_bytes) == {1, 2}  # a stage's backward compiled for chunks of 1, 2
    assert all(per_token > 0 for _, per_token in machine.chunk_gradient_bytes.values())
    assert machine.remat_gradient_bytes[1] > 0 and machine.compiled_for.startswith("d_model=32,layers=2")
    assert set(machine.flops_per_s_by_tokens) == {8, 16, 32}  # at 1, 2 and 4 examples of 8
    by_tokens = machine.recompute_costs_by_tokens  # the recompute ratios at the same sizes, each chunk
    assert {k: set(costs) for k, costs in by_tokens.items()} == {1: {8, 16, 32}, 2: {8, 16, 32}}
    assert (by_tokens[1][32], by_tokens[2][32]) == (machine.recompute_cost, machine.chunk_recompute_costs[2])
    # simulated CPU devices; sharing the cores where each process's 2 outnumber its half of them
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert (machine.overlaps, machine.shared_cores) == (False, 2 > half)

    args = ["plan", "--model", MODEL, "--machine", str(out), "--global-batch", "8", "--json", "--top", "100"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["machine"]["slices"] == 2
    assert any(p["dcn"] for p in report["plans"])  # plans with an axis across the processes


def test_processes_with_different_device_counts_are_one_error():
    from types import SimpleNamespace

    from torsh_jax.errors import MeshError
    from torsh_jax.planner.calibrate import devices_per_process

    uneven = [SimpleNamespace(process_index=p) for p in (0, 0, 1)]
    with pytest.raises(MeshError, match=r"different device counts \(process 0: 2, process 1: 1\)"):
        devices_per_process(uneven)


def test_the_compile_threads_share_the_host_cores_with_the_jobs_other_processes(monkeypatch):
    """A process compiles on the cores it may use over the job's processes on its host: 2
    ``torsh-jax launch`` processes on 8 usable cores get 4 threads each, 1 alone all 8, and each of
    torchrun's 8 processes per node 1."""
    from torsh_jax.planner import cores

    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    assert cores.cpu_share({}) == 8
    launched = {
        "TORSH_JAX_NUM_PROCESSES": "2",
        "TORSH_JAX_PROCESS_ID": "1",
        "TORSH_JAX_COORDINATOR": "127.0.0.1:1234",
    }
    assert cores.cpu_share(launched) == 4
    torchrun = {"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
    torchrun |= {"MASTER_ADDR": "h0", "MASTER_PORT": "29500"}
    assert cores.cpu_share(torchrun) == 1
