"""Real multi-process training: ``torsh-jax launch -n 2 --devices-per-process 2`` equals one process with 4 devices.

Each run is a subprocess of tests/scripts/train_multiprocess.py (the demo
language model, adamw, 3 steps, identical parameters and batches everywhere).
The single-process reference uses ``--devices 4`` and, for hybrid plans,
simulates the 2 slices with consecutive device groups; under the launcher
each process is one slice. Runs are cached per module, so every configuration
starts once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "train_multiprocess.py"
STEPS = 3
RTOL = 1e-5
#: Seconds one run may take before it counts as hung (launch --timeout and subprocess timeout).
RUN_TIMEOUT_S = 150

pytestmark = pytest.mark.slow


def child_environ() -> dict[str, str]:
    """The test's environment without launcher variables (children set their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORSH_JAX_", "JAX_COORDINATOR"))}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_training(out: Path, *, plan: str, launched: bool, local_batches: bool = False) -> dict:
    """Train ``plan`` once; returns process 0's JSON plus ``ranks`` (every process's JSON)."""
    script = [str(SCRIPT), "--plan", plan, "--steps", str(STEPS), "--out", str(out)]
    if local_batches:
        script.append("--local-batches")
    if launched:
        cli = [sys.executable, "-m", "torsh_jax.cli.main", "launch", "-n", "2", "--devices-per-process", "2"]
        argv = [*cli, "--timeout", str(RUN_TIMEOUT_S), *script]
    else:
        argv = [sys.executable, *script, "--devices", "4"]
    done = subprocess.run(
        argv, cwd=REPO, env=child_environ(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 30
    )
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    result = json.loads(out.read_text())
    ranks = [result]
    for rank in range(1, result["process_count"]):
        ranks.append(json.loads(out.with_name(f"{out.name}.rank{rank}").read_text()))
    return {**result, "ranks": ranks}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(plan, launched=..., local_batches=...)``: each configuration trains once per module."""
    cache: dict[tuple, dict] = {}
    root = tmp_path_factory.mktemp("multiprocess_train")

    def get(plan: str, *, launched: bool, local_batches: bool = False) -> dict:
        key = (plan, launched, local_batches)
        if key not in cache:
            name = f"{plan}-{'launch' if launched else 'single'}{'-local' if local_batches else ''}.json"
            cache[key] = run_training(root / name, plan=plan, launched=launched, local_batches=local_batches)
        return cache[key]

    return get


def assert_same_training(got: dict, want: dict) -> None:
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
    np.testing.assert_allclose(got["grad_norms"], want["grad_norms"], rtol=RTOL)
    assert got["mesh"] == want["mesh"]


def assert_two_processes_agree(run: dict) -> None:
    """Both processes ran 2 x 2 devices and read identical replicated metrics."""
    assert run["process_count"] == 2 and run["devices"] == 4
    first, second = run["ranks"]
    assert first["losses"] == second["losses"] and first["grad_norms"] == second["grad_norms"]


def test_ddp_two_processes_equal_one_process_with_four_devices(runs):
    launched, single = runs("ddp", launched=True), runs("ddp", launched=False)
    assert single["process_count"] == 1 and single["devices"] == 4
    assert_two_processes_agree(launched)
    assert launched["mesh"] == {"data": 4, "stage": 1, "fsdp": 1, "tensor": 1}
    assert_same_training(launched, single)
    assert launched["losses"][-1] < launched["losses"][0], "the model did not learn"


HYBRID = {
    # plan: (mesh shape, owning process of every mesh position in launched runs)
    "ddp_2slice": ({"data": 4, "stage": 1, "fsdp": 1, "tensor": 1}, [0, 0, 1, 1]),
    "hsdp": ({"data": 2, "stage": 1, "fsdp": 2, "tensor": 1}, [[0, 0], [1, 1]]),
}


@pytest.mark.parametrize("plan", HYBRID)
def test_two_slice_hybrid_mesh_one_slice_per_process(runs, plan):
    shape, owners = HYBRID[plan]
    launched, single = runs(plan, launched=True), runs(plan, launched=False)
    assert_two_processes_agree(launched)
    assert launched["mesh"] == shape
    # data is the slice (DCN) axis: each process owns one slice of the mesh.
    processes = np.asarray(launched["mesh_processes"]).reshape([shape[a] for a in ("data", "fsdp")])
    np.testing.assert_array_equal(processes, np.asarray(owners).reshape(processes.shape))
    assert np.all(np.asarray(single["mesh_processes"]) == 0)
    assert_same_training(launched, single)


def test_zero3_two_processes_equal_one_process(runs):
    launched, single = runs("zero3", launched=True), runs("zero3", launched=False)
    assert_two_processes_agree(launched)
    assert launched["mesh"] == {"data": 1, "stage": 1, "fsdp": 4, "tensor": 1}
    assert_same_training(launched, single)


def test_process_local_batches_equal_global_batches(runs):
    """Each process loads only its rows (global_batch_from_local) over a data x fsdp mesh."""
    local = runs("hsdp", launched=True, local_batches=True)
    assert local["local_batches"]
    assert_two_processes_agree(local)
    assert_same_training(local, runs("hsdp", launched=True))
