"""Step time measured on this host's devices: the planner's pick among its best-ranked plans by
running them (``torsh-jax plan --measure N``), where the devices planned for are here.

The plans run are those that fit and are predicted within :data:`MEASURE_BAND` of the best one's
step, at most ``N``: closer than that, the cost model's own error (the bound it is held to) does
not order them, and a plan predicted further off is not worth the run.

Each plan's step is built as :func:`~torsh_jax.planner.rank.verify` builds it (the demo model of
the shape, or your model's), its state made from parameters drawn at a transformer's scale (values
do not change what a step computes, only where it could take a shortcut: none are zeros), each
device drawing only its own shards (a plan is run because it fits: the whole model need not), its
batch the model's example repeated to the global batch. One plan at a time holds the devices (a
plan that fits may need most of their memory); each is timed for ``steps`` steps after ``warmup``
and keeps the median.

Example:
    >>> import jax
    >>> from torsh_jax import load_plan
    >>> from torsh_jax.planner import parse_model
    >>> from torsh_jax.planner.steps import demo_step_builder
    >>> shape = parse_model("demo:d_model=64,layers=2,vocab=256,seq_len=16,heads=4")
    >>> seconds = step_seconds(load_plan("ddp"), demo_step_builder(shape), jax.devices()[:1],
    ...                        demo_example(shape), remat=False, steps=2, warmup=1)
    >>> seconds > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torsh_jax.typing import PyTree

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.plan import ParallelPlan
    from torsh_jax.planner.cost import Prediction
    from torsh_jax.planner.shape import ModelShape
    from torsh_jax.planner.steps import StepBuilder

__all__ = [
    "MEASURE_BAND",
    "MEASURE_STEPS",
    "MEASURE_WARMUP",
    "demo_example",
    "drawn_state",
    "measure_best",
    "step_seconds",
]

#: Steps timed per plan, after :data:`MEASURE_WARMUP` untimed ones (the first compiles).
MEASURE_STEPS = 5
MEASURE_WARMUP = 2

#: Plans predicted slower than the best by more than this share are not run: the step-time error
#: the cost model is held to (a mean absolute 15 %, docs/planner.md).
MEASURE_BAND = 0.15

#: Standard deviation of the parameters drawn for a measured step (a transformer's initialisation).
PARAM_SCALE = 0.02


def demo_example(shape: ModelShape, /) -> PyTree:
    """One example of the demo model of ``shape`` (its tokens)."""
    from torsh_jax.demo.model import synthetic_tokens

    return synthetic_tokens(shape.demo_config(), batch_size=1, seed=0)


def step_seconds(
    plan: ParallelPlan,
    build: StepBuilder,
    devices: Sequence,
    example: PyTree,
    /,
    *,
    remat: bool,
    steps: int = MEASURE_STEPS,
    warmup: int = MEASURE_WARMUP,
) -> float:
    """Median seconds of ``steps`` train steps of ``plan`` over ``devices`` after ``warmup``
    (``build``'s step, each layer recomputed where ``remat``; the batch ``example`` repeated)."""
    import jax

    train, _ = build(plan, devices, remat=remat)
    state = drawn_state(train)()
    batch = _repeated(example, train.global_batch_size)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = train.step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_best(
    ranked: Sequence[Prediction],
    count: int,
    build: StepBuilder,
    devices: Sequence,
    example: PyTree,
    /,
    *,
    steps: int = MEASURE_STEPS,
    band: float = MEASURE_BAND,
) -> dict[str, float]:
    """Measured step seconds of the first ``count`` plans of ``ranked`` that fit (predicted, and
    compiled where compiled) and are predicted within ``band`` of the fastest of them, by label, in
    ranking order."""
    fitting = [p for p in ranked if p.fits_as_compiled]
    best = min((p.step_s for p in fitting), default=0.0)
    fitting = [p for p in fitting if p.step_s <= best * (1 + band)][:count]
    return {
        p.candidate.label: step_seconds(
            p.candidate.plan, build, devices, example, remat=p.candidate.remat, steps=steps
        )
        for p in fitting
    }


def drawn_state(train) -> Callable[[], PyTree]:
    """The program making ``train``'s state from parameters drawn at :data:`PARAM_SCALE`, on its
    devices: each draws only its shards, in the layout the state stores (with partitioned random
    bits). ``init`` takes the parameters as the model defines them, so an interleaved pipeline's
    layer chunks pass through the model's ``[layers, ...]`` layout, which no sharding of it
    matches: there a device holds up to about the layer stack for a moment (docs/planner.md).

    Example:
        >>> from torsh_jax.planner.steps import demo_step_builder
        >>> from torsh_jax.planner.shape import parse_model
        >>> from torsh_jax import load_plan
        >>> import jax
        >>> build = demo_step_builder(parse_model("demo:d_model=64,layers=2,vocab=256,seq_len=16,heads=4"))
        >>> train, _ = build(load_plan("zero3"), jax.devices()[:1], remat=False)
        >>> int(drawn_state(train)().step)
        0
    """
    import jax

    return jax.jit(lambda: train.init(_drawn_params(train)), out_shardings=train.state_shardings)


def _drawn_params(train) -> PyTree:
    """Parameters of the step's model as the model defines them, drawn at :data:`PARAM_SCALE` in
    the stored layout, each leaf placed as the step places it."""
    import jax
    from jax.sharding import NamedSharding

    leaves, tree = jax.tree.flatten(train.abstract_state().params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    with jax.threefry_partitionable(True):
        drawn = [
            jax.lax.with_sharding_constraint(
                _drawn(key, leaf), NamedSharding(leaf.sharding.mesh, leaf.sharding.spec)
            )
            for key, leaf in zip(keys, leaves, strict=True)
        ]
    return train.logical_params(jax.tree.unflatten(tree, drawn))


def _drawn(key, leaf) -> PyTree:
    import jax
    import jax.numpy as jnp

    if jnp.issubdtype(leaf.dtype, jnp.floating):
        return (PARAM_SCALE * jax.random.normal(key, leaf.shape)).astype(leaf.dtype)
    return jnp.zeros(leaf.shape, leaf.dtype)


def _repeated(example: PyTree, size: int) -> PyTree:
    """``example`` (any leading dim) repeated along its leading dim to ``size`` rows."""
    import jax
    import numpy as np

    def rows(x):
        x = np.asarray(x)
        return np.resize(x, (size, *x.shape[1:])) if x.shape[0] != size else x

    return jax.tree.map(rows, example)
