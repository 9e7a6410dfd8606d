"""A translated corpus config runs end to end through ``torsh-jax demo --plan <translated.toml>``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "torsh_jax.cli.main"]
SMALL = ["--layers", "1", "--d-model", "16"]


def _demo_records(*args: str) -> list[dict]:
    """Run ``torsh-jax demo ARGS --json``; assert it succeeds and return its JSON lines."""
    run = subprocess.run([*CLI, "demo", *args, "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.mark.slow
def test_translated_deepspeed_config_runs_in_the_demo(corpus_dir, tmp_path):
    source = corpus_dir / "deepspeed" / "dsdoc-getting-started.json"
    plan_path = tmp_path / "plan.toml"
    subprocess.run(
        [*CLI, "translate", str(source), "--world-size", "8", "-o", str(plan_path)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    records = _demo_records("--plan", str(plan_path), "--devices", "8", "--steps", "3", "--layers", "1")
    summary = records[-1]
    assert summary["summary"] and summary["plan"] == "dsdoc-getting-started"
    assert summary["mesh"]["fsdp"] == 8  # ZeRO stage 1 over 8 devices
    assert summary["compiles"] == 1
    assert summary["wire_ratio"] == pytest.approx(1.0, abs=0.02)
    assert all(r["loss"] == r["loss"] for r in records[:-1])  # finite, fp16 with dynamic loss scaling


@pytest.mark.slow
def test_demo_verify_reports_twin_agreement():
    # the smallest demo (one layer of d_model 16, ZeRO-3 over 4 devices): what --verify reports does
    # not depend on the model's size
    lines = _demo_records("--plan", "zero3", "--devices", "4", "--steps", "3", "--verify", *SMALL)
    summary = lines[-1]
    for key in (
        "final_loss",
        "max_rel_err",
        "within_roundoff",
        "parallel_vs_float64",
        "twin_vs_float64",
        "roundoff_bound",
        "wire_bytes_per_step",
        "theoretical_wire_bytes_per_step",
        "memory_per_device_bytes",
        "compiles",
    ):
        assert key in summary, key
    assert summary["within_roundoff"] is True and summary["max_rel_err"] <= 1e-3, summary
    assert summary["parallel_vs_float64"] <= summary["roundoff_bound"], summary
    assert summary["compiles"] == 1
    assert len(lines) == 4


def test_demo_rejects_unknown_plan_with_a_typed_error():
    run = subprocess.run([*CLI, "demo", "--plan", "no-such-plan"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "no meshes preset or file named 'no-such-plan'" in run.stderr
    assert "Traceback" not in run.stderr
