"""``torsh-jax demo``: train the small transformer LM under a plan on (simulated) devices.

Example:
    $ torsh-jax demo --plan ddp --devices 8 --steps 20 --verify
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="train a small transformer LM on synthetic tokens under a plan")
    parser.add_argument("--plan", default="ddp", help="preset name (meshes/*.toml) or plan file [ddp]")
    parser.add_argument("--devices", type=int, default=8, help="devices; simulated on CPU [8]")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps [20]")
    parser.add_argument("--verify", action="store_true", help="also run the single-device twin and compare")
    parser.add_argument("--json", action="store_true", help="one JSON object per step, then a summary object")
    parser.add_argument("--seed", type=int, default=0, help="parameter and data seed [0]")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers [4]")
    parser.add_argument("--d-model", type=int, default=64, help="model width [64]")
    parser.set_defaults(func=run)


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"demo: plan {summary['plan']} on {summary['devices']} devices")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = {
        "mesh": ", ".join(f"{k}={v}" for k, v in summary["mesh"].items()),
        "parameters": f"{summary['param_count']:,}",
        "global batch": str(summary["global_batch_size"]),
        "final loss": f"{summary['final_loss']:.4f}",
        "wire bytes / step (measured)": _human_bytes(summary["wire_bytes_per_step"]),
        "wire bytes / step (theory)": _human_bytes(summary["theoretical_wire_bytes_per_step"]),
        "memory / device": _human_bytes(summary["memory_per_device_bytes"]),
        "compiles": str(summary["compiles"]),
    }
    if "max_rel_err" in summary:
        rows["max relative loss diff vs 1 device"] = f"{summary['max_rel_err']:.2e}"
    for key, value in rows.items():
        table.add_row(key, value)
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    from torsh_jax.demo.run import DemoConfig, run_demo

    config = DemoConfig(
        plan=args.plan,
        devices=args.devices,
        steps=args.steps,
        verify=args.verify,
        seed=args.seed,
        layers=args.layers,
        d_model=args.d_model,
    )
    if args.json:
        emit = lambda record: print(json.dumps(record), flush=True)
        summary = run_demo(config, emit=emit)
        print(json.dumps(summary), flush=True)
        return 0
    from rich.progress import Progress

    with Progress(transient=False) as progress:
        task = progress.add_task(f"training ({args.plan})", total=args.steps)

        def emit(record: dict) -> None:
            desc = (
                f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"wire {_human_bytes(record['wire_bytes_per_step'])}/step | "
                f"mem {_human_bytes(record['memory_per_device_bytes'])}/device"
            )
            progress.update(task, advance=1, description=desc)

        summary = run_demo(config, emit=emit)
    _print_summary(summary)
    sys.stdout.flush()
    return 0
