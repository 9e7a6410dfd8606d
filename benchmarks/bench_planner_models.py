"""The planner's predicted memory for flax models it did not write, with the demo model's compiled
gradients and with the model's own, against the compiled peak.

The models are tests/flax_blocks.py's Llama-style (grouped-query attention, SwiGLU, RMSNorm, an
untied head) and GPT-2-style (a tied embedding, its blocks under ``blocks``) linen modules,
converted with ``from_linen`` as their authors would, at ``d_model`` 256, 8 blocks, a vocabulary of
2,048 and 128 tokens (``--quick``: 64, 2 blocks, 256, 32). On 8 simulated CPU devices at global
batch 32, each plan of :data:`PLANS` is predicted twice, with the machine's memory fields from
:func:`torsh_jax.planner.calibrate.compiled_memory` of the demo model of the same widths (what a
machine file of ``torsh-jax calibrate`` holds) and of the model itself
(:class:`torsh_jax.planner.gradients.ModelGradients`), and compiled as the model's own step
(``model_step_builder``). Nothing is timed: the run needs no quiet machine.

Prints one ``planner_model_memory`` row per model and plan (``predicted_demo``, ``predicted_own``,
``compiled``, ``error_demo``, ``error_own``) and one ``planner_model_memory_summary`` row per model
and overall (``plans``, ``within_5pct_demo``, ``within_5pct_own``, ``mean_abs_error_demo``,
``mean_abs_error_own``).

Usage:
    python benchmarks/bench_planner_models.py [--model llama|gpt2] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import common
from bench_planner_memory import cpu_machine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the flax models

#: Plans compiled for each model: recomputing ones (ZeRO-3 gathering on use, remat), tensor ones
#: (split by shape: ``auto``), accumulating and pipelines.
PLANS = (
    "zero3 fsdp=8 acc=1",
    "zero1 fsdp=8 remat acc=1",
    "zero3 fsdp=4 tensor=2 auto acc=1",
    "zero1 fsdp=4 tensor=2 auto remat acc=1",
    "zero2 fsdp=8 acc=2",
    "zero2 fsdp=4 tensor=2 auto acc=2",
    "ddp data=8 acc=1",
    "ddp data=4 tensor=2 auto acc=1",
    "pp data=2 stage=4 1f1b m=4 acc=1",
    "pp data=2 stage=4 zb_h1 m=4 acc=1",
    "pp data=2 stage=4 interleaved v=2 m=4 acc=1",
)
#: ``--quick``: two blocks (no 4-stage pipeline)
QUICK_PLANS = PLANS[:3]
GLOBAL_BATCH = 32
#: (d_model, blocks, vocabulary, tokens, heads) of the full and the quick run
SIZES = {False: (256, 8, 2048, 128, 4), True: (64, 2, 256, 32, 4)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama", "gpt2"), default=None, help="one model [both]")
    parser.add_argument("--quick", action="store_true", help="small models, three plans")
    return parser.parse_args()


def converted(name: str, quick: bool):
    """``(layered model, its parameters, an example batch, its ModelShape)``."""
    import jax
    from flax_blocks import GPT2, Llama, next_token_loss

    from torsh_jax import from_linen
    from torsh_jax.demo.model import LMConfig, synthetic_tokens
    from torsh_jax.planner.shape import ModelShape

    d, blocks, vocab, seq, heads = SIZES[quick]
    if name == "llama":
        mlp = -(-8 * d // 3 // 16) * 16  # Llama's SwiGLU width: 8 d / 3 up to a multiple of 16
        module, key = (
            Llama(vocab=vocab, d_model=d, heads=heads, kv_heads=heads // 2, layers=blocks, hidden=mlp),
            "layers",
        )
    else:
        mlp = 4 * d
        module, key = GPT2(vocab=vocab, d_model=d, heads=heads, layers=blocks, max_len=seq), "blocks"
    example = synthetic_tokens(LMConfig(vocab=vocab, seq_len=seq), batch_size=2, seed=0)
    params = module.init(jax.random.key(0), example["inputs"])["params"]
    layered = from_linen(module, params, example, loss=next_token_loss, blocks=key)
    widths = {"d_model": d, "seq_len": seq, "vocab": vocab, "heads": heads, "mlp": mlp}
    shape = ModelShape.from_model(layered.model, layered.params, **widths)
    return layered, example, shape


def model_rows(name: str, quick: bool) -> list[dict]:
    """One row per plan of ``name``, printed."""
    import jax

    from torsh_jax.planner import ModelGradients, compiled_memory, model_step_builder
    from torsh_jax.planner.cost import optimizer_state_factor, predict
    from torsh_jax.planner.rank import verify
    from torsh_jax.planner.space import candidates

    layered, example, shape = converted(name, quick)
    devices = jax.devices()[:8]
    base = cpu_machine()
    gradients = ModelGradients(layered.model, layered.params, example)
    machines = {
        "demo": dataclasses.replace(base, **compiled_memory(shape, devices[0])),
        "own": dataclasses.replace(base, **compiled_memory(shape, devices[0], gradients=gradients)),
    }
    build = model_step_builder(layered.model, layered.params, example)
    found = {c.label: c for c in candidates(shape, devices=8, global_batch=GLOBAL_BATCH)}
    rows = []
    for label in QUICK_PLANS if quick else PLANS:
        c = found[label]
        opt = optimizer_state_factor(c.plan)
        predicted = {k: predict(c, shape, m, opt_factor=opt).memory["total"] for k, m in machines.items()}
        peak = verify(predict(c, shape, machines["own"], opt_factor=opt), shape, devices, build=build)["peak"]
        row = {"name": "planner_model_memory", "model": name, "plan": label, "compiled": peak}
        for k, bytes_ in predicted.items():
            row[f"predicted_{k}"], row[f"error_{k}"] = bytes_, bytes_ / peak - 1
        common.emit(row)
        rows.append(row)
    return rows


def summary(rows: list[dict], model: str) -> dict:
    """Within 5 % and the mean absolute error of both predictions over ``rows``."""
    row = {"name": "planner_model_memory_summary", "model": model, "plans": len(rows)}
    for k in ("demo", "own"):
        errors = [abs(r[f"error_{k}"]) for r in rows]
        row[f"within_5pct_{k}"] = sum(e <= 0.05 for e in errors)
        row[f"mean_abs_error_{k}"] = statistics.fmean(errors)
    return row


def main() -> int:
    args = parse_args()
    common.setup_devices(8)
    rows = []
    for name in [args.model] if args.model else ["llama", "gpt2"]:
        found = model_rows(name, args.quick)
        common.emit(summary(found, name))
        rows += found
    common.emit(summary(rows, "all"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
