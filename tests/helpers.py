"""Shared test fixtures: the demo model and a twin comparison on simulated devices."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from torsh_jax.demo.model import LMConfig, init_params, layered_model, loss_fn, synthetic_tokens
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.layered import LayeredModel, layered_loss
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import TwinReport, compare_with_twin, record_gradients
from torsh_jax.tensor import tensor_axis

SMALL = LMConfig(vocab=64, d_model=32, heads=2, head_dim=16, mlp=64, layers=2, seq_len=16)


def recording_optimizer(lr: float = 1e-2) -> optax.GradientTransformation:
    return optax.chain(record_gradients(), optax.adamw(lr))


def mlp_model(cfg: LMConfig) -> LayeredModel:
    """The smallest model with the demo's embed -> stacked layers -> head shape and batches: token
    embedding, residual ``tanh`` MLP layers (``cfg.d_model`` -> ``cfg.mlp``), a linear head with
    next-token cross-entropy. A third of the demo model's compile time, for tests of what runs
    around the layers (pipeline schedules), not of the layers themselves."""
    return LayeredModel(
        embed=lambda p, batch: p["embed"]["table"][batch["inputs"]],
        layer=lambda p, h: h + jnp.tanh(h @ p["w_in"]) @ p["w_out"],
        head=lambda p, h, batch: optax.softmax_cross_entropy_with_integer_labels(
            h @ p["head"]["w"], batch["targets"]
        ).mean(),
    )


@functools.partial(jax.jit, static_argnums=0)
def mlp_params(cfg: LMConfig, key: jax.Array) -> dict:
    """Parameters of :func:`mlp_model` in float32: ``{"embed", "layers" (stacked), "head"}``."""
    k_embed, k_in, k_out, k_head = jax.random.split(key, 4)
    d, h, n = cfg.d_model, cfg.mlp, cfg.layers
    return {
        "embed": {"table": jax.random.normal(k_embed, (cfg.vocab, d))},
        "layers": {
            "w_in": jax.random.normal(k_in, (n, d, h)) / d**0.5,
            "w_out": jax.random.normal(k_out, (n, h, d)) / h**0.5 / n,
        },
        "head": {"w": jax.random.normal(k_head, (d, cfg.vocab)) / d**0.5},
    }


def needs_tensor_blocks(plan: ParallelPlan) -> bool:
    """Whether ``plan`` has a tensor axis (the demo model's tensor blocks, not the MLP)."""
    return (plan.mesh.tensor.ici, plan.mesh.tensor.dcn) != (1, 1)


def model_for(plan: ParallelPlan, cfg: LMConfig):
    """``(model, init)``: :func:`mlp_model` (a third of the demo model's compile time, for tests of
    what runs around the layers) unless ``plan`` has a tensor axis, which needs the demo model's
    tensor blocks."""
    if needs_tensor_blocks(plan):
        return layered_model(cfg), init_params
    return mlp_model(cfg), mlp_params


def twin_report(
    plan: ParallelPlan, *, devices=None, steps: int = 5, cfg: LMConfig = SMALL, optimizer=None, mlp=False
):
    """Run ``plan``, its single-device twin and the twin in float64 (the reference of
    :func:`assert_matches_twin`) for ``steps`` steps on the demo model (``mlp``: on
    :func:`mlp_model`)."""
    optimizer = optimizer or recording_optimizer()
    mesh = build_mesh(plan, devices)
    tp = tensor_axis(plan)
    model = mlp_model(cfg) if mlp else layered_model(cfg, tp=tp)
    params = (mlp_params if mlp else init_params)(cfg, jax.random.key(0))
    train = make_train_step(model, optimizer, plan, mesh, params)
    twin_loss = layered_loss(model) if mlp else loss_fn(cfg, tp=tp)
    twin = make_reference_step(twin_loss, optimizer, plan)
    exact = make_reference_step(twin_loss, optimizer, plan, dtype="float64")
    batches = [synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=i) for i in range(steps)]
    return compare_with_twin(tuple(train), twin, params, batches, exact=exact), train


def assert_matches_twin(report: TwinReport, *, params: bool = False, **criterion) -> None:
    """The parallel program is within round-off of the math: its losses and gradients (and parameters
    with ``params``: for SGD or momentum, or lockstep) are no further from the float64 run than
    ``ROUNDOFF_FACTOR`` x the float32 twin's own error + ``ROUNDOFF_FLOOR``
    (:meth:`~torsh_jax.runtime.verify.TwinReport.roundoff_violations`)."""
    quantities = ("loss", "grads", "params") if params else ("loss", "grads")
    violations = report.roundoff_violations(quantities, **criterion)
    assert not violations, f"not within round-off of the float64 run: {'; '.join(violations)}"


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_common():
    """``benchmarks/common.py`` (its GSPMD baselines) as module ``bench_common`` (loaded once)."""
    if "bench_common" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_common", BENCHMARKS / "common.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_common"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_common"]
