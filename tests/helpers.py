"""Shared test fixtures: the demo model and a twin comparison on simulated devices."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from torsh_jax.demo.model import LMConfig, init_params, layered_model, loss_fn, synthetic_tokens
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.layered import LayeredModel, layered_loss
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import (
    TwinReport,
    compare_with_twin,
    float64_batch,
    record_gradients,
    with_float64,
)
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


def mlp_step_peak(cfg: LMConfig, plan: ParallelPlan, devices: int) -> int:
    """Bytes at the peak of ``plan``'s compiled step for :func:`mlp_model` of ``cfg`` on the first
    ``devices`` simulated devices (nothing initialised or run)."""
    from torsh_jax.analysis.memory import memory_report, peak_bytes

    shapes = jax.eval_shape(lambda: mlp_params(cfg, jax.random.key(0)))
    mesh = build_mesh(plan, jax.devices()[:devices])
    train = make_train_step(mlp_model(cfg), optax.sgd(0.1), plan, mesh, shapes)
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    return peak_bytes(memory_report(train.lower(train.abstract_state(), batch).compile()), "cpu")


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
    plan: ParallelPlan,
    *,
    devices=None,
    steps: int = 5,
    cfg: LMConfig = SMALL,
    optimizer: Callable[[], optax.GradientTransformation] = recording_optimizer,
    mlp=False,
):
    """Run ``plan``, its single-device twin and the twin in float64 (the reference of
    :func:`assert_matches_twin`) for ``steps`` steps on the demo model (``mlp``: on
    :func:`mlp_model`), with the optimizer ``optimizer()`` makes. The two twin runs are recorded
    once per worker for every plan they do not depend on (:func:`shared_twin_runs`)."""
    mesh = build_mesh(plan, devices)
    tp = tensor_axis(plan)
    model = mlp_model(cfg) if mlp else layered_model(cfg, tp=tp)
    params = (mlp_params if mlp else init_params)(cfg, jax.random.key(0))
    train = make_train_step(model, optimizer(), plan, mesh, params)
    twin_loss = layered_loss(model) if mlp else loss_fn(cfg, tp=tp)
    batches = [synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=i) for i in range(steps)]
    key = ("mlp" if mlp else "demo", cfg, tp, optimizer, twin_plan_key(plan))
    twin, exact = shared_twin_runs(key, twin_loss, twin_loss, optimizer, plan, params, batches)
    return compare_with_twin(tuple(train), twin, params, batches, exact=exact), train


def twin_plan_key(plan: ParallelPlan) -> tuple:
    """What of ``plan`` the single-device twin reads (``make_reference_step``): the precision policy
    with its loss scaling, and how accumulated gradients are reduced. Plans that differ only in their
    mesh, sharding, pipeline or tensor layout have the same twin."""
    accumulation = plan.batch.accumulation_steps if plan.batch.accumulation_reduce == "sum" else 1
    return (plan.precision, plan.batch.accumulation_reduce, accumulation)


@dataclass(frozen=True)
class RecordedRun:
    """One ``(init, step)`` program run from ``params`` on ``batches``: the state before each step
    and after the last, and each step's metrics."""

    params: object
    batches: tuple
    states: tuple
    metrics: tuple

    def replay(self) -> tuple[Callable, Callable]:
        """``(init, step)`` handing back the recorded states: ``init`` for the recorded parameters,
        ``step`` for a state it handed out and the batch that state was stepped on (anything else
        fails: a replay is never compared with a run it is not). Metrics come as new dicts."""

        def init(params):
            _assert_same_tree(params, self.params, "parameters")
            return self.states[0]

        def step(state, batch):
            i = next((i for i, s in enumerate(self.states[:-1]) if s is state), None)
            assert i is not None, "the twin replay was given a state it did not hand out"
            _assert_same_tree(batch, self.batches[i], f"batch {i}")
            return self.states[i + 1], dict(self.metrics[i])

        return init, step


def record_run(init: Callable, step: Callable, params, batches) -> RecordedRun:
    """Run ``init`` and ``step`` over ``batches`` and keep every state and metrics."""
    states, metrics = [init(params)], []
    for batch in batches:
        state, out = step(states[-1], batch)
        states.append(state)
        metrics.append(out)
    return RecordedRun(_host_copy(params), _host_copy(tuple(batches)), tuple(states), tuple(metrics))


def _host_copy(tree):
    """``tree`` as new numpy arrays: what a replay compares its inputs with, whatever happens to the
    caller's arrays later."""
    return jax.tree.map(np.array, tree)


def _assert_same_tree(actual, expected, what: str) -> None:
    """``actual`` has ``expected``'s structure and values, exactly."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), f"twin replay: other {what}"
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert np.array_equal(np.asarray(a), e), f"twin replay: other {what}"


_TWIN_RUNS: dict = {}


def digest(tree) -> str:
    """A hash of ``tree``'s structure, shapes, dtypes and values."""
    h = hashlib.sha256(str(jax.tree.structure(tree)).encode())
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        h.update(f"{leaf.shape}{leaf.dtype}".encode())
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def shared_twin_runs(
    key: Hashable,
    loss,
    exact_loss,
    optimizer: Callable[[], optax.GradientTransformation],
    plan,
    params,
    batches,
) -> tuple[tuple[Callable, Callable], tuple[Callable, Callable]]:
    """``(twin, exact)``: replays (:meth:`RecordedRun.replay`) of the float32 twin of ``loss`` and the
    float64 run of ``exact_loss`` (on the batches in float64, as ``compare_with_twin`` steps it),
    with ``optimizer()`` on ``plan``, from ``params`` over ``batches``.

    Each twin run compiles two programs, as long as the parallel step's; many tests compare different
    plans with the same twin. They are run once per worker for each ``key`` (which must name the
    losses, ``optimizer`` and :func:`twin_plan_key`) and :func:`digest` of the parameters and
    batches; the replays check they are given the recorded parameters and batches. States are
    immutable jax arrays."""
    full_key = (key, digest((params, list(batches))))
    if full_key not in _TWIN_RUNS:
        opt = optimizer()
        twin = make_reference_step(loss, opt, plan)
        exact = make_reference_step(exact_loss, opt, plan, dtype="float64")
        exact_run = with_float64(record_run, *exact, params, [float64_batch(b) for b in batches])
        _TWIN_RUNS[full_key] = (record_run(*twin, params, batches), exact_run)
    return tuple(run.replay() for run in _TWIN_RUNS[full_key])


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
