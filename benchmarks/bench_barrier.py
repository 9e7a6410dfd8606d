"""What one collective costs inside a step on simulated devices, against the compute around it.

Simulated CPU devices share the host's cores: a collective is a barrier all of them reach before
any goes on. ``torsh_jax.planner.calibrate`` times collectives on their own (no compute waits on
them) and fits the link's ``alpha_s`` to those; here each of a scan's iterations runs one layer-like
matmul per device, then (or not: the baseline, in the same run) one small collective
(``psum``, ``all_gather`` or ``ppermute`` of 64 floats) the next iteration depends on, over
groups of every size in ``--group-sizes`` (the devices split into ``devices / size`` groups that
run their collectives apart, as ``fsdp = 4`` does beside ``data = 2``). Prints one ``barrier`` row
per width, kind and group size: ``collectives_per_run`` (the compiled program's, executed:
``ITERATIONS``; ``baseline_collectives_per_run``: none) and ``compiled_group_size`` (its
collectives' groups, the row's size), ``iteration_s`` (the baseline's seconds
per iteration), ``per_collective_s`` (the added seconds per collective; a width's programs timed
in turn, one run each per round, the median of ``--steps`` rounds), ``share`` (their ratio) and
``per_ring_step_s`` (over the collective's latency steps as the cost model counts them: ``2 (n -
1)`` for ``psum``, ``n - 1`` for ``all_gather``, 1 for ``ppermute``): the time a step loses at
each collective it runs between its layers, which the calibrated ``alpha_s`` does not hold
(benchmarks/README.md).

Usage:
    python benchmarks/bench_barrier.py [--devices 8] [--steps 15] [--group-sizes 8,4,2] [--quick]
"""

from __future__ import annotations

import argparse

import common

#: (width, rows per device) of the matmul each iteration runs.
SIZES = ((128, 256), (256, 512), (512, 512))
QUICK_SIZES = ((64, 64),)
KINDS = ("none", "psum", "all_gather", "ppermute")
ITERATIONS = 32
#: The mesh axis the collectives run over (a group); the other one, ``GROUPS``, counts the groups.
AXIS = "devices"
GROUPS = "groups"
#: Latency steps of each kind's collective over ``n`` devices, as ``torsh_jax.planner.cost`` counts them.
RING_STEPS = {"psum": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "ppermute": lambda n: 1}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument(
        "--steps", type=int, default=15, help="timed rounds, one run of each program a round (median)"
    )
    parser.add_argument(
        "--group-sizes",
        type=_sizes,
        default=None,
        help="comma-separated devices per collective's group, each dividing --devices (default: "
        "every power of two from --devices down to 2)",
    )
    parser.add_argument("--quick", action="store_true", help="one small width, three runs")
    args = parser.parse_args()
    args.group_sizes = args.group_sizes or _powers_of_two_down(args.devices)
    bad = [n for n in args.group_sizes if n < 2 or args.devices % n]
    if bad:
        parser.error(
            f"--group-sizes {bad[0]} does not divide --devices {args.devices} into groups of 2 or more"
        )
    return args


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _powers_of_two_down(devices: int) -> tuple[int, ...]:
    """``devices`` and every power of two from 2 up that divides it, largest first."""
    powers = (2**k for k in range(1, devices.bit_length()))
    return tuple(sorted({devices, *(n for n in powers if devices % n == 0)}, reverse=True))


def _collective(kind: str, x, size: int):
    import jax

    if kind == "psum":
        return jax.lax.psum(x, AXIS)
    if kind == "all_gather":
        return jax.lax.all_gather(x, AXIS)
    return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % size) for i in range(size)])


def group_mesh(devices: int, size: int):
    """``devices`` split into groups of ``size`` (``GROUPS`` × ``AXIS``)."""
    import jax

    explicit = (jax.sharding.AxisType.Explicit,) * 2
    return jax.make_mesh((devices // size, size), (GROUPS, AXIS), axis_types=explicit)


def scan_program(kind: str, mesh):
    """``ITERATIONS`` matmuls per device, each followed by one collective of ``kind`` over the
    device's group (``none``: not) whose result the next iteration reads."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def layer(h, w):
        h = jnp.tanh(h @ w)
        if kind != "none":
            h = h + 1e-9 * _collective(kind, h[:1, :64], mesh.shape[AXIS]).sum()
        return h, None

    scan = lambda h, ws: jax.lax.scan(layer, h, ws)[0]
    rows = P((GROUPS, AXIS))
    return jax.jit(jax.shard_map(scan, mesh=mesh, in_specs=(rows, P()), out_specs=rows))


def main() -> int:
    args = parse_args()
    common.setup_devices(args.devices)
    steps = 3 if args.quick else args.steps
    for width, rows in QUICK_SIZES if args.quick else SIZES:
        for row in width_rows(args.devices, args.group_sizes, width, rows, steps):
            common.emit(row)
    return 0


def width_rows(devices: int, group_sizes: tuple[int, ...], width: int, rows: int, steps: int) -> list[dict]:
    """One width's rows: every kind over every group size against the baseline, timed in turn."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.analysis.hlo import collectives
    from torsh_jax.planner.calibrate import seconds_in_rounds

    programs, executed, grouped = {}, {}, {}
    for key in [("none", group_sizes[0])] + [(kind, n) for n in group_sizes for kind in KINDS[1:]]:
        mesh = group_mesh(devices, key[1])
        h = jax.device_put(jnp.ones((devices * rows, width)), NamedSharding(mesh, P((GROUPS, AXIS))))
        ws = jax.device_put(jnp.full((ITERATIONS, width, width), 0.01), NamedSharding(mesh, P()))
        compiled = scan_program(key[0], mesh).lower(h, ws).compile()
        programs[key] = (compiled, (h, ws))
        found = collectives(compiled, mesh)
        executed[key] = sum(c.executions for c in found)
        grouped[key] = max((c.group_size for c in found), default=1)
    seconds = seconds_in_rounds(programs, steps)
    base = ("none", group_sizes[0])
    iteration = seconds[base] / ITERATIONS
    out = []
    for (kind, size), spent in seconds.items():
        if kind == "none":
            continue
        added = (spent - seconds[base]) / ITERATIONS
        out.append(
            {
                "name": "barrier",
                "devices": devices,
                "group_size": size,
                "width": width,
                "rows_per_device": rows,
                "kind": kind,
                "collectives_per_run": executed[kind, size],
                "compiled_group_size": grouped[kind, size],
                "baseline_collectives_per_run": executed[base],
                "iteration_s": iteration,
                "per_collective_s": added,
                "share": added / iteration,
                "per_ring_step_s": added / RING_STEPS[kind](size),
            }
        )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
