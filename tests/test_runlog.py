"""The run log of a real demo run (one tiny ZeRO-3 run with a profiled window, shared by the tests):
its records against the figures they are computed from, the plan and inspect files, the trace,
compile counting and flushing."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import require_devices

from torsh_jax.cli.main import main
from torsh_jax.plan.io import load_plan
from torsh_jax.runlog import RunLog
from torsh_jax.runlog.files import INSPECT_FILE, PLAN_TOML, RUN_FILE, STEPS_FILE

STEPS = 4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from torsh_jax.demo.run import DemoConfig, run_demo

    require_devices(4)
    path = tmp_path_factory.mktemp("run")
    config = DemoConfig(plan="zero3", devices=4, steps=STEPS, layers=2, log_dir=str(path), profile="2:3")
    run_demo(config, emit=lambda record: None)
    return path


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / STEPS_FILE).read_text().splitlines()]


def test_step_records_are_computed_from_the_named_figures(run_dir):
    header = json.loads((run_dir / RUN_FILE).read_text())
    records = _steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert header["finished"] and header["devices"] == 4 and header["plan"] == "zero3"
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(header["tokens_per_step"] / r["step_time_s"])
        want = r["flops_per_step"] / (r["step_time_s"] * r["peak_flops_per_device"] * header["devices"])
        assert r["mfu"] == pytest.approx(want) and 0 < r["mfu"]
        assert r["flops_source"] == header["flops_source"] and r["peak_flops_source"].startswith("measured")
        assert r["grad_norm"] > 0 and r["loss"] > 0
    # a scanned model: the compiled program has while loops, so the FLOPs are the model's formula
    assert header["while_loops"] > 0 and header["flops_source"].startswith("model")
    assert [r["profiled"] for r in records] == [False, True, True, False]


def test_plan_inspect_and_trace_files(run_dir):
    plan = load_plan(str(run_dir / PLAN_TOML))
    assert plan.zero.stage == 3
    inspected = json.loads((run_dir / INSPECT_FILE).read_text())
    assert inspected["roles"].startswith("ZeRO-3") and inspected["collectives"]
    assert inspected["totals"]["wire_bytes"] > 0 and inspected["memory"]["peak_estimate_bytes"] > 0
    traces = list((run_dir / "profile").rglob("perfetto_trace.json.gz"))
    assert traces and traces[0].stat().st_size > 0


def test_each_step_is_on_disk_when_it_ends_and_compiles_are_counted(tmp_path):
    log = RunLog(tmp_path, tokens_per_step=100)
    total = jax.jit(lambda x: (x * 2).sum())
    for step, size in ((1, 3), (2, 3), (3, 5)):  # step 3 has a new shape: a compile
        log.begin(step)
        loss = total(np.ones(size, np.float32))
        record = log.end(step, {"loss": loss, "grad_norm": np.float32(1.5)})
        assert _steps(tmp_path)[-1] == record  # readable before close
    log.close()
    assert [r["compiles"] for r in _steps(tmp_path)] == [1, 0, 1]
    assert all(r["mfu"] is None and r["flops_source"] == "unknown" for r in _steps(tmp_path))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--profile", "2:3"], "--profile: needs a run directory"),
        (["--log-dir", "LOG", "--profile", "5:2"], "--profile: steps 5 to 2"),
        (["--log-dir", "FILE"], "--log-dir: cannot write the run directory"),
    ],
    ids=["profile-without-dir", "window-backwards", "dir-is-a-file"],
)
def test_bad_log_options_are_one_line(capsys, tmp_path, argv, says):
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("LOG", "FILE") else a for a in argv]
    assert main(["demo", "--devices", "1", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Fix:" in err


def test_demo_model_flops_are_the_planners_count():
    from torsh_jax.demo.model import LMConfig, init_params
    from torsh_jax.demo.runlog import model_flops_per_step
    from torsh_jax.planner.shape import ModelShape

    cfg = LMConfig(layers=3, d_model=32, heads=2, head_dim=16, mlp=128)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    widths = {"d_model": 32, "seq_len": cfg.seq_len, "vocab": cfg.vocab, "heads": 2, "mlp": 128}
    per_token = ModelShape.from_params(shapes, **widths).train_flops_per_token(recompute=False)
    assert model_flops_per_step(cfg, shapes, 1000) == pytest.approx(per_token * 1000)
