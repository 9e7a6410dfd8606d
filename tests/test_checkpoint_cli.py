"""``torsh-jax demo --checkpoint-dir/--save-every/--resume`` and ``torsh-jax checkpoint list|show``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_cli import SMALL, _error_line, _strict_json

from torsh_jax.cli.main import main

DEMO = ["demo", "--plan", "zero3", "--devices", "4", "--json", *SMALL]


def _steps(capsys, argv: list[str]) -> tuple[list[dict], dict]:
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    records = [_strict_json(line) for line in out.strip().splitlines()]
    return records[:-1], records[-1]


def test_demo_resumes_on_the_batches_it_would_have_seen_also_on_fewer_devices(capsys, tmp_path):
    straight, straight_summary = _steps(capsys, [*DEMO, "--steps", "4"])
    saving = ["--save-every", "1", "--checkpoint-dir", str(tmp_path)]
    first, summary = _steps(capsys, [*DEMO, "--steps", "2", *saving])
    assert summary["checkpoint_steps"] == [1, 2]
    shutil.copytree(tmp_path, tmp_path.with_name(tmp_path.name + "-copy"))
    resumed, summary = _steps(capsys, [*DEMO, "--steps", "4", "--resume", "--checkpoint-dir", str(tmp_path)])
    assert summary["resumed_from_step"] == 2
    assert [r["step"] for r in resumed] == [3, 4], "per-step records carry the global step"
    assert [r["loss"] for r in first + resumed] == [r["loss"] for r in straight]
    # on 2 devices: ZeRO-3 over fsdp=2 with 2 accumulation steps keeps the global batch of 4 x 8
    copy = ["--resume", "--checkpoint-dir", str(tmp_path.with_name(tmp_path.name + "-copy"))]
    fewer, summary = _steps(capsys, [*DEMO[:4], "2", *DEMO[5:], "--steps", "4", *copy])
    assert summary["devices"] == 2 and summary["global_batch_size"] == straight_summary["global_batch_size"]
    np.testing.assert_allclose([r["loss"] for r in fewer], [r["loss"] for r in straight[2:]], rtol=1e-5)


def test_checkpoint_list_and_show(capsys, tmp_path):
    _steps(capsys, [*DEMO, "--steps", "2", "--save-every", "1", "--checkpoint-dir", str(tmp_path)])
    assert main(["checkpoint", "list", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr()[0])
    assert [(c["step"], c["complete"]) for c in listed] == [(1, True), (2, True)]
    assert main(["checkpoint", "show", str(tmp_path), "--step", "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr()[0])
    assert shown["step"] == 1 and shown["mesh"]["fsdp"] == 4 and 'name = "zero3"' in shown["plan"]
    assert shown["data_position"] == {"next_step": 1, "seed": 0}
    assert any("fsdp" in (p["partition_spec"] or []) for p in shown["params"].values())
    # the step, every parameter and the optimizer's moments carry a checksum
    assert shown["checksummed_arrays"] > 2 * len(shown["params"])
    assert main(["checkpoint", "show", str(tmp_path)]) == 0
    text = capsys.readouterr()[0]
    assert text.startswith("step 2") and "params/embed/embedding" in text
    assert f"checksums: {shown['checksummed_arrays']} arrays" in text


@pytest.mark.parametrize(
    "argv, says",
    [
        (["demo", "--resume"], "--resume: needs a checkpoint directory"),
        (["demo", "--save-every", "2"], "--save-every: needs a checkpoint directory"),
        (["checkpoint", "show", "/no/such/dir"], "no such checkpoint directory"),
        (["checkpoint", "list", "/no/such/dir"], "no such checkpoint directory"),
    ],
)
def test_bad_checkpoint_arguments_are_one_line_with_a_fix(capsys, argv, says):
    assert says in _error_line(capsys, argv)


def test_a_missing_step_lists_the_complete_ones(capsys, tmp_path):
    _steps(capsys, [*DEMO, "--steps", "1", "--checkpoint-dir", str(tmp_path)])
    assert "complete steps: [1]" in _error_line(capsys, ["checkpoint", "show", str(tmp_path), "--step", "9"])
