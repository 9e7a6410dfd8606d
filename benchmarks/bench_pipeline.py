"""Pipeline schedules against the equivalent non-pipelined plan, in the same run.

Each schedule (``pp_gpipe``, ``pp_1f1b``, ``pp_interleaved`` with 2 chunks per
stage, ``pp_zb_h1``: data 2 x stage 4, 8 micro-batches)
trains the demo language model with ``optax.adamw``; the baseline is our DDP
step over all 8 devices with the same global batch. Steps are interleaved
(ABC...) in one process.

Prints one JSON object per line, for each schedule ``s``:
``pipeline_{s}`` with ``ratio`` = pipelined / DDP median step time,
``bubble`` (idle fraction of the table) and ``theory_bubble``,
``temp_ratio`` = temporary memory per device / DDP's (``memory_analysis``),
``stage_wire_ratio`` = bytes over ``stage`` / the pipeline theory, and
``activations_held`` (per stage, from the table).

On simulated CPU devices every device is a thread on the same cores, so a
pipeline cannot overlap its stages: the ratio shows the schedule's overhead
(its bubble and its per-tick work), not the speed-up of real devices.

Usage:
    python benchmarks/bench_pipeline.py [--steps 20] [--layers 8] [--quick] [--plans pp_gpipe,pp_1f1b,...]
"""

from __future__ import annotations

import dataclasses

import common

PLANS = ("pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_zb_h1")


def equivalent_ddp(plan):
    """DDP over every device with the pipelined plan's global batch (``micro x data``)."""
    from torsh_jax.plan import plan_from_dict

    data = 8 // plan.mesh.stage.ici
    micro = plan.batch.micro_batch_size * data // 8
    return plan_from_dict({"mesh": {"data": -1}, "batch": {"micro_batch_size": micro}}, name="ddp")


def renamed(program: common.Program, name: str) -> common.Program:
    return dataclasses.replace(program, name=name)


def pipeline_row(plan_name: str, pair, ddp_pair, times: dict, summaries: dict, **fields) -> dict:
    import statistics

    ours, base = times[plan_name], times["ddp"]
    summary, ddp_summary = summaries[plan_name], summaries["ddp"]
    pipe, stage = summary["pipeline"], summary["theory"]["axes"]["stage"]
    return {
        "name": f"pipeline_{pipe['schedule']}",
        "ratio": statistics.median(ours) / statistics.median(base),
        "paired_ratio": common.paired_ratio(ours, base, chunk=1),
        "median_s": statistics.median(ours),
        "ddp_median_s": statistics.median(base),
        "bubble": pipe["bubble"],
        "theory_bubble": pipe["theory_bubble"],
        "activations_held": pipe["in_flight"],
        "temp_bytes": summary["memory"]["temp_bytes"],
        "ddp_temp_bytes": ddp_summary["memory"]["temp_bytes"],
        "temp_ratio": summary["memory"]["temp_bytes"] / ddp_summary["memory"]["temp_bytes"],
        "stage_wire_ratio": stage["wire_ratio"],
        "data_wire_ratio": summary["theory"]["wire_ratio"],
        "loss": pair.ours.last_loss,
        "ddp_loss": ddp_pair.ours.last_loss,
        "mesh": summary["mesh"],
        **fields,
    }


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_steps=20, default_layers=8, plans=PLANS)
    common.setup_devices(8)

    from torsh_jax.demo.model import LMConfig
    from torsh_jax.plan import load_plan
    from torsh_jax.runtime.inspect import inspect_step

    steps = 3 if args.quick else args.steps
    wide = {"d_model": 16, "head_dim": 8, "mlp": 32, "seq_len": 8} if args.quick else {}
    cfg = LMConfig(**{"d_model": 32, "heads": 2, "head_dim": 16, "mlp": 128, "layers": args.layers,
                      "seq_len": 64, **wide})  # fmt: skip
    plans = {name: load_plan(name) for name in args.plans}
    if args.quick:  # m = p: the shortest 1F1B table (a smoke run)
        plans = {n: p.replace(pipeline=dataclasses.replace(p.pipeline, microbatches=p.mesh.stage.ici))
                 for n, p in plans.items()}  # fmt: skip
    pairs = {name: common.build_pair(cfg, plan, baseline=None) for name, plan in plans.items()}
    ddp_pair = common.build_pair(cfg, equivalent_ddp(next(iter(plans.values()))), baseline=None)
    for name, pair in [*pairs.items(), ("ddp", ddp_pair)]:
        pair.ours = renamed(pair.ours, name)  # distinct names: the timings are keyed by them
    programs = [pair.ours for pair in [*pairs.values(), ddp_pair]]
    times = common.interleaved_timing(programs, steps=steps, chunk=1)
    summaries = {
        name: inspect_step(pair.train, pair.ours.state, pair.ours.batch)
        for name, pair in [*pairs.items(), ("ddp", ddp_pair)]
    }
    for name, pair in pairs.items():
        fields = {"plan": name, "layers": args.layers, "steps": steps}
        common.emit(pipeline_row(name, pair, ddp_pair, times, summaries, **fields))


if __name__ == "__main__":
    main()
