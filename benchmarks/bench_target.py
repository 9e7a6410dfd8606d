"""Our steps against GSPMD's, compiled for an accelerator this machine does not have (``v5e-16``).

For each plan the demo language model's step is lowered from its abstract state and compiled by
the target's compiler (``libtpu``; nothing runs). Next to it, the ``jax.jit`` baselines of
:mod:`common` (``jit_fsdp``: state sharded over ``fsdp``; ``jit_fsdp_gathered``: the same with every
part's weights constrained to replicated where used), compiled for the same mesh and batch, for
the plans whose mesh they fit (data and fsdp axes; the pipeline has none).

Prints one JSON object per plan and program: ``overlap`` (fraction of collective payload bytes
whose start and done have compute between them, see :mod:`torsh_jax.analysis.overlap`),
``overlap_all_gather`` / ``overlap_reduce`` (the same for gathers and for reductions),
``overlap_by_axes`` (per mesh-axis set), ``overlap_by_place`` (collectives in loop bodies, e.g. a layer
scan's, and outside them), ``temp_bytes`` (``memory_analysis``), ``peak_bytes`` (on a TPU libtpu's
own peak, what its check holds to HBM; its ``temp`` is more than the temporaries live then),
``wire_bytes`` (ring-algorithm bytes per step of the async pairs and synchronous collectives),
compile seconds; then per plan and baseline the ratios ours / baseline (``temp_ratio``,
``peak_ratio``, ``wire_ratio``) and both overlap fractions.

``--every-preset`` compiles every plan preset (``meshes/``) for the first of ``--targets`` its mesh
resolves for (``v5e-16x2``: two slices over DCN; a preset written for 8 devices resolves for
``v5e-8``) through ``torsh-jax inspect --target`` on the demo model at its smallest (``--layers`` as
the preset needs, ``--d-model 64``) and prints one ``target_preset`` row each: ``compiled``,
``fits``, ``temp_bytes``, ``peak_bytes``, ``overlap``, ``compile_s`` (``error``: the message); the
exit code is 1 if a preset resolves for none of the targets or fails to compile.

Usage:
    python benchmarks/bench_target.py [--target v5e-16] [--layers 8] [--d-model 512] [--plans zero3,fsdp_tp]
    python benchmarks/bench_target.py --every-preset [--targets v5e-16,v5e-16x2,v5e-8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common

PLANS = ("zero3", "fsdp_tp", "pp_1f1b")
BASELINES = ("fsdp_gathered", "fsdp")


def parse_args() -> argparse.Namespace:
    split = lambda text: tuple(p for p in text.split(",") if p)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e-16")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--plans", type=split, default=PLANS)
    parser.add_argument(
        "--baselines", type=split, default=BASELINES, help=f"of {', '.join(common.BASELINE_KINDS)}"
    )
    parser.add_argument("--every-preset", action="store_true", help="compile every plan preset (smoke)")
    parser.add_argument(
        "--targets",
        default="v5e-16,v5e-16x2,v5e-8,v5e-4x2",
        help="with --every-preset: targets, NAMExSLICES for slices [v5e-16,v5e-16x2,v5e-8,v5e-4x2]",
    )
    return parser.parse_args()


def model_config(args):
    from torsh_jax.demo.model import LMConfig

    heads = max(1, args.d_model // 64)
    return LMConfig(
        vocab=args.vocab,
        d_model=args.d_model,
        heads=heads,
        head_dim=args.d_model // heads,
        mlp=4 * args.d_model,
        layers=args.layers,
        seq_len=args.seq_len,
    )


def measure(compiled, mesh, seconds: float) -> dict:
    """Overlap, memory and wire figures of one compiled program."""
    from torsh_jax.analysis import memory_report
    from torsh_jax.analysis.memory import peak_bytes
    from torsh_jax.analysis.overlap import collective_overlap

    memory = memory_report(compiled)
    report = collective_overlap(compiled, mesh)
    kinds = report.by_kind()
    reduce_kinds = [kinds[k] for k in ("all-reduce", "reduce-scatter") if k in kinds]
    reduce_bytes = sum(k["bytes"] for k in reduce_kinds)
    return {
        "overlap": report.fraction(),
        "overlap_all_gather": report.fraction(kind="all-gather"),
        "overlap_reduce": sum(k["overlapped_bytes"] for k in reduce_kinds) / reduce_bytes
        if reduce_bytes
        else None,
        "overlap_by_axes": {axes: group["fraction"] for axes, group in report.by_axes().items()},
        "overlap_by_place": {place: group["fraction"] for place, group in report.by_place().items()},
        "collectives": len(report.collectives),
        "async": sum(o.is_async for o in report.collectives),
        "wire_bytes": sum(o.collective.wire_bytes_per_step for o in report.collectives),
        "temp_bytes": memory.temp_bytes,
        "peak_bytes": peak_bytes(memory, mesh.devices.flat[0].platform),
        "compile_s": round(seconds, 1),
    }


def compile_ours(plan, mesh, cfg, shapes):
    import optax

    from torsh_jax.demo.model import layered_model
    from torsh_jax.runtime.step import make_train_step
    from torsh_jax.tensor import tensor_axis

    start = time.perf_counter()
    model = layered_model(cfg, tp=tensor_axis(plan))
    train = make_train_step(model, optax.adamw(common.LEARNING_RATE), plan, mesh, shapes)
    batch = token_shapes(cfg, train.global_batch_size)
    compiled = train.lower(train.abstract_state(), batch).compile()
    return compiled, train.global_batch_size, time.perf_counter() - start


def compile_baseline(kind: str, mesh, cfg, shapes, batch_size: int):
    import optax

    from torsh_jax.demo.model import layered_model

    start = time.perf_counter()
    optimizer = optax.adamw(common.LEARNING_RATE)
    jitted, _ = common._baseline_functions(layered_model(cfg), optimizer, shapes, mesh, kind=kind, key=cfg)
    import jax

    state = jax.eval_shape(lambda p: (p, optimizer.init(p)), shapes)
    compiled = jitted.lower(state, token_shapes(cfg, batch_size)).compile()
    return compiled, time.perf_counter() - start


def token_shapes(cfg, batch_size: int) -> dict:
    import jax
    import jax.numpy as jnp

    tokens = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)
    return {"inputs": tokens, "targets": tokens}


def run_plan(name: str, args, devices, cfg, shapes) -> None:
    from torsh_jax.plan import load_plan
    from torsh_jax.runtime.mesh import build_mesh

    plan = load_plan(name)
    mesh = build_mesh(plan, devices)
    fields = {"plan": name, "target": args.target, "layers": cfg.layers, "d_model": cfg.d_model}
    try:
        compiled, batch_size, seconds = compile_ours(plan, mesh, cfg, shapes)
    except Exception as err:  # the compiler refused it: a result (libtpu's out-of-memory)
        common.emit({"name": "target_program", "program": "ours", **fields, "compiled": False,
                     "error": _first_line(err)})  # fmt: skip
        return
    ours = measure(compiled, mesh, seconds)
    common.emit({"name": "target_program", "program": "ours", **fields, "batch": batch_size, **ours})
    if mesh.shape["stage"] > 1:
        return  # no GSPMD pipeline to compare with
    for kind in args.baselines:
        try:
            compiled, seconds = compile_baseline(kind, mesh, cfg, shapes, batch_size)
        except Exception as err:  # the compiler refused it: a result (libtpu's out-of-memory)
            common.emit({"name": "target_program", "program": f"jit_{kind}", **fields, "batch": batch_size,
                         "compiled": False, "error": _first_line(err)})  # fmt: skip
            continue
        base = measure(compiled, mesh, seconds)
        common.emit(
            {"name": "target_program", "program": f"jit_{kind}", **fields, "batch": batch_size, **base}
        )
        common.emit(
            {
                "name": "target_compare",
                "baseline": f"jit_{kind}",
                **fields,
                "overlap_ours": ours["overlap"],
                "overlap_baseline": base["overlap"],
                "temp_ratio": _ratio(ours["temp_bytes"], base["temp_bytes"]),
                "peak_ratio": _ratio(ours["peak_bytes"], base["peak_bytes"]),
                "wire_ratio": _ratio(ours["wire_bytes"], base["wire_bytes"]),
            }
        )


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).strip().splitlines()[0].split())}"[:300]


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def compile_preset(name: str, target: str, slices: int) -> dict:
    """``torsh-jax inspect --plan name --target target --json`` on the smallest demo model: a row."""
    import contextlib
    import io
    import json

    from torsh_jax.cli.main import main as cli

    argv = [
        "inspect",
        "--plan",
        name,
        "--target",
        target,
        "--slices",
        str(slices),
        "--d-model",
        "64",
        "--json",
    ]
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(argv)
        except Exception as failure:  # a compiler error: the smoke reports it and goes on
            print(_first_line(failure), file=sys.stderr)
            code = 1
    row = {"name": "target_preset", "plan": name, "target": target, "slices": slices,
           "compile_s": round(time.perf_counter() - start, 1), "compiled": code == 0}  # fmt: skip
    if code != 0:
        return {**row, "error": err.getvalue().strip().splitlines()[-1:]}
    report = json.loads(out.getvalue())["target"]
    overlap = report["overlap"] or {}
    return {**row, "fits": report["fits"], "temp_bytes": report["memory"]["temp"],
            "peak_bytes": report["memory"]["peak"],
            "overlap": overlap.get("fraction"), "compiler_message": report["compiler_message"]}  # fmt: skip


def _target_list(text: str) -> list[tuple[str, int]]:
    """``v5e-16,v5e-16x2`` -> ``[("v5e-16", 1), ("v5e-16", 2)]`` (``xN``: N slices)."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, slices = item.partition("x")
        out.append((name, int(slices or 1)))
    return out


def _resolves(name: str, target: str, slices: int) -> bool:
    """The preset's mesh resolves for the target's chips and slices (else it is not for it)."""
    from torsh_jax.errors import MeshError
    from torsh_jax.plan import load_plan
    from torsh_jax.runtime.mesh import resolve_mesh
    from torsh_jax.targets import parse_target

    try:
        resolve_mesh(load_plan(name), parse_target(target, slices=slices).devices, num_slices=slices)
    except MeshError:
        return False
    return True


def every_preset(args) -> int:
    """Each preset compiled for the first of ``--targets`` its mesh resolves for; 1 if a preset
    resolves for none or fails to compile."""
    from torsh_jax.plan import presets

    failed = False
    for name in presets.names("meshes"):
        places = [(t, n) for t, n in _target_list(args.targets) if _resolves(name, t, n)]
        rows = [compile_preset(name, t, n) for t, n in places[:1]]
        for row in rows or [{"name": "target_preset", "plan": name, "compiled": False,
                             "error": f"the mesh resolves for none of {args.targets}"}]:  # fmt: skip
            common.emit(row)
        failed |= not rows or not all(row["compiled"] for row in rows)
    return 1 if failed else 0


def main() -> int:
    args = parse_args()
    if args.every_preset:
        return every_preset(args)
    # JAX's own backend on the CPU: libtpu then starts at the target's first topology, after
    # target_devices gave it its environment and flags (torsh_jax.targets.libtpu_env)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from torsh_jax.demo.model import init_params
    from torsh_jax.targets import target_devices

    devices = target_devices(args.target)
    cfg = model_config(args)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    for name in args.plans:
        run_plan(name, args, devices, cfg, shapes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
