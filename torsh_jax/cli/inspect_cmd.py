"""``torsh-jax inspect``: collectives and per-device memory of a plan's compiled train step.

Example:
    $ torsh-jax inspect --plan ddp --devices 8 --json
"""

from __future__ import annotations

import argparse

from torsh_jax.cli.args import MAX_DEVICES, count_type

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("inspect", help="list collectives and memory of a plan's compiled train step")
    parser.add_argument("--plan", default="ddp", help="preset name (meshes/*.toml) or plan file [ddp]")
    parser.add_argument(
        "--devices", type=count_type(1, MAX_DEVICES, fix="pass --devices 8"), default=8,
        help="devices; simulated on CPU, bounded by host memory [8]",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--layers", type=count_type(1, 256, fix="pass --layers 4"), default=None,
                        help="demo model layers [4, or a multiple of stages x chunks]")  # fmt: skip
    parser.add_argument("--d-model", type=count_type(16, 8192, fix="pass --d-model 64"), default=64,
                        help="demo model width [64]")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax

    from torsh_jax.analysis import render_text
    from torsh_jax.cli.output import Progress, json_text
    from torsh_jax.demo.devices import select_devices
    from torsh_jax.demo.model import init_params, layered_model, synthetic_tokens
    from torsh_jax.demo.run import DemoConfig, model_config
    from torsh_jax.optim import build_optimizer
    from torsh_jax.plan.io import load_plan
    from torsh_jax.runtime.inspect import inspect_step
    from torsh_jax.runtime.mesh import build_mesh
    from torsh_jax.runtime.step import make_train_step
    from torsh_jax.tensor.axis import tensor_axis

    plan = load_plan(args.plan, key="--plan")
    if not args.json:  # stdout carries the report only; say on stderr what takes time
        Progress(f"inspect ({plan.name})", 0, live=False).phase(
            f"compiling the train step on {args.devices} devices"
        )
    mesh = build_mesh(plan, select_devices(args.devices))
    cfg = model_config(DemoConfig(plan=plan, layers=args.layers, d_model=args.d_model), dict(mesh.shape))
    model = layered_model(cfg, tp=tensor_axis(plan))
    train = make_train_step(model, build_optimizer(plan.optimizer), plan, mesh)
    train.prepare(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))  # no state is created
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    summary = inspect_step(train, train.abstract_state(), batch)
    print(
        json_text(summary) if args.json else render_text(summary) + _pipeline_text(summary) + _notes(summary)
    )
    return 0


def _notes(summary: dict) -> str:
    """What the step changed or what the report cannot say, one ``note:`` line each."""
    return "".join(f"note: {note}\n" for note in summary.get("notes", []))


def _pipeline_text(summary: dict) -> str:
    """The schedule grid (rows stages, columns ticks), its bubble and the activations each stage holds."""
    pipe = summary.get("pipeline")
    if pipe is None:
        return ""
    from torsh_jax.pipeline.schedule import render_grid

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
    return "\n".join(lines) + "\n"
