"""What one device of a candidate plan holds and runs, which both its memory and its step time
read: its parameters before ZeRO, its micro-step's tokens, which layers run forward again, and the
figures of its pipeline's schedule table.

Example:
    >>> from torsh_jax.planner.shape import ModelShape
    >>> from torsh_jax.planner.space import candidates
    >>> shape = ModelShape.demo("tiny")
    >>> found = {c.label: c for c in candidates(shape, devices=8, global_batch=64)}
    >>> recomputed(found["zero3 fsdp=8 acc=1"]), recomputed(found["zero1 fsdp=8 acc=1"])
    (True, False)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from torsh_jax.pipeline.schedule import IDLE, build_pipeline_schedule
from torsh_jax.pipeline.slots import slot_plan
from torsh_jax.plan.roles import compose, head_backward_first
from torsh_jax.planner.buffers import compressed_buffers, tensor_split_elements
from torsh_jax.planner.shape import ModelShape
from torsh_jax.planner.space import Candidate
from torsh_jax.runtime.pipeline.ends import pairs_end_sums

__all__ = [
    "local_params",
    "paired_end_sums",
    "TensorShares",
    "tensor_shares",
    "split_part",
    "head_params_on_device",
    "layer_remat",
    "recomputed",
    "tokens_per_micro_step",
    "chunk_layers",
    "ScheduleFigures",
    "schedule_figures",
]


def local_params(c: Candidate, shape: ModelShape) -> tuple[int, int]:
    """(parameters of one device's layers, of its embedding and head) before ZeRO: over ``tensor``,
    a ``1/tensor`` share of what the plan splits and the rest whole (:func:`tensor_shares`)."""
    t, s = c.sizes["tensor"], c.sizes["stage"]
    shares = tensor_shares(c, shape)
    one_layer = split_part(shares.layer, shape.layer_params / t, shape.layer_params)
    both = shape.embed_params + shape.head_params
    return shape.layers // s * round(one_layer), round(split_part(shares.shared, both / t, both))


def compressed_buffers_of(c: Candidate, shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Per axis the plan compresses gradients over: the length of each buffer one device's
    reductions over it encode per synchronisation (the length of its error-feedback residual).
    The runtime's buckets (:func:`~torsh_jax.planner.buffers.compressed_buffers`) where the model's
    leaves are known; else one buffer of its local parameters, a ``1/fsdp`` shard of them where
    ZeRO reduce-scatters over ``fsdp`` before another axis reduces
    (:func:`torsh_jax.runtime.data_parallel.gradient_sync`).

    Example:
        >>> import dataclasses
        >>> from torsh_jax.plan import AxisCompression, CompressorSpec
        >>> from torsh_jax.planner.space import candidates
        >>> shape = ModelShape.demo("tiny")
        >>> found = {c.label: c for c in candidates(shape, devices=8, global_batch=64)}
        >>> c = found["zero1 data=2 fsdp=4 acc=1"]
        >>> int8 = (AxisCompression(axis="data", gradients=CompressorSpec(method="int8")),)
        >>> c = dataclasses.replace(c, plan=c.plan.replace(compression=int8))
        >>> sum(local_params(c, shape)), sum(compressed_buffers_of(c, shape)["data"])  # a quarter, padded
        (4260160, 1065984)
    """
    buffers = compressed_buffers(shape, c.plan, c.sizes)
    if buffers:
        return buffers
    roles, local = compose(c.plan, c.sizes), sum(local_params(c, shape))
    out = {}
    for axis in roles.gradient_compression:
        scattered = roles.shard_axis is not None and axis != roles.shard_axis
        out[axis] = (local // roles.size(roles.shard_axis) if scattered else local,)
    return out


def paired_end_sums(c: Candidate, shape: ModelShape) -> tuple[int, bool]:
    """``(parameters of the device's smaller part of the embedding and head, whether a pipeline
    stage carries their gradient sums paired)``: the runtime's stages share one buffer between
    the two parts' sums (:mod:`torsh_jax.runtime.pipeline.ends`) unless the compiler partitions
    ``tensor`` (a model without tensor blocks), where each stage carries both
    (:func:`~torsh_jax.runtime.pipeline.ends.pairs_end_sums`, given what the compiler would
    partition).

    Example:
        >>> from torsh_jax.planner.space import candidates
        >>> shape = ModelShape.demo("tiny")
        >>> found = {c.label: c for c in candidates(shape, devices=8, global_batch=64)}
        >>> smaller = min(shape.embed_params, shape.head_params)
        >>> paired_end_sums(found["pp fsdp=4 stage=2 1f1b m=2 zero1 acc=1"], shape) == (smaller, True)
        True
    """
    t = c.sizes["tensor"]
    smaller = min(shape.embed_params, shape.head_params)
    paired = c.sizes["stage"] > 1 and pairs_end_sums(() if shape.tensor_blocks else (t,))
    return round(split_part(tensor_shares(c, shape).shared, smaller / t, smaller)), paired


class TensorShares(NamedTuple):
    """The shares of a model's parameters a plan splits over ``tensor`` (:func:`tensor_shares`).

    Attributes:
        layer: of one layer's parameters.
        shared: of the embedding's and head's.
        vocab: of the vocabulary projection's (the logits are split as it is).
    """

    layer: float
    shared: float
    vocab: float


def tensor_shares(c: Candidate, shape: ModelShape) -> TensorShares:
    """What the candidate's plan splits over ``tensor``, as its rules lay the model's parameters out
    (:func:`~torsh_jax.planner.buffers.tensor_split_elements`); a shape without parameter paths:
    all of it.

    Example:
        >>> from torsh_jax.planner.shape import parse_model
        >>> from torsh_jax.planner.space import candidates
        >>> shape = parse_model("demo:d_model=256,layers=4,vocab=256,seq_len=32")
        >>> found = {c.label: c for c in candidates(shape, devices=8, global_batch=32)}
        >>> shares = tensor_shares(found["ddp data=4 tensor=2 acc=1"], shape)
        >>> round(shares.layer, 4), shares.vocab  # the layers' norms stay whole
        (0.9993, 1.0)
    """
    found = tensor_split_elements(shape, c.plan, c.sizes)
    if found is None:
        return TensorShares(1.0, 1.0, 1.0)
    both = shape.embed_params + shape.head_params
    share = lambda part, whole: part / whole if whole else 1.0
    return TensorShares(share(found.layer, shape.layer_params), share(found.shared, both), found.vocab)


def split_part(share: float, split: float, whole: float) -> float:
    """What one device holds (or runs) of a quantity of which the plan splits ``share`` over
    ``tensor``: ``split`` (the quantity at the device's ``1/tensor``) for that share, ``whole`` for
    the rest.

    Example:
        >>> split_part(0.75, 1.0, 4.0)  # three quarters split over 4 devices
        1.75
    """
    return share * split + (1 - share) * whole


def head_params_on_device(c: Candidate, shape: ModelShape) -> float:
    """The head's parameters one device holds before ZeRO, of its share over ``tensor``.

    Example (the tiny demo model's head is its ``d_model x vocab`` kernel and final norm):
        >>> from torsh_jax.planner.space import candidates
        >>> shape = ModelShape.demo("tiny")
        >>> c = candidates(shape, devices=8, global_batch=64)[0]
        >>> head_params_on_device(c, shape) == shape.head_params
        True
    """
    t = c.sizes["tensor"]
    return split_part(tensor_shares(c, shape).shared, shape.head_params / t, shape.head_params)


def layer_remat(c: Candidate) -> bool:
    """Each layer runs forward again in its backward pass, from its saved input: ZeRO-3 gathering
    each layer on use."""
    return c.remat or c.plan.zero.stage == 3 and c.sizes["fsdp"] > 1 and c.sizes["stage"] == 1


def logits_apart_from_layers(c: Candidate) -> bool:
    """The step never holds its logits beside a recomputed layer's working set: its layers are
    recomputed (:func:`layer_remat`) and it finishes the head's backward before theirs
    (:func:`torsh_jax.plan.roles.head_backward_first`, the predicate the runtime's step follows:
    not under a pipeline, nor where micro-steps add their layers' gradients into the step's sum in
    place, whose peak is not the head's)."""
    return layer_remat(c) and head_backward_first(c.plan, c.sizes, remat=c.remat)


def recomputed(c: Candidate) -> bool:
    """The layers' forward runs twice: per layer (:func:`layer_remat`) or per pipeline chunk (a
    stage's backward recomputes its chunk from the stashed input)."""
    return layer_remat(c) or c.sizes["stage"] > 1


def tokens_per_micro_step(c: Candidate, shape: ModelShape) -> int:
    """Tokens of one device's micro-step (a pipeline micro-batch under a pipeline)."""
    rows = c.plan.batch.micro_batch_size
    if c.sizes["stage"] > 1:
        rows //= c.plan.pipeline.microbatches
    return rows * shape.seq_len


def chunk_layers(c: Candidate, shape: ModelShape) -> int:
    """Layers of one pipeline chunk (a stage's layers over its virtual stages)."""
    return max(1, shape.layers // (c.sizes["stage"] * c.plan.pipeline.virtual_stages))


class ScheduleFigures(NamedTuple):
    """What the cost model reads of a pipeline's schedule table: idle over busy slots, the runtime's
    activation, gradient and ``W`` stash slots, the ``ppermute`` collectives one pass runs
    (each tick that sends forward runs one, each that sends backward another), and whether its
    backwards are split into ``B`` and ``W`` (ZB-H1)."""

    idle_fraction: float
    stash: tuple[int, int, int]
    permutes: int
    splits_backward: bool


def schedule_figures(c: Candidate) -> ScheduleFigures:
    pipe = c.plan.pipeline
    return _table_figures(pipe.schedule, c.sizes["stage"], pipe.microbatches, pipe.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _table_figures(name: str, stages: int, microbatches: int, virtual_stages: int) -> ScheduleFigures:
    table = build_pipeline_schedule(
        name, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages
    )
    idle = int((table.table[..., 0] == IDLE).sum())
    slots = slot_plan(table)
    stash = (slots.activation_slots, slots.gradient_slots, slots.weight_slots)
    permutes = int(slots.sends_forward.any(axis=1).sum() + slots.sends_backward.any(axis=1).sum())
    idle_fraction = idle / (table.table[..., 0].size - idle)
    return ScheduleFigures(idle_fraction, stash, permutes, table.splits_backward)
