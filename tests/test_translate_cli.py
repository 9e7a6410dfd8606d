"""``torsh-jax translate`` end to end, in subprocesses (no JAX import allowed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torsh_jax.errors import TranslationError

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


def test_lenient_and_strict_together_are_refused_in_one_line(launch_file, tmp_path):
    proc = _cli(str(launch_file), "--lenient", "--strict", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--strict: not allowed with argument --lenient" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Fix:" in proc.stderr


def test_world_size_that_differs_from_the_launch_line_is_one_error(tmp_path):
    path = tmp_path / "h.txt"
    path.write_text("horovodrun -np 8 -H localhost:4 python train.py\n")
    proc = _cli(str(path), "--world-size", "4", "--format", "json", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr.strip()
    assert line.startswith("torsh-jax translate: error: horovodrun.-np:") and len(line.splitlines()) == 1
    assert "8 processes" in line and "--world-size says 4" in line and "drop --world-size" in line


DS_AUTO_BF16 = {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}}


@pytest.mark.parametrize(("value", "compute"), [("1", "bfloat16"), ('"false"', None), ("NO", None)])
def test_hf_trainer_booleans_read_as_transformers_does(tmp_path, value, compute):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_AUTO_BF16))
    proc = _cli(str(path), "--world-size", "8", "--format", "json", "--hf-trainer",
                "per_device_train_batch_size=4", f"bf16={value}", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plan"].get("precision", {}).get("compute_dtype") == compute


def test_hf_trainer_boolean_transformers_refuses_is_one_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_AUTO_BF16))
    proc = _cli(str(path), "--world-size", "8", "--hf-trainer", "bf16=maybe", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("torsh-jax translate: error: --hf-trainer bf16: must be a boolean")
    assert "'maybe'" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_long_key_and_set_item_are_clipped_in_the_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "k" * 100_000: 1}))
    strict = _cli(str(path), "--world-size", "8", "--strict", cwd=tmp_path)
    assert strict.returncode == 2 and len(strict.stderr) < 300 and "kkk...kkk" in strict.stderr
    bad_set = _cli(str(path), "--set", "x" * 100_000, cwd=tmp_path)
    assert bad_set.returncode == 2 and len(bad_set.stderr) < 300 and "--set" in bad_set.stderr


#: Sections of docs/translate.md -> the kind of the input examples they show.
DOC_INPUT_KINDS = {
    "Horovod": "horovod",
    "PyTorch FSDP": "torch_fsdp",
    "Device meshes: FSDP with tensor parallelism": "torch_fsdp",
}
#: Sections whose examples are not input: the command's JSON output, the Python API.
DOC_OTHER_EXAMPLES = ("JSON output", "From Python")
_FENCE = re.compile(r"```(json|toml|python)\n(.*?)```", re.DOTALL)
_INLINE_OBJECT = re.compile(r"`(\{[^`]*\})`")


def _inline_json(body: str) -> list[str]:
    found = []
    for match in _INLINE_OBJECT.finditer(_FENCE.sub("", body)):
        text = " ".join(match.group(1).split())
        try:
            json.loads(text)
        except json.JSONDecodeError:
            continue  # a sketch such as {"fsdp": {...}}
        found.append(text)
    return found


def _doc_examples() -> list[tuple[str, str, str]]:
    """``(section, suffix, text)`` of each fenced JSON/TOML/Python block and inline JSON object."""
    text = (REPO / "docs" / "translate.md").read_text()
    examples = []
    for section in re.split(r"^#{2,3} ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        suffixes = {"json": ".json", "toml": ".toml", "python": ".py"}
        examples += [(title.strip(), suffixes[lang], block) for lang, block in _FENCE.findall(body)]
        examples += [(title.strip(), ".json", obj) for obj in _inline_json(body)]
    return examples


DOC_EXAMPLES = _doc_examples()


def test_doc_examples_are_found_and_every_section_is_known():
    assert any(title == "Device meshes: FSDP with tensor parallelism" and suffix == ".json"
               for title, suffix, _ in DOC_EXAMPLES)  # fmt: skip
    unknown = {title for title, _, _ in DOC_EXAMPLES} - set(DOC_INPUT_KINDS) - set(DOC_OTHER_EXAMPLES)
    assert not unknown, f"say what kind of example these sections of docs/translate.md show: {unknown}"


@pytest.mark.parametrize(
    ("title", "suffix", "text"),
    [pytest.param(*e, id=f"{i}-{e[0]}{e[1]}") for i, e in enumerate(DOC_EXAMPLES) if e[0] in DOC_INPUT_KINDS],
)
def test_every_doc_input_example_is_detected_as_its_kind_and_translates(tmp_path, title, suffix, text):
    from torsh_jax.translate.detect import detect_kind, translate_file

    path = tmp_path / f"example{suffix}"
    path.write_text(text)
    assert detect_kind(path) == DOC_INPUT_KINDS[title]
    assert translate_file(path, lenient=True).kind == DOC_INPUT_KINDS[title]


def test_long_input_path_is_named_whole_and_a_long_key_clipped(tmp_path):
    from torsh_jax.translate.detect import translate_file

    path = tmp_path / ("d" * 100) / "notes.txt"
    path.parent.mkdir()
    path.write_text("nothing to see here\n")
    with pytest.raises(TranslationError) as err:
        translate_file(path)
    assert err.value.key == str(path)
    horovod = tmp_path / "launch.sh"
    horovod.write_text(LAUNCH)
    with pytest.raises(TranslationError) as err:
        translate_file(horovod, overrides={"x" * 1000: 1})
    assert err.value.key == "x" * 39 + "..." + "x" * 38
