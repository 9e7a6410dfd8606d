"""Shared test fixtures: the demo model and a twin comparison on simulated devices."""

from __future__ import annotations

import jax
import optax

from torsh_jax.demo.model import LMConfig, init_params, layered_model, loss_fn, synthetic_tokens
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import compare_with_twin, record_gradients
from torsh_jax.tensor import tensor_axis

SMALL = LMConfig(vocab=64, d_model=32, heads=2, head_dim=16, mlp=64, layers=2, seq_len=16)


def recording_optimizer(lr: float = 1e-2) -> optax.GradientTransformation:
    return optax.chain(record_gradients(), optax.adamw(lr))


def twin_report(plan: ParallelPlan, *, devices=None, steps: int = 5, cfg: LMConfig = SMALL, optimizer=None):
    """Run ``plan`` and its single-device twin for ``steps`` steps on the demo model."""
    optimizer = optimizer or recording_optimizer()
    mesh = build_mesh(plan, devices)
    tp = tensor_axis(plan)
    train = make_train_step(layered_model(cfg, tp=tp), optimizer, plan, mesh)
    twin = make_reference_step(loss_fn(cfg, tp=tp), optimizer, plan)
    params = init_params(cfg, jax.random.key(0))
    batches = [synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=i) for i in range(steps)]
    return compare_with_twin(tuple(train), twin, params, batches), train
