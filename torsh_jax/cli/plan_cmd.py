"""``torsh-jax plan``: rank the plans for a model, a global batch and a machine by predicted step time.

Example:
    $ torsh-jax plan --model demo:1b --target v5e-256 --global-batch 512
    $ torsh-jax plan --model demo:150m --target v5e-16 --global-batch 128 --verify 1 --json -o plan.toml
    $ torsh-jax plan --model demo:d_model=128,layers=4 --machine machine.json --global-batch 64
    $ torsh-jax plan --model demo:1b --machine node.json --devices 64 --memory-limit 70GiB --global-batch 512
    $ torsh-jax plan --model my_model:planned --machine machine.json --global-batch 64 --verify 1
    $ torsh-jax plan --model demo:d_model=128,layers=4 --machine machine.json --global-batch 32 --measure 3
"""

from __future__ import annotations

import argparse
import sys

from torsh_jax.cli.args import MAX_DEVICES, bytes_type, count_type, names_type, output_file_type
from torsh_jax.planner.space import COMPRESSION_METHODS

__all__ = ["register"]

#: Plans compiled down the ranking by default for a target whose compiler is installed.
TARGET_VERIFY = 3

#: Seconds of compiling down the ranking after which no compile is started (the first always runs):
#: ``plan`` answers within 2 minutes on a slow host too.
VERIFY_SECONDS = 90


#: Said when a target's plans are predicted but not compiled, with the reason.
UNVERIFIED = "memory predicted, not compiled: {}"

#: Printed after writing a plan whose candidate recomputes its layers (a model property).
REMAT_NOTE = (
    "the plan file cannot say remat (a property of the model): build the model with each layer "
    "recomputed, LayeredModel(..., remat=True) or layered_model(cfg, remat=True)"
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("plan", help="rank parallel plans for a model and machine by predicted step time")
    parser.add_argument(
        "--model",
        default="demo:150m",
        help="demo:150m, demo:1b, ... or demo:d_model=N,layers=N[,vocab=N,seq_len=N,heads=N,mlp=N]; "
        "your model: MODULE:NAME, a PlannedModel (docs/planner.md) [demo:150m]",
    )
    parser.add_argument(
        "--global-batch",
        type=count_type(1, 2**31 - 1, fix="pass --global-batch 512"),
        required=True,
        help="examples per optimizer step",
    )
    parser.add_argument("--target", default=None, help="v5e-256, v5p-128, h100-16, ... (docs/targets.md)")
    parser.add_argument(
        "--slices",
        type=count_type(1, 64, fix="pass --slices 2"),
        default=1,
        help="TPU slices of --target joined over DCN [1]",
    )
    parser.add_argument(
        "--machine", default=None, help="a machine file (JSON, docs/planner.md) instead of --target"
    )
    parser.add_argument(
        "--devices",
        type=count_type(1, MAX_DEVICES, fix="pass --devices 64"),
        default=None,
        help="devices to plan for, of --machine's kind: part of one of its slices (nodes) or whole "
        "slices joined by its dcn link [the machine's]",
    )
    parser.add_argument(
        "--memory-limit",
        type=bytes_type(fix="pass --memory-limit 14GiB"),
        default=None,
        help="bytes one device may use, e.g. 14GiB to keep headroom (plans above it do not fit) "
        "[the machine's or target's]",
    )
    parser.add_argument(
        "--base", default=None, help="plan preset or file whose precision and optimizer the candidates keep"
    )
    parser.add_argument(
        "--top", type=count_type(1, 1000, fix="pass --top 10"), default=10, help="plans to print [10]"
    )
    parser.add_argument(
        "--verify",
        type=count_type(0, 100, fix="pass --verify 1"),
        default=None,
        help=f"compile down the ranking, at most N plans, until one fits [{TARGET_VERIFY} for a --target "
        "whose compiler is installed, else 0]",
    )
    parser.add_argument(
        "--verify-seconds",
        type=count_type(1, 86_400, fix="pass --verify-seconds 90"),
        default=VERIFY_SECONDS,
        help="start no compile that would end past this many seconds of compiling; the first always "
        f"runs [{VERIFY_SECONDS}]",
    )
    parser.add_argument(
        "--measure",
        type=count_type(0, 100, fix="pass --measure 3"),
        default=0,
        help="run the N best-ranked plans that fit, of those predicted within 15%% of the best, on this "
        "host's devices (a --machine file of them, no --target) and pick the fastest measured "
        "[0: pick by prediction]",
    )
    parser.add_argument(
        "--compression",
        type=names_type(COMPRESSION_METHODS),
        default=COMPRESSION_METHODS,
        help="gradient compressions tried over a data axis that crosses slices (nodes), a comma list, "
        f"or none (lossless plans only) [{','.join(COMPRESSION_METHODS)}]",
    )
    parser.add_argument("--json", action="store_true", help="print the ranking as JSON")
    parser.add_argument("-o", "--output", type=output_file_type(), default=None,
                        help="write the best plan to this file (TOML; JSON for a .json file)")  # fmt: skip
    parser.set_defaults(func=run, starts_jax=True)


def run(args: argparse.Namespace) -> int:
    from torsh_jax.cli.output import json_text, write_or_show
    from torsh_jax.errors import TargetError
    from torsh_jax.plan.io import load_plan, plan_text
    from torsh_jax.planner.rank import rules_of_thumb, search_verified
    from torsh_jax.planner.space import Space

    machine, target = _machine(args)
    measure_on = _measure_devices(args.measure, machine, target)  # before the model's module starts JAX
    base = load_plan(args.base, key="--base") if args.base else None
    shape, build, example, machine = _model(args, machine, target, base)
    check = lambda p: _verify(p, shape, target, machine, build)
    budget, unverified = _verify_budget(args.verify, target)
    search = lambda n: search_verified(
        shape,
        machine,
        global_batch=args.global_batch,
        budget=n,
        check=check,
        base=base,
        seconds=args.verify_seconds,
        space=Space(compression_methods=args.compression),
    )
    try:
        ranked, pick, machine, stopped = search(budget)
    except TargetError as error:
        if args.verify is not None:  # asked for: the error stands
            raise
        budget, unverified = 0, UNVERIFIED.format(error)
        ranked, pick, machine, stopped = search(0)
    if measure_on:
        ranked, pick = _measured(ranked, args.measure, shape, build, example, measure_on)
    shown = ranked[: max(args.top, ranked.index(pick) + 1 if pick in ranked else 0)]
    shown += [p for p in ranked[len(shown) :] if p.compiled]  # what the compiler refused, too
    unwritten = None  # the search is not lost to a full disk: the plan's text is shown instead
    if args.output and pick is not None:
        unwritten = write_or_show(args.output, plan_text(pick.candidate.plan, args.output))
    written = str(args.output) if args.output and pick is not None and unwritten is None else None
    report = {
        "model": {
            "name": shape.name,
            "params": shape.param_count,
            "layers": shape.layers,
            "d_model": shape.d_model,
            "tensor_collectives": _tensor_collectives(shape),
        },
        "activation_scale": machine.activation_scale,
        "machine": {
            "name": machine.name,
            "devices": machine.devices,
            "slices": machine.slices,
            "flops_per_s": machine.flops_per_s,
            "memory_bytes": machine.memory_bytes,
            "memory_source": _memory_source(args, target),
            "links": {
                kind: {
                    "medium": link.medium,
                    "alpha_s": link.alpha_s,
                    "bytes_per_s": link.bytes_per_s,
                    "algorithms": list(link.algorithms),
                }
                for kind, link in machine.links.items()
            },  # fmt: skip
            # the machine's compiled gradients are of this model: pipelines and ZeRO-3 cost them
            "compiled_gradients": machine.compiled_gradients_of(shape.signature),
            "host_load": machine.host_load,  # how busy the host was while calibrate measured
            "source": machine.source,
        },
        "global_batch": args.global_batch,
        "candidates": len(ranked),
        "fitting": sum(p.fits_as_compiled for p in ranked),
        "may_fit": sum(p.may_fit and not p.fits and not p.compiled for p in ranked),  # compiling decides
        "verify": budget,
        "verify_seconds": args.verify_seconds,
        "verify_stopped": stopped,
        "unverified": unverified,
        "pick": pick.candidate.label if pick is not None else None,
        "pick_by": _pick_by(pick),
        "compression": list(args.compression),
        "measure": args.measure,
        "measured_plans": sum(p.measured_s is not None for p in ranked),
        "plans": [p.to_dict() for p in shown],
        "rules_of_thumb": rules_of_thumb(ranked, shape, machine, pick) if ranked else [],
        "output": written,
        "output_remat": bool(written and pick.candidate.remat),
    }
    print(json_text(report) if args.json else _table(report))
    if args.json and report["output_remat"]:
        print(REMAT_NOTE, file=sys.stderr)  # stdout is the JSON
    if unwritten is not None:
        raise unwritten
    return 0


def _machine(args: argparse.Namespace):
    """The machine file (at ``--devices``), or the target's published figures; either with
    ``--memory-limit`` per device."""
    from dataclasses import replace

    from torsh_jax.errors import TargetError
    from torsh_jax.planner.machine import Machine
    from torsh_jax.targets import parse_target

    if args.target is not None and args.machine is not None:
        raise TargetError(
            f"--target {args.target} and --machine {args.machine} both name the machine",
            key="--machine",
            fix="keep one: --target for published figures, --machine for a calibrated machine file",
        )
    if args.target is None and args.machine is None:
        given = f" (--devices {args.devices} is how many of its devices)" if args.devices else ""
        raise TargetError(
            f"no machine given{given}",
            key="--target",
            fix="pass --target v5e-256 (published figures) or --machine machine.json [--devices N]"
            " (torsh-jax calibrate -o machine.json measures this one)",
        )
    if args.target is not None and args.devices is not None:
        raise TargetError(
            f"--target {args.target} names its devices",
            key="--devices",
            fix="drop --devices, or name the count in --target (v5e-64)",
        )
    if args.machine is not None:
        machine, target = Machine.load(args.machine), None
        _say_if_calibrated_busy(machine, args.machine)
        machine = machine if args.devices is None else machine.with_devices(args.devices)
    else:
        target = parse_target(args.target, slices=args.slices)
        machine = Machine.from_target(args.target, slices=args.slices)
    if args.memory_limit is not None:
        _check_memory_limit(args.memory_limit, target)
        source = f"{machine.source}; memory per device from --memory-limit"
        machine = replace(machine, memory_bytes=args.memory_limit, source=source)
    return machine, target


def _check_memory_limit(limit: int, target) -> None:
    """``--memory-limit`` keeps headroom below what a target's device may hold, never above it."""
    from torsh_jax.errors import TargetError
    from torsh_jax.units import format_bytes

    if target is None or limit <= target.memory_limit_bytes:
        return
    held = format_bytes(target.memory_limit_bytes)
    fix = f"pass at most {held}"
    if target.platform == "gpu":
        fix = "set XLA_CLIENT_MEM_FRACTION (e.g. 0.9) here and in the job, or " + fix
    raise TargetError(
        f"{format_bytes(limit)} is above the {held} a device of {target.name} may hold "
        f"({target.memory_limit_source})",
        key="--memory-limit",
        fix=fix,
    )


def _memory_source(args: argparse.Namespace, target) -> str:
    """Where the plan's memory per device comes from, for the report."""
    if args.memory_limit is not None:
        return "--memory-limit"
    return target.memory_limit_source if target is not None else "the machine file"


def _say_if_calibrated_busy(machine, path: str) -> None:
    """One line on stderr where the machine file was measured on a busy host (its ``host_load``)."""
    from torsh_jax.planner.host_load import recorded_busy

    busy = recorded_busy(machine.host_load)
    if busy is not None:
        print(
            f"torsh-jax plan: warning: {path} was calibrated while {busy.describe()}: its times may be "
            "slow; calibrate again on a quiet host",
            file=sys.stderr,
        )


def _verify_budget(verify: int | None, target) -> tuple[int, str | None]:
    """``--verify`` as given; unset, :data:`TARGET_VERIFY` for a target whose compiler is installed
    (its memory is the compiler's, not a formula's), else 0 with what is missing to compile. (A
    compiler installed but unable to start, unset, leaves the plans predicted and says why.)"""
    if verify is not None or target is None:
        return verify or 0, None
    from torsh_jax.targets import missing_compiler

    missing = missing_compiler(target.name)
    return (0, UNVERIFIED.format(missing)) if missing else (TARGET_VERIFY, None)


def _measure_devices(count: int, machine, target) -> list | None:
    """The devices ``--measure`` runs plans on: this host's, of the machine file's kind (``None``
    when not asked for); a :class:`~torsh_jax.errors.PlanError` where the devices planned for are
    not here."""
    from torsh_jax.errors import PlanError

    if not count:
        return None
    fix = "drop --measure, or plan for this host: torsh-jax calibrate -o m.json, then --machine m.json"
    if target is not None:
        why = f"runs plans on this host's devices, not on target {target.name}'s"
    elif (devices := _host_devices(machine)) is None:
        why = f"runs plans on this host's devices; machine {machine.name!r} is of {machine.platform} devices"
    else:
        return devices
    raise PlanError(why, key="--measure", fix=fix)


def _measured(ranked: list, count: int, shape, build, example, devices) -> tuple[list, object]:
    """``ranked`` with the step time of its ``count`` best plans that fit measured on ``devices``
    (:func:`~torsh_jax.planner.measure.measure_best`), and the fastest of them: the pick; a warning
    where other work took the host's cores meanwhile."""
    import dataclasses

    from torsh_jax.planner.host_load import HostMeter, warn_if_busy
    from torsh_jax.planner.measure import demo_example, measure_best
    from torsh_jax.planner.steps import demo_step_builder

    example = demo_example(shape) if build is None else example
    with HostMeter() as meter:
        times = measure_best(ranked, count, build or demo_step_builder(shape), devices, example)
    warn_if_busy(meter.load, f"while plan ran its {len(times)} best-ranked plans")
    ranked = [dataclasses.replace(p, measured_s=times.get(p.candidate.label)) for p in ranked]
    pick = min((p for p in ranked if p.measured_s is not None), key=lambda p: p.measured_s, default=None)
    return ranked, pick


def _pick_by(pick) -> str | None:
    """How the pick was chosen: ``measured`` (the fastest run), ``compiled`` (the best-ranked plan
    that compiled and fit) or ``predicted``."""
    if pick is None:
        return None
    return "measured" if pick.measured_s is not None else "compiled" if pick.compiled else "predicted"


def _model(args: argparse.Namespace, machine, target, base):
    """``(shape, step builder, example batch, machine)`` of ``--model``: the demo model's shape (its
    step built by ``verify``: no builder or example), or your model's (``MODULE:NAME``,
    :mod:`~torsh_jax.planner.own_model`) with its own step, its collectives over ``tensor`` read
    from its compiled step where the compiler partitions it and devices to compile on exist
    (:func:`_target_devices`, :func:`_host_devices`), and, where the machine file's compiled
    gradients are of this host's kind of device, the compiled memory of its own gradient."""
    from torsh_jax.planner.own_model import load_planned_model, names_own_model
    from torsh_jax.planner.shape import parse_model
    from torsh_jax.planner.space import candidates

    spec = args.model
    if not names_own_model(spec):
        return parse_model(spec), None, None, machine
    host = _host_devices(machine) if target is None else None  # before the model's module starts JAX
    planned = load_planned_model(spec)
    devices = None if planned.shape.tensor_blocks else _target_devices(target) or host
    if devices:
        found = candidates(
            planned.shape,
            devices=machine.devices,
            global_batch=args.global_batch,
            slices=machine.slices,
            base=base,
        )
        planned = planned.with_tensor_counts(found, devices)
    if machine.compiled_for and host:
        import dataclasses

        from torsh_jax.planner.calibrate import compiled_memory

        own = compiled_memory(planned.shape, host[0], gradients=planned.gradients())
        machine = dataclasses.replace(machine, **own)
    return planned.shape, planned.step_builder(), planned.example, machine


def _target_devices(target) -> list | None:
    """The target's compile-only devices, with its compiler installed (else ``None``)."""
    if target is None:
        return None
    from torsh_jax.targets import missing_compiler, target_devices

    return None if missing_compiler(target.name) else target_devices(target)


def _host_devices(machine) -> list | None:
    """This host's devices where they are of the machine file's kind (``None`` otherwise): for a
    CPU machine its ``devices`` simulated ones, requested before JAX starts, as ``--verify`` uses."""
    import jax

    if machine.platform == "cpu":
        from torsh_jax.demo.devices import select_devices

        devices = select_devices(machine.devices)
    else:
        devices = jax.devices()
    return devices if devices[0].platform == machine.platform else None


def _tensor_collectives(shape) -> str:
    """How the plans' collectives over ``tensor`` are counted (the report's ``model`` entry)."""
    if shape.tensor_blocks:
        return "Megatron's (the model's tensor blocks)"
    if not shape.tensor_counts:
        return "Megatron's (no devices of the machine's kind to compile the model's step on)"
    sizes = sorted({key[0] for key, _ in shape.tensor_counts})
    return "compiled: the model's step over tensor=" + ",".join(map(str, sizes))


def _verify(prediction, shape, target, machine, build=None) -> dict:
    from torsh_jax.planner.rank import verify

    if target is None:
        from torsh_jax.demo.devices import select_devices

        return verify(prediction, shape, select_devices(machine.devices), build=build)
    from torsh_jax.errors import TargetError
    from torsh_jax.targets import missing_compiler, target_devices

    missing = missing_compiler(target.name)
    if missing is not None:
        raise TargetError(missing, key="--verify", fix="install it, or drop --verify")
    return verify(prediction, shape, target_devices(target), target=target, build=build)


def _table(report: dict) -> str:
    """The report as text: the model and machine, the plans as a table (:func:`_plans_table`), the
    pick and the rules of thumb."""
    from torsh_jax.units import format_bytes

    m = report["machine"]
    lines = [
        f"{report['model']['name']} ({report['model']['params'] / 1e6:,.0f} M parameters), global batch "
        f"{report['global_batch']}, on {m['name']} ({m['devices']} devices, "
        f"{format_bytes(m['memory_bytes'])} each: {m['memory_source']})",
        f"{report['candidates']} plans considered, {report['fitting']} fit{_may_fit_text(report)}; "
        "predicted per step:",
        _rendered(_plans_table(report["plans"])),
    ]
    if report.get("pick_by") == "measured":
        run = report["measured_plans"]
        lines.append(f"pick: {report['pick']} (the fastest of the {run} best-ranked plans run here)")
    elif report["pick"]:
        lines.append(f"pick: {report['pick']}")
    elif report.get("verify_stopped"):
        lines.append(f"pick: none; {report['verify_stopped']} (pass --verify-seconds S)")
    elif report.get("verify"):
        lines.append(f"pick: none; no plan compiled and fit in {report['verify']} compiles (pass --verify N)")
    if report.get("unverified"):
        lines.append(report["unverified"])
    for row in report["rules_of_thumb"]:
        lines.append(f"rule of thumb: {row['rule']}: {row['reason']}")
    if report["output"]:
        lines.append(f"wrote {report['output']}")
    if report["output_remat"]:
        lines.append(REMAT_NOTE)
    return "\n".join(lines)


def _plans_table(plans: list[dict]):
    """One row per plan: the predicted step and its parts (compute, bubble, each mesh axis's
    communication before overlap, the exposed part of it), memory per device, what the compiler
    said and, where plans were run (``--measure``), the measured step."""
    from rich import box
    from rich.table import Table

    from torsh_jax.plan.spec import AXES

    axes = [a for a in AXES if any(a in p["comm_s"] for p in plans)]  # in the plan's order
    dashed_head = box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)
    table = Table(box=dashed_head, show_edge=False, pad_edge=False)
    table.add_column("plan", no_wrap=True)
    for name in ("step", "compute", "bubble", *(f"{a} comm" for a in axes), "exposed", "memory"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("compiled", no_wrap=True)
    measured = any(p["measured_s"] is not None for p in plans)
    if measured:
        table.add_column("measured", justify="right", no_wrap=True)
    for p in plans:
        comm = [_ms(p["comm_s"][a]) if a in p["comm_s"] else "-" for a in axes]
        table.add_row(
            p["label"] + _fit_note(p),
            *(_ms(p[k]) for k in ("step_s", "compute_s", "bubble_s")),
            *comm,
            _ms(p["exposed_s"]),
            _memory_text(p),
            _compiled_text(p["compiled"]),
            *([_ms(p["measured_s"]) if p["measured_s"] is not None else ""] if measured else []),
        )
    return table


def _may_fit_text(report: dict) -> str:
    """`` (3 more may: the compiler decides)`` where plans fit by their floor alone, else nothing."""
    more = report.get("may_fit")
    return f" ({more} more may: the compiler decides)" if more else ""


def _fit_note(plan: dict) -> str:
    """After a plan's label: nothing where it fits (as compiled, where it was), ``(may fit)`` where
    only its floor does and it was not compiled, else ``(does not fit)``."""
    if plan.get("fits_as_compiled", plan["fits"]):
        return ""
    return " (may fit)" if plan.get("may_fit") and not plan["compiled"] else " (does not fit)"


def _memory_text(plan: dict) -> str:
    """The predicted memory per device: ``1.2 GiB``, or ``0.8-1.2 GiB`` where the compiler's
    schedule decides between a floor and the total (``memory_floor``)."""
    from torsh_jax.units import format_bytes

    total, floor = plan["memory"]["total"], plan.get("memory_floor")
    return format_bytes(total) if floor is None else f"{format_bytes(floor)} to {format_bytes(total)}"


def _rendered(table) -> str:
    """``table`` as plain text at its own width: squeezed into a narrow terminal, its figures would
    be cut short."""
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=10_000, color_system=None, highlight=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


def _compiled_text(compiled: dict | None) -> str:
    """``12.9 GiB (-1%)``, with the step its schedule's overlap gives (a target's: ``; step 143.4
    ms``); ``16.5 GiB (+3%, does not fit)`` where the compiler found it too large (a refusal's
    figure is the peak it needed); or nothing (not compiled)."""
    from torsh_jax.units import format_bytes

    if not compiled:
        return ""
    if compiled["peak"] is None:
        return "refused"
    fits = "" if compiled["fits"] else ", does not fit"
    step = f"; step {_ms(compiled['step_s'])}" if compiled.get("step_s") is not None else ""
    return f"{format_bytes(compiled['peak'])} ({compiled['memory_error']:+.0%}{fits}){step}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
