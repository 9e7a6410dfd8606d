"""Launcher variables -> process layout (pure; no JAX, no processes)."""

from __future__ import annotations

import pytest
from conftest import imports_jax

from torsh_jax.distributed.env import (
    KINDS,
    LAUNCH_VARS,
    ProcessEnv,
    detect_environment,
    expand_hostlist,
    slurm_port,
)
from torsh_jax.errors import DistributedError

TORCHRUN_4x2 = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
SLURM_8x4 = {
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODELIST": "gpu[03-06]",
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_TASKS_PER_NODE": "2(x4)",
}
OMPI_4 = {
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "node7",
    "MASTER_PORT": "12345",
}
LAUNCH_2 = {
    LAUNCH_VARS["coordinator"]: "127.0.0.1:4000",
    LAUNCH_VARS["num_processes"]: "2",
    LAUNCH_VARS["process_id"]: "1",
    LAUNCH_VARS["devices_per_process"]: "4",
}

# (environ, expected fields)
DETECT_CASES = {
    "empty": ({}, dict(kind="single", num_processes=1, process_id=0, coordinator_address=None, num_nodes=1)),
    "unrelated-vars": ({"HOME": "/root", "PATH": "/bin"}, dict(kind="single", source_vars=())),
    "torchrun-4x2": (
        TORCHRUN_4x2,
        dict(
            kind="torchrun",
            num_processes=4,
            process_id=3,
            local_rank=1,
            local_world_size=2,
            num_nodes=2,
            node_rank=1,
            coordinator_address="10.0.0.1:29500",
        ),
    ),
    "torchrun-agent-store-takes-next-port": (
        {**TORCHRUN_4x2, "TORCHELASTIC_USE_AGENT_STORE": "True"},
        dict(coordinator_address="10.0.0.1:29501"),
    ),
    "torchrun-node-rank-from-rank": (
        {k: v for k, v in TORCHRUN_4x2.items() if k != "GROUP_RANK"},
        dict(node_rank=1, num_nodes=2),
    ),
    "torchrun-world-1-needs-no-master": (
        {"RANK": "0", "WORLD_SIZE": "1"},
        dict(kind="torchrun", num_processes=1, coordinator_address=None),
    ),
    "torchrun-jax-coordinator-override": (
        {**TORCHRUN_4x2, "JAX_COORDINATOR_ADDRESS": "10.9.9.9:7777"},
        dict(coordinator_address="10.9.9.9:7777"),
    ),
    "torchrun-jax-port-override": (
        {**TORCHRUN_4x2, "JAX_COORDINATOR_PORT": "31000"},
        dict(coordinator_address="10.0.0.1:31000"),
    ),
    "torchrun-ipv6-coordinator": (
        {**TORCHRUN_4x2, "JAX_COORDINATOR_ADDRESS": "[fe80::1]:1234"},
        dict(coordinator_address="[fe80::1]:1234"),
    ),
    "slurm-8x4": (
        SLURM_8x4,
        dict(
            kind="slurm",
            num_processes=8,
            process_id=5,
            local_rank=1,
            local_world_size=2,
            num_nodes=4,
            node_rank=2,
            coordinator_address="gpu03:61586",
        ),
    ),
    "slurm-master-vars-win": (
        {**SLURM_8x4, "MASTER_ADDR": "head", "MASTER_PORT": "5000"},
        dict(kind="slurm", coordinator_address="head:5000"),
    ),
    "slurm-step-nodelist-first": (
        {**SLURM_8x4, "SLURM_STEP_NODELIST": "step[09-12]"},
        dict(coordinator_address="step09:61586"),
    ),
    "slurm-uneven-tasks-per-node": (
        {
            **SLURM_8x4,
            "SLURM_NTASKS": "4",
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "0",
            "SLURM_NNODES": "2",
            "SLURM_NODEID": "1",
            "SLURM_TASKS_PER_NODE": "3,1",
        },
        dict(local_world_size=1, num_nodes=2, node_rank=1),
    ),
    "slurm-ntasks-per-node": (
        {**{k: v for k, v in SLURM_8x4.items() if k != "SLURM_TASKS_PER_NODE"}, "SLURM_NTASKS_PER_NODE": "2"},
        dict(local_world_size=2),
    ),
    "openmpi-4": (
        OMPI_4,
        dict(
            kind="openmpi",
            num_processes=4,
            process_id=2,
            local_rank=0,
            local_world_size=2,
            num_nodes=2,
            node_rank=1,
            coordinator_address="node7:12345",
        ),
    ),
    "jax-own": (
        {"JAX_COORDINATOR_ADDRESS": "10.1.1.1:8476", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
        dict(kind="jax", num_processes=2, process_id=1, coordinator_address="10.1.1.1:8476"),
    ),
    "torsh-launch": (
        LAUNCH_2,
        dict(
            kind="torsh_launch",
            num_processes=2,
            process_id=1,
            local_rank=1,
            local_world_size=2,
            num_nodes=1,
            devices_per_process=4,
            coordinator_address="127.0.0.1:4000",
        ),
    ),
    "devices-var-alone-is-single": (
        {LAUNCH_VARS["devices_per_process"]: "8"},
        dict(kind="single", devices_per_process=8, num_processes=1),
    ),
    "devices-var-with-torchrun": (
        {**TORCHRUN_4x2, LAUNCH_VARS["devices_per_process"]: "2"},
        dict(kind="torchrun", devices_per_process=2),
    ),
    "launch-beats-torchrun": ({**TORCHRUN_4x2, **LAUNCH_2}, dict(kind="torsh_launch")),
    "torchrun-beats-slurm": ({**SLURM_8x4, **TORCHRUN_4x2}, dict(kind="torchrun", process_id=3)),
    "openmpi-beats-slurm": ({**SLURM_8x4, **OMPI_4}, dict(kind="openmpi", process_id=2)),
}


@pytest.mark.parametrize(("environ", "expected"), DETECT_CASES.values(), ids=DETECT_CASES.keys())
def test_detect_environment(environ, expected):
    env = detect_environment(environ)
    assert {name: getattr(env, name) for name in expected} == expected
    assert env.kind in KINDS
    assert set(env.source_vars) <= set(environ)


# (environ, expected key, text the message or fix must contain)
ERROR_CASES = {
    "world-2-no-master-addr": (
        {"WORLD_SIZE": "2", "RANK": "0"},
        "MASTER_ADDR",
        "export MASTER_ADDR=<host of rank 0>",
    ),
    "master-addr-without-port": (
        {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"},
        "MASTER_PORT",
        "export MASTER_PORT=",
    ),
    "rank-without-world-size": ({"RANK": "0"}, "WORLD_SIZE", "export WORLD_SIZE=<integer>"),
    "rank-not-integer": ({**TORCHRUN_4x2, "RANK": "three"}, "RANK", "must be an integer"),
    "rank-out-of-range": ({**TORCHRUN_4x2, "RANK": "4"}, "RANK", "outside [0, 4)"),
    "world-size-zero": ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE", "must be >= 1"),
    "negative-rank": ({**TORCHRUN_4x2, "RANK": "-1"}, "RANK", "must be >= 0"),
    "local-rank-out-of-range": ({**TORCHRUN_4x2, "LOCAL_RANK": "2"}, "LOCAL_RANK", "outside [0, 2)"),
    "local-world-bigger-than-world": (
        {**TORCHRUN_4x2, "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0"},
        "LOCAL_RANK",
        "8 processes per node but 4",
    ),
    "group-rank-out-of-range": (
        {**TORCHRUN_4x2, "GROUP_RANK": "2"},
        "GROUP_RANK",
        "node rank 2 is outside [0, 2)",
    ),
    "bad-port": ({**TORCHRUN_4x2, "MASTER_PORT": "http"}, "MASTER_PORT", "must be an integer"),
    "port-too-large": ({**TORCHRUN_4x2, "MASTER_PORT": "70000"}, "MASTER_PORT", "1..65535"),
    "bad-jax-coordinator": (
        {**TORCHRUN_4x2, "JAX_COORDINATOR_ADDRESS": "no-port"},
        "JAX_COORDINATOR_ADDRESS",
        "host:port",
    ),
    "slurm-no-nodelist": (
        {k: v for k, v in SLURM_8x4.items() if k != "SLURM_NODELIST"},
        "SLURM_NODELIST",
        "srun",
    ),
    "slurm-no-job-id": (
        {k: v for k, v in SLURM_8x4.items() if k != "SLURM_JOB_ID"},
        "SLURM_JOB_ID",
        "export MASTER_PORT",
    ),
    "slurm-bad-hostlist": ({**SLURM_8x4, "SLURM_NODELIST": "gpu[03-06"}, "SLURM_NODELIST", "unbalanced"),
    "slurm-bad-range": ({**SLURM_8x4, "SLURM_NODELIST": "gpu[a-b]"}, "SLURM_NODELIST", "bad range"),
    "slurm-bad-tasks-per-node": (
        {**SLURM_8x4, "SLURM_TASKS_PER_NODE": "2(x"},
        "SLURM_TASKS_PER_NODE",
        "cannot parse",
    ),
    "slurm-nodeid-too-big": ({**SLURM_8x4, "SLURM_NODEID": "4"}, "SLURM_NODEID", "outside [0, 4)"),
    "slurm-localid-too-big": ({**SLURM_8x4, "SLURM_LOCALID": "2"}, "SLURM_LOCALID", "outside [0, 2)"),
    "openmpi-no-master": (
        {k: v for k, v in OMPI_4.items() if not k.startswith("MASTER")},
        "MASTER_ADDR",
        "mpirun -x MASTER_ADDR",
    ),
    "jax-no-coordinator": (
        {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
        "JAX_COORDINATOR_ADDRESS",
        "export JAX_COORDINATOR_ADDRESS",
    ),
    "jax-id-without-count": ({"JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES", "export JAX_NUM_PROCESSES"),
    "launch-partial": ({LAUNCH_VARS["process_id"]: "0"}, LAUNCH_VARS["num_processes"], "is not set"),
    "launch-no-coordinator": (
        {LAUNCH_VARS["num_processes"]: "2", LAUNCH_VARS["process_id"]: "0"},
        LAUNCH_VARS["coordinator"],
        "torsh-jax launch",
    ),
    "launch-zero-devices": (
        {**LAUNCH_2, LAUNCH_VARS["devices_per_process"]: "0"},
        "TORSH_JAX_DEVICES_PER_PROCESS",
        ">= 1",
    ),
}


@pytest.mark.parametrize(("environ", "key", "text"), ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_detect_environment_errors(environ, key, text):
    with pytest.raises(DistributedError) as info:
        detect_environment(environ)
    assert info.value.key == key
    assert text in str(info.value)


OVERRIDE_CASES = {
    "explicit-on-empty-env": (
        {},
        dict(coordinator_address="h:1", num_processes=2, process_id=1),
        dict(kind="explicit", num_processes=2, process_id=1, coordinator_address="h:1"),
    ),
    "coordinator-fills-missing-master": (
        {"WORLD_SIZE": "2", "RANK": "1"},
        dict(coordinator_address="h:2"),
        dict(kind="torchrun", coordinator_address="h:2"),
    ),
    "process-id-overrides-rank": (TORCHRUN_4x2, dict(process_id=0), dict(process_id=0)),
}


@pytest.mark.parametrize(
    ("environ", "kwargs", "expected"), OVERRIDE_CASES.values(), ids=OVERRIDE_CASES.keys()
)
def test_explicit_arguments_override(environ, kwargs, expected):
    env = detect_environment(environ, **kwargs)
    assert {name: getattr(env, name) for name in expected} == expected


def test_explicit_multi_process_without_coordinator_names_argument():
    with pytest.raises(DistributedError) as info:
        detect_environment({}, num_processes=2, process_id=0)
    assert info.value.key == "coordinator_address"


def test_explicit_process_id_out_of_range():
    with pytest.raises(DistributedError) as info:
        detect_environment({}, coordinator_address="h:1", num_processes=2, process_id=5)
    assert info.value.key == "process_id"


HOSTLISTS = {
    "single": ("node001", ["node001"]),
    "plain-list": ("a,b", ["a", "b"]),
    "range-keeps-zero-padding": ("node[01-03]", ["node01", "node02", "node03"]),
    "range-and-single": ("node[01-02,07]", ["node01", "node02", "node07"]),
    "brackets-then-host": ("gpu[1-2],login", ["gpu1", "gpu2", "login"]),
    "two-bracket-groups": ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    "suffix-after-bracket": ("n[8-9]-ib", ["n8-ib", "n9-ib"]),
    "width-grows": ("n[8-10]", ["n8", "n9", "n10"]),
}


@pytest.mark.parametrize(("text", "hosts"), HOSTLISTS.values(), ids=HOSTLISTS.keys())
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_slurm_port_matches_jax_rule():
    # jax/_src/clusters/slurm_cluster.py: job_id % 2**12 + (65535 - 2**12 + 1)
    assert slurm_port(0) == 61440
    assert slurm_port(4095) == 65535
    assert slurm_port(4096) == 61440


def test_initialize_kwargs_and_describe():
    env = detect_environment(LAUNCH_2)
    assert env.initialize_kwargs() == {
        "num_processes": 2,
        "process_id": 1,
        "coordinator_address": "127.0.0.1:4000",
        "num_cpu_devices": 4,
    }
    line = env.describe()
    assert line.startswith("torsh_launch: process 1/2") and "127.0.0.1:4000" in line
    assert "TORSH_JAX_PROCESS_ID" in line
    single = detect_environment({})
    assert single.initialize_kwargs() == {"num_processes": 1, "process_id": 0}
    assert not single.is_multi_process and env.is_multi_process


def test_reads_os_environ_by_default(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith(("SLURM_", "OMPI_", "TORSH_JAX_", "JAX_", "MASTER_")) or name in TORCHRUN_4x2:
            monkeypatch.delenv(name)
    for name, value in TORCHRUN_4x2.items():
        monkeypatch.setenv(name, value)
    assert detect_environment().process_id == 3


def test_process_env_is_frozen():
    env = detect_environment({})
    with pytest.raises(AttributeError):
        env.num_processes = 2  # type: ignore[misc]
    assert isinstance(env, ProcessEnv)


def test_env_layers_do_not_import_jax():
    assert not imports_jax(
        "import torsh_jax.distributed, torsh_jax.distributed.env, torsh_jax.distributed.launcher, "
        "torsh_jax.translate.environment, torsh_jax.cli.launch_cmd; "
        "torsh_jax.distributed.detect_environment({})"
    )
