"""The planner's predicted memory against the compiled peak, over its whole candidate space.

``bench_planner.py`` checks 13 plans per model with a timed calibration; this compiles every
candidate the planner enumerates for the demo model on 8 simulated CPU devices (global batch 32:
DDP, ZeRO-1/2/3, tensor and sequence parallelism, remat, pipelines of every schedule and
micro-batch count, accumulation) and compares each prediction with ``memory_analysis()`` of its
compiled step, through :func:`torsh_jax.planner.rank.verify` (what ``plan --verify`` runs). The
machine's memory fields come from :func:`torsh_jax.planner.calibrate.compiled_memory` (compiled,
nothing timed), so the run needs no quiet machine.

``--tpu SET`` compiles a set of plans for a TPU target instead (:data:`TPU_SETS`: the demo model at
150 M on v5e-16, 350 M on v5e-32, 1 B and 7 B on v5e-256, and at ``d_model`` 512 with 4 layers and
768 with 6 layers on v5e-8; ``*_pp``, pipelines of three of them and of a layer-bound model,
``d_model`` 2048 with 8 layers, a vocabulary of 256 and 128 tokens; ``350m_dcn``, 350 M on two
v5e-32 slices with its gradients compressed over ``data`` across them); needs ``libtpu``, ``pip install
"torsh-jax[tpu-aot]"``; about half a minute a plan on 2 cores): the TPU compiler's peak against
the prediction from the target's figures (:mod:`torsh_jax.planner.compilers`), what ``plan
--target`` ranks by before it compiles. A plan the compiler refuses for memory is printed with no
``compiled`` peak and left out of the summaries. ``--tpu all`` compiles every set, one after
the other (over an hour on 2 cores), and prints the summaries over them all.
``--global-batch N`` compiles the set's plans at
another global batch; ``--scheduler-off`` compiles with libtpu's latency-hiding scheduler off,
which keeps no memory for overlapping collectives with compute (docs/planner.md: the scheduler
takes memory the step does not need when it has room).

Prints one ``planner_memory`` row per candidate (``plan``, ``kind``, ``predicted``, ``compiled``,
``error``; ``floor`` and ``floor_error`` where the prediction is a range: on a TPU, ZeRO-3
gathering on use and a pipeline stage) and one ``planner_memory_summary`` row per kind of plan and
overall: ``plans``, ``within_5pct``, ``max_abs_error``, ``mean_abs_error``, ``ranged`` (plans
predicted as a range) and ``within_range`` (of those, the compiled peak between the floor and
the total, 5 % either side).

Usage:
    python benchmarks/bench_planner_memory.py [--model small|medium] [--match TEXT] [--every N]
        [--offset K] [--quick]
    python benchmarks/bench_planner_memory.py --tpu 150m|350m|1b|7b|d512|d768|d512_pp|150m_pp|1b_pp|d2048_pp
        |350m_dcn [--match TEXT] [--global-batch N] [--scheduler-off]
    python benchmarks/bench_planner_memory.py --tpu all [--match TEXT] [--scheduler-off]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import common
from bench_planner import GLOBAL_BATCH, QUICK_MODELS
from bench_planner import MODELS as TIMED_MODELS

#: The models of bench_planner.py, its quick one too.
MODELS = {**TIMED_MODELS, **QUICK_MODELS}
#: Plans compiled for a TPU target (``--tpu``): model, target, global batch, candidate labels.
TPU_SETS = {
    "150m": ("demo:150m", "v5e-16", 128, (
        "ddp data=16 acc=4", "zero1 fsdp=16 acc=2", "zero1 fsdp=16 acc=4", "zero2 fsdp=16 acc=2",
        "zero2 fsdp=16 acc=4", "zero1 fsdp=16 remat acc=1", "zero1 fsdp=16 remat acc=2",
        "zero1 fsdp=16 remat acc=4", "zero2 fsdp=16 remat acc=2", "ddp data=16 remat acc=1",
        "zero3 fsdp=16 acc=1", "zero3 fsdp=16 acc=2", "zero3 fsdp=16 acc=4", "zero1 fsdp=8 tensor=2 acc=2",
        "zero2 fsdp=8 tensor=2 acc=4", "zero3 fsdp=8 tensor=2 acc=2", "zero1 fsdp=16 remat acc=8",
        "ddp data=16 remat acc=2", "ddp data=16 remat acc=4",
    )),
    "350m": ("demo:350m", "v5e-32", 128, (
        "zero1 fsdp=32 acc=2", "zero2 fsdp=32 acc=2", "zero3 fsdp=32 acc=1", "zero3 fsdp=32 acc=2",
        "zero1 fsdp=32 remat acc=1", "zero1 fsdp=16 tensor=2 acc=2", "zero2 fsdp=16 tensor=2 acc=2",
        "ddp data=32 acc=4",
    )),
    "1b": ("demo:1b", "v5e-256", 512, (
        "zero1 data=4 fsdp=32 tensor=2 acc=2", "zero1 data=4 fsdp=32 tensor=2 acc=4",
        "zero1 data=4 fsdp=32 tensor=2 sp acc=4", "zero1 fsdp=128 tensor=2 acc=4",
        "zero2 data=4 fsdp=32 tensor=2 acc=4", "zero2 fsdp=256 acc=2", "zero2 data=2 fsdp=128 acc=2",
        "zero2 fsdp=128 tensor=2 sp acc=2", "zero1 data=4 fsdp=32 tensor=2 remat acc=1",
        "zero1 data=4 fsdp=64 remat acc=1", "ddp data=128 tensor=2 remat acc=1", "zero3 fsdp=256 acc=1",
        "zero3 fsdp=256 acc=2", "zero3 data=2 fsdp=128 acc=1", "zero3 fsdp=128 tensor=2 acc=1",
        "zero1 data=4 fsdp=32 tensor=2 remat acc=2", "zero1 data=4 fsdp=64 remat acc=2",
        "ddp data=128 tensor=2 remat acc=2",
    )),
    "7b": ("demo:7b", "v5e-256", 512, (
        "zero3 fsdp=256 acc=1", "zero3 fsdp=128 tensor=2 acc=1", "zero1 fsdp=128 tensor=2 acc=4",
    )),
    "d512": ("demo:d_model=512,layers=4", "v5e-8", 32, (
        "ddp data=8 acc=1", "zero1 fsdp=8 acc=1", "zero1 fsdp=8 acc=2", "zero2 fsdp=8 acc=2",
        "zero1 fsdp=8 remat acc=1", "zero3 fsdp=8 acc=1", "zero3 fsdp=8 acc=2", "zero1 fsdp=4 tensor=2 acc=1",
        "zero3 fsdp=4 tensor=2 acc=1", "ddp data=4 tensor=2 sp acc=1",
    )),
    "d768": ("demo:d_model=768,layers=6", "v5e-8", 32, (
        "zero1 fsdp=8 acc=2", "ddp data=8 acc=2", "zero2 fsdp=8 acc=2", "zero1 fsdp=8 acc=4",
        "zero2 fsdp=8 acc=4", "zero1 fsdp=8 remat acc=2", "zero1 fsdp=8 acc=1",
    )),
    # pipelines, each stage costed as the step of its chunk on one micro-batch (every 27th and every
    # 93rd of the two models' pipelined candidates, and the 1 B pipeline of docs/pipeline.md)
    "d512_pp": ("demo:d_model=512,layers=4", "v5e-8", 32, (
        "pp tensor=2 stage=4 1f1b m=4 acc=8", "pp tensor=4 stage=2 1f1b m=4 acc=2",
        "pp fsdp=2 stage=4 1f1b m=8 zero2 acc=1", "pp fsdp=2 tensor=2 stage=2 1f1b m=4 zero1 acc=2",
        "pp fsdp=2 tensor=2 stage=2 zb_h1 m=4 zero2 acc=2",
        "pp fsdp=4 stage=2 interleaved v=2 m=2 zero1 acc=2", "pp fsdp=4 stage=2 1f1b m=2 zero3 acc=2",
        "pp data=2 tensor=2 stage=2 1f1b m=2 acc=8", "pp data=2 fsdp=2 stage=2 1f1b m=4 zero1 acc=1",
        "pp data=2 fsdp=2 stage=2 zb_h1 m=2 zero3 acc=1",
    )),
    "150m_pp": ("demo:150m", "v5e-16", 128, (
        "pp tensor=2 stage=8 zb_h1 m=8 acc=1",
        "pp fsdp=2 stage=8 1f1b m=16 zero1 acc=1",
        "pp fsdp=2 tensor=2 stage=4 interleaved v=2 m=4 zero3 acc=1",
        "pp fsdp=2 tensor=4 stage=2 1f1b m=2 zero3 acc=32",
        "pp fsdp=4 tensor=2 stage=2 1f1b m=2 zero1 acc=4",
        "pp fsdp=8 stage=2 1f1b m=4 zero1 acc=4",
        "pp data=2 tensor=4 stage=2 1f1b m=2 acc=8",
        "pp data=2 fsdp=2 tensor=2 stage=2 1f1b m=2 zero1 acc=1",
        "pp data=2 fsdp=4 stage=2 1f1b m=4 zero1 acc=1",
        "pp data=4 tensor=2 stage=2 interleaved v=2 m=4 acc=4",
    )),
    "1b_pp": ("demo:1b", "v5e-256", 512, ("pp data=16 tensor=8 stage=2 zb_h1 m=4 acc=2",)),
    # layer-bound stages: wide layers, a small vocabulary, short sequences
    "d2048_pp": ("demo:d_model=2048,layers=8,vocab=256,seq_len=128", "v5e-8", 32, (
        "pp data=2 stage=4 1f1b m=4 acc=1", "pp data=2 stage=4 1f1b m=4 acc=2",
        "pp stage=8 1f1b m=8 acc=1", "pp data=4 stage=2 1f1b m=4 acc=1",
        "pp data=2 stage=4 zb_h1 m=4 acc=1", "pp data=2 stage=4 interleaved v=2 m=4 acc=1",
        "pp fsdp=2 stage=4 1f1b m=4 zero1 acc=1", "pp fsdp=4 stage=2 1f1b m=4 zero3 acc=1",
    )),
    # two slices over DCN, gradients compressed over the data axis across them
    "350m_dcn": ("demo:350m", "v5e-32", 256, (
        "zero1 data=2 fsdp=32 acc=4", "zero1 data=2 fsdp=32 int8@data acc=4",
        "zero2 data=2 fsdp=32 int8@data acc=2", "zero3 data=2 fsdp=32 int8@data acc=1",
        "zero1 data=2 fsdp=32 topk@data acc=4", "zero1 data=2 fsdp=32 powersgd@data acc=4",
    ), 2),
}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--match", default="", help="only candidates whose label holds this text")
    parser.add_argument("--every", type=int, default=1, help="every N-th candidate (a sample)")
    parser.add_argument(
        "--offset", type=int, default=0, help="start at this candidate (--every 2 --offset 1: the other half)"
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model, every 40th candidate")
    parser.add_argument(
        "--tpu",
        choices=[*sorted(TPU_SETS), "all"],
        help="compile this set of plans (all: every set) for its TPU target",
    )
    parser.add_argument("--global-batch", type=int, help="with --tpu: this global batch, not the set's")
    parser.add_argument(
        "--scheduler-off", action="store_true", help="with --tpu: libtpu's latency-hiding scheduler off"
    )
    args = parser.parse_args()
    if args.tpu == "all" and args.global_batch:
        parser.error("--global-batch: each set has its own; give it with one --tpu SET")
    return args


def cpu_machine():
    """The 8 simulated devices the memory benchmarks compile for, before their compiled memory is
    read: memory is compiled, not timed, so the link and rate are placeholders."""
    from torsh_jax.planner.machine import Link, Machine

    return Machine("cpu-8", 8, 1, 1e9, 2**34, {"ici": Link(20e-6, 1e9)}, overlaps=False, platform="cpu")


def kind_of(candidate) -> str:
    """The candidate's kind: ZeRO stage or pipeline schedule, with tensor, remat, accumulation."""
    plan, sizes = candidate.plan, candidate.sizes
    if sizes["stage"] > 1:
        parts = [f"pp {plan.pipeline.schedule}"]
        if plan.zero.stage == 3 and sizes["fsdp"] > 1:
            parts.append("zero3")
    else:
        parts = [candidate.label.split()[0]]
    parts += [name for name, on in (("tensor", sizes["tensor"] > 1), ("remat", candidate.remat)) if on]
    if plan.batch.accumulation_steps > 1:
        parts.append("acc")
    return " ".join(parts)


def summary(rows: list[dict], kind: str) -> dict:
    errors = [abs(r["error"]) for r in rows]
    ranged = [r for r in rows if r.get("floor") is not None]
    return {
        "name": "planner_memory_summary",
        "kind": kind,
        "plans": len(rows),
        "within_5pct": sum(e <= 0.05 for e in errors),
        "max_abs_error": max(errors),
        "mean_abs_error": statistics.mean(errors),
        "ranged": len(ranged),  # predicted as a range (a memory floor below the total)
        "within_range": sum(_within_range(r) for r in ranged),
    }


def _floor_error(floor: int | None, peak: int | None) -> float | None:
    """The floor against the compiled peak (floor / peak - 1), where both are known."""
    return floor / peak - 1 if floor is not None and peak else None


def _within_range(row: dict) -> bool:
    """Whether the compiled peak lies between the floor and the total, 5 % either side."""
    return row["floor_error"] <= 0.05 and row["error"] >= -0.05


#: libtpu's flag that turns its latency-hiding scheduler off (``--scheduler-off``).
SCHEDULER_OFF = "--xla_tpu_enable_latency_hiding_scheduler=false"


def tpu_set(name: str) -> tuple:
    """``TPU_SETS[name]`` as ``(model, target, global batch, labels, slices)``: a set's fifth field
    is its target's slices, 1 where it has none."""
    model, target, global_batch, labels, *rest = TPU_SETS[name]
    return model, target, global_batch, labels, rest[0] if rest else 1


def tpu_rows(name: str, match: str, global_batch: int | None = None) -> list[dict]:
    """Each plan of ``TPU_SETS[name]`` compiled for its target (at ``global_batch``, else the
    set's) against its prediction."""
    from torsh_jax.planner.machine import Machine
    from torsh_jax.planner.shape import parse_model
    from torsh_jax.planner.space import candidates
    from torsh_jax.targets import parse_target, target_devices

    model, target_name, set_batch, labels, slices = tpu_set(name)
    global_batch = global_batch or set_batch
    shape = parse_model(model)
    machine = Machine.from_target(target_name, slices=slices)
    target = parse_target(target_name, slices=slices)
    found = candidates(shape, devices=machine.devices, global_batch=global_batch, slices=slices)
    by_label = {c.label: c for c in found}
    devices, rows = target_devices(target), []
    scheduler = "off" if SCHEDULER_OFF in os.environ.get("LIBTPU_INIT_ARGS", "") else "on"
    context = {"target": target_name, "slices": slices, "global_batch": global_batch, "scheduler": scheduler}
    for label in (label for label in labels if match in label):
        row = compared(by_label[label], shape, machine, devices, model=model, target=target, context=context)
        if row["compiled"] is not None:  # refused for memory: no peak to compare
            rows.append(row)
    return rows


def compared(
    candidate, shape, machine, devices, *, model: str, target=None, context: dict | None = None
) -> dict:
    """The candidate's predicted memory against its compiled peak (over ``devices``, a
    ``target``'s with it): one ``planner_memory`` row with ``context``'s keys, printed."""
    from torsh_jax.planner.cost import optimizer_state_factor, predict
    from torsh_jax.planner.rank import verify

    predicted = predict(candidate, shape, machine, opt_factor=optimizer_state_factor(candidate.plan))
    compiled = verify(predicted, shape, devices, target=target)
    row = {
        "name": "planner_memory",
        "model": model,
        **(context or {}),
        "plan": candidate.label,
        "kind": kind_of(candidate),
        "predicted": predicted.memory["total"],
        "compiled": compiled["peak"],
        "error": compiled["memory_error"],
        "fits": compiled["fits"],
        "floor": predicted.memory_floor,  # where the compiler's schedule decides: the range's low end
        "floor_error": _floor_error(predicted.memory_floor, compiled["peak"]),
    }
    common.emit(row)
    return row


def emit_summaries(rows: list[dict]) -> None:
    """One ``planner_memory_summary`` row per kind of plan, and one of them all."""
    for kind in sorted({r["kind"] for r in rows}):
        common.emit(summary([r for r in rows if r["kind"] == kind], kind))
    common.emit(summary(rows, "all"))


def main() -> int:
    args = parse_args()
    if args.tpu:  # torsh_jax.targets sets libtpu's environment; the host's devices stay CPUs
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        if args.scheduler_off:  # read by libtpu when it starts
            given = os.environ.get("LIBTPU_INIT_ARGS", "")
            os.environ["LIBTPU_INIT_ARGS"] = f"{given} {SCHEDULER_OFF}".strip()
        names = sorted(TPU_SETS) if args.tpu == "all" else [args.tpu]
        emit_summaries([row for name in names for row in tpu_rows(name, args.match, args.global_batch)])
        return 0
    common.setup_devices(8)
    import jax

    from torsh_jax.planner.calibrate import compiled_memory
    from torsh_jax.planner.shape import parse_model
    from torsh_jax.planner.space import candidates

    name, every, offset = ("tiny", 40, 0) if args.quick else (args.model, args.every, args.offset)
    shape, devices = parse_model(MODELS[name]), jax.devices()[:8]
    machine = cpu_machine()
    machine = dataclasses.replace(machine, **compiled_memory(shape, devices[0]))
    found = [c for c in candidates(shape, devices=8, global_batch=GLOBAL_BATCH) if args.match in c.label]
    sample = found[offset::every]
    emit_summaries([compared(candidate, shape, machine, devices, model=name) for candidate in sample])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
