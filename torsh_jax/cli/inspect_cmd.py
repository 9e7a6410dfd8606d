"""``torsh-jax inspect``: collectives and per-device memory of a plan's compiled train step.

Example:
    $ torsh-jax inspect --plan ddp --devices 8 --json
    $ torsh-jax inspect --plan zero3 --target v5e-16 --json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from torsh_jax.cli.args import MAX_DEVICES, count_type

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("inspect", help="list collectives and memory of a plan's compiled train step")
    parser.add_argument("--plan", default="ddp", help="preset name (meshes/*.toml) or plan file [ddp]")
    parser.add_argument(
        "--devices", type=count_type(1, MAX_DEVICES, fix="pass --devices 8"), default=None,
        help="devices; simulated on CPU, bounded by host memory [8; with --target: the target's]",
    )  # fmt: skip
    parser.add_argument("--target", default=None,
                        help="compile for an accelerator this machine does not have: v5e-16, v4-32, v5p-64, "
                             "v6e-64, h100-8, a100-8, ... (docs/targets.md)")  # fmt: skip
    parser.add_argument("--slices", type=count_type(1, 64, fix="pass --slices 2"), default=1,
                        help="TPU slices of --target joined over the data-center network [1]")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--layers", type=count_type(1, 256, fix="pass --layers 4"), default=None,
                        help="demo model layers [4, or a multiple of stages x chunks]")  # fmt: skip
    parser.add_argument("--d-model", type=count_type(16, 8192, fix="pass --d-model 64"), default=64,
                        help="demo model width [64]")  # fmt: skip
    parser.add_argument("--vocab", type=count_type(2, 1_048_576, fix="pass --vocab 32000"), default=256,
                        help="demo model vocabulary [256]")  # fmt: skip
    parser.add_argument("--seq-len", type=count_type(1, 1_048_576, fix="pass --seq-len 1024"), default=32,
                        help="demo model tokens per example [32]")  # fmt: skip
    parser.add_argument(
        "--micro-batch",
        type=count_type(1, 1_048_576, fix="pass --micro-batch 8"),
        default=None,
        help="examples per data-parallel rank per micro-step [the plan's]",
    )
    parser.set_defaults(func=run, starts_jax=True)


def run(args: argparse.Namespace) -> int:
    from torsh_jax.analysis import render_text
    from torsh_jax.cli.output import json_text
    from torsh_jax.plan.io import load_plan

    plan = _with_micro_batch(load_plan(args.plan, key="--plan"), args.micro_batch)
    target = _target(args)
    compiling = _say_compiling(args, plan, target)
    summary = (
        _target_summary(args, plan, target, compiling) if target else _cpu_summary(args, plan, compiling)
    )
    text = render_text(summary) + _pipeline_text(summary) if "collectives" in summary else ""
    print(json_text(summary) if args.json else text + _target_text(summary) + _notes(summary))
    return 0  # "does not fit" is a result, not a failure


def _with_micro_batch(plan, micro_batch: int | None):
    """``plan`` with ``--micro-batch`` examples per data-parallel rank per micro-step (if given)."""
    import dataclasses

    if micro_batch is None:
        return plan
    return dataclasses.replace(plan, batch=dataclasses.replace(plan.batch, micro_batch_size=micro_batch))


def _target(args: argparse.Namespace):
    """The ``--target`` (``None``: simulated CPU devices); checked before anything compiles."""
    from torsh_jax.errors import TargetError
    from torsh_jax.targets import missing_compiler, parse_target

    if args.target is None:
        if args.slices != 1:
            raise TargetError(
                "slices need a TPU target", key="--slices", fix="add --target v5e-16, or drop --slices"
            )
        return None
    if args.devices is not None:
        raise TargetError(
            "the target decides the devices", key="--devices", fix="drop --devices, or drop --target"
        )
    target = parse_target(args.target, slices=args.slices)
    missing = missing_compiler(target.name)
    if missing is not None:
        raise TargetError(missing, key="--target", fix="install it, then run the command again")
    return target


def _train_step(args: argparse.Namespace, plan, devices, *, num_slices: int | None = None):
    """The demo model's train step over ``devices`` (built from parameter shapes: nothing is allocated),
    and a global batch of token shapes."""
    import dataclasses

    from torsh_jax.demo.run import DemoConfig, abstract_train_step, model_config
    from torsh_jax.runtime.mesh import build_mesh

    mesh_shape = dict(build_mesh(plan, devices, num_slices=num_slices).shape)
    cfg = model_config(DemoConfig(plan=plan, layers=args.layers, d_model=args.d_model), mesh_shape)
    cfg = dataclasses.replace(cfg, vocab=args.vocab, seq_len=args.seq_len)
    return abstract_train_step(plan, cfg, devices, num_slices=num_slices)


def _say_compiling(args: argparse.Namespace, plan, target) -> Callable[[], None]:
    """Says on stderr that the step compiles, once it is built (its checks passed); nothing with
    ``--json`` (stdout carries the report only)."""
    from torsh_jax.cli.output import Progress

    if args.json:
        return lambda: None
    where = (
        f"for {target.name} ({target.devices} x {target.chip.name})"
        if target
        else f"on {args.devices or 8} devices"
    )
    return lambda: Progress(f"inspect ({plan.name})", 0, live=False).phase(
        f"compiling the train step {where}"
    )


def _cpu_summary(args: argparse.Namespace, plan, compiling: Callable[[], None]) -> dict:
    from torsh_jax.demo.devices import select_devices
    from torsh_jax.runtime.inspect import inspect_step

    train, batch = _train_step(args, plan, select_devices(args.devices or 8))
    compiling()
    return inspect_step(train, train.abstract_state(), batch)


def _target_summary(args: argparse.Namespace, plan, target, compiling: Callable[[], None]) -> dict:
    """The step compiled by the target's compiler: the CPU report's keys where it compiled, and
    ``target`` (memory fit, roofline; the compiler's message when the step does not fit)."""
    from torsh_jax.runtime.inspect import inspect_step
    from torsh_jax.targets import compile_for_target, target_devices

    train, batch = _train_step(args, plan, target_devices(target), num_slices=target.slices)
    compiling()
    report = compile_for_target(train, batch, target=target)
    if report.compiled is None or target.slices > 1:
        summary = {"plan": plan.name, "roles": train.layout.roles.describe(), "notes": list(train.notes)}
        summary["notes"] += [MULTI_SLICE_NOTE] if report.compiled is not None else []
    else:
        summary = inspect_step(train, train.abstract_state(), batch, compiled=report.compiled)
    return {**summary, "target": report.to_json()}


#: Why a multi-slice target's report has no collectives.
MULTI_SLICE_NOTE = (
    "collectives: not listed for a multi-slice target: the TPU compiler's program is one slice's "
    "(its devices are the slice's chips) and the cross-slice collectives are runtime calls "
    "(AsyncCollectiveStart/Done), not collectives of the program"
)


def _target_text(summary: dict) -> str:
    """The target section as text: fit, memory and the roofline bound."""
    from torsh_jax.units import format_bytes

    section = summary.get("target")
    if section is None:
        return ""
    memory = section["memory"]
    verdict = "fits" if section["fits"] else "does NOT fit"
    shape = (
        section["topology"]
        if section["slices"] == 1
        else f"{section['slices']} slices of {section['topology']}"
    )
    lines = [
        f"target {section['name']}: {section['chips']} x {section['chip']} ({shape}), "
        f"HBM limit {format_bytes(section['hbm_limit_bytes'])} per chip ({section['hbm_limit_source']})",
        "memory per chip: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in memory.items() if v is not None),
        f"{verdict}: margin {format_bytes(section['margin_bytes'])}",
    ]
    if section["roofline_step_s"] is not None:
        mfu = section["mfu_bound"]
        lines.append(
            f"roofline step time >= {section['roofline_step_s'] * 1e3:.3f} ms (flops {section['flops']:.3e}, "
            f"bytes {section['bytes_accessed']:.3e} per chip"
            + (f"; MFU <= {mfu:.2f})" if mfu is not None else
               f"; counting {section['while_loops']} while loop bodies once: a lower bound, no MFU bound)")
        )  # fmt: skip
    elif section["compiler_message"] is None:
        lines.append("roofline: the compiler reports no cost analysis for this target")
    lines += _overlap_lines(section.get("overlap"))
    if section["compiler_message"]:
        lines.append(f"compiler: {section['compiler_message']}")
    return "\n".join(lines) + "\n"


def _overlap_lines(overlap: dict | None) -> list[str]:
    """``collectives overlapping compute: 0.93 of 1.2 GiB (all-gather 1.00, reduce-scatter 0.86)``."""
    from torsh_jax.units import format_bytes

    if not overlap or not overlap["bytes"]:
        return []
    kinds = ", ".join(
        f"{kind} {group['fraction']:.2f}" for kind, group in overlap["by_kind"].items() if group["bytes"]
    )
    places = ", ".join(
        f"{place.replace('_', ' ')} {group['fraction']:.2f} of {format_bytes(group['bytes'])}"
        for place, group in overlap.get("by_place", {}).items() if group["bytes"]
    )  # fmt: skip
    return [f"collectives overlapping compute: {overlap['fraction']:.2f} of {format_bytes(overlap['bytes'])} "
            f"per step ({kinds}; {overlap['async']} of {overlap['count']} asynchronous)",
            f"  by place: {places}"]  # fmt: skip


def _notes(summary: dict) -> str:
    """What the step changed or what the report cannot say, one ``note:`` line each."""
    return "".join(f"note: {note}\n" for note in summary.get("notes", []))


def _pipeline_text(summary: dict) -> str:
    """The schedule grid (rows stages, columns ticks), its bubble and the activations each stage holds."""
    pipe = summary.get("pipeline")
    if pipe is None:
        return ""
    from torsh_jax.pipeline.schedule import render_grid
    from torsh_jax.units import format_bytes

    stage = (summary.get("theory") or {}).get("axes", {}).get("stage") or {}
    lines = [
        f"pipeline: {pipe['schedule']}, {pipe['stages']} stages x {pipe['microbatches']} micro-batches, "
        f"{pipe['ticks']} ticks, bubble {pipe['bubble']:.3f} (theory {pipe['theory_bubble']:.3f})",
        render_grid(pipe["grid"]),
        "activations held per stage: " + ", ".join(str(n) for n in pipe["in_flight"]),
    ]
    if stage:
        lines.append(f"stage bytes per device: {stage['measured_wire_bytes']:,.0f} measured, "
                     f"{stage['wire_bytes']:,.0f} theory (ratio {stage['wire_ratio']:.3f})")  # fmt: skip
    sent = ", ".join(format_bytes(s["wire_bytes"]) for s in summary.get("stage_totals", []))
    lines += [f"wire bytes per device and step, by stage (its own branches): {sent}"] if sent else []
    return "\n".join(lines) + "\n"
