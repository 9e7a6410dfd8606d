"""``torsh-jax translate`` end to end, in subprocesses (no JAX import allowed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LAUNCH = (
    "horovodrun -np 8 -H a:4,b:4 --hierarchical-allreduce --fusion-threshold-mb 32 python train.py --lr 0.1\n"
)
FSDP = {"fsdp": {"sharding_strategy": "FULL_SHARD", "mixed_precision": {"param_dtype": "bfloat16"}}}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torsh_jax.cli.main", "translate", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


@pytest.fixture
def launch_file(tmp_path: Path) -> Path:
    path = tmp_path / "launch.sh"
    path.write_text(LAUNCH)
    return path


def test_text_output_is_a_table_and_writes_the_plan(launch_file, tmp_path):
    out = tmp_path / "plan.toml"
    proc = _cli(str(launch_file), "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "horovodrun.--fusion-threshold-mb" in proc.stdout
    assert "approximated" in proc.stdout
    assert f"plan written to {out}" in proc.stdout
    from torsh_jax.plan import load_plan

    plan = load_plan(out)
    assert plan.communication.bucket_mb == pytest.approx(32 * 1048576 / 1e6)
    assert (plan.mesh.data.ici, plan.mesh.data.dcn) == (4, 2)


def test_json_output_keys(launch_file, tmp_path):
    proc = _cli(str(launch_file), "--format", "json", "--world-size", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {"plan", "notes", "extras"} <= set(data)
    assert data["extras"]["world_size"] == 8
    assert {n["key"] for n in data["notes"]} >= {"horovodrun.-np", "horovodrun.script.--lr"}
    assert all(
        n["status"] in ("mapped", "approximated", "ignored", "unsupported", "removed") for n in data["notes"]
    )


def test_toml_output_loads_as_a_plan(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(FSDP))
    proc = _cli(str(path), "--format", "toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    written = tmp_path / "stdout.toml"
    written.write_text(proc.stdout)
    from torsh_jax.plan import load_plan

    plan = load_plan(written)
    assert plan.zero.stage == 3 and plan.precision.compute_dtype == "bfloat16"


def test_set_values_are_json_when_they_parse(launch_file, tmp_path):
    proc = _cli(
        str(launch_file), "--format", "json", "--set", "batch.micro_batch_size=16",
        "DistributedOptimizer.op=Sum",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert plan["batch"]["micro_batch_size"] == 16
    assert plan["communication"]["reduce_op"] == "sum"


def test_unsupported_input_exits_2_naming_the_key(tmp_path):
    path = tmp_path / "adasum.py"
    path.write_text("import horovod.torch as hvd\nopt = hvd.DistributedOptimizer(opt, op=hvd.Adasum)\n")
    proc = _cli(str(path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "DistributedOptimizer.op" in proc.stderr
    assert "Traceback" not in proc.stderr
    lenient = _cli(str(path), "--lenient", "--format", "json", cwd=tmp_path)
    assert lenient.returncode == 0
    statuses = {n["key"]: n["status"] for n in json.loads(lenient.stdout)["notes"]}
    assert statuses["DistributedOptimizer.op"] == "unsupported"


def test_bad_arguments_are_typed_errors(launch_file, tmp_path):
    assert _cli(str(tmp_path / "missing.json"), cwd=tmp_path).returncode == 2
    bad_set = _cli(str(launch_file), "--set", "novalue", cwd=tmp_path)
    assert bad_set.returncode == 2 and "--set" in bad_set.stderr
    bad_out = _cli(str(launch_file), "-o", str(tmp_path / "plan.yaml"), cwd=tmp_path)
    assert bad_out.returncode == 2 and "--output" in bad_out.stderr
    hf = _cli(str(launch_file), "--hf-trainer", "learning_rate=0.1", cwd=tmp_path)
    assert hf.returncode == 2 and "--hf-trainer" in hf.stderr


def test_translate_does_not_import_jax(launch_file, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        from torsh_jax.cli.main import main
        code = main(["translate", {str(launch_file)!r}, "--format", "json"])
        assert code == 0
        print("JAX_LOADED" if "jax" in sys.modules else "JAX_ABSENT")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("JAX_ABSENT")


def test_corpus_file_through_cli(corpus_dir, tmp_path):
    path = corpus_dir / "horovod" / "ext-pidajay-tpu-mnasnet-mpirun.txt"
    proc = _cli(str(path), "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["plan"]["communication"]["bucket_mb"] == pytest.approx(16777216 / 1e6)
