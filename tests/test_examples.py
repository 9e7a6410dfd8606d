"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_train_with_plan_example_trains():
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_with_plan.py"), "--plan", "zero2", "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    losses = [float(line.split("loss")[1].split()[0]) for line in run.stdout.splitlines() if "loss" in line]
    assert len(losses) == 2 and losses[-1] < losses[0]
