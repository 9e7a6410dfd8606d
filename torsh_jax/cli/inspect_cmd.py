"""``torsh-jax inspect``: collectives and per-device memory of a plan's compiled train step.

Example:
    $ torsh-jax inspect --plan ddp --devices 8 --json
"""

from __future__ import annotations

import argparse
import json

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("inspect", help="list collectives and memory of a plan's compiled train step")
    parser.add_argument("--plan", default="ddp", help="preset name (meshes/*.toml) or plan file [ddp]")
    parser.add_argument("--devices", type=int, default=8, help="devices; simulated on CPU [8]")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--layers", type=int, default=4, help="demo model layers [4]")
    parser.add_argument("--d-model", type=int, default=64, help="demo model width [64]")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax

    from torsh_jax.analysis import render_text
    from torsh_jax.demo.devices import select_devices
    from torsh_jax.demo.model import init_params, layered_model, synthetic_tokens
    from torsh_jax.demo.run import DemoConfig, model_config
    from torsh_jax.optim import build_optimizer
    from torsh_jax.parallel.mesh import build_mesh
    from torsh_jax.plan.io import load_plan
    from torsh_jax.train.inspect import inspect_step
    from torsh_jax.train.step import make_train_step

    plan = load_plan(args.plan)
    mesh = build_mesh(plan, select_devices(args.devices))
    cfg = model_config(DemoConfig(layers=args.layers, d_model=args.d_model))
    train = make_train_step(layered_model(cfg), build_optimizer(plan.optimizer), plan, mesh)
    state = train.init(init_params(cfg, jax.random.key(0)))
    summary = inspect_step(train, state, synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0))
    print(json.dumps(summary, indent=2) if args.json else render_text(summary))
    return 0
