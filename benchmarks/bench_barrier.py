"""What one collective costs inside a step on simulated devices, against the compute around it.

Simulated CPU devices share the host's cores: a collective is a barrier all of them reach before
any goes on. ``torsh_jax.planner.calibrate`` times collectives on their own (no compute waits on
them) and fits the link's ``alpha_s`` to those; here each of a scan's iterations runs one layer-like
matmul per device, then (or not: the baseline, in the same run) one small collective
(``psum``, ``all_gather`` or ``ppermute`` of 64 floats) the next iteration depends on. Prints one
``barrier`` row per width and kind: ``collectives_per_run`` (the compiled program's, executed:
``ITERATIONS``; ``baseline_collectives_per_run``: none), ``iteration_s`` (the baseline's seconds
per iteration), ``per_collective_s`` (the added seconds per collective; the four programs timed in
turn, one run each per round, the median of ``--steps`` rounds) and ``share`` (their ratio): the
time a step loses at each collective it runs between its layers, which the calibrated ``alpha_s`` does
not hold (benchmarks/README.md).

Usage:
    python benchmarks/bench_barrier.py [--devices 8] [--steps 15] [--quick]
"""

from __future__ import annotations

import argparse

import common

#: (width, rows per device) of the matmul each iteration runs.
SIZES = ((128, 256), (256, 512), (512, 512))
QUICK_SIZES = ((64, 64),)
KINDS = ("none", "psum", "all_gather", "ppermute")
ITERATIONS = 32
#: The one mesh axis, over every simulated device.
AXIS = "devices"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument(
        "--steps", type=int, default=15, help="timed rounds, one run of each program a round (median)"
    )
    parser.add_argument("--quick", action="store_true", help="one small width, three runs")
    return parser.parse_args()


def _collective(kind: str, x, devices: int):
    import jax

    if kind == "psum":
        return jax.lax.psum(x, AXIS)
    if kind == "all_gather":
        return jax.lax.all_gather(x, AXIS)
    return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % devices) for i in range(devices)])


def scan_program(kind: str, mesh):
    """``ITERATIONS`` matmuls per device, each followed by one collective of ``kind`` (``none``:
    not) whose result the next iteration reads."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def layer(h, w):
        h = jnp.tanh(h @ w)
        if kind != "none":
            h = h + 1e-9 * _collective(kind, h[:1, :64], mesh.shape[AXIS]).sum()
        return h, None

    scan = lambda h, ws: jax.lax.scan(layer, h, ws)[0]
    return jax.jit(jax.shard_map(scan, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS)))


def main() -> int:
    args = parse_args()
    common.setup_devices(args.devices)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.analysis.hlo import collectives
    from torsh_jax.planner.calibrate import seconds_in_rounds

    mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
    steps = 3 if args.quick else args.steps
    for width, rows in QUICK_SIZES if args.quick else SIZES:
        h = jax.device_put(jnp.ones((args.devices * rows, width)), NamedSharding(mesh, P(AXIS)))
        ws = jax.device_put(jnp.full((ITERATIONS, width, width), 0.01), NamedSharding(mesh, P()))
        compiled = {kind: scan_program(kind, mesh).lower(h, ws).compile() for kind in KINDS}
        run = {
            kind: sum(c.executions for c in collectives(program, mesh)) for kind, program in compiled.items()
        }
        seconds = seconds_in_rounds({kind: (program, (h, ws)) for kind, program in compiled.items()}, steps)
        iteration = seconds["none"] / ITERATIONS
        for kind in KINDS[1:]:
            added = (seconds[kind] - seconds["none"]) / ITERATIONS
            common.emit(
                {
                    "name": "barrier",
                    "devices": args.devices,
                    "width": width,
                    "rows_per_device": rows,
                    "kind": kind,
                    "collectives_per_run": run[kind],
                    "baseline_collectives_per_run": run["none"],
                    "iteration_s": iteration,
                    "per_collective_s": added,
                    "share": added / iteration,
                }
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
