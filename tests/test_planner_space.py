"""The planner's search space beyond mesh sizes: pipeline schedules, sequence parallelism, remat and
gradient compression methods; each where the runtime can run it, each with its cost.

The pipeline bubble is the schedule table's; interleaved's stage traffic is what ``inspect``
compares (tests/test_planner.py checks it against the train step's theory); the compressed bytes of
top-k and PowerSGD are the compiled program's.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from conftest import require_devices

from torsh_jax.analysis.theory import ring_wire_bytes
from torsh_jax.pipeline.schedule import IDLE, build_pipeline_schedule
from torsh_jax.pipeline.slots import scoped_send, slot_plan
from torsh_jax.planner.cost import _bubble_fraction, codec_seconds, predict, theories
from torsh_jax.planner.machine import Link, Machine
from torsh_jax.planner.memory import SCANNED_STAGE, memory_parts
from torsh_jax.planner.per_device import compressed_buffers_of
from torsh_jax.planner.shape import parse_model
from torsh_jax.planner.space import Space, candidates

TINY = "demo:d_model=256,layers=4,vocab=256,seq_len=32"
#: no shared cores (a bubble costs time), no measured recompute cost (the FLOP ratio)
MACHINE = Machine("m-8", 8, 1, 1e9, 2**30, {"ici": Link(20e-6, 1e9)}, overlaps=False, platform="cpu")
ALL_SCHEDULES = Space(schedules=("gpipe", "1f1b", "interleaved", "zb_h1"))


@pytest.fixture(scope="module")
def tiny():
    return parse_model(TINY)


@pytest.fixture(scope="module")
def found(tiny):
    return {c.label: c for c in candidates(tiny, devices=8, global_batch=64, space=ALL_SCHEDULES)}


def test_schedules_are_tried_where_the_runtime_runs_them_and_gpipe_only_when_asked(tiny):
    found = candidates(tiny, devices=8, global_batch=64)
    by_stage = {}
    for c in found:
        by_stage.setdefault(c.sizes["stage"], set()).add(
            (c.plan.pipeline.schedule, c.plan.pipeline.virtual_stages)
        )
    assert by_stage[1] == {("1f1b", 1)}  # the default, unused without a pipeline
    assert by_stage[2] == {("1f1b", 1), ("zb_h1", 1), ("interleaved", 2)}  # 4 layers: 2 chunks of 1
    assert by_stage[4] == {("1f1b", 1), ("zb_h1", 1)}  # 4 layers do not split into 4 x 2 chunks
    assert all(c.plan.pipeline.microbatches in (c.sizes["stage"], 2 * c.sizes["stage"]) for c in found
               if c.sizes["stage"] > 1)  # fmt: skip
    asked = candidates(tiny, devices=8, global_batch=64, space=Space(schedules=("gpipe",)))
    assert {c.plan.pipeline.schedule for c in asked if c.sizes["stage"] > 1} == {"gpipe"}


def test_the_bubble_is_the_tables_idle_time_over_its_busy_time(found):
    """p = 2, m = 4: 1F1B and GPipe idle (p - 1)/m of the compute, interleaved (v = 2) (p - 1)/(v m),
    ZB-H1 (p - 1)/(3 m) (its slots are thirds of a forward and backward); the prediction charges it."""
    fractions = {}
    for schedule in ("gpipe", "1f1b", "interleaved", "zb_h1"):
        chunks = " v=2" if schedule == "interleaved" else ""
        c = found[f"pp data=4 stage=2 {schedule}{chunks} m=4 acc=1"]
        pipe = c.plan.pipeline
        table = build_pipeline_schedule(
            schedule, stages=2, microbatches=4, virtual_stages=pipe.virtual_stages
        )
        idle = (table.table[..., 0] == IDLE).sum()
        fractions[schedule] = _bubble_fraction(c)
        assert fractions[schedule] == pytest.approx(idle / (table.table[..., 0].size - idle))
        assert fractions[schedule] == pytest.approx(table.bubble / (1 - table.bubble))
        p = predict(c, parse_model(TINY), MACHINE)
        assert p.bubble_s == pytest.approx(p.compute_s * fractions[schedule]) and p.bubble_s > 0
    assert fractions == pytest.approx({"gpipe": 1 / 4, "1f1b": 1 / 4, "interleaved": 1 / 8, "zb_h1": 1 / 12})
    assert fractions["zb_h1"] < fractions["interleaved"] < fractions["1f1b"] == fractions["gpipe"]


def test_each_schedule_stashes_what_its_table_holds_in_flight(tiny, found):
    stash = {}
    for schedule in ("gpipe", "1f1b", "interleaved", "zb_h1"):
        chunks = " v=2" if schedule == "interleaved" else ""
        stash[schedule] = found[f"pp data=4 stage=2 {schedule}{chunks} m=4 acc=1"]
    virtual = {name: c.plan.pipeline.virtual_stages for name, c in stash.items()}
    tables = {
        name: build_pipeline_schedule(name, stages=2, microbatches=4, virtual_stages=v)
        for name, v in virtual.items()
    }
    counts = {name: int(table.in_flight.max()) for name, table in tables.items()}
    # GPipe all m; 1F1B and ZB-H1 min(m, p); interleaved its cap 2(p - 1) + (v - 1) p + 1 chunk inputs
    assert counts == {"gpipe": 4, "1f1b": 2, "interleaved": 5, "zb_h1": 2}
    memory = {name: predict(c, tiny, MACHINE).memory["activations"] for name, c in stash.items()}
    assert memory["1f1b"] < memory["gpipe"]
    # ZB-H1 also keeps, per W slot, every chunk layer's input and output gradient (the runtime's slots)
    c = stash["zb_h1"]
    row = c.plan.batch.micro_batch_size // 4 * tiny.seq_len * tiny.d_model * 4  # one hidden state, f32
    weight_slots = slot_plan(build_pipeline_schedule("zb_h1", stages=2, microbatches=4)).weight_slots
    sent = SCANNED_STAGE["zb_h1"].hidden_states_more - SCANNED_STAGE["1f1b"].hidden_states_more
    expected = (2 * 2 * weight_slots + sent) * row  # chunks of 2 layers
    assert memory["zb_h1"] - memory["1f1b"] == pytest.approx(expected, abs=2)
    # interleaved stashes more chunk inputs, but each recomputed chunk is half the stage's layers
    layer = predict(stash["1f1b"], tiny, MACHINE).memory["activations"] - memory["interleaved"]
    assert 0 < layer < memory["1f1b"] / 2


def test_interleaved_sends_an_activation_across_every_chunk_boundary(tiny, found):
    """p = 2 stages x v = 2 chunks: 3 boundaries (the last stage sends back to the first) against
    1F1B's 1, each twice per micro-batch: (p v - 1)/(p - 1) = 3 times 1F1B's permutes (what the
    compiled program sends: tests/test_pipeline.py)."""
    permuted = lambda c: sum(x.wire_bytes for t in theories(c, tiny) for x in t.collectives
                             if x.kind == "collective-permute")  # fmt: skip
    one = permuted(found["pp data=4 stage=2 1f1b m=4 acc=1"])
    assert one > 0 and permuted(found["pp data=4 stage=2 interleaved v=2 m=4 acc=1"]) == 3 * one
    assert permuted(found["pp data=4 stage=2 zb_h1 m=4 acc=1"]) == one


def test_sequence_parallelism_is_tried_with_tensor_and_no_pipeline_and_holds_fewer_activations(tiny, found):
    sp = [c for c in found.values() if c.plan.tensor.sequence_parallel]
    assert sp and all(c.sizes["tensor"] > 1 and c.sizes["stage"] == 1 for c in sp)
    assert {c.sizes["tensor"] for c in sp} == {2, 4}
    assert all(" sp" in c.label for c in sp) and not any(
        " sp" in c.label for c in found.values() if c not in sp
    )
    with_sp, without = found["ddp data=2 tensor=4 sp acc=1"], found["ddp data=2 tensor=4 acc=1"]
    a, b = predict(with_sp, tiny, MACHINE), predict(without, tiny, MACHINE)
    assert a.memory["activations"] < b.memory["activations"]
    # 30 tokens split over tensor = 2 only: the runtime needs the sequence divisible by tensor
    odd = parse_model("demo:d_model=256,layers=4,vocab=256,seq_len=30")
    split = {
        c.sizes["tensor"]
        for c in candidates(odd, devices=8, global_batch=64)
        if c.plan.tensor.sequence_parallel
    }
    assert split == {2}


def test_remat_is_tried_where_layers_are_not_recomputed_and_trades_compute_for_memory(tiny, found):
    remat = [c for c in found.values() if c.remat]
    assert remat and all(c.sizes["stage"] == 1 for c in remat)
    assert not any(c.plan.zero.stage == 3 and c.sizes["fsdp"] > 1 for c in remat)
    assert {c.plan.zero.stage for c in remat} == {0, 1, 2}
    assert {c.family for c in remat} == {c.family.replace(" remat", "") + " remat" for c in remat}
    on, off = (
        predict(found["ddp data=8 remat acc=1"], tiny, MACHINE),
        predict(found["ddp data=8 acc=1"], tiny, MACHINE),
    )
    assert on.memory["activations"] < off.memory["activations"] and on.compute_s > off.compute_s
    assert on.to_dict()["remat"] is True and off.to_dict()["remat"] is False


def test_space_switches_turn_each_dimension_off(tiny):
    space = Space(schedules=("1f1b",), sequence_parallel=False, remat=False, compression_methods=("int8",))
    found = candidates(tiny, devices=16, global_batch=64, slices=2, space=space)
    assert {c.plan.pipeline.schedule for c in found} == {"1f1b"}
    assert not any(c.plan.tensor.sequence_parallel or c.remat for c in found)
    assert {a.gradients.method for c in found for a in c.plan.compression} == {"int8"}


def test_compression_methods_are_tried_over_data_across_slices(tiny):
    found = candidates(tiny, devices=16, global_batch=64, slices=2)
    methods = {}
    for c in found:
        for a in c.plan.compression:
            methods.setdefault(a.gradients.method, set()).add(tuple(c.dcn))
    assert methods == {m: {("data",)} for m in ("int8", "topk", "powersgd")}
    assert not any(c.plan.compression for c in candidates(tiny, devices=8, global_batch=64))


def _data_wire(summary) -> float:
    """Bytes the compiled step sends over ``data`` alone."""
    return sum(c["wire_bytes"] * c["executions"] for c in summary["collectives"] if c["axes"] == ["data"])


@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_topk_and_powersgd_bytes_are_the_compiled_programs(tiny, method):
    """DDP over data = 8 (2 slices of 4): top-k all-gathers 41 values and their int16 positions per
    chunk of 4,096 of the padded bucket from every device; PowerSGD all-reduces P and Q of its
    matrix view. The planner's theory of those bytes equals what the compiled step sends, but the
    loss's float32 sum (a 4-byte all-reduce; XLA fuses it into PowerSGD's second one)."""
    from torsh_jax.demo.run import abstract_train_step
    from torsh_jax.runtime.inspect import inspect_step

    devices = require_devices(8)
    [c] = [
        c
        for c in candidates(tiny, devices=8, global_batch=16, slices=2)
        if c.label == f"ddp data=8 {method}@data acc=1"
    ]
    train, batch = abstract_train_step(c.plan, tiny.demo_config(), devices, num_slices=2)
    measured = _data_wire(inspect_step(train, train.abstract_state(), batch))
    planned = sum(x.wire_bytes for t in theories(c, tiny) for x in t.collectives if x.axes == ("data",))
    loss = ring_wire_bytes("all-reduce", 4, 8)
    assert planned + loss == measured, (planned, measured)
    plain = sum(x.wire_bytes for t in theories(c, tiny, compressed=False) for x in t.collectives)
    assert planned < plain / 10


def test_each_method_costs_its_own_codec_rate_and_old_machine_files_load(tiny, tmp_path):
    found = candidates(tiny, devices=16, global_batch=64, slices=2)
    by_method = {c.plan.compression[0].gradients.method: c for c in found
                 if c.plan.compression and c.label.startswith("ddp data=16 ")}  # fmt: skip
    machine = Machine.from_target("v5e-8", slices=2)
    measured = replace(machine, codec_s_per_element_by_method={"topk": 3e-9})
    # the buffers each method encodes, padded to 16 of its blocks (top-k: chunks, 1.7 % here)
    elements = {m: sum(compressed_buffers_of(by_method[m], tiny)["data"]) for m in ("int8", "topk")}
    assert all(tiny.param_count <= n < tiny.param_count * 1.02 for n in elements.values())
    assert codec_seconds(by_method["int8"], tiny, machine) == pytest.approx(
        elements["int8"] * machine.codec_s_per_element
    )
    assert codec_seconds(by_method["topk"], tiny, measured) == pytest.approx(elements["topk"] * 3e-9)
    assumed = codec_seconds(by_method["topk"], tiny, machine) / codec_seconds(
        by_method["int8"], tiny, machine
    )
    per_element = assumed * elements["int8"] / elements["topk"]
    assert per_element == pytest.approx(9.0)  # CODEC_VS_INT8: a stated assumption, not int8's rate
    old = json.loads(MACHINE.to_json())
    del old["codec_s_per_element_by_method"]
    assert Machine.from_json(json.dumps(old)) == MACHINE


#: Plans whose ``data`` gradients are compressed: ZeRO-1, -2 and -3 reduce-scatter over ``fsdp``
#: before ``data`` reduces, so their residuals are of the shard.
COMPRESSED = (
    "ddp data=8 acc=1",
    "zero1 data=2 fsdp=4 acc=1",
    "zero3 data=2 fsdp=4 acc=1",
    "ddp data=4 tensor=2 acc=1",
)


@pytest.mark.parametrize("method", ["int8", "topk", "powersgd"])
def test_compression_state_is_the_runtimes_to_the_byte(method):
    """The predicted feedback (residuals, PowerSGD's warm start) is what the runtime's step keeps
    per device; the codec's elements scale with it (ZeRO-1's were its whole gradient's before)."""
    import jax

    from torsh_jax.plan import AxisCompression, CompressorSpec
    from torsh_jax.planner.steps import demo_step_builder

    require_devices(8)
    shape = parse_model("demo:d_model=128,layers=2,vocab=256,seq_len=32")
    found = {c.label: c for c in candidates(shape, devices=8, global_batch=32)}
    compression = (AxisCompression(axis="data", gradients=CompressorSpec(method=method)),)
    machine = Machine.from_target("v5e-8", slices=2)
    codec = {}
    for label in COMPRESSED:
        c = replace(found[label], plan=found[label].plan.replace(compression=compression))
        train, _ = demo_step_builder(shape)(c.plan, jax.devices()[:8], remat=c.remat)
        kept = sum(
            _device_bytes(x) for x in jax.tree.leaves(train.abstract_state().feedback) if x.dtype == "float32"
        )
        assert memory_parts(c, shape, 2.0, machine)["feedback"] == kept, label
        codec[label] = codec_seconds(c, shape, machine)
    ddp, zero1 = codec["ddp data=8 acc=1"], codec["zero1 data=2 fsdp=4 acc=1"]
    assert zero1 == pytest.approx(ddp / 4, rel=0.02)


def _device_bytes(x) -> int:
    """Bytes of one device's shard of the abstract array ``x``."""
    shard = x.sharding.shard_shape(x.shape)
    return math.prod(shard) * x.dtype.itemsize


def test_plan_json_has_the_new_keys_and_a_remat_pick_says_the_model_must_recompute(capsys):
    from torsh_jax.cli.main import main
    from torsh_jax.cli.plan_cmd import REMAT_NOTE, _table

    assert main(["plan", "--model", TINY, "--target", "v5e-8", "--slices", "2", "--global-batch", "64",
                 "--json", "--top", "1000", "--verify", "0"]) == 0  # fmt: skip
    plans = json.loads(capsys.readouterr().out)["plans"]
    keys = {"remat", "schedule", "virtual_stages", "sequence_parallel", "compression"}
    assert all(keys <= set(p) for p in plans)
    assert {p["schedule"] for p in plans} >= {"1f1b", "interleaved", "zb_h1", None}
    assert {m for p in plans for m in p["compression"].values()} == {"int8", "topk", "powersgd"}
    assert any(p["remat"] for p in plans) and any(p["sequence_parallel"] for p in plans)
    machine = {"name": "x", "devices": 8, "memory_bytes": 1, "memory_source": "the machine file"}
    report = {"model": {"name": "m", "params": 1e6}, "machine": machine, "global_batch": 8, "candidates": 1,
              "fitting": 1, "pick": "ddp data=8 remat acc=1", "plans": [], "rules_of_thumb": [],
              "output": "plan.toml", "output_remat": True}  # fmt: skip
    assert _table(report).splitlines()[-2:] == ["wrote plan.toml", REMAT_NOTE]


def _sends_run(jaxpr, plan, times: float = 1.0) -> float:
    """Times the step's ``ppermute`` s run: each, in its sender pattern's scope inside the scan over
    the ticks, at the ticks of the table whose senders are that pattern; once per iteration of the
    loops around it (accumulation passes)."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    ticks, runs = plan.branch.shape[0], 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            direction, pattern = scoped_send(str(eqn.source_info.name_stack))
            table = plan.sends_forward if direction == "F" else plan.sends_backward
            runs += times / ticks * sum(tuple(row) == pattern for row in table.tolist())
        inner = [q for v in eqn.params.values() for q in (v if isinstance(v, tuple) else (v,))]
        inner = [q.jaxpr if isinstance(q, ClosedJaxpr) else q for q in inner]
        loops = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        runs += sum(_sends_run(q, plan, times * loops) for q in inner if isinstance(q, Jaxpr))
    return runs


@pytest.mark.parametrize(
    "label",
    [
        "pp data=2 stage=4 1f1b m=4 acc=2",
        "pp fsdp=4 stage=2 interleaved v=2 m=4 zero1 acc=1",
        "pp data=2 stage=4 zb_h1 m=8 acc=1",
    ],  # fmt: skip
)
def test_a_pipeline_pays_the_links_latency_once_per_ppermute_its_step_runs(tiny, label):
    """The α steps of the ``stage`` axis are the ``ppermute`` s the traced step runs (each at the
    ticks with its senders, in every accumulation pass), and the ring all-reduce of the
    embedding's and head's gradients over the ``p`` stages once: ``2 (p - 1)``."""

    from torsh_jax.demo.run import abstract_train_step

    devices = require_devices(8)
    [c] = [c for c in candidates(tiny, devices=8, global_batch=32) if c.label == label]
    train, batch = abstract_train_step(c.plan, tiny.demo_config(), devices)
    traced = train.jitted.trace(train.abstract_state(), train.shard_batch(batch))
    pipe = c.plan.pipeline
    table = build_pipeline_schedule(
        pipe.schedule,
        stages=c.sizes["stage"],
        microbatches=pipe.microbatches,
        virtual_stages=pipe.virtual_stages,
    )
    runs = _sends_run(traced.jaxpr.jaxpr, slot_plan(table))
    slow = replace(MACHINE, links={"ici": Link(alpha_s=1.0, bytes_per_s=float("inf"))})
    shared = 2 * (c.sizes["stage"] - 1)
    assert runs > 0 and predict(c, tiny, slow).comm_s["stage"] == pytest.approx(runs + shared)
