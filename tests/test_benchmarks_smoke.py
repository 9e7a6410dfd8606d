"""The train-step benchmarks run with ``--quick`` and print one JSON object per line.

Each script runs in its own process (it sets up simulated devices before
JAX starts). Times are never asserted; the numbers that do not depend on
the machine are: both programs reach the same loss, DDP moves exactly the
theory's bytes, and ZeRO-3 keeps 1/N of the state on each of N devices. The
ZeRO and tensor benchmarks run on 4 devices (``--devices 4``): what they
compare does not depend on the count, and their GSPMD baselines compile a
fifth faster than on 8.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import require_devices
from helpers import BENCHMARKS, load_common
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

TIMING_KEYS = {"name", "ratio", "paired_ratio", "min_ratio", "ours_median_s", "baseline_median_s", "steps"}
WIRE_KEYS = {"name", "ratio", "baseline_ratio", "theory_wire_bytes", "ours_wire_bytes", "baseline_wire_bytes"}
MEMORY_KEYS = {
    "name",
    "ratio",
    "baseline_ratio",
    "state_bytes_total",
    "ours_state_bytes_per_device",
    "baseline_state_bytes_per_device",
}
TEMP_KEYS = {"name", "ratio", "baseline_ratio", "layers", "ours_temp_bytes", "baseline_temp_bytes"}


def run_quick(script: str, *extra: str) -> dict[str, dict]:
    """Rows of ``script --quick`` by name; fails on a non-zero exit or a non-JSON line."""
    return {row["name"]: row for row in script_rows(script, "--quick", *extra)}


def script_rows(script: str, *args: str) -> list[dict]:
    """Every row ``script`` prints, in order; fails on a non-zero exit or a non-JSON line."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines, done.stderr[-3000:]
    rows = [json.loads(line) for line in lines]
    assert all(isinstance(row, dict) for row in rows)
    return rows


def assert_keys(row: dict, keys: set[str]) -> None:
    assert keys <= set(row), f"{row['name']} lacks {sorted(keys - set(row))}"


@pytest.mark.slow
def test_bench_ddp_quick():
    rows = run_quick("bench_ddp.py")
    assert set(rows) == {"ddp_step_time", "ddp_wire", "ddp_memory"}
    timing = rows["ddp_step_time"]
    assert_keys(timing, TIMING_KEYS | {"target"})
    assert timing["ratio"] > 0
    assert abs(timing["ours_loss"] - timing["baseline_loss"]) <= 1e-5 * abs(timing["baseline_loss"])
    assert_keys(rows["ddp_wire"], WIRE_KEYS)
    assert rows["ddp_wire"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert_keys(rows["ddp_memory"], MEMORY_KEYS)
    assert rows["ddp_memory"]["ratio"] == pytest.approx(8.0, rel=1e-3)


@pytest.mark.slow
def test_bench_zero_quick():
    rows = run_quick("bench_zero.py", "--devices", "4")
    stages = (1, 3)  # --quick skips stage 2
    expected = {f"zero{s}_{kind}" for s in stages for kind in ("step_time", "wire", "memory")}
    assert set(rows) == expected | {"zero3_temp_memory"}
    for stage in stages:
        timing = rows[f"zero{stage}_step_time"]
        assert_keys(timing, TIMING_KEYS)
        assert abs(timing["ours_loss"] - timing["baseline_loss"]) <= 1e-5 * abs(timing["baseline_loss"])
        assert_keys(rows[f"zero{stage}_wire"], WIRE_KEYS)
        assert_keys(rows[f"zero{stage}_memory"], MEMORY_KEYS)
    assert rows["zero3_memory"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert rows["zero1_memory"]["ratio"] > rows["zero3_memory"]["ratio"]
    assert_keys(rows["zero3_temp_memory"], TEMP_KEYS)


@pytest.mark.slow
def test_bench_tensor_quick():
    """Both programs train the same model to the same loss; our bytes equal both theories
    (sequence parallel and ZeRO-3 x tensor; tp is their simpler case)."""
    plans = ("tp_sp", "fsdp_tp")
    rows = run_quick("bench_tensor.py", "--plans", ",".join(plans), "--devices", "4")
    assert set(rows) == {f"{p}_{kind}" for p in plans for kind in ("step_time", "wire")}
    for plan in plans:
        timing = rows[f"{plan}_step_time"]
        assert_keys(timing, TIMING_KEYS | {"target"})
        assert abs(timing["ours_loss"] - timing["baseline_loss"]) <= 1e-5 * abs(timing["baseline_loss"])
        wire = rows[f"{plan}_wire"]
        assert_keys(wire, {"ratio", "tensor_ratio", "baseline_ratio", "baseline_tensor_ratio"})
        assert wire["ratio"] == pytest.approx(1.0, abs=0.01), wire
        assert wire["tensor_ratio"] == pytest.approx(1.0, abs=0.01), wire


@pytest.mark.slow
def test_bench_pipeline_quick():
    """The 1F1B pipeline and DDP over the same devices train to the same loss; the row carries the
    table's bubble, the activations held and stage bytes equal to their theory."""
    rows = run_quick("bench_pipeline.py", "--plans", "pp_1f1b", "--layers", "4")  # one layer per stage
    row = rows["pipeline_1f1b"]
    assert_keys(row, {"ratio", "paired_ratio", "bubble", "theory_bubble", "temp_ratio", "stage_wire_ratio"})
    assert row["bubble"] == pytest.approx(3 / 7) and row["activations_held"] == [4, 3, 2, 1]  # m = p = 4
    assert abs(row["loss"] - row["ddp_loss"]) <= 1e-5 * abs(row["ddp_loss"])
    assert row["stage_wire_ratio"] == pytest.approx(1.0, abs=0.02), row


@pytest.mark.slow
def test_bench_barrier_quick_runs_one_collective_per_iteration_against_none():
    """The timed programs are what the rows say: each kind's scan runs its collective once per
    iteration (the compiled program's, not hoisted or dropped) over groups of the row's size, the
    baseline none."""
    rows = script_rows("bench_barrier.py", "--quick", "--group-sizes", "8,2")
    kinds = ["all_gather", "ppermute", "psum"]
    assert sorted((row["group_size"], row["kind"]) for row in rows) == [(n, k) for n in (2, 8) for k in kinds]
    for row in rows:
        assert row["collectives_per_run"] == 32 and row["baseline_collectives_per_run"] == 0, row
        assert row["compiled_group_size"] == row["group_size"] and row["iteration_s"] > 0, row


@pytest.mark.slow
def test_bench_checkpoint_quick():
    """Saves, restores and survives SIGKILL during saves (2 kills in the smoke run, 20 by default)."""
    rows = run_quick("bench_checkpoint.py")
    names = {"checkpoint_save_blocking", "checkpoint_restore_throughput", "checkpoint_crash_safety"}
    assert set(rows) == names
    assert 0 < rows["checkpoint_save_blocking"]["ratio"] < 1, rows["checkpoint_save_blocking"]
    assert rows["checkpoint_restore_throughput"]["megabytes_on_disk"] > 0.5 * 32
    crash = rows["checkpoint_crash_safety"]
    assert crash["restored"] == crash["kills"] == 2, crash


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((256, 64), P("fsdp", None)), ((3, 64), P(None, "fsdp")), ((64, 64), P("fsdp", None)), ((3, 5), P())],
)
def test_fsdp_baseline_shards_the_largest_divisible_dim(shape, expected):
    assert load_common().fsdp_spec(shape, fsdp_size=8) == expected


def test_paired_ratio_is_the_median_of_per_round_ratios():
    common = load_common()
    assert common.paired_ratio([1.0, 1.0, 2.0, 2.0, 3.0, 3.0], [1.0] * 6, chunk=2) == 2.0


def test_state_bytes_counts_one_device_shard():
    devices = require_devices(8)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    sharded = jax.device_put(jnp.zeros((16, 4)), NamedSharding(mesh, P("fsdp")))
    replicated = jax.device_put(jnp.zeros((3,)), NamedSharding(mesh, P()))
    assert load_common().state_bytes({"a": sharded, "b": replicated}) == (2 * 4 * 4 + 12, 16 * 4 * 4 + 12)


def test_compressor_benchmark_pairs_each_measurement_with_its_baseline():
    """Every row carries its own baseline (timed alternately) and the spread of the per-round ratios."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_compressors.py"), "--elements", "65536", "--repeats", "3"]
        + ["--presets", "int8", "sign"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    compressor = [r for r in rows if r["kind"] == "compressor"]
    collective = [r for r in rows if r["kind"] == "collective"]
    assert {(r["preset"], r["op"]) for r in compressor} == {
        (p, op) for p in ("int8", "sign") for op in ("quantise", "dequantise", "feedback")
    }
    assert [r["preset"] for r in collective] == ["int8", "sign"]
    for r in compressor:
        low, high = r["ratio_spread"]
        assert low <= r["ratio_to_copy"] <= high and r["rounds"] == 3 and r["copy_seconds"] > 0
    for r in collective:
        low, high = r["compressed_over_plain_spread"]
        assert low <= r["compressed_over_plain"] <= high and r["plain_seconds"] > 0


def _load_bench(name: str = "bench_planner"):
    """``benchmarks/<name>.py`` as a module (it imports ``common`` by name, as run)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _planner_row(plan: str, predicted: float, measured: float, iqr: float) -> dict:
    return {
        "plan": plan,
        "predicted_s": predicted,
        "measured_s": measured,
        "measured_iqr_s": iqr,
        "measured_halves_s": [measured, measured * (3.0 if plan == "a" else 1.0)],
        "error": predicted / measured - 1,
        "memory_error": 0.01,
    }


def test_planner_benchmark_scores_the_ranking_the_pick_and_the_misordered_pairs():
    """The planner benchmark's figures from its rows: MAPE, tau-b (a pair predicted equal is left
    out), the measurement's tau-b against itself (even rounds against odd), the pick's measured
    time over the fastest, and the pairs ordered against the measurement by more than either
    plan's spread."""
    bench = _load_bench()
    rows = [
        _planner_row("a", 1.0, 1.1, 0.01),  # predicted fastest, measured 10 % off the fastest
        _planner_row("b", 2.0, 1.0, 0.01),  # against a beyond the spread
        _planner_row("c", 3.0, 3.0, 0.01),
        _planner_row("d", 3.0, 2.9, 0.5),  # predicted equal to c: no pair with c counted
    ]
    found = bench.summary(rows, "m")
    assert found["pick"] == "a" and found["pick_ratio"] == pytest.approx(1.1)
    assert found["misordered_beyond_noise"] == [["a", "b"]]
    assert found["mape"] == pytest.approx((0.1 / 1.1 + 1.0 + 0.0 + 0.1 / 2.9) / 4)
    # 5 untied pairs: 4 agree, (a, b) disagrees; tau-b's denominator leaves the tie (c, d) out
    assert found["kendall_tau"] == pytest.approx((4 - 1) / math.sqrt(5 * 6))
    # the odd rounds put a (3.3 s) after c and d: 4 of 6 pairs agree with the even rounds
    assert found["kendall_tau_halves"] == pytest.approx((4 - 2) / 6)
    rows[1]["measured_iqr_s"] = 0.2  # the gap (0.1 s) is within b's spread now
    assert bench.misordered_beyond_noise(rows) == []


@pytest.mark.parametrize("devices", [8, 2])
def test_planner_benchmark_plans_are_candidates_of_the_planner(devices):
    """Every plan the benchmark times is one the planner enumerates for its devices (int8 added)."""
    from torsh_jax.planner.shape import parse_model

    bench = _load_bench()
    chosen = bench.plans_for(parse_model(bench.MODELS["small"]), devices)
    assert [c.label for c in chosen] == list(bench.PLANS_BY_DEVICES[devices])
    assert all(math.prod(c.sizes.values()) == devices for c in chosen)


def test_planner_benchmark_counts_the_collectives_a_step_runs_inside_its_loops():
    """Per step: every collective's executions; those inside a loop (trip count above 1) apart."""
    from types import SimpleNamespace as Found

    bench = _load_bench()
    found = [
        Found(trip_count=None, executions=1),  # the step's own all-reduce, outside any loop
        Found(trip_count=8, executions=8),  # one per layer
        Found(trip_count=1, executions=1),  # a loop of one iteration is no loop
    ]
    assert bench.collective_counts(found) == {"collectives": 10, "collectives_in_loops": 8}


def test_planner_memory_benchmark_sorts_the_candidates_into_kinds_and_counts_within_5_percent():
    """The memory benchmark's kinds (ZeRO stage or schedule, with ZeRO-3 under a pipeline, tensor,
    remat and accumulation) and its summary of the errors."""
    from torsh_jax.planner.shape import parse_model
    from torsh_jax.planner.space import candidates

    bench = _load_bench("bench_planner_memory")
    shape = parse_model(bench.MODELS["tiny"])
    by_label = {c.label: c for c in candidates(shape, devices=8, global_batch=bench.GLOBAL_BATCH)}
    kinds = {
        "ddp data=8 acc=1": "ddp",
        "zero2 fsdp=8 remat acc=2": "zero2 remat acc",
        "zero3 fsdp=4 tensor=2 acc=1": "zero3 tensor",
        "pp fsdp=4 stage=2 1f1b m=2 zero3 acc=2": "pp 1f1b zero3 acc",
        "pp data=2 tensor=2 stage=2 zb_h1 m=2 acc=1": "pp zb_h1 tensor",
    }
    assert {label: bench.kind_of(by_label[label]) for label in kinds} == kinds
    found = bench.summary([{"error": e} for e in (0.01, -0.05, 0.2, -0.08)], "k")
    assert (found["plans"], found["within_5pct"]) == (4, 2)
    assert found["max_abs_error"] == pytest.approx(0.2) and found["mean_abs_error"] == pytest.approx(0.085)
    assert (found["ranged"], found["within_range"]) == (0, 0)
    # a range holds the peak from its floor (at most 5 % over it) to its total (at most 5 % under)
    ranged = [
        {"error": 0.5, "floor": 1, "floor_error": bench._floor_error(104, 100)},  # floor 4 % over
        {"error": 0.5, "floor": 1, "floor_error": bench._floor_error(106, 100)},  # floor 6 % over
        {"error": -0.06, "floor": 1, "floor_error": -0.3},  # the total 6 % under
        {"error": 0.01, "floor": None, "floor_error": None},
    ]
    found = bench.summary(ranged, "k")
    assert (found["plans"], found["ranged"], found["within_range"]) == (4, 3, 1)


def test_bench_planner_models_quick_predicts_a_converted_models_plans_with_its_own_gradients():
    """The GPT-2-style flax model's recomputing plans, predicted with its own compiled gradients:
    remat within 5 % of the compiled peak; ZeRO-3 never more than 5 % under, and over by at most
    12 %. Since ZeRO-3 reduces each gradient in its own shape, this 2-block model's ZeRO-3 step
    holds 130 KB less (about two of its tied table's 64 KB gradients), +10.2 % against +1.9 % as
    rows; the 8-block model of the full run +4.3 % (benchmarks/README.md). The summary counts
    both predictions."""
    rows = script_rows("bench_planner_models.py", "--quick", "--model", "gpt2")
    plans = [r for r in rows if r["name"] == "planner_model_memory"]
    assert len(plans) == 3, plans
    for r in plans:
        over = 0.12 if r["plan"].startswith("zero3") else 0.05
        assert -0.05 <= r["error_own"] <= over, r
    [total] = [r for r in rows if r["name"] == "planner_model_memory_summary" and r["model"] == "all"]
    assert total["plans"] == 3
    for kind in ("own", "demo"):
        assert total[f"within_5pct_{kind}"] == sum(abs(r[f"error_{kind}"]) <= 0.05 for r in plans)


def test_every_tpu_set_names_plans_its_target_has():
    """Each plan of the memory benchmark's TPU sets is a candidate of its model, target and global
    batch, so ``--tpu SET`` compiles every plan it lists (nothing is compiled here)."""
    from torsh_jax.planner.machine import Machine
    from torsh_jax.planner.shape import parse_model
    from torsh_jax.planner.space import candidates

    bench = _load_bench("bench_planner_memory")
    for name in bench.TPU_SETS:
        model, target, global_batch, labels, slices = bench.tpu_set(name)
        devices = Machine.from_target(target, slices=slices).devices
        shape = parse_model(model)
        found = candidates(shape, devices=devices, global_batch=global_batch, slices=slices)
        found = {c.label for c in found}
        assert set(labels) <= found, (name, sorted(set(labels) - found))


def test_the_memory_benchmark_refuses_one_global_batch_for_every_tpu_set():
    """``--tpu all`` compiles each set at its own global batch: given one, it stops with a one-line
    usage error before anything compiles."""
    script = BENCHMARKS / "bench_planner_memory.py"
    done = subprocess.run(
        [sys.executable, str(script), "--tpu", "all", "--global-batch", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].endswith("each set has its own; give it with one --tpu SET")
