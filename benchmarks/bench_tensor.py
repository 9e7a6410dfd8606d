"""Tensor-parallel train steps against plain ``jax.jit`` steps with the same shardings.

Each row runs a preset (``tp``, ``tp_sp``, ``fsdp_tp``) on the demo language
model (built from ``torsh_jax.tensor`` blocks) with ``optax.adamw``. The
baseline is one ``jax.jit`` step of the same model written densely, whose
parameters and optimizer state carry exactly our state layout's
``NamedSharding``s (tensor splits and fsdp shards) and whose batch is split
over ``("data", "fsdp")``: GSPMD partitions the model and places every
collective. Runs are interleaved in the same process.

Prints one JSON object per line, for each plan ``p``:
``{p}_step_time`` (``ratio`` = ours / baseline median step time, target <= 1.05)
and ``{p}_wire`` (``ratio`` = our data-parallel wire bytes / the plan's theory,
``tensor_ratio`` = our tensor bytes / the Megatron theory, and the baseline's
bytes over each axis against the same theories).

Usage:
    python benchmarks/bench_tensor.py [--devices 8] [--steps 30] [--layers 4] [--quick]
                                      [--plans tp,tp_sp,fsdp_tp]
"""

from __future__ import annotations

import common

PLANS = ("tp", "tp_sp", "fsdp_tp")
TARGET_RATIO = 1.05


def same_shardings_baseline(pair) -> common.Program:
    """``jax.jit`` of the dense model with the state shardings of our layout (GSPMD decides the rest)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.runtime.layered import layered_loss

    train, mesh = pair.train, pair.mesh
    dense = train.loss._replace(tensor_blocks=False)  # blocks outside shard_map compute densely
    ours = train.layout.shardings()
    shardings = (ours.params, ours.opt_state)
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    optimizer = pair.optimizer
    step = jax.jit(
        common._baseline_step(layered_loss(dense), optimizer),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    init = jax.jit(lambda p: (p, optimizer.init(p)), out_shardings=shardings)
    batch = jax.device_put(pair.host_batch, batch_sharding)
    return common.Program("jit_same_shardings", step, init(pair.host_params), batch, step.lower)


def wire_row(name: str, pair, baseline: common.Program, **fields) -> dict:
    """Data-parallel and tensor bytes of both programs against the plan's and Megatron's theories."""
    from torsh_jax.analysis import summarize
    from torsh_jax.runtime.inspect import inspect_step, tensor_theory

    ours = inspect_step(pair.train, pair.ours.state, pair.ours.batch)
    tensor = tensor_theory(pair.train, pair.ours.batch)
    theory = common.plan_theory_for(pair)
    base = summarize(baseline.lower().compile(), pair.mesh, theory=theory, axis_theories={"tensor": tensor})
    return {
        "name": name,
        "ratio": ours["theory"]["wire_ratio"],
        "tensor_ratio": ours["theory"]["axes"]["tensor"]["wire_ratio"],
        "baseline_ratio": base["theory"]["wire_ratio"],
        "baseline_tensor_ratio": base["theory"]["axes"]["tensor"]["wire_ratio"],
        "theory": ours["theory"]["description"],
        "tensor_theory": tensor.to_dict()["description"],
        "theory_wire_bytes": theory.wire_bytes,
        "tensor_theory_wire_bytes": tensor.wire_bytes,
        "ours_wire_by_axis": {k: v["wire_bytes"] for k, v in ours["totals"]["by_axis"].items()},
        "baseline_wire_by_axis": {k: v["wire_bytes"] for k, v in base["totals"]["by_axis"].items()},
        "ours_temp_bytes": ours["memory"]["temp_bytes"],
        "baseline_temp_bytes": base["memory"]["temp_bytes"],
        **fields,
    }


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_steps=30, default_layers=4, plans=PLANS)
    common.setup_devices(args.devices)

    from torsh_jax.demo.model import LMConfig
    from torsh_jax.plan import load_plan

    steps, layers, chunk = (4, 1, 1) if args.quick else (args.steps, args.layers, 2)
    cfg = LMConfig(layers=layers)
    for plan in args.plans:
        pair = common.build_pair(cfg, load_plan(plan), baseline=None)
        baseline = same_shardings_baseline(pair)
        pair.baseline = baseline
        times = common.interleaved_timing([pair.ours, baseline], steps=steps, chunk=chunk)
        fields = {"plan": plan, "devices": args.devices, "layers": layers}
        common.emit(
            common.timing_row(f"{plan}_step_time", pair, times, chunk=chunk, target=TARGET_RATIO, **fields)
        )
        common.emit(wire_row(f"{plan}_wire", pair, baseline, **fields))


if __name__ == "__main__":
    main()
