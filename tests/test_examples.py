"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_train_with_plan_example_trains_and_resumes_on_fewer_devices(tmp_path):
    """3 steps on 8 devices with a checkpoint, then the same command on 4 devices resumes at step 3
    (ZeRO-2 over 4 ranks, 2 accumulation steps: the saved global batch) and finishes 6 steps."""

    def run(steps: int, devices: int) -> list[str]:
        argv = [sys.executable, str(EXAMPLES / "train_with_plan.py"), "--plan", "zero2"]
        argv += ["--steps", str(steps), "--devices", str(devices)]
        argv += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--log-every", "1", "--layers", "1"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    first, rest = run(3, 8), run(6, 4)
    assert rest[0] == "resumed at step 3 on 4 devices (ZeRO-2 over fsdp=4, 2 accumulation step(s))", rest
    losses = [float(line.split("loss")[1].split()[0]) for line in first + rest if "loss" in line]
    assert len(losses) == 6 and losses[-1] < losses[0]
