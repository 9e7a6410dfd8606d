"""A compiler-partitioned model's collectives over ``tensor``, read from its compiled step.

A model written with the tensor blocks (the demo model) places Megatron's collectives itself
(:func:`~torsh_jax.analysis.theory.megatron_blocks`). Any other model is partitioned by the
compiler from its weights' layout, and it sends something else: flax's attention projects query,
key and value apart, so the backward pass sums three input gradients (XLA combines them into one
all-reduce of three activations); key and value heads that ``tensor`` does not divide are split
over part of it, and their sums run within those groups. So the planner compiles such a model's
step over ``tensor`` alone, two and three layers deep on two batch sizes, and reads each kind's
executions and bytes per token, per layer and outside the layers. A plan's collectives are those
counts at its layers and its micro-step's tokens (:func:`counted_tensor_theory`).

Example (counts of a model's step, at 8 layers and 64 tokens per micro-step):
    >>> counts = (KindCount("all-reduce", group=2, layer_runs=5, outside_runs=4, layer_token_bytes=1792,
    ...                     outside_token_bytes=128),)
    >>> t = counted_tensor_theory(counts, 64, tensor_size=2, layers=8, micro_steps=1)
    >>> t.count_by_kind, t.payload_bytes_by_kind
    ({'all-reduce': 44}, {'all-reduce': 925716})
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from torsh_jax.analysis.theory import Theory, TheoryCollective
from torsh_jax.plan.spec import AxisSize, MeshSpec, PipelineSpec

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.plan.spec import ParallelPlan
    from torsh_jax.planner.shape import ModelShape
    from torsh_jax.planner.space import Candidate
    from torsh_jax.planner.steps import StepBuilder

__all__ = [
    "KindCount",
    "CountKey",
    "count_key",
    "counted_tensor_theory",
    "measure_tensor_counts",
    "with_tensor_counts",
]

#: What decides a step's collectives over ``tensor``: its size, the plan's tensor rules, and
#: whether each layer's forward runs again in the backward pass.
CountKey = tuple[int, str, bool]


@dataclass(frozen=True)
class KindCount:
    """One collective kind over ``tensor`` per micro-step, among ``group`` devices (fewer than
    ``tensor`` where heads are split over part of it): executions, and bytes sent per token, per
    layer and outside the layers."""

    kind: str
    group: int
    layer_runs: float
    outside_runs: float
    layer_token_bytes: float
    outside_token_bytes: float


def count_key(c: Candidate) -> CountKey:
    """The counts a candidate's collectives over ``tensor`` are read from."""
    from torsh_jax.planner.per_device import recomputed

    return c.sizes["tensor"], c.plan.tensor.rules, recomputed(c)


def counted_tensor_theory(
    counts: Iterable[KindCount], tokens: int, /, *, tensor_size: int, layers: int, micro_steps: int
) -> Theory:
    """The collectives of ``counts`` for ``layers`` layers on micro-steps of ``tokens`` tokens
    (each kind's executions at their mean size)."""
    out = []
    for k in counts:
        runs = round(k.layer_runs * layers + k.outside_runs)
        per_token = k.layer_token_bytes * layers + k.outside_token_bytes
        sent = per_token * tokens
        if runs > 0 and sent > 0:
            out.append(TheoryCollective(k.kind, ("tensor",), round(sent / runs), k.group, runs * micro_steps))
    return Theory(f"collectives over tensor={tensor_size} as compiled ({layers} layers)", tuple(out))


def measure_tensor_counts(
    build_at_depth: Callable[[int], StepBuilder], shape: ModelShape, plan: ParallelPlan, key: CountKey,
    devices, /, *, rows: int = 2,
) -> tuple[KindCount, ...]:  # fmt: skip
    """Compile ``build_at_depth(layers)``'s step under ``plan``'s precision and ``key``'s tensor
    layout over ``tensor`` alone (the first ``key[0]`` of ``devices``), 2 and 3 layers deep (each
    a loop over its layers) on ``rows`` and ``2 rows`` examples, and read its collectives over
    ``tensor`` per layer and outside the layers (the four compiled at once)."""
    from torsh_jax.planner.cores import in_parallel

    tensor, rules, remat = key
    alone = replace(
        plan, name="tensor counts", mesh=MeshSpec(data=AxisSize(), tensor=AxisSize(ici=tensor)),
        zero=replace(plan.zero, stage=0), pipeline=PipelineSpec(), compression=(),
        tensor=replace(plan.tensor, rules=rules, sequence_parallel=False),
    )  # fmt: skip
    lowered = {}
    for layers, n in itertools.product((2, 3), (rows, 2 * rows)):
        sized = replace(alone, batch=replace(alone.batch, micro_batch_size=n, accumulation_steps=1))
        train, batch = build_at_depth(layers)(sized, list(devices)[:tensor], remat=remat)
        lowered[layers, n] = (train.lower(train.abstract_state(), batch), train.mesh)
    read = in_parallel({at: partial(_tensor_collectives, *program) for at, program in lowered.items()})
    kinds = sorted({kind for found in read.values() for kind in found})
    return tuple(_kind_count(kind, read, rows, rows * shape.seq_len) for kind in kinds)


def _tensor_collectives(lowered, mesh) -> dict:
    """``{(kind, group size): (executions, payload bytes)}`` over ``tensor`` of the ``lowered``
    step, compiled."""
    from torsh_jax.analysis.overlap import collectives_once

    found: dict[tuple[str, int], tuple[float, float]] = {}
    for c in collectives_once(lowered.compile(), mesh):
        if c.axes == ("tensor",):
            runs, sent = found.get((c.kind, c.group_size), (0.0, 0.0))
            found[c.kind, c.group_size] = (
                runs + c.executions,
                sent + c.unwidened_payload_bytes * c.executions,
            )
    return found


def _kind_count(kind: tuple[str, int], read: dict, rows: int, tokens: int) -> KindCount:
    """One kind's counts from the four compiles ``read[layers, rows]`` (2 and 3 layers; ``rows`` and
    ``2 rows`` examples of ``tokens / rows`` tokens): executions and the bytes that grow with the
    tokens, each linear in layers. Bytes that do not grow with the tokens (weights gathered where
    ``tensor`` does not divide them, the optimizer's norm) are left out: the partitioner's choice
    for them depends on the rest of the mesh, which these steps do not have."""
    runs = {k: v.get(kind, (0.0, 0.0))[0] for k, v in read.items()}
    sent = {k: v.get(kind, (0.0, 0.0))[1] for k, v in read.items()}
    per_token = {n: (sent[n, 2 * rows] - sent[n, rows]) / tokens for n in (2, 3)}
    layer_runs = runs[3, rows] - runs[2, rows]
    per_layer = lambda by_depth: by_depth[3] - by_depth[2]
    outside = lambda by_depth: 3 * by_depth[2] - 2 * by_depth[3]  # at 0 layers
    return KindCount(
        *kind, layer_runs, runs[2, rows] - 2 * layer_runs,
        layer_token_bytes=per_layer(per_token), outside_token_bytes=outside(per_token),
    )  # fmt: skip


def with_tensor_counts(shape: ModelShape, found: Iterable[Candidate], build_at_depth, devices) -> ModelShape:
    """``shape`` with the counts every candidate in ``found`` over ``tensor`` (without a pipeline)
    is read from, for a model the compiler partitions (``shape.tensor_blocks`` false) and as many
    devices as each ``tensor`` needs; else ``shape`` as it is."""
    if shape.tensor_blocks:
        return shape
    wanted = {}
    for c in found:
        if 1 < c.sizes["tensor"] <= len(devices) and c.sizes["stage"] == 1:
            wanted.setdefault(count_key(c), c.plan)
    counted = dict(shape.tensor_counts)
    for key, plan in wanted.items():
        if key not in counted:
            counted[key] = measure_tensor_counts(build_at_depth, shape, plan, key, devices)
    return replace(shape, tensor_counts=tuple(sorted(counted.items())))
