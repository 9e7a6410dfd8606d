"""Shared pieces of the train-step benchmarks: devices, baselines, timing, memory and wire rows.

Every benchmark compares our train step with a plain ``jax.jit`` step of the
same demo model, optimizer and mesh, built here: parameters and optimizer
state carry ``NamedSharding`` s (replicated for the data-parallel baseline,
sharded over ``fsdp`` for the FSDP baseline) and GSPMD places the collectives.

Nothing here touches JAX at import time; :func:`setup_devices` must run
first in a script's ``main``.

Example (inside a script, after ``setup_devices(8)``):
    >>> cfg, plan = LMConfig(layers=2), load_plan("ddp")   # doctest: +SKIP
    >>> pair = build_pair(cfg, plan, baseline="replicated")  # doctest: +SKIP
    >>> times = interleaved_timing([pair.ours, pair.baseline], steps=10, chunk=2)  # doctest: +SKIP
    >>> emit(timing_row("ddp_step_time", pair, times, chunk=2))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PyTree = Any
LEARNING_RATE = 1e-3


def parse_args(
    description: str,
    *,
    default_steps: int,
    default_layers: int,
    temp_layers: int | None = None,
    plans: tuple[str, ...] | None = None,
) -> argparse.Namespace:
    """Command-line options shared by the benchmarks (``--temp-layers`` when ``temp_layers`` is
    given, ``--plans`` (comma-separated, default ``plans``) when ``plans`` is)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--steps", type=int, default=default_steps, help="timed steps of each program")
    parser.add_argument("--layers", type=int, default=default_layers, help="transformer blocks")
    parser.add_argument("--quick", action="store_true", help="a few seconds: tiny model, few steps")
    if temp_layers is not None:
        help_text = "layer count L of the temp-memory comparison (L against 2L)"
        parser.add_argument("--temp-layers", type=int, default=temp_layers, help=help_text)
    if plans is not None:
        split = lambda text: tuple(p for p in text.split(",") if p)
        parser.add_argument("--plans", type=split, default=plans, help=f"plans to run [{','.join(plans)}]")
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
    lower_fn: Callable[[Any, Any], Any]
    last_loss: float = float("nan")

    def lower(self) -> Any:
        """The step lowered for the current state and batch."""
        return self.lower_fn(self.state, self.batch)

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
    baseline: Program | None
    train: Any
    mesh: Any
    param_count: int
    extra: list[Program] = field(default_factory=list)
    optimizer: Any = None
    host_params: Any = None
    host_batch: Any = None

    @property
    def programs(self) -> list[Program]:
        """Ours, the baseline and the extra baselines, in timing order."""
        return [self.ours, self.baseline, *self.extra]


def gathered_model(model, mesh):
    """``model`` with each part's parameters constrained to replicated where they are used.

    Under ``jax.jit`` GSPMD then all-gathers the weights and keeps the
    matmuls batch-parallel: FSDP written as sharding annotations (GSPMD
    chooses where the gathers go and how gradients are reduced).
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated = NamedSharding(mesh, P())

    def gather(tree):
        return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: replicated, tree))

    return model._replace(
        embed=lambda p, batch: model.embed(gather(p), batch),
        layer=lambda p, h: model.layer(gather(p), h),
        head=lambda p, h, batch: model.head(gather(p), h, batch),
    )


#: The GSPMD baselines: state replicated; state sharded over ``fsdp``; the same with weights gathered.
BASELINE_KINDS = ("replicated", "fsdp", "fsdp_gathered")
#: Compiled-once baseline programs by (kind, model config, mesh devices): stages share them.
_BASELINE_CACHE: dict[tuple, tuple[Callable, Callable]] = {}


def _baseline_functions(model, optimizer, params, mesh, *, kind: str, key: Any) -> tuple[Callable, Callable]:
    """``(jitted_step, jitted_init)`` of a baseline, built once per ``key``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.runtime.layered import layered_loss

    if kind not in BASELINE_KINDS:
        raise ValueError(f"baseline {kind!r} is not one of {', '.join(BASELINE_KINDS)}")
    cache_key = (kind, key, mesh.devices.tobytes(), tuple(mesh.shape.items()))
    if cache_key not in _BASELINE_CACHE:
        abstract = jax.eval_shape(lambda p: (p, optimizer.init(p)), params)
        shard_kind = "replicated" if kind == "replicated" else "fsdp"
        state_shardings = baseline_shardings(mesh, abstract, kind=shard_kind)
        batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
        loss_model = gathered_model(model, mesh) if kind == "fsdp_gathered" else model
        jitted = jax.jit(
            _baseline_step(layered_loss(loss_model), optimizer),
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, NamedSharding(mesh, P())),
            donate_argnums=0,
        )
        init = jax.jit(lambda p: (p, optimizer.init(p)), out_shardings=state_shardings)
        _BASELINE_CACHE[cache_key] = (jitted, init)
    return _BASELINE_CACHE[cache_key]


def build_baseline(model, optimizer, params, batch, mesh, *, kind: str, key: Any = None) -> Program:
    """A ``jax.jit`` step with ``NamedSharding`` state: ``replicated``, ``fsdp`` or ``fsdp_gathered``.

    Programs with the same ``kind`` and ``key`` (e.g. the model config) on the
    same mesh share one compiled step; each starts from ``params``.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    key = key if key is not None else id(model)
    jitted, init = _baseline_functions(model, optimizer, params, mesh, kind=kind, key=key)
    placed = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp"))))
    return Program(f"jit_{kind}", jitted, init(params), placed, jitted.lower)


def build_pair(cfg, plan, *, baseline: str | None, extra: tuple[str, ...] = (), batch_seed: int = 0) -> Pair:
    """Our step for ``plan`` and ``jax.jit`` baselines (see :func:`build_baseline`), all initialised.

    ``extra`` names further baseline kinds, kept in ``Pair.extra``; ``baseline=None`` builds
    none (the caller sets ``Pair.baseline`` from ``optimizer``, ``host_params`` and ``host_batch``).
    """
    import jax
    import optax

    from torsh_jax.demo.model import init_params, layered_model, param_count, synthetic_tokens
    from torsh_jax.runtime.mesh import build_mesh
    from torsh_jax.runtime.step import make_train_step
    from torsh_jax.tensor import tensor_axis

    mesh = build_mesh(plan)
    model = layered_model(cfg, tp=tensor_axis(plan))
    optimizer = optax.adamw(LEARNING_RATE)
    params = init_params(cfg, jax.random.key(0))
    train = make_train_step(model, optimizer, plan, mesh, params)
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=batch_seed)
    ours = Program("ours", train.step, train.init(params), train.shard_batch(batch), train.lower)
    kinds = (baseline, *extra) if baseline is not None else ()
    built = [build_baseline(model, optimizer, params, batch, mesh, kind=k, key=cfg) for k in kinds]
    base, *others = built or [None]
    return Pair(ours, base, train, mesh, param_count(params), others, optimizer, params, batch)


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
        **_extra_timing(pair, times, chunk=chunk),
        **fields,
    }


def _extra_timing(pair: Pair, times: dict, *, chunk: int) -> dict:
    """``{kind}_ratio``, ``{kind}_paired_ratio`` and ``{kind}_median_s`` of every extra baseline."""
    ours = times[pair.ours.name]
    row = {}
    for program in pair.extra:
        other, key = times[program.name], program.name.removeprefix("jit_")
        row[f"{key}_median_s"] = statistics.median(other)
        row[f"{key}_ratio"] = statistics.median(ours) / statistics.median(other)
        row[f"{key}_paired_ratio"] = paired_ratio(ours, other, chunk=chunk)
        row[f"{key}_loss"] = program.last_loss
    return row


def state_bytes(state: PyTree) -> tuple[int, int]:
    """``(bytes held by one device, logical bytes)`` of a placed pytree (largest device shard)."""
    import jax

    leaves = jax.tree.leaves(state)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    return per_device, total


def summaries(pair: Pair) -> dict:
    """Collectives and memory of both compiled programs, against the plan's theory.

    Ours comes from :func:`torsh_jax.runtime.inspect.inspect_step`; the baseline
    from :func:`torsh_jax.analysis.summarize` with the same theory.
    """
    from torsh_jax.analysis import summarize
    from torsh_jax.runtime.inspect import inspect_step

    theory = plan_theory_for(pair)
    found = {"ours": inspect_step(pair.train, pair.ours.state, pair.ours.batch)}
    for key, program in (
        ("baseline", pair.baseline),
        *((p.name.removeprefix("jit_"), p) for p in pair.extra),
    ):
        found[key] = summarize(program.lower().compile(), pair.mesh, theory=theory)
    return found


def _ratio_key(side: str) -> str:
    """``ratio`` for ours, ``baseline_ratio``, ``fsdp_gathered_ratio``... for the others."""
    return "ratio" if side == "ours" else f"{side}_ratio"


def memory_row(name: str, pair: Pair, summary: dict, **fields) -> dict:
    """Per-device state (params + optimizer state) bytes against ``total / devices``.

    ``ratio`` is ours over the ideal even split; ``baseline_ratio`` the same
    for the baseline. ``*_temp_bytes`` and ``*_peak_bytes`` of every program
    come from ``memory_analysis``.
    """
    devices = pair.mesh.size
    ours_dev, total = state_bytes((pair.ours.state.params, pair.ours.state.opt_state))
    base_dev, _ = state_bytes(pair.baseline.state)
    parts = (("temp", "temp_bytes"), ("peak", "peak_estimate_bytes"))
    return {
        "name": name,
        "ratio": ours_dev / (total / devices),
        "baseline_ratio": base_dev / (total / devices),
        "state_bytes_total": total,
        "ideal_bytes_per_device": total / devices,
        "ours_state_bytes_per_device": ours_dev,
        "baseline_state_bytes_per_device": base_dev,
        **{
            f"{side}_{part}_bytes": entry["memory"][key]
            for side, entry in summary.items()
            for part, key in parts
        },
        **fields,
    }


def plan_theory_for(pair: Pair):
    """The plan's minimum wire bytes for this model (as ``inspect_step`` computes it)."""
    from torsh_jax.runtime.inspect import data_theory

    return data_theory(pair.train)


def wire_row(name: str, summary: dict, **fields) -> dict:
    """Bytes on the wire per step and device against the plan's theory.

    ``ratio`` is ours / theory (``inspect_step``'s ``wire_ratio``);
    ``baseline_ratio`` (and ``fsdp_gathered_ratio``) the baselines' wire
    bytes / the same theory.
    """
    from torsh_jax.runtime.inspect import headline

    theory = summary["baseline"]["theory"]
    return {
        "name": name,
        **{_ratio_key(side): entry["theory"]["wire_ratio"] for side, entry in summary.items()},
        "theory": theory["description"],
        "theory_wire_bytes": headline(summary["ours"])["theoretical_wire_bytes_per_step"],
        **{f"{side}_wire_bytes": entry["totals"]["wire_bytes"] for side, entry in summary.items()},
        **{f"{side}_wire_by_kind": _wire_by_kind(entry) for side, entry in summary.items()},
        **fields,
    }


def _wire_by_kind(summary: dict) -> dict:
    return {kind: entry["wire_bytes"] for kind, entry in summary["totals"]["by_kind"].items()}
