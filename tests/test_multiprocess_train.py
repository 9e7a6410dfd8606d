"""Real multi-process training: ``torsh-jax launch -n 2 --devices-per-process 2`` == one 4-device process.

Each run is a subprocess of tests/scripts/train_multiprocess.py (the demo
language model, adamw, 3 steps, identical parameters and batches everywhere).
The single-process reference uses ``--devices 4`` and, for hybrid plans,
simulates the 2 slices with consecutive device groups; under the launcher
each process is one slice. Runs are cached per module, so every configuration
starts once, and all runs share a persistent compilation cache (identical
programs, e.g. the parameter initialisation, compile once per module).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "train_multiprocess.py"
STEPS = 3
RTOL = 1e-5
#: Seconds one run may take before it counts as hung (launch --timeout and subprocess timeout).
RUN_TIMEOUT_S = 150

pytestmark = pytest.mark.slow


def child_environ(cache_dir: Path) -> dict[str, str]:
    """The test's environment without launcher variables (children set their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORSH_JAX_", "JAX_COORDINATOR"))}
    env["JAX_PLATFORMS"] = "cpu"
    # Device counts come from --devices / --devices-per-process only.
    flags = env.pop("XLA_FLAGS", "").split()
    kept = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    if kept:
        env["XLA_FLAGS"] = " ".join(kept)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


class Config(NamedTuple):
    """One training run: a plan, under the launcher or not, with global or process-local batches."""

    plan: str
    launched: bool
    local_batches: bool = False
    devices_per_process: int = 2
    extra: tuple[str, ...] = ()
    launch_flags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        local = "-local" if self.local_batches else ""
        extra = "".join(a.strip("-").split("/")[-1] for a in self.extra)
        where = "launch" if self.launched else "single"
        return f"{Path(self.plan).stem}-{where}{local}-{self.devices_per_process}{extra}"

    def argv(self, out: Path) -> list[str]:
        script = [str(SCRIPT), "--plan", self.plan, "--steps", str(STEPS), "--out", str(out)]
        if self.local_batches:
            script.append("--local-batches")
        script += list(self.extra)
        per_process = str(self.devices_per_process)
        if not self.launched:
            return [sys.executable, *script, "--devices", str(2 * self.devices_per_process)]
        cli = [sys.executable, "-m", "torsh_jax.cli.main", "launch", "-n", "2"]
        cli += ["--devices-per-process", per_process, *self.launch_flags]
        return [*cli, "--timeout", str(RUN_TIMEOUT_S), *script]


def read_result(out: Path) -> dict:
    """Process 0's JSON plus ``ranks`` (every process's JSON)."""
    result = json.loads(out.read_text())
    ranks = [result]
    for rank in range(1, result["process_count"]):
        ranks.append(json.loads(out.with_name(f"{out.name}.rank{rank}").read_text()))
    assert [r["traces"] for r in ranks] == [1] * len(ranks), "the train step retraced"
    killed = out.with_name(f"{out.name}.killed")  # written by a process that killed itself
    return {**result, "ranks": ranks, "killed_at": float(killed.read_text()) if killed.exists() else None}


def run_concurrently(configs: list[Config], root: Path) -> dict[Config, dict]:
    """Start every run at once (a launched job leaves a core idle while one process compiles)."""
    started = []
    for config in configs:
        out, log = root / f"{config.name}.json", root / f"{config.name}.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(
                config.argv(out),
                cwd=REPO,
                env=child_environ(root / "xla"),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        started.append((config, proc, out, log))
    results = {}
    try:
        for config, proc, out, log in started:
            code = proc.wait(timeout=RUN_TIMEOUT_S + 30)
            assert code == 0, f"{' '.join(config.argv(out))} exited {code}\n{log.read_text()}"
            results[config] = read_result(out)
    finally:
        stop_all([proc for _, proc, _, _ in started])
    return results


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (the launcher forwards it to its processes), then SIGKILL whatever is left."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(config, ...)``: the results in order; each configuration trains once per module."""
    cache: dict[Config, dict] = {}
    root = tmp_path_factory.mktemp("multiprocess_train")

    def get(*configs: Config) -> list[dict]:
        cache.update(run_concurrently([c for c in configs if c not in cache], root))
        return [cache[c] for c in configs]

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


HYBRID = {
    # plan: (mesh shape, owning process of every mesh position in launched runs)
    "ddp_2slice": ({"data": 4, "stage": 1, "fsdp": 1, "tensor": 1}, [0, 0, 1, 1]),
    "hsdp": ({"data": 2, "stage": 1, "fsdp": 2, "tensor": 1}, [[0, 0], [1, 1]]),
}


@pytest.mark.parametrize("plan", HYBRID)
def test_two_slice_hybrid_mesh_one_slice_per_process(runs, plan):
    """Two processes equal one 4-device process (DDP across processes: ``ddp_2slice``; a mesh that is
    not hybrid across processes: the ZeRO-3, fsdp x tensor and pipeline tests)."""
    shape, owners = HYBRID[plan]
    launched, single = runs(Config(plan, launched=True), Config(plan, launched=False))
    assert single["process_count"] == 1 and single["devices"] == 4
    assert_two_processes_agree(launched)
    assert launched["losses"][-1] < launched["losses"][0], "the model did not learn"
    assert launched["mesh"] == shape
    # data is the slice (DCN) axis: each process owns one slice of the mesh.
    processes = np.asarray(launched["mesh_processes"]).reshape([shape[a] for a in ("data", "fsdp")])
    np.testing.assert_array_equal(processes, np.asarray(owners).reshape(processes.shape))
    assert np.all(np.asarray(single["mesh_processes"]) == 0)
    assert_same_training(launched, single)


def test_zero3_two_processes_equal_one_process(runs):
    launched, single = runs(Config("zero3", launched=True), Config("zero3", launched=False))
    assert_two_processes_agree(launched)
    assert launched["mesh"] == {"data": 1, "stage": 1, "fsdp": 4, "tensor": 1}
    assert_same_training(launched, single)


def test_process_local_batches_equal_global_batches(runs):
    """Each process loads only its rows (global_batch_from_local), the batch split over data x fsdp."""
    local, placed = runs(Config("hsdp", launched=True, local_batches=True), Config("hsdp", launched=True))
    assert local["local_batches"]
    assert_two_processes_agree(local)
    assert_same_training(local, placed)


def test_fsdp_tp_tensor_inside_each_process_fsdp_across_them(runs):
    """ZeRO-3 x tensor parallelism, 2 processes x 4 devices: every tensor pair is inside one
    process, the fsdp axis (4) crosses the processes; equal to one 8-device process."""
    launched, single = runs(
        Config("fsdp_tp", launched=True, devices_per_process=4),
        Config("fsdp_tp", launched=False, devices_per_process=4),
    )
    assert launched["process_count"] == 2 and launched["devices"] == 8
    first, second = launched["ranks"]
    assert first["losses"] == second["losses"] and first["grad_norms"] == second["grad_norms"]
    assert launched["mesh"] == {"data": 1, "stage": 1, "fsdp": 4, "tensor": 2}
    processes = np.asarray(launched["mesh_processes"]).reshape(4, 2)  # [fsdp, tensor]
    assert all(len(set(row)) == 1 for row in processes.tolist()), processes
    assert processes[:, 0].tolist() == [0, 0, 1, 1], processes
    assert_same_training(launched, single)


#: Rank 0, blocked in a collective with the killed rank, ignores the launcher's SIGTERM; SIGKILL it after
#: 1 s instead of the default 5 (the grace period itself is tests/test_launch.py's)
SIGKILL_SOON = ("--grace-period", "1")


def test_a_killed_process_restarts_the_job_which_resumes_from_its_checkpoint(runs, tmp_path):
    """launch --max-restarts 1: rank 1 is SIGKILLed in step 2 of 3; 2 new processes restore the
    newest checkpoint (every process wrote its shards after step 1) and finish; the steps after
    equal a straight run's bit for bit."""
    saving = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "1", "--resume")
    restarts = ("--max-restarts", "1", *SIGKILL_SOON)
    config = Config("zero3", launched=True, extra=(*saving, "--kill-at", "1"), launch_flags=restarts)
    (straight,) = runs(Config("zero3", launched=True))
    (recovered,) = runs(config)
    # the checkpoint of step 1 was complete when rank 1 died in step 2 (the SIGKILLs during saves
    # are benchmarks/bench_checkpoint.py's)
    assert recovered["restart"] == 1 and recovered["start_step"] == 1, recovered["start_step"]
    assert_two_processes_agree(recovered)
    assert recovered["losses"] == straight["losses"][1:]
    assert recovered["grad_norms"] == straight["grad_norms"][1:]
    assert 0 < recovered["first_step_time"] - recovered["killed_at"] < 60, "kill to first resumed step"


def test_a_restart_on_fewer_processes_continues_with_the_same_global_batch(runs, tmp_path):
    """launch --max-restarts 1 --min-processes 1: rank 1 is SIGKILLed in step 2 of 3 and the job
    continues on the one process left: ZeRO-3 over 2 devices instead of 4, the state resharded
    onto them, 2 accumulation steps keeping the global batch; losses follow the straight run."""
    saving = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "1", "--resume")
    restarts = ("--max-restarts", "1", "--min-processes", "1", *SIGKILL_SOON)
    config = Config("zero3", launched=True, extra=(*saving, "--kill-at", "1"), launch_flags=restarts)
    (straight,) = runs(Config("zero3", launched=True))
    (recovered,) = runs(config)
    assert recovered["restart"] == 1 and recovered["process_count"] == 1 and recovered["devices"] == 2
    assert recovered["mesh"]["fsdp"] == 2 and recovered["batch"] == [8, 2, 32]
    assert straight["batch"] == [8, 1, 32]
    assert recovered["start_step"] == 1 and len(recovered["losses"]) == STEPS - 1
    np.testing.assert_allclose(recovered["losses"], straight["losses"][1:], rtol=RTOL)
    np.testing.assert_allclose(recovered["grad_norms"], straight["grad_norms"][1:], rtol=RTOL)


#: ZeRO-2 over fsdp 2 x a 1F1B pipeline over 2 stages (one per process), 2 micro-batches
PIPELINE_PLAN = REPO / "tests" / "scripts" / "pipeline_2x2.toml"


def test_pipeline_stages_across_processes_equal_one_process(runs):
    """2 processes x 2 devices: stage 0 in process 0, stage 1 in process 1, so every activation and
    its gradient crosses the processes; equal to one 4-device process."""
    plan = str(PIPELINE_PLAN)
    launched, single = runs(Config(plan, launched=True), Config(plan, launched=False))
    assert launched["process_count"] == 2 and launched["devices"] == 4
    assert launched["mesh"] == {"data": 1, "stage": 2, "fsdp": 2, "tensor": 1}
    processes = np.asarray(launched["mesh_processes"]).reshape(2, 2)  # [stage, fsdp]
    assert processes.tolist() == [[0, 0], [1, 1]], processes
    first, second = launched["ranks"]
    assert first["losses"] == second["losses"]
    assert_same_training(launched, single)
