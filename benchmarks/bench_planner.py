"""The planner's predictions against measured steps on this machine (held out from its calibration).

``torsh_jax.planner.calibrate`` measures the simulated devices first (the model's forward and
backward pass on every device with no collective, ``psum``/``all_gather`` at several sizes, an
empty step); none of the plans below is part of it. Then for each model size every plan's demo
model train step is compiled and warmed up (two steps), and ``--steps`` rounds each time one step
of every plan in turn (median per plan: a drift of the machine's speed falls on all plans alike);
the planner predicts each (:func:`torsh_jax.planner.cost.predict` with the calibrated machine).

Prints one ``planner_plan`` row per plan and model (``predicted_s``, ``measured_s``, ``error``,
``predicted_memory``, ``compiled_peak``, ``memory_error``; ``collectives``, the compiled step's
per step, and ``collectives_in_loops`` of them inside a loop) and one ``planner_summary`` row per
model and overall: ``mape`` (mean absolute percentage error of the step time), ``kendall_tau`` (rank
agreement of predicted and measured times: tau-b; ``kendall_tau_a`` beside it),
``measured_pick`` and ``measured_pick_ratio`` (``plan --measure``'s pick: the fastest of the
plans predicted within 15 % of the best, at most :data:`MEASURED`, each run again on its own
(``torsh_jax.planner.measure``), and its time in the rounds over the fastest's),
``kendall_tau_halves`` (tau-b of the even rounds' medians against the odd rounds': how well the
measurement ranks the plans against itself; each side has half the rounds, so it understates how
well two whole runs agree),
``misordered_beyond_noise`` (pairs ordered against the measurement by more than the rounds'
spread, ``measured_iqr_s`` per plan), ``pick_ratio``
(measured time of the plan the planner ranks first / the fastest measured), ``memory_mape``,
``host_load`` (the shares of the host's cores other processes and the hypervisor took during the
model's timed rounds; the ``planner_machine`` row's, during its calibration): the figures hold for
a quiet host, and a warning says where it was not.

``--devices 2`` runs the same kinds of plan on 2 simulated devices (:data:`PLANS_BY_DEVICES`):
one core per device on a 2-core host, where 8 devices share the cores (benchmarks/README.md, run
11).

Usage:
    python benchmarks/bench_planner.py [--steps 7] [--quick] [--devices 8|2]
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import common

#: Model sizes validated (demo model; heads of 64 -> d_model / 64 heads).
MODELS = {
    "small": "demo:d_model=128,layers=4,vocab=1024,seq_len=128",
    "medium": "demo:d_model=256,layers=8,vocab=2048,seq_len=128",
}
QUICK_MODELS = {"tiny": "demo:d_model=128,layers=4,vocab=256,seq_len=32"}
#: Plans by the planner's labels (8 devices, global batch 32); ``+int8`` adds int8 gradients over data.
PLANS = (
    "ddp data=8 acc=1",
    "ddp data=8 acc=1 +int8",
    "zero1 fsdp=8 acc=1",
    "zero2 fsdp=8 acc=1",
    "zero3 fsdp=8 acc=1",
    "zero3 data=2 fsdp=4 acc=1",
    "zero3 data=2 fsdp=4 acc=1 +int8",
    "ddp data=4 tensor=2 acc=1",
    "zero3 fsdp=4 tensor=2 acc=1",
    "pp data=2 stage=4 1f1b m=4 acc=1",
    "pp data=2 stage=4 1f1b m=8 acc=1",
    "pp fsdp=2 stage=4 1f1b m=4 zero2 acc=1",
    "zero2 fsdp=8 acc=2",
)
#: The same kinds on 2 devices (no HSDP, nor ZeRO-3 over tensor: they need 4).
PLANS_2 = (
    "ddp data=2 acc=1",
    "ddp data=2 acc=1 +int8",
    "zero1 fsdp=2 acc=1",
    "zero2 fsdp=2 acc=1",
    "zero3 fsdp=2 acc=1",
    "ddp tensor=2 acc=1",
    "ddp tensor=2 sp acc=1",
    "pp stage=2 1f1b m=2 acc=1",
    "pp stage=2 1f1b m=4 acc=1",
    "pp stage=2 zb_h1 m=4 acc=1",
    "zero2 fsdp=2 acc=2",
    "zero1 fsdp=2 acc=2",
    "ddp data=2 remat acc=1",
)
#: Plans by the number of simulated devices (``--devices``).
PLANS_BY_DEVICES = {8: PLANS, 2: PLANS_2}
GLOBAL_BATCH = 32
#: Most plans ``plan --measure`` runs (``measured_pick``): those predicted within 15 % of the best.
MEASURED = 8


def parse_args():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (one step per plan each)")
    parser.add_argument("--quick", action="store_true", help="one tiny model, two steps (a smoke run)")
    parser.add_argument(
        "--devices", type=int, default=8, choices=sorted(PLANS_BY_DEVICES), help="simulated devices"
    )
    return parser.parse_args()


def plans_for(shape, devices: int = 8) -> list:
    from torsh_jax.plan import AxisCompression, CompressorSpec
    from torsh_jax.planner.space import candidates

    by_label = {c.label: c for c in candidates(shape, devices=devices, global_batch=GLOBAL_BATCH)}
    chosen = []
    for label in PLANS_BY_DEVICES[devices]:
        base, _, extra = label.partition(" +")
        candidate = by_label[base]
        if extra == "int8":
            int8 = (AxisCompression(axis="data", gradients=CompressorSpec(method="int8")),)
            candidate = dataclasses.replace(
                candidate, plan=dataclasses.replace(candidate.plan, compression=int8), label=label
            )
        chosen.append(candidate)
    return chosen


def prepare(candidate, shape, devices, steps: int) -> dict:
    """The demo model's step under the candidate (each layer recomputed where it has remat), its
    state, ``steps`` batches, its compiled peak bytes and its collectives (:func:`collective_counts`);
    two warm-up steps run."""
    import jax

    from torsh_jax.analysis.hlo import collectives
    from torsh_jax.analysis.memory import memory_report
    from torsh_jax.demo.model import init_params, synthetic_tokens
    from torsh_jax.demo.run import abstract_train_step

    cfg = shape.demo_config()
    train, _ = abstract_train_step(candidate.plan, cfg, devices, remat=candidate.remat)
    state = train.init(init_params(cfg, jax.random.key(0)))
    batches = [synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=i) for i in range(steps)]
    compiled = train.lower(state, batches[0]).compile()
    peak = memory_report(compiled).peak_estimate_bytes
    counts = collective_counts(collectives(compiled, train.mesh))
    run = {"train": train, "state": state, "batches": batches, "peak": peak, "times": [], **counts}
    for batch in batches[:2]:
        _timed_step(run, batch)
    run["times"].clear()
    return run


def collective_counts(found: list) -> dict:
    """Collectives the compiled step executes per step, and how many of them run inside a loop
    (the layer loop): on simulated CPU devices a collective between blocks of compute costs time of
    its own, which the cost model does not count (benchmarks/README.md)."""
    looped = [c for c in found if (c.trip_count or 1) > 1]
    return {
        "collectives": sum(c.executions for c in found),
        "collectives_in_loops": sum(c.executions for c in looped),
    }


def _timed_step(run: dict, batch) -> None:
    import jax

    start = time.perf_counter()
    run["state"], metrics = run["train"].step(run["state"], batch)
    jax.block_until_ready(metrics["loss"])
    run["times"].append(time.perf_counter() - start)


def measured_pick(predictions: list, shape, devices) -> str:
    """The label ``plan --measure`` picks among ``predictions``: the fastest of those predicted within
    15 % of the best, at most :data:`MEASURED`, each run on its own
    (:func:`torsh_jax.planner.measure.measure_best`)."""
    from torsh_jax.planner.measure import demo_example, measure_best
    from torsh_jax.planner.steps import demo_step_builder

    ranked = sorted(predictions, key=lambda p: p.step_s)
    times = measure_best(ranked, MEASURED, demo_step_builder(shape), devices, demo_example(shape))
    return min(times, key=times.get)


def measure_in_rounds(runs: list[dict], rounds: int) -> list[float]:
    """Median step seconds of each prepared run over ``rounds`` rounds, each timing one step of
    every run in turn: a drift of the machine's speed during the benchmark falls on every plan
    alike instead of on the plans measured while it lasts."""
    for r in range(rounds):
        for run in runs:
            _timed_step(run, run["batches"][r % len(run["batches"])])
    return [statistics.median(run["times"]) for run in runs]


def kendall_tau_b(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two rankings (``scipy.stats.kendalltau``'s default): pairs tied in either
    ranking are left out of the denominator's count for that ranking, so plans the model predicts
    equal (same bytes, same FLOPs) are not counted as disagreeing with the order noise gives them."""
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic)


def kendall_tau_a(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two rankings (ties count as neither agreeing nor disagreeing)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    sign = lambda x: (x > 0) - (x < 0)
    agree = sum(sign(a[i] - a[j]) * sign(b[i] - b[j]) for i, j in pairs)
    return agree / len(pairs)


def misordered_beyond_noise(rows: list[dict]) -> list[list[str]]:
    """Pairs of plans the prediction orders against the measurement by more than the noise: the
    measured gap exceeds both plans' interquartile range over the rounds (pairs predicted equal
    are not counted). The pairs that decide a low Kendall's tau in figures rather than in noise."""
    out = []
    for a, b in itertools.combinations(rows, 2):
        gap = a["measured_s"] - b["measured_s"]
        predicted = a["predicted_s"] - b["predicted_s"]
        beyond = abs(gap) > max(a["measured_iqr_s"], b["measured_iqr_s"])
        if predicted and gap and (predicted > 0) != (gap > 0) and beyond:
            out.append([a["plan"], b["plan"]])
    return out


def _halves(times: list[float]) -> list[float]:
    """Median step seconds of the even and of the odd rounds: two measurements of the plan from
    the same run."""
    return [statistics.median(times[0::2]), statistics.median(times[1::2])]


def _iqr(times: list[float]) -> float:
    low, _, high = statistics.quantiles(times, n=4)
    return high - low


def summary(rows: list[dict], name: str) -> dict:
    predicted = [r["predicted_s"] for r in rows]
    measured = [r["measured_s"] for r in rows]
    best = min(range(len(rows)), key=lambda i: predicted[i])
    return {
        "name": "planner_summary",
        "model": name,
        "plans": len(rows),
        "mape": statistics.mean(abs(r["error"]) for r in rows),
        "kendall_tau": kendall_tau_b(predicted, measured),
        "kendall_tau_a": kendall_tau_a(predicted, measured),
        "kendall_tau_halves": kendall_tau_b(*zip(*(r["measured_halves_s"] for r in rows), strict=True)),
        "misordered_beyond_noise": misordered_beyond_noise(rows),
        "pick": rows[best]["plan"],
        "pick_ratio": measured[best] / min(measured),
        "memory_mape": statistics.mean(abs(r["memory_error"]) for r in rows),
    }


def main() -> int:
    args = parse_args()
    common.setup_devices(args.devices)
    import jax

    from torsh_jax.planner.calibrate import calibrate
    from torsh_jax.planner.cost import optimizer_state_factor, predict
    from torsh_jax.planner.host_load import HostMeter, warn_if_busy
    from torsh_jax.planner.shape import parse_model

    devices = jax.devices()[: args.devices]
    models = QUICK_MODELS if args.quick else MODELS
    steps = 2 if args.quick else args.steps
    every = []
    for name, text in models.items():
        shape = parse_model(text)
        # the compute rate up to the plans' largest micro-step (16 examples on 2 devices)
        machine = calibrate(
            devices, shape, repeats=steps, max_examples_per_device=GLOBAL_BATCH // len(devices)
        )
        common.emit(
            {
                "name": "planner_machine",
                "model": name,
                "flops_per_s": machine.flops_per_s,
                "alpha_s": machine.link("ici").alpha_s,
                "bytes_per_s": machine.link("ici").bytes_per_s,
                "step_overhead_s": machine.step_overhead_s,
                "activation_scale": machine.activation_scale,
                "recompute_scale": machine.recompute_scale,
                "flops_per_s_by_tokens": machine.flops_per_s_by_tokens,
                "recompute_costs_by_tokens": machine.recompute_costs_by_tokens,
                "host_load": machine.host_load,
            }
        )
        rows = []
        chosen = plans_for(shape, len(devices))
        runs = [prepare(candidate, shape, devices, steps) for candidate in chosen]
        with HostMeter() as meter:  # other work on the host slows the plans it falls on
            measured = measure_in_rounds(runs, steps)
        warn_if_busy(meter.load, f"while bench_planner.py timed the {name} model's plans")
        for run in runs:  # their states go: the measured pick runs its plans one at a time
            del run["state"], run["train"], run["batches"]
        predictions = [
            predict(candidate, shape, machine, opt_factor=optimizer_state_factor(candidate.plan))
            for candidate in chosen
        ]
        picked = measured_pick(predictions, shape, devices)
        for candidate, p, run, seconds in zip(chosen, predictions, runs, measured, strict=True):
            peak = run["peak"]
            row = {
                "name": "planner_plan",
                "model": name,
                "plan": candidate.label,
                "predicted_s": p.step_s,
                "measured_s": seconds,
                "measured_iqr_s": _iqr(run["times"]),
                "measured_halves_s": _halves(run["times"]),
                "error": p.step_s / seconds - 1,
                "predicted_memory": p.memory["total"],
                "compiled_peak": peak,
                "memory_error": p.memory["total"] / peak - 1,
                "collectives": run["collectives"],
                "collectives_in_loops": run["collectives_in_loops"],
            }
            common.emit(row)
            rows.append(row)
        fastest = min(r["measured_s"] for r in rows)
        common.emit(
            {
                **summary(rows, name),
                "measured_pick": picked,
                "measured_pick_ratio": next(r["measured_s"] for r in rows if r["plan"] == picked) / fastest,
                "host_load": dataclasses.asdict(meter.load) if meter.load else None,
            }
        )
        every += rows
    if len(models) > 1:
        common.emit(
            {
                **summary(every, "all"),
                "pick": None,
                "pick_ratio": None,
                "measured_pick": None,
                "measured_pick_ratio": None,
            }
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
