"""Shared pieces of the train-step benchmarks: devices, baselines, timing, memory and wire rows.

Every benchmark compares our train step with a plain ``jax.jit`` step of the
same demo model, optimizer and mesh, built here: parameters and optimizer
state carry ``NamedSharding`` s (replicated for the data-parallel baseline,
sharded over ``fsdp`` for the FSDP baseline) and GSPMD places the collectives.

Nothing here touches JAX at import time; :func:`setup_devices` must run
first in a script's ``main``.

Example (inside a script, after ``setup_devices(8)``):
    >>> cfg, plan = LMConfig(layers=2), load_plan("ddp")   # doctest: +SKIP
    >>> bench = build_pair(cfg, plan, baseline="replicated")  # doctest: +SKIP
    >>> timing = interleaved_timing(bench.runners(), steps=10, chunk=5)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PyTree = Any
LEARNING_RATE = 1e-3


def parse_args(description: str, *, default_steps: int, default_layers: int) -> argparse.Namespace:
    """Command-line options shared by the benchmarks."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--steps", type=int, default=default_steps, help="timed steps of each program")
    parser.add_argument("--layers", type=int, default=default_layers, help="transformer blocks")
    parser.add_argument("--quick", action="store_true", help="a few seconds: tiny model, few steps")
    return parser.parse_args()


def setup_devices(count: int) -> None:
    """Simulate ``count`` CPU devices; call before any other JAX use."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", count)


def emit(row: dict) -> None:
    """Print one measurement as a JSON object on its own line."""
    print(json.dumps(row), flush=True)


def _baseline_step(loss_fn: Callable, optimizer) -> Callable:
    """A plain training step: gradients, optax update, loss and gradient norm."""
    import jax
    import optax

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return step


def fsdp_spec(shape: tuple[int, ...], *, fsdp_size: int):
    """``PartitionSpec`` sharding the largest dim that ``fsdp_size`` divides (replicated if none)."""
    from jax.sharding import PartitionSpec as P

    divisible = [(size, -dim) for dim, size in enumerate(shape) if size % fsdp_size == 0]
    if fsdp_size == 1 or not divisible:
        return P()
    _, neg_dim = max(divisible)
    return P(*[("fsdp" if d == -neg_dim else None) for d in range(len(shape))])


def baseline_shardings(mesh, abstract_state: PyTree, *, kind: str) -> PyTree:
    """``NamedSharding`` of every state leaf: ``replicated`` or ``fsdp`` (largest divisible dim)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    fsdp_size = mesh.shape["fsdp"]

    def one(leaf):
        if kind == "replicated" or leaf.ndim == 0:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, fsdp_spec(leaf.shape, fsdp_size=fsdp_size))

    return jax.tree.map(one, abstract_state)


@dataclass
class Program:
    """One side of a comparison: a step function, its live state and its sharded batch."""

    name: str
    step: Callable
    state: Any
    batch: Any
    lower: Callable[[], Any]

    def run(self) -> float:
        """Run one step to completion; return its wall time in seconds."""
        import jax

        start = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        self.last_loss = float(metrics["loss"])
        return time.perf_counter() - start


@dataclass
class Pair:
    """Our train step and its baseline on the same mesh, model, optimizer and batch."""

    ours: Program
    baseline: Program
    train: Any
    mesh: Any
    param_count: int


def build_pair(cfg, plan, *, baseline: str, batch_seed: int = 0) -> Pair:
    """Our step for ``plan`` and a ``jax.jit`` baseline (``replicated`` or ``fsdp``), both initialised."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.demo.model import init_params, layered_model, param_count, synthetic_tokens
    from torsh_jax.parallel.layered import layered_loss
    from torsh_jax.parallel.mesh import build_mesh
    from torsh_jax.train.step import make_train_step

    mesh = build_mesh(plan)
    model = layered_model(cfg)
    optimizer = optax.adamw(LEARNING_RATE)
    params = init_params(cfg, jax.random.key(0))
    train = make_train_step(model, optimizer, plan, mesh)
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=batch_seed)
    ours_batch = train.shard_batch(batch)
    ours = Program("ours", train.step, train.init(params), ours_batch, lambda: None)
    ours.lower = lambda: train.lower(ours.state, ours_batch)

    abstract = jax.eval_shape(lambda p: (p, optimizer.init(p)), params)
    state_shardings = baseline_shardings(mesh, abstract, kind=baseline)
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    base_batch = jax.device_put(batch, batch_sharding)
    jitted = jax.jit(
        _baseline_step(layered_loss(model), optimizer),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    init = jax.jit(lambda p: (p, optimizer.init(p)), out_shardings=state_shardings)
    base = Program(f"jit_{baseline}", jitted, init(params), base_batch, lambda: None)
    base.lower = lambda: jitted.lower(base.state, base_batch)
    return Pair(ours, base, train, mesh, param_count(params))


def interleaved_timing(programs: list[Program], *, steps: int, chunk: int = 1, warmup: int = 2) -> dict:
    """Step times of each program, running ``chunk`` steps of each in turn (ABAB...).

    Every program first runs ``warmup`` steps (the first compiles). Returns
    ``{name: [seconds of each step]}``; round ``r`` of every program is
    ``values[r * chunk:(r + 1) * chunk]``.
    """
    for program in programs:
        for _ in range(warmup):
            program.run()
    times: dict[str, list[float]] = {p.name: [] for p in programs}
    while len(times[programs[0].name]) < steps:
        for program in programs:
            times[program.name].extend(program.run() for _ in range(chunk))
    return times


def paired_ratio(ours: list[float], baseline: list[float], *, chunk: int) -> float:
    """Median over rounds of ours / baseline time in the same round (cancels load drift)."""
    rounds = range(0, min(len(ours), len(baseline)), chunk)
    return statistics.median(sum(ours[i : i + chunk]) / sum(baseline[i : i + chunk]) for i in rounds)


def timing_row(name: str, pair: Pair, times: dict, *, chunk: int, **fields) -> dict:
    """The step-time comparison: ``ratio = ours median / baseline median``.

    Also ``paired_ratio`` (median of per-round ratios) and ``min_ratio``
    (fastest step of each), which are less sensitive to a busy machine.
    """
    ours, base = times[pair.ours.name], times[pair.baseline.name]
    ours_median, base_median = statistics.median(ours), statistics.median(base)
    return {
        "name": name,
        "ratio": ours_median / base_median,
        "paired_ratio": paired_ratio(ours, base, chunk=chunk),
        "min_ratio": min(ours) / min(base),
        "ours_median_s": ours_median,
        "baseline_median_s": base_median,
        "ours_min_s": min(ours),
        "baseline_min_s": min(base),
        "steps": len(ours),
        "baseline": pair.baseline.name,
        "ours_loss": pair.ours.last_loss,
        "baseline_loss": pair.baseline.last_loss,
        "param_count": pair.param_count,
        "mesh": {a: int(s) for a, s in pair.mesh.shape.items()},
        **fields,
    }


def state_bytes(state: PyTree) -> tuple[int, int]:
    """``(bytes held by one device, logical bytes)`` of a placed pytree (largest device shard)."""
    import jax

    per_device = total = 0
    for leaf in jax.tree.leaves(state):
        itemsize = leaf.dtype.itemsize
        total += leaf.size * itemsize
        shard = leaf.sharding.shard_shape(leaf.shape)
        count = 1
        for size in shard:
            count *= size
        per_device += count * itemsize
    return per_device, total


def summaries(pair: Pair) -> dict:
    """Collectives and memory of both compiled programs, against the plan's theory.

    Ours comes from :func:`torsh_jax.train.inspect.inspect_step`; the baseline
    from :func:`torsh_jax.analysis.summarize` with the same theory.
    """
    from torsh_jax.analysis import summarize
    from torsh_jax.train.inspect import inspect_step

    ours = inspect_step(pair.train, pair.ours.state, pair.ours.batch)
    baseline = summarize(pair.baseline.lower().compile(), pair.mesh, theory=plan_theory_for(pair))
    return {"ours": ours, "baseline": baseline}


def memory_row(name: str, pair: Pair, summary: dict, **fields) -> dict:
    """Per-device state (params + optimizer state) bytes against ``total / devices``.

    ``ratio`` is ours over the ideal even split; ``baseline_ratio`` the same
    for the baseline. Temp and peak bytes come from ``memory_analysis``.
    """
    devices = pair.mesh.size
    ours_dev, total = state_bytes((pair.ours.state.params, pair.ours.state.opt_state))
    base_dev, _ = state_bytes(pair.baseline.state)
    ours_mem, base_mem = summary["ours"]["memory"], summary["baseline"]["memory"]
    return {
        "name": name,
        "ratio": ours_dev / (total / devices),
        "baseline_ratio": base_dev / (total / devices),
        "state_bytes_total": total,
        "ideal_bytes_per_device": total / devices,
        "ours_state_bytes_per_device": ours_dev,
        "baseline_state_bytes_per_device": base_dev,
        "ours_temp_bytes": ours_mem["temp_bytes"],
        "baseline_temp_bytes": base_mem["temp_bytes"],
        "ours_peak_bytes": ours_mem["peak_estimate_bytes"],
        "baseline_peak_bytes": base_mem["peak_estimate_bytes"],
        **fields,
    }


def plan_theory_for(pair: Pair):
    """The plan's minimum wire bytes for this model (as ``inspect_step`` computes it)."""
    from torsh_jax.analysis.theory import plan_theory
    from torsh_jax.demo.model import param_count
    from torsh_jax.parallel.mesh import default_num_slices

    layers = param_count(pair.ours.state.params[pair.train.loss.layers_key])
    return plan_theory(
        pair.train.plan,
        param_count=pair.param_count,
        num_devices=pair.mesh.size,
        num_slices=default_num_slices(pair.train.plan),
        regathered_fraction=layers / pair.param_count,
    )


def wire_row(name: str, summary: dict, **fields) -> dict:
    """Bytes on the wire per step and device against the plan's theory.

    ``ratio`` is ours / theory (``inspect_step``'s ``wire_ratio``);
    ``baseline_ratio`` is the GSPMD baseline's wire bytes / the same theory.
    """
    from torsh_jax.train.inspect import headline

    ours, base = headline(summary["ours"]), summary["baseline"]
    return {
        "name": name,
        "ratio": ours["wire_ratio"],
        "baseline_ratio": base["theory"]["wire_ratio"],
        "theory": base["theory"]["description"],
        "theory_wire_bytes": ours["theoretical_wire_bytes_per_step"],
        "ours_wire_bytes": ours["wire_bytes_per_step"],
        "baseline_wire_bytes": base["totals"]["wire_bytes"],
        "ours_wire_by_kind": _wire_by_kind(summary["ours"]),
        "baseline_wire_by_kind": _wire_by_kind(base),
        **fields,
    }


def _wire_by_kind(summary: dict) -> dict:
    return {kind: entry["wire_bytes"] for kind, entry in summary["totals"]["by_kind"].items()}

