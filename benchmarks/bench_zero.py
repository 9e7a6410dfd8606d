"""ZeRO stages 1-3 against plain ``jax.jit`` FSDP steps, with memory and wire tables.

Each stage runs the ``zero1``/``zero2``/``zero3`` preset on the demo language
model with ``optax.adamw``. The baseline is one ``jax.jit`` step on the same
mesh whose parameters and optimizer state are sharded over ``fsdp`` on their
largest divisible dim (``NamedSharding``); GSPMD places its collectives. A
second baseline, ``fsdp_gathered``, is the same step with every layer's
parameters constrained to replicated where they are used (GSPMD then
all-gathers them, the usual way to write FSDP under ``jit``). Runs are
interleaved and compared in the same process (``--quick`` skips the second
baseline).

Prints one JSON object per line, for each stage ``s``:
``zero{s}_step_time`` (``ratio`` = ours / baseline median step time,
``fsdp_gathered_ratio`` = ours / second baseline), ``zero{s}_wire``
(``ratio`` = our wire bytes / theory, ``baseline_ratio`` the baseline's) and
``zero{s}_memory`` (``ratio`` = per-device params + optimizer-state bytes /
(total / devices)); then ``zero3_temp_memory`` (``ratio`` = our temp bytes
at ``2 x --temp-layers`` layers / at ``--temp-layers``).

Usage:
    python benchmarks/bench_zero.py [--devices 8] [--steps 20] [--layers 4] [--temp-layers 8] [--quick]
"""

from __future__ import annotations

import common

STAGES = (1, 2, 3)
#: ``--quick`` (a smoke run): the two ends; stage 2 runs the same code paths as 1 and 3 together
QUICK_STAGES = (1, 3)
EXTRA = ("fsdp_gathered",)


def stage_rows(
    stage: int, cfg, *, steps: int, chunk: int, extra: tuple[str, ...], fields: dict
) -> tuple[list[dict], dict]:
    """Step time, wire and memory rows of one ZeRO stage against the FSDP baseline, and the summaries."""
    from torsh_jax.plan import load_plan

    pair = common.build_pair(cfg, load_plan(f"zero{stage}"), baseline="fsdp", extra=extra)
    times = common.interleaved_timing(pair.programs, steps=steps, chunk=chunk)
    fields = {"plan": f"zero{stage}", "stage": stage, **fields}
    summary = common.summaries(pair)
    rows = [
        common.timing_row(f"zero{stage}_step_time", pair, times, chunk=chunk, **fields),
        common.wire_row(f"zero{stage}_wire", summary, **fields),
        common.memory_row(f"zero{stage}_memory", pair, summary, **fields),
    ]
    return rows, summary


def _temp_bytes(summary: dict) -> dict:
    return {side: entry["memory"]["temp_bytes"] for side, entry in summary.items()}


def temp_memory_row(cfg, *, layers: int, known: dict, extra: tuple[str, ...], devices: int) -> dict:
    """ZeRO-3 temp bytes per device at ``layers`` and ``2 * layers`` (``known``: summaries by layer count)."""
    import dataclasses

    from torsh_jax.plan import load_plan

    temp = {}
    for count in (layers, 2 * layers):
        if count not in known:
            deeper = dataclasses.replace(cfg, layers=count)
            known[count] = common.summaries(
                common.build_pair(deeper, load_plan("zero3"), baseline="fsdp", extra=extra)
            )
        temp[count] = _temp_bytes(known[count])
    small, large = temp[layers], temp[2 * layers]
    return {
        "name": "zero3_temp_memory",
        "ratio": large["ours"] / small["ours"],
        "baseline_ratio": large["baseline"] / small["baseline"],
        "layers": [layers, 2 * layers],
        **{f"{side}_temp_bytes": [small[side], large[side]] for side in small},
        **{f"{side}_ratio": large[side] / small[side] for side in small if side not in ("ours", "baseline")},
        "plan": "zero3",
        "stage": 3,
        "devices": devices,
    }


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_steps=20, default_layers=4, temp_layers=8)
    common.setup_devices(args.devices)

    from torsh_jax.demo.model import LMConfig

    steps, layers, chunk = (4, 1, 1) if args.quick else (args.steps, args.layers, 2)
    temp_layers = 1 if args.quick else args.temp_layers
    extra = () if args.quick else EXTRA
    cfg = LMConfig(layers=layers)
    fields = {"devices": args.devices, "layers": layers}
    known = {}
    for stage in QUICK_STAGES if args.quick else STAGES:
        rows, summary = stage_rows(stage, cfg, steps=steps, chunk=chunk, extra=extra, fields=fields)
        if stage == 3:
            known[layers] = summary
        for row in rows:
            common.emit(row)
    common.emit(temp_memory_row(cfg, layers=temp_layers, known=known, extra=extra, devices=args.devices))


if __name__ == "__main__":
    main()
