"""DDP train step against a plain ``jax.jit`` + ``NamedSharding`` data-parallel step.

Both steps train the demo language model with ``optax.adamw`` on the mesh of
the ``ddp`` preset; the baseline keeps parameters and optimizer state
replicated (``NamedSharding(mesh, P())``), splits the batch over
``("data", "fsdp")`` and lets GSPMD place the gradient all-reduce. Runs are
interleaved and the medians compared in the same process.

Prints one JSON object per line:
``ddp_step_time`` (``ratio`` = ours / baseline median step time, target <= 1.05),
``ddp_wire`` (``ratio`` = our wire bytes / theory) and ``ddp_memory``
(``ratio`` = per-device state bytes / (total / devices)).

Usage:
    python benchmarks/bench_ddp.py [--devices 8] [--steps 100] [--layers 4] [--quick]
"""

from __future__ import annotations

import common

TARGET_RATIO = 1.05


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_steps=100, default_layers=4)
    common.setup_devices(args.devices)

    from torsh_jax.demo.model import LMConfig
    from torsh_jax.plan import load_plan

    steps, layers, chunk = (6, 1, 1) if args.quick else (args.steps, args.layers, 2)
    cfg = LMConfig(layers=layers)
    pair = common.build_pair(cfg, load_plan("ddp"), baseline="replicated")
    times = common.interleaved_timing([pair.ours, pair.baseline], steps=steps, chunk=chunk)
    fields = {"plan": "ddp", "devices": args.devices, "layers": layers}
    common.emit(common.timing_row("ddp_step_time", pair, times, chunk=chunk, target=TARGET_RATIO, **fields))
    summary = common.summaries(pair)
    common.emit(common.wire_row("ddp_wire", summary, **fields))
    common.emit(common.memory_row("ddp_memory", pair, summary, **fields))


if __name__ == "__main__":
    main()
