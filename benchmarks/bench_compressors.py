"""Throughput of the compressors' CPU path, and compressed vs plain collective step time.

Prints one JSON object per measurement. Compressor rows compare against a
memory copy (``-x`` on a float32 buffer of the same length) timed alternately
with each operation: every round times the copy, then the operation, and
``ratio_to_copy`` is the median over rounds of ``copy_seconds / seconds``
(1.0 = as fast as a copy), with ``ratio_spread`` = [min, max] over rounds and
targets quantise >= 0.35, dequantise >= 0.30, fused error-feedback step >= 0.20.
Collective rows time a jitted ``shard_map`` all-reduce on 8 simulated CPU
devices, compressed and plain (``pmean``), alternating the same way.

Usage:
    python benchmarks/bench_compressors.py [--elements 4194304] [--repeats 25]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

TARGETS = {"quantise": 0.35, "dequantise": 0.30, "feedback": 0.20}
PRESETS = ("int8", "int8_stochastic", "int4", "sign", "fp16", "bf16", "topk", "powersgd")


def _once(fn, args) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def paired_timing(fn, args, baseline, baseline_args, *, repeats: int) -> dict:
    """Time ``baseline`` then ``fn`` in each of ``repeats`` rounds, after one warm-up call each.

    Returns the medians of both, the median per-round ratio ``baseline / fn`` and its
    [min, max] spread, so a load that comes and goes hits both sides of a round alike.
    """
    import jax

    jax.block_until_ready(baseline(*baseline_args))
    jax.block_until_ready(fn(*args))
    rounds = [(_once(baseline, baseline_args), _once(fn, args)) for _ in range(repeats)]
    ratios = [b / f for b, f in rounds]
    return {
        "seconds": statistics.median(f for _, f in rounds),
        "baseline_seconds": statistics.median(b for b, _ in rounds),
        "ratio": statistics.median(ratios),
        "spread": [min(ratios), max(ratios)],
    }


def _compressor_rows(preset: str, elements: int, repeats: int):
    import jax

    from torsh_jax.compress import make_compressor, padded_length
    from torsh_jax.compress import powersgd as psgd
    from torsh_jax.plan import load_compressor

    spec = load_compressor(preset)
    n = padded_length(elements, axis_size=1, spec=spec)
    c = make_compressor(spec)
    x = jax.random.normal(jax.random.key(0), (n,))
    residual = x * 0.01
    key = jax.random.key(1)
    state = c.init(n)
    quantise = jax.jit(lambda x, key: c.compress(x, state, key=key)[0])
    payload = quantise(x, key)
    if spec.method == "powersgd":
        feedback = jax.jit(lambda x, r: psgd.encode_with_feedback(x, r, state)[:2])
    else:
        feedback = jax.jit(lambda x, r, key: c.compress_with_feedback(x, r, key=key))
    ops = {
        "quantise": (quantise, (x, key)),
        "dequantise": (jax.jit(c.decompress), (payload,)),
        "feedback": (feedback, (x, residual) if spec.method == "powersgd" else (x, residual, key)),
    }
    copy = jax.jit(lambda x: -x)
    for op, (fn, args) in ops.items():
        t = paired_timing(fn, args, copy, (x,), repeats=repeats)
        yield {
            "kind": "compressor",
            "preset": preset,
            "op": op,
            "elements": n,
            "seconds": t["seconds"],
            "copy_seconds": t["baseline_seconds"],
            "ratio_to_copy": t["ratio"],
            "ratio_spread": t["spread"],
            "rounds": repeats,
            "target": TARGETS[op],
        }


def _collective_rows(preset: str, elements: int, repeats: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from torsh_jax.compress import compressed_all_reduce, init_feedback, padded_length
    from torsh_jax.plan import load_compressor

    devices = 8
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = load_compressor(preset)
    n = padded_length(elements // devices, axis_size=devices, spec=spec)
    x = jax.random.normal(jax.random.key(0), (devices * n,))
    plain = jax.jit(
        jax.shard_map(lambda x: jax.lax.pmean(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    )
    fb = jax.tree.map(
        lambda a: jnp.concatenate([a] * devices), init_feedback(spec, length=n, axis_size=devices)
    )

    def body(x, fb, key):
        return compressed_all_reduce(x, fb, spec=spec, axis_name="data", axis_size=devices, key=key)

    specs = (P("data"), P("data"), P())
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P("data"))))
    t = paired_timing(step, (x, fb, jax.random.key(0)), plain, (x,), repeats=repeats)
    yield {
        "kind": "collective",
        "preset": preset,
        "devices": devices,
        "elements_per_device": n,
        "seconds": t["seconds"],
        "plain_seconds": t["baseline_seconds"],
        "compressed_over_plain": 1.0 / t["ratio"],
        "compressed_over_plain_spread": sorted(1.0 / r for r in t["spread"]),
        "rounds": repeats,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=25, help="alternating rounds per measurement")
    parser.add_argument("--presets", nargs="*", default=list(PRESETS))
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    for preset in args.presets:
        for row in _compressor_rows(preset, args.elements, args.repeats):
            print(json.dumps(row), flush=True)
    for preset in args.presets:
        for row in _collective_rows(preset, args.elements, args.repeats):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
