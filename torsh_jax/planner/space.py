"""The plans a planner considers: mesh sizes, ZeRO stage, accumulation, pipeline schedule and
micro-batches, sequence parallelism, remat, gradient compression across slices.

Each :class:`Candidate` is a complete :class:`~torsh_jax.plan.ParallelPlan` for the machine's
devices and the global batch, checked by :func:`~torsh_jax.plan.roles.compose` (a combination the
runtime refuses is not a candidate). The rules, each one decision:

* a slice's devices split over ``data × fsdp × tensor × stage``; extra slices (DCN) go to
  ``data`` (DDP or HSDP across slices) or to ``stage`` (a pipeline across slices);
* ``tensor`` divides the heads, the MLP width and the vocabulary (split Megatron-style), at most
  :attr:`Space.max_tensor`;
* ``stage`` divides the layers; its micro-batches are ``stage`` and ``2 · stage``, each under
  1F1B, ZB-H1 and, where ``stage · 2`` divides the layers, interleaved with two chunks per stage.
  GPipe is left out: it idles as long as 1F1B and stashes all ``m`` micro-batches' inputs where
  1F1B stashes ``min(m, stages)``, so it never wins (``Space.schedules`` may add it);
* ``fsdp = 1`` is DDP; ``fsdp > 1`` is ZeRO-1, ZeRO-2 or ZeRO-3;
* ``tensor > 1``: the base plan's ``tensor.rules``, or ``"auto"`` (label ``auto``) where its names
  leave some of the model's layer weights whole and Megatron's split by shape splits them (read
  from the model's parameters as the runtime lays them out; not for a model written with tensor
  blocks); not a candidate where the runtime would refuse the layout. Without a pipeline: with
  and without sequence parallelism (where ``tensor`` divides the sequence, as the runtime needs,
  and the model is written with tensor blocks);
* remat (the model's :class:`~torsh_jax.runtime.layered.LayeredModel` ``remat``: each layer
  recomputed in the backward pass; not a plan field, see :attr:`Candidate.remat`) where the
  layers are not recomputed already: not under a pipeline (a stage recomputes its chunk), not
  under ZeRO-3 over ``fsdp > 1`` (it gathers and recomputes each layer on use);
* accumulation steps are powers of two that divide the per-replica batch (the search keeps the
  fewest that fit);
* gradient compression over ``data`` when ``data`` crosses slices: int8, top-k and PowerSGD at
  their :class:`~torsh_jax.plan.CompressorSpec` defaults (int8 is what the seeds' guides
  recommend below 25 Gb/s, top-k below 10 Gb/s).

Example:
    >>> from torsh_jax.planner.shape import ModelShape
    >>> shape = ModelShape.demo("tiny")
    >>> found = candidates(shape, devices=8, global_batch=64)
    >>> sorted({c.label.split(" ")[0] for c in found})
    ['ddp', 'pp', 'zero1', 'zero2', 'zero3']
    >>> sorted({c.plan.pipeline.schedule for c in found if c.sizes["stage"] > 1})  # 2 layers: 1 chunk
    ['1f1b', 'zb_h1']
    >>> sorted({c.family for c in found if c.sizes["fsdp"] == 8})  # ZeRO-3 recomputes its layers
    ['zero1 fsdp=8', 'zero1 fsdp=8 remat', 'zero2 fsdp=8', 'zero2 fsdp=8 remat', 'zero3 fsdp=8']
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from torsh_jax.errors import NotSupportedYetError, PlanError, ShardingError
from torsh_jax.plan import (
    AxisCompression,
    AxisSize,
    CompressorSpec,
    MeshSpec,
    ParallelPlan,
    PipelineSpec,
    TensorSpec,
)
from torsh_jax.plan.factor import factorisations
from torsh_jax.plan.roles import compose
from torsh_jax.plan.spec import AXES
from torsh_jax.planner.buffers import tensor_split_elements
from torsh_jax.planner.shape import ModelShape

__all__ = ["COMPRESSION_METHODS", "Candidate", "Space", "candidates"]

#: Gradient compressions tried over a ``data`` axis that crosses slices (``plan --compression``).
COMPRESSION_METHODS = ("int8", "topk", "powersgd")


@dataclass(frozen=True)
class Space:
    """Bounds of the search.

    Attributes:
        max_tensor: largest ``tensor`` axis (inside a host: 8).
        max_accumulation: most accumulation steps tried.
        zero_stages: ZeRO stages tried when ``fsdp > 1``.
        pipelines: try ``stage > 1``.
        schedules: pipeline schedules tried (keys of
            :data:`~torsh_jax.pipeline.schedule.PIPELINE_SCHEDULES`; ``interleaved`` with two
            chunks per stage).
        sequence_parallel: try sequence parallelism where ``tensor > 1`` (besides without).
        remat: try recomputing each layer in the backward pass (besides not).
        compression: try compressed gradients over a ``data`` axis that crosses slices.
        compression_methods: the methods tried there (none: as ``compression=False``).
    """

    max_tensor: int = 8
    max_accumulation: int = 64
    zero_stages: tuple[int, ...] = (1, 2, 3)
    pipelines: bool = True
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb_h1")
    sequence_parallel: bool = True
    remat: bool = True
    compression: bool = True
    compression_methods: tuple[str, ...] = COMPRESSION_METHODS


@dataclass(frozen=True)
class Candidate:
    """A plan the planner may pick.

    Attributes:
        plan: the whole plan (its mesh written out, no ``-1``).
        sizes: ``{axis: size}`` over all slices.
        dcn: ``{axis: size}`` of the part that crosses slices.
        label: one line, e.g. ``zero3 fsdp=16 tensor=4 acc=2``.
        remat: the model recomputes each layer in its backward pass (``LayeredModel(remat=True)``);
            a model property, so a plan file does not carry it.
    """

    plan: ParallelPlan
    sizes: dict[str, int]
    dcn: dict[str, int]
    label: str
    remat: bool = False

    @property
    def family(self) -> str:
        """The label without accumulation (candidates differing only in it compete)."""
        return self.label.split(" acc=")[0]


def candidates(
    shape: ModelShape,
    /,
    *,
    devices: int,
    global_batch: int,
    slices: int = 1,
    base: ParallelPlan | None = None,
    space: Space | None = None,
) -> list[Candidate]:
    """Every plan in ``space`` for ``devices`` (over ``slices``) and ``global_batch`` examples.

    Raises:
        PlanError: ``devices`` is not a multiple of ``slices``, or nothing divides the batch.
    """
    base, space = base or ParallelPlan(), space or Space()
    if devices % slices:
        raise PlanError(
            f"{devices} devices do not split into {slices} slices",
            key="devices",
            fix="give a device count that is a multiple of the slices",
        )
    found = []
    for ici in factorisations(devices // slices, AXES):
        if not _mesh_ok(shape, ici, space):
            continue
        for dcn in _dcn_parts(slices, ici, shape):
            sizes = {a: ici[a] * dcn.get(a, 1) for a in AXES}
            for plan, label, remat in _plans(shape, base, space, ici, dcn, sizes, global_batch):
                if _valid(plan, sizes):
                    found.append(Candidate(plan, sizes, dcn, label, remat))
    if not found:
        raise PlanError(
            f"no plan splits a global batch of {global_batch} over {devices} devices",
            key="global_batch",
            fix="use a global batch that the data-parallel sizes divide (a power of two)",
        )
    return found


def _mesh_ok(shape: ModelShape, ici: dict[str, int], space: Space) -> bool:
    tensor, stage = ici["tensor"], ici["stage"]
    divides = all(width % tensor == 0 for width in (shape.heads, shape.mlp, shape.vocab))
    tensor_ok = tensor <= space.max_tensor and divides
    stage_ok = stage == 1 or (space.pipelines and shape.layers % stage == 0)
    return tensor_ok and stage_ok


def _dcn_parts(slices: int, ici: dict[str, int], shape: ModelShape) -> list[dict[str, int]]:
    if slices == 1:
        return [{}]
    parts = [{"data": slices}]
    if shape.layers % (ici["stage"] * slices) == 0:
        parts.append({"stage": slices})
    return parts


def _plans(shape, base, space, ici, dcn, sizes, global_batch):
    replicas = sizes["data"] * sizes["fsdp"]
    if global_batch % replicas:
        return
    per_replica = global_batch // replicas
    mesh = MeshSpec(**{a: AxisSize(ici=ici[a], dcn=dcn.get(a, 1)) for a in AXES})
    stages = (0,) if sizes["fsdp"] == 1 else space.zero_stages
    options = itertools.product(
        stages,
        _pipelines(shape, sizes["stage"], space),
        _tensor_options(shape, base, space, sizes),
        _compressions(space, dcn, sizes),
    )
    for zero_stage, pipeline, tensor, compression in options:
        for remat in _remats(space, sizes, zero_stage):
            for acc in _accumulations(per_replica, pipeline.microbatches, space):
                plan = replace(
                    base,
                    name="planned",
                    mesh=mesh,
                    zero=replace(base.zero, stage=zero_stage),
                    batch=replace(base.batch, micro_batch_size=per_replica // acc, accumulation_steps=acc),
                    pipeline=pipeline,
                    tensor=tensor,
                    compression=compression,
                )
                yield plan, _label(sizes, zero_stage, plan, remat, acc), remat


def _pipelines(shape: ModelShape, stage: int, space: Space) -> list[PipelineSpec]:
    if stage == 1:
        return [PipelineSpec()]
    out = []
    for m in (stage, 2 * stage):
        for schedule in space.schedules:
            if schedule != "interleaved":
                out.append(PipelineSpec(microbatches=m, schedule=schedule))
            elif shape.layers % (2 * stage) == 0:  # two chunks of whole layers per stage
                out.append(PipelineSpec(microbatches=m, schedule=schedule, virtual_stages=2))
    return out


def _tensor_options(shape: ModelShape, base: ParallelPlan, space: Space, sizes) -> list[TensorSpec]:
    """Sequence parallelism off, and on where it applies (``tensor > 1``, no pipeline, ``tensor``
    dividing the sequence, a model written with tensor blocks); each with the rules of
    :func:`_tensor_rules` (none where no rules lay the model out over ``tensor``)."""
    rules = _tensor_rules(shape, base, sizes)
    if rules is None:
        return []
    off = replace(base.tensor, sequence_parallel=False, rules=rules)
    t = sizes["tensor"]
    if not space.sequence_parallel or t == 1 or sizes["stage"] > 1 or shape.seq_len % t:
        return [off]
    if not shape.tensor_blocks:  # the compiler partitions it: its activations stay whole
        return [off]
    return [off, replace(off, sequence_parallel=True)]


def _tensor_rules(shape: ModelShape, base: ParallelPlan, sizes) -> str | None:
    """Of the base plan's ``tensor.rules`` and, for a model not written with tensor blocks (whose
    block code does not decide its own splits), Megatron's split by shape (``"auto"``): the one
    that splits more of a layer's weights, the base's on a tie; ``None`` where the runtime would
    refuse both (a named dim ``tensor`` does not divide, 2 key-value heads over 4 devices; no
    parameter split at all)."""
    if sizes["tensor"] == 1:
        return base.tensor.rules
    tried = [base.tensor.rules] if shape.tensor_blocks else list(dict.fromkeys([base.tensor.rules, "auto"]))
    laid = replace(base, pipeline=PipelineSpec())  # which weights the rules split: not the schedule's
    under = lambda rules: laid.replace(tensor=replace(base.tensor, rules=rules))
    split = {rules: _split_layer_elements(shape, under(rules), sizes) for rules in tried}
    runnable = {rules: n for rules, n in split.items() if n is not None}
    return max(runnable, key=runnable.get) if runnable else None


def _split_layer_elements(shape: ModelShape, plan: ParallelPlan, sizes) -> int | None:
    """Elements of one layer ``plan`` splits over ``tensor`` (all of them for a shape without
    parameter paths); ``None`` where the runtime refuses its layout: a dim its rules split that
    ``tensor`` does not divide, or no parameter split at all (unless ``tensor.allow_replicated``)."""
    try:
        found = tensor_split_elements(shape, plan, sizes)
    except ShardingError:
        return None
    if found is None:
        return shape.layer_params
    if found.layer == found.shared == 0 and not plan.tensor.allow_replicated:
        return None
    return found.layer


def _remats(space: Space, sizes, zero_stage: int) -> tuple[bool, ...]:
    """Remat off, and on where the layers are not recomputed already (a pipeline stage's chunk,
    ZeRO-3's layers gathered on use)."""
    recomputed = sizes["stage"] > 1 or (zero_stage == 3 and sizes["fsdp"] > 1)
    return (False,) if recomputed or not space.remat else (False, True)


def _compressions(space, dcn, sizes) -> list[tuple[AxisCompression, ...]]:
    options: list[tuple[AxisCompression, ...]] = [()]
    if space.compression and dcn.get("data", 1) > 1 and sizes["data"] > 1:
        for method in space.compression_methods:
            options.append((AxisCompression(axis="data", gradients=CompressorSpec(method=method)),))
    return options


def _accumulations(per_replica: int, microbatches: int, space: Space) -> list[int]:
    steps, acc = [], 1
    while acc <= min(per_replica, space.max_accumulation):
        if per_replica % acc == 0 and (per_replica // acc) % microbatches == 0:
            steps.append(acc)
        acc *= 2
    return steps


def _valid(plan: ParallelPlan, sizes: dict[str, int]) -> bool:
    try:
        compose(plan, sizes)
    except (PlanError, NotSupportedYetError):
        return False
    return True


def _label(sizes, zero_stage, plan: ParallelPlan, remat: bool, acc: int) -> str:
    kind = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[zero_stage]
    if sizes["stage"] > 1:
        kind = "pp"
    parts = [kind] + [f"{a}={sizes[a]}" for a in AXES if sizes[a] > 1]
    if sizes["stage"] > 1:
        pipe = plan.pipeline
        chunks = f" v={pipe.virtual_stages}" if pipe.virtual_stages > 1 else ""
        parts.append(f"{pipe.schedule}{chunks} m={pipe.microbatches}")
        if sizes["fsdp"] > 1:
            parts.append(f"zero{zero_stage}")
    if sizes["tensor"] > 1 and plan.tensor.rules == "auto":
        parts.append("auto")
    if sizes["tensor"] > 1 and plan.tensor.sequence_parallel:
        parts.append("sp")
    parts += [f"{a.gradients.method}@{a.axis}" for a in plan.compression if a.gradients is not None]
    if remat:
        parts.append("remat")
    return " ".join(parts) + f" acc={acc}"
