"""ZeRO stages 1-3 against a plain ``jax.jit`` FSDP step, with memory and wire tables.

Each stage runs the ``zero1``/``zero2``/``zero3`` preset on the demo language
model with ``optax.adamw``. The baseline is one ``jax.jit`` step on the same
mesh whose parameters and optimizer state are sharded over ``fsdp`` on their
largest divisible dim (``NamedSharding``); GSPMD places its collectives.
Runs are interleaved and compared in the same process.

Prints one JSON object per line, for each stage ``s``:
``zero{s}_step_time`` (``ratio`` = ours / baseline median step time),
``zero{s}_wire`` (``ratio`` = our wire bytes / theory) and
``zero{s}_memory`` (``ratio`` = per-device params + optimizer-state bytes /
(total / devices)); then ``zero3_temp_memory`` (``ratio`` = our temp bytes at
twice the layers / at the base layer count, ``--layers`` and ``2 x --layers``).

Usage:
    python benchmarks/bench_zero.py [--devices 8] [--steps 30] [--layers 8] [--quick]
"""

from __future__ import annotations

import common

STAGES = (1, 2, 3)


def stage_rows(stage: int, cfg, *, steps: int, chunk: int, fields: dict) -> list[dict]:
    """Step time, wire and memory rows of one ZeRO stage against the FSDP baseline."""
    from torsh_jax.plan import load_plan

    pair = common.build_pair(cfg, load_plan(f"zero{stage}"), baseline="fsdp")
    times = common.interleaved_timing([pair.ours, pair.baseline], steps=steps, chunk=chunk)
    fields = {"plan": f"zero{stage}", "stage": stage, **fields}
    summary = common.summaries(pair)
    return [
        common.timing_row(f"zero{stage}_step_time", pair, times, chunk=chunk, **fields),
        common.wire_row(f"zero{stage}_wire", summary, **fields),
        common.memory_row(f"zero{stage}_memory", pair, summary, **fields),
    ]


def temp_memory_row(cfg, *, devices: int) -> dict:
    """ZeRO-3 temp bytes per device at ``cfg.layers`` and twice as many layers."""
    import dataclasses

    from torsh_jax.plan import load_plan

    temp = {}
    for layers in (cfg.layers, 2 * cfg.layers):
        pair = common.build_pair(dataclasses.replace(cfg, layers=layers), load_plan("zero3"), baseline="fsdp")
        summary = common.summaries(pair)
        temp[layers] = {side: summary[side]["memory"]["temp_bytes"] for side in ("ours", "baseline")}
    small, large = temp[cfg.layers], temp[2 * cfg.layers]
    return {
        "name": "zero3_temp_memory",
        "ratio": large["ours"] / small["ours"],
        "baseline_ratio": large["baseline"] / small["baseline"],
        "layers": [cfg.layers, 2 * cfg.layers],
        "ours_temp_bytes": [small["ours"], large["ours"]],
        "baseline_temp_bytes": [small["baseline"], large["baseline"]],
        "plan": "zero3",
        "stage": 3,
        "devices": devices,
    }


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_steps=30, default_layers=8)
    common.setup_devices(args.devices)

    from torsh_jax.demo.model import LMConfig

    steps, layers, chunk = (4, 1, 2) if args.quick else (args.steps, args.layers, 5)
    cfg = LMConfig(layers=layers)
    fields = {"devices": args.devices, "layers": layers}
    for stage in STAGES:
        for row in stage_rows(stage, cfg, steps=steps, chunk=chunk, fields=fields):
            common.emit(row)
    common.emit(temp_memory_row(cfg, devices=args.devices))


if __name__ == "__main__":
    main()
