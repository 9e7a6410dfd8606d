"""ParallelPlan: validation, TOML/JSON round trip, presets."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import imports_jax

from torsh_jax.errors import MeshError, PlanError, PresetNotFoundError
from torsh_jax.plan import (
    AxisSize,
    BatchSpec,
    MeshSpec,
    ParallelPlan,
    load_compressor,
    load_plan,
    plan_from_dict,
    plan_from_json,
    plan_from_toml,
    plan_to_json,
    plan_to_toml,
    presets,
    save_plan,
)
from torsh_jax.plan.factor import factorisations


@pytest.mark.parametrize("name", presets.names("meshes"))
def test_every_preset_round_trips(name):
    plan = load_plan(name)
    assert plan.name == name
    assert plan_from_toml(plan_to_toml(plan)) == plan
    assert plan_from_json(plan_to_json(plan)) == plan


def test_round_trip_of_a_rich_plan():
    plan = plan_from_dict(
        {
            "mesh": {"data": {"ici": 1, "dcn": 2}, "fsdp": -1},
            "zero": {"stage": 3, "reshard_after_forward": False},
            "precision": {"compute_dtype": "bfloat16", "loss_scale": {"mode": "dynamic"}},
            "batch": {"micro_batch_size": 4, "accumulation_steps": 2},
            "compression": [{"axis": "data", "gradients": "int8"}],
            "optimizer": {"name": "adamw", "learning_rate": 3e-4, "params": {"b2": 0.95}},
        }
    )
    assert plan.mesh.data == AxisSize(ici=1, dcn=2)
    assert plan.compression[0].gradients.method == "int8"
    assert plan_from_toml(plan_to_toml(plan)) == plan


def test_toml_writes_only_what_differs():
    text = plan_to_toml(ParallelPlan(batch=BatchSpec(micro_batch_size=4)))
    assert "micro_batch_size = 4" in text
    assert "zero" not in text


@pytest.mark.parametrize(
    "data, key",
    [
        pytest.param({"zero": {"stag": 1}}, "zero.stag", id="unknown-key"),
        pytest.param({"mesh": {"tensr": 2}}, "mesh.tensr", id="unknown-axis"),
        pytest.param({"zero": {"stage": 4}}, "zero.stage", id="bad-stage"),
        pytest.param({"batch": {"micro_batch_size": 0}}, "batch.micro_batch_size", id="zero-batch"),
        pytest.param({"batch": {"micro_batch_size": "8"}}, "batch.micro_batch_size", id="string-batch"),
        pytest.param({"precision": {"param_dtype": "float8"}}, "precision.param_dtype", id="bad-dtype"),
        pytest.param({"mesh": {"data": {"ici": 0}}}, "mesh.data.ici", id="zero-axis"),
        pytest.param(
            {"compression": [{"axis": "data", "gradients": {"method": "int9"}}]},
            "compression[0].gradients.method",
            id="bad-compressor",
        ),
        pytest.param({"compression": [{"axis": "tensor"}]}, "compression[0].axis", id="bad-compression-axis"),
        pytest.param({"rules": [["embed", ["tensr"]]]}, "rules[0]", id="bad-rule-axis"),
    ],
)
def test_invalid_plans_name_the_key(data, key):
    with pytest.raises(PlanError) as err:
        plan_from_dict(data)
    assert err.value.key == key
    assert key in str(err.value)


def test_unknown_toml_key_in_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[batch]\nmicro_batch = 8\n")
    with pytest.raises(PlanError, match=r"batch\.micro_batch: unknown key.*micro_batch_size"):
        load_plan(path)


def test_unknown_preset_lists_presets():
    with pytest.raises(PresetNotFoundError, match="ddp"):
        load_plan("no-such-plan")
    with pytest.raises(PresetNotFoundError):
        load_compressor("no-such-compressor")


def test_mesh_resolution_and_suggestions():
    assert MeshSpec(data=AxisSize(ici=2), fsdp=AxisSize(ici=-1)).resolve(8).shape["fsdp"] == 4
    hybrid = MeshSpec(data=AxisSize(ici=1, dcn=2), fsdp=AxisSize(ici=-1)).resolve(8, num_slices=2)
    assert hybrid.shape == {"data": 2, "stage": 1, "fsdp": 4, "tensor": 1}
    with pytest.raises(MeshError) as err:
        MeshSpec(data=AxisSize(ici=3)).resolve(8)
    assert "data=8" in str(err.value)
    with pytest.raises(MeshError, match="fsdp=4"):
        MeshSpec(data=AxisSize(ici=2), fsdp=AxisSize(ici=2)).resolve(8)
    with pytest.raises(PlanError, match="only one axis may be -1"):
        MeshSpec(data=AxisSize(ici=-1), fsdp=AxisSize(ici=-1)).resolve(8)


def test_factorisations():
    assert factorisations(8, ("data", "fsdp")) == [
        {"data": 1, "fsdp": 8},
        {"data": 2, "fsdp": 4},
        {"data": 4, "fsdp": 2},
        {"data": 8, "fsdp": 1},
    ]


def test_global_batch():
    assert BatchSpec(micro_batch_size=8, accumulation_steps=4).global_batch_size(8) == 256


def test_importing_plans_does_not_import_jax():
    assert not imports_jax("import torsh_jax, torsh_jax.plan; torsh_jax.load_plan('ddp')")


def test_presets_ship_in_the_wheel(tmp_path):
    """A non-editable install loads presets by name from the package."""
    wheel_dir = tmp_path / "wheel"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            ".",
        ],
        capture_output=True,
        text=True,
        cwd=presets.Path(__file__).resolve().parents[1],
    )
    assert build.returncode == 0, build.stderr
    import zipfile

    (wheel,) = wheel_dir.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "torsh_jax/_presets/meshes/ddp.toml" in names
    assert "torsh_jax/_presets/compression/int8.toml" in names


@pytest.mark.parametrize(
    "text, shape",
    [
        ("[mesh]\nfsdp = -1\n", {"data": 1, "fsdp": 8}),
        ("[mesh]\ntensor = 2\nstage = -1\n", {"data": 1, "tensor": 2, "stage": 4}),
        ("[mesh]\nfsdp = 2\n", {"data": 4, "fsdp": 2}),
        ("[mesh]\ndata = 2\nfsdp = -1\n", {"data": 2, "fsdp": 4}),
    ],
    ids=["fsdp-inferred", "stage-inferred", "data-inferred", "data-given"],
)
def test_data_left_out_takes_what_one_inferred_axis_leaves(tmp_path, text, shape):
    path = tmp_path / "plan.toml"
    path.write_text(text)
    plan = load_plan(path)
    resolved = plan.mesh.resolve(8).shape
    assert {axis: resolved[axis] for axis in shape} == shape
    assert load_plan(save_plan(plan, tmp_path / "again.toml")).mesh == plan.mesh


def test_two_inferred_axes_written_out_are_still_refused():
    with pytest.raises(PlanError, match="only one axis may be -1"):
        plan_from_dict({"mesh": {"data": -1, "fsdp": -1}}).mesh.resolve(8)


@pytest.mark.parametrize("value", ['"8"', "true", "8.0"], ids=["text", "bool", "float"])
def test_axis_size_of_the_wrong_type_says_integer_or_table(tmp_path, value):
    path = tmp_path / "plan.toml"
    path.write_text(f"[mesh]\nfsdp = {value}\n")
    with pytest.raises(PlanError) as err:
        load_plan(path)
    assert err.value.key == "mesh.fsdp"
    assert "must be an integer or a table {ici = N, dcn = M}" in str(err.value)
    assert "fsdp = 8 (no quotes)" in err.value.fix


def test_a_plan_in_another_format_says_which_formats_are_read(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("mesh:\n  fsdp: 8\n")
    with pytest.raises(PlanError) as err:
        load_plan(path, key="--plan")
    assert err.value.key == "--plan"
    assert ".toml or .json, not .yaml" in str(err.value) and "plan.toml" in err.value.fix


def test_a_directory_is_not_a_plan_and_a_preset_name_still_wins(tmp_path, monkeypatch):
    (tmp_path / "runs").mkdir()
    with pytest.raises(PlanError, match="is a directory, not a plan file"):
        load_plan(tmp_path / "runs")
    (tmp_path / "ddp").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_plan("ddp").name == "ddp"
