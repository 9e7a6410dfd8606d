"""Launcher environments -> TranslationResult (notes, layout extras, plan)."""

from __future__ import annotations

import pytest

from torsh_jax.errors import TranslationError
from torsh_jax.plan.spec import AxisSize, MeshSpec
from torsh_jax.translate.environment import RECOGNISED, translate_environment
from torsh_jax.translate.result import STATUSES

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "ROLE_RANK": "5",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "OMP_NUM_THREADS": "1",
    "NCCL_DEBUG": "INFO",
    "HOME": "/root",
}
SLURM = {
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODELIST": "cn[001-004]",
    "SLURM_JOB_ID": "100",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "0",
    "SLURM_CPUS_PER_TASK": "16",
}


def _notes(result) -> dict[str, tuple[str, str]]:
    return {n.key: (n.status, n.detail) for n in result.notes}


def test_torchrun_layout_and_initialize_kwargs():
    result = translate_environment(TORCHRUN)
    assert result.kind == "env" and result.source == "<env>"
    extras = result.extras
    assert (extras["num_processes"], extras["process_id"], extras["local_world_size"]) == (8, 5, 4)
    assert (extras["num_nodes"], extras["node_rank"], extras["kind"]) == (2, 1, "torchrun")
    assert extras["coordinator_address"] == "10.0.0.1:29500"
    assert extras["initialize_kwargs"] == {
        "num_processes": 8,
        "process_id": 5,
        "coordinator_address": "10.0.0.1:29500",
    }


def test_every_recognised_variable_gets_one_note_and_others_none():
    result = translate_environment(TORCHRUN)
    notes = _notes(result)
    assert len(notes) == len(result.notes)  # one note per key
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR"):
        assert notes[name][0] == "mapped", name
    for name in ("ROLE_RANK", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS", "NCCL_DEBUG"):
        assert notes[name][0] == "ignored" and notes[name][1], name
    assert "HOME" not in notes
    assert all(n.status in STATUSES for n in result.notes)


def test_multi_node_plan_has_one_dcn_slice_per_node():
    result = translate_environment(TORCHRUN)
    assert result.plan.mesh == MeshSpec(data=AxisSize(ici=-1, dcn=2))
    status, detail = _notes(result)["num_nodes"]
    assert status == "approximated" and "one slice per node" in detail
    assert result.plan.mesh.resolve(16, num_slices=2).shape["data"] == 16


def test_single_node_plan_is_default_mesh():
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    result = translate_environment(env)
    assert result.plan.mesh == MeshSpec()
    assert "num_nodes" not in _notes(result)


def test_slurm_layout_and_unused_recognised_vars():
    env = {**SLURM, "RANK_UNRELATED": "x"}
    result = translate_environment(env)
    assert result.extras["coordinator_address"] == "cn001:61540"
    assert result.extras["num_nodes"] == 4 and result.plan.mesh.data.dcn == 4
    notes = _notes(result)
    assert notes["SLURM_NODELIST"][0] == "mapped"
    assert notes["SLURM_CPUS_PER_TASK"][0] == "ignored"


def test_lower_precedence_launcher_vars_are_ignored_with_reason():
    result = translate_environment({**SLURM, **TORCHRUN})
    notes = _notes(result)
    assert result.extras["kind"] == "torchrun"
    status, detail = notes["SLURM_PROCID"]
    assert status == "ignored" and "torchrun" in detail


def test_single_process_environment():
    result = translate_environment({"OMP_NUM_THREADS": "4"})
    assert result.extras["kind"] == "single" and result.extras["num_processes"] == 1
    assert result.extras["initialize_kwargs"] == {"num_processes": 1, "process_id": 0}
    assert [n.key for n in result.notes] == ["OMP_NUM_THREADS"]


BAD = {
    "missing-master-addr": ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    "rank-too-big": ({**TORCHRUN, "RANK": "8"}, "RANK"),
    "slurm-without-nodes": ({k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}, "SLURM_NODELIST"),
}


@pytest.mark.parametrize(("environ", "key"), BAD.values(), ids=BAD.keys())
def test_bad_environment_is_a_translation_error(environ, key):
    with pytest.raises(TranslationError) as info:
        translate_environment(environ)
    assert info.value.key == key and info.value.fix


def test_recognised_table_matches_detection():
    """Every variable detection reads has a meaning in the notes table."""
    from torsh_jax.distributed.env import detect_environment

    samples = [TORCHRUN, SLURM, {**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"}]
    for environ in samples:
        assert set(detect_environment(environ).source_vars) <= set(RECOGNISED)
