"""Throughput of the compressors' CPU path, and compressed vs plain collective step time.

Prints one JSON object per measurement. Compressor rows compare against a
memory copy (``-x`` on the same float32 buffer) timed in the same run:
``ratio_to_copy = copy_seconds / seconds`` (1.0 = as fast as a copy), with
targets quantise >= 0.35, dequantise >= 0.30, fused error-feedback step >= 0.20.
Collective rows time a jitted ``shard_map`` all-reduce on 8 simulated CPU
devices, compressed and plain (``pmean``).

Usage:
    python benchmarks/bench_compressors.py [--elements 4194304] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import time

TARGETS = {"quantise": 0.35, "dequantise": 0.30, "feedback": 0.20}
PRESETS = ("int8", "int8_stochastic", "int4", "sign", "fp16", "bf16", "topk", "powersgd")


def _seconds(fn, args, repeats: int) -> float:
    """Median wall time of ``fn(*args)`` after one warm-up call (compilation)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _compressor_rows(preset: str, elements: int, repeats: int, copy_seconds: float):
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
    for op, (fn, args) in ops.items():
        seconds = _seconds(fn, args, repeats)
        yield {
            "kind": "compressor",
            "preset": preset,
            "op": op,
            "elements": n,
            "seconds": seconds,
            "copy_seconds": copy_seconds * n / elements,
            "ratio_to_copy": copy_seconds * n / elements / seconds,
            "target": TARGETS[op],
        }


def _collective_rows(preset: str | None, elements: int, repeats: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from torsh_jax.compress import compressed_all_reduce, init_feedback, padded_length
    from torsh_jax.plan import load_compressor

    devices = 8
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = load_compressor(preset or "int8")
    n = padded_length(elements // devices, axis_size=devices, spec=spec)
    x = jax.random.normal(jax.random.key(0), (devices * n,))
    plain = jax.jit(
        jax.shard_map(lambda x: jax.lax.pmean(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    )
    plain_seconds = _seconds(plain, (x,), repeats)
    if preset is None:
        return
    fb = jax.tree.map(
        lambda a: jnp.concatenate([a] * devices), init_feedback(spec, length=n, axis_size=devices)
    )

    def body(x, fb, key):
        return compressed_all_reduce(x, fb, spec=spec, axis_name="data", axis_size=devices, key=key)

    specs = (P("data"), P("data"), P())
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P("data"))))
    seconds = _seconds(step, (x, fb, jax.random.key(0)), repeats)
    yield {
        "kind": "collective",
        "preset": preset,
        "devices": devices,
        "elements_per_device": n,
        "seconds": seconds,
        "plain_seconds": plain_seconds,
        "compressed_over_plain": seconds / plain_seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--presets", nargs="*", default=list(PRESETS))
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    x = jax.random.normal(jax.random.key(0), (args.elements,))
    copy_seconds = _seconds(jax.jit(lambda x: -x), (x,), args.repeats)
    print(json.dumps({"kind": "copy", "elements": args.elements, "seconds": copy_seconds}), flush=True)
    for preset in args.presets:
        for row in _compressor_rows(preset, args.elements, args.repeats, copy_seconds):
            print(json.dumps(row), flush=True)
    for preset in args.presets:
        for row in _collective_rows(preset, args.elements, args.repeats):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
