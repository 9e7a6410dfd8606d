"""``torsh-jax demo``: train the small transformer LM under a plan on (simulated) devices.

Results go to stdout (a summary table, or ``--json`` lines); progress goes to
stderr: a live bar on a terminal, plain lines otherwise, nothing with
``--json``. ``--steps 0`` (or ``--compile-only``) builds and compiles the step, reports its
memory and wire bytes, and trains nothing; ``--compile-only --target v5e-16``
compiles it for an accelerator this machine does not have and prints what
``torsh-jax inspect --target`` prints.

Example:
    $ torsh-jax demo --plan ddp --devices 8 --steps 20 --verify
    $ torsh-jax demo --plan zero3 --compile-only --target v5e-16 --json
"""

from __future__ import annotations

import argparse
import sys

from torsh_jax.cli.args import MAX_DEVICES, MAX_STEPS, count_type
from torsh_jax.cli.output import Progress, print_json
from torsh_jax.units import format_bytes

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="train a small transformer LM on synthetic tokens under a plan")
    parser.add_argument("--plan", default="ddp", help="preset name (meshes/*.toml) or plan file [ddp]")
    parser.add_argument(
        "--devices", type=count_type(1, MAX_DEVICES, fix="pass --devices 8"), default=None,
        help="devices; simulated on CPU, bounded by host memory [8; with --target, the target's]",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=count_type(0, MAX_STEPS, fix="pass --steps 20"), default=None,
        help="optimizer steps; 0 compiles and reports without training [20; 0 with --compile-only]",
    )  # fmt: skip
    parser.add_argument("--compile-only", action="store_true",
                        help="build and compile the step, train nothing (--steps 0); with --target, "
                             "for that target")  # fmt: skip
    parser.add_argument("--target", default=None,
                        help="with --compile-only: compile for v5e-16, v4-32, h100-8, ... "
                             "(docs/targets.md)")  # fmt: skip
    parser.add_argument("--slices", type=count_type(1, 64, fix="pass --slices 2"), default=1,
                        help="TPU slices of --target joined over the data-center network [1]")  # fmt: skip
    parser.add_argument("--verify", action="store_true",
                        help="also run the single-device twin in float32 and float64; compare")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per step, then a summary object")
    parser.add_argument("--seed", type=count_type(0, 2**31 - 1, fix="pass --seed 0"), default=0,
                        help="parameter and data seed [0]")  # fmt: skip
    parser.add_argument("--layers", type=count_type(1, 256, fix="pass --layers 4"), default=None,
                        help="transformer layers [4, or a multiple of stages x chunks]")  # fmt: skip
    parser.add_argument("--d-model", type=count_type(16, 8192, fix="pass --d-model 64"), default=64,
                        help="model width [64]")  # fmt: skip
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", default=None,
        help="save checkpoints here (every --save-every steps and at the last step)",
    )  # fmt: skip
    parser.add_argument(
        "--save-every", type=count_type(1, MAX_STEPS, fix="pass --save-every 10"), default=0, metavar="K",
        help="steps between checkpoints [only the last step]",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint-dir, up to --steps in total",
    )  # fmt: skip
    parser.add_argument("--log-dir", metavar="DIR", default=None,
                        help="write a run log here: plan, inspect report, one JSON line per step "
                             "(docs/report.md)")  # fmt: skip
    parser.add_argument("--profile", metavar="STEPS", default=None,
                        help="trace steps FIRST:LAST (3:5) with jax.profiler into --log-dir")  # fmt: skip
    parser.add_argument("--tensorboard", action="store_true",
                        help="also write TensorBoard scalars into --log-dir (tensorboardX)")  # fmt: skip
    parser.add_argument("--machine", metavar="FILE", default=None,
                        help="machine file (calibrate -o) to model communication in the log")  # fmt: skip
    parser.set_defaults(func=run, starts_jax=True)


def _summary_rows(summary: dict) -> dict[str, str]:
    loss = summary["final_loss"]
    rows = {
        "mesh": ", ".join(f"{k}={v}" for k, v in summary["mesh"].items()),
        "parameters": f"{summary['param_count']:,}",
        "global batch": str(summary["global_batch_size"]),
        "steps": str(summary["steps"]),
        "final loss": "trained nothing (--steps 0)" if loss is None else f"{loss:.4f}",
        "wire bytes / step (measured)": format_bytes(summary["wire_bytes_per_step"]),
        "wire bytes / step (theory)": format_bytes(summary["theoretical_wire_bytes_per_step"]),
        "measured / theory": _ratios(
            summary.get("wire_ratio_by_axis") or {}, summary.get("unmodelled_wire_bytes_by_axis")
        ),
        "memory / device": format_bytes(summary["memory_per_device_bytes"]),
        "compiles": str(summary["compiles"]),
    }
    if summary.get("max_rel_err") is not None:
        rows["max relative loss diff vs 1 device"] = f"{summary['max_rel_err']:.2e}"
    if summary.get("within_roundoff") is not None:
        rows["within round-off of float64"] = _roundoff_text(summary)
    if summary.get("resumed_from_step") is not None:
        rows["resumed from step"] = str(summary["resumed_from_step"])
    if summary.get("checkpoint_steps"):
        rows["checkpoints kept"] = ", ".join(map(str, summary["checkpoint_steps"]))
    if summary.get("log_dir"):
        rows["run log"] = f"{summary['log_dir']} (torsh-jax report {summary['log_dir']})"
    return rows


def _roundoff_text(summary: dict) -> str:
    """``yes (loss 1.2e-07 <= 1.1e-06)``: the twin criterion on the losses (error against float64,
    bound)."""
    verdict = "yes" if summary["within_roundoff"] else "no"
    relation = "<=" if summary["within_roundoff"] else ">"
    error, bound = summary["parallel_vs_float64"], summary["roundoff_bound"]
    return f"{verdict} (loss {error:.1e} {relation} {bound:.1e})"


def _ratios(by_axis: dict, unmodelled: dict | None) -> str:
    """``data parallel 1.00, stage 1.00; tensor not modelled``: measured / theory wire bytes per axis."""
    shown = [f"{name.replace('_', ' ')} {ratio:.2f}" for name, ratio in by_axis.items() if ratio is not None]
    text = ", ".join(shown) or "-"
    return text + (f"; {', '.join(unmodelled)} not modelled" if unmodelled else "")


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"demo: plan {summary['plan']} on {summary['devices']} devices")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in _summary_rows(summary).items():
        table.add_row(key, value)
    Console(soft_wrap=True).print(table)


def _step_text(record: dict) -> str:
    return (
        f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
        f"wire {format_bytes(record['wire_bytes_per_step'])}/step | "
        f"mem {format_bytes(record['memory_per_device_bytes'])}/device"
    )


def run(args: argparse.Namespace) -> int:
    from torsh_jax.demo.run import DemoConfig, run_demo
    from torsh_jax.plan.io import load_plan

    steps = _steps(args)
    if args.target is not None or args.slices != 1:
        return _compile_for_target(args)
    plan = load_plan(args.plan, key="--plan")  # before any output or JAX start-up
    config = DemoConfig(
        plan=plan,
        devices=8 if args.devices is None else args.devices,
        steps=steps,
        verify=args.verify,
        seed=args.seed,
        layers=args.layers,
        d_model=args.d_model,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        resume=args.resume,
        log_dir=args.log_dir,
        profile=args.profile,
        tensorboard=args.tensorboard,
        machine=args.machine,
    )
    if args.json:
        print_json(run_demo(config, emit=print_json))
        return 0
    with Progress(f"training ({plan.name})", steps) as progress:
        emit = lambda record: progress.step(record["step"], _step_text(record))
        summary = run_demo(config, emit=emit, phase=progress.phase)
    _print_summary(summary)
    sys.stdout.flush()
    return 0


def _steps(args: argparse.Namespace) -> int:
    """The steps to train: ``--steps`` (20 unless given), 0 with ``--compile-only``."""
    from torsh_jax.errors import PlanError

    if not args.compile_only:
        return 20 if args.steps is None else args.steps
    if args.steps:
        raise PlanError(
            "--compile-only trains nothing",
            key="--steps",
            fix="drop --steps, or drop --compile-only to train",
        )
    return 0


def _compile_for_target(args: argparse.Namespace) -> int:
    """``--compile-only --target``: the demo model's step compiled for the target, reported as
    ``torsh-jax inspect --target`` reports it (same keys; inspect refuses ``--devices``: the target
    decides them)."""
    from torsh_jax.cli import inspect_cmd
    from torsh_jax.errors import TargetError

    if args.target is None:
        raise TargetError(
            "slices need a TPU target", key="--slices", fix="add --target v5e-16, or drop --slices"
        )
    if not args.compile_only:
        raise TargetError(
            "a target is compiled for, not trained on, here", key="--target", fix="add --compile-only"
        )
    run_only = (args.verify, args.checkpoint_dir, args.resume, args.log_dir, args.profile, args.tensorboard,
                args.machine)  # fmt: skip
    if any(run_only):
        raise TargetError(
            "--verify, checkpoints and run logs need a run",
            key="--target",
            fix="drop them with --compile-only --target",
        )
    inspect_args = argparse.Namespace(
        plan=args.plan, devices=args.devices, target=args.target, slices=args.slices, json=args.json,
        layers=args.layers, d_model=args.d_model, vocab=256, seq_len=32, micro_batch=None,
    )  # fmt: skip
    return inspect_cmd.run(inspect_args)
