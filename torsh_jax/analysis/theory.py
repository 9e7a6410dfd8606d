"""Theoretical minimum communication and memory of data-parallel plans (pure arithmetic).

``P`` is the bytes of the parameters one device's model replica holds (the
parameters of one tensor × stage shard), counted in the reduction dtype;
``n`` a data-parallel axis size. Per training step and device:

=========================  ===============================================  ======================
plan                       collectives (payload)                            wire bytes (ring)
=========================  ===============================================  ======================
DDP (``data=n``)           all-reduce P                                     2P(n−1)/n
ZeRO-1, ZeRO-2 (``fsdp``)  reduce-scatter grads P, all-gather params P      2P(n−1)/n
ZeRO-3 (``fsdp``)          all-gather params C ×2 (forward and backward     (2C + P)(n−1)/n
                           re-gather; ×1 without re-gather), reduce-
                           scatter grads P
HSDP (``data=d``,          reduce-scatter P over fsdp, all-reduce P/f       2P(f−1)/f
``fsdp=f``, stage 1-2)     over data, all-gather params P over fsdp         + 2(P/f)(d−1)/d
=========================  ===============================================  ======================

``C`` is the parameter bytes in the compute dtype (the dtype of ZeRO-3
gathers). ZeRO-1 and ZeRO-2 both use the sharded update: each device
reduce-scatters the gradients, updates its shard of the parameters with its
shard of the optimizer state, and all-gathers the updated parameters; this
moves the same bytes as DDP's all-reduce (an all-reduce *is* a
reduce-scatter plus an all-gather). They differ under gradient accumulation:
ZeRO-1 accumulates full local gradients and reduces once per step, ZeRO-2
reduce-scatters every micro-step into a sharded accumulator (and ZeRO-3
also gathers every micro-step), so their counts scale with the micro-steps.

Example:
    >>> t = zero(4_000_000, stage=3, fsdp_size=4, compute_param_bytes=2_000_000)
    >>> t.payload_bytes_by_kind
    {'all-gather': 4000000, 'reduce-scatter': 4000000}
    >>> t.wire_bytes
    6000000.0
    >>> ddp(4_000_000, data_size=8).wire_bytes
    7000000.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torsh_jax.errors import PlanError
from torsh_jax.plan.compressors import METHODS, kept_per_chunk, matrix_shape
from torsh_jax.plan.roles import compose, head_backward_first

__all__ = [
    "ring_wire_bytes",
    "TheoryCollective",
    "Theory",
    "ddp",
    "zero",
    "hsdp",
    "pipeline_stages",
    "megatron_blocks",
    "pipelined_megatron_blocks",
    "plan_theory",
    "MemoryTheory",
    "theoretical_memory_per_device",
    "DTYPE_BYTES",
    "compressed_payload_bytes",
    "compressed_reduction",
]

#: Bytes per element of the plan dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def ring_wire_bytes(kind: str, payload_bytes: float, group_size: int) -> float:
    """Bytes one device sends for one collective under ring-algorithm conventions.

    Args:
        kind: ``all-reduce``, ``reduce-scatter``, ``all-gather``,
            ``all-to-all`` or ``collective-permute``.
        payload_bytes: logical size S: the all-reduce operand, the
            reduce-scatter input, the all-gather output, the all-to-all
            operand, the permuted operand.
        group_size: devices per group n.

    Returns:
        all-reduce ``2·S·(n−1)/n``; reduce-scatter, all-gather, all-to-all
        ``S·(n−1)/n``; collective-permute ``S``.

    Example:
        >>> ring_wire_bytes("all-reduce", 1024, 4), ring_wire_bytes("all-gather", 1024, 4)
        (1536.0, 768.0)
    """
    if kind == "collective-permute":
        return float(payload_bytes)
    if group_size <= 1:
        return 0.0
    share = payload_bytes * (group_size - 1) / group_size
    return 2.0 * share if kind == "all-reduce" else float(share)


@dataclass(frozen=True)
class TheoryCollective:
    """One collective a plan needs per step: ``count`` times ``kind`` of ``payload_bytes`` over ``axes``."""

    kind: str
    axes: tuple[str, ...]
    payload_bytes: int
    group_size: int
    count: int = 1

    @property
    def wire_bytes(self) -> float:
        return ring_wire_bytes(self.kind, self.payload_bytes, self.group_size) * self.count


@dataclass(frozen=True)
class Theory:
    """The minimum collectives of a plan per step and device.

    Attributes:
        description: e.g. ``"ZeRO-3 over fsdp=4"``.
        collectives: what must cross the wire.
    """

    description: str
    collectives: tuple[TheoryCollective, ...]

    @property
    def payload_bytes_by_kind(self) -> dict[str, int]:
        """Payload bytes per collective kind (counts multiplied in)."""
        totals: dict[str, int] = {}
        for c in self.collectives:
            totals[c.kind] = totals.get(c.kind, 0) + c.payload_bytes * c.count
        return totals

    @property
    def count_by_kind(self) -> dict[str, int]:
        """Collectives per step of each kind."""
        totals: dict[str, int] = {}
        for c in self.collectives:
            totals[c.kind] = totals.get(c.kind, 0) + c.count
        return totals

    @property
    def payload_bytes_by_axis(self) -> dict[str, int]:
        """Payload bytes per axis key (``"data"``, ``"data+fsdp"``)."""
        totals: dict[str, int] = {}
        for c in self.collectives:
            key = "+".join(c.axes)
            totals[key] = totals.get(key, 0) + c.payload_bytes * c.count
        return totals

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes * c.count for c in self.collectives)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per step."""
        return sum(c.wire_bytes for c in self.collectives)

    def to_dict(self) -> dict:
        return {
            "description": self.description,
            "payload_bytes_by_kind": self.payload_bytes_by_kind,
            "payload_bytes_by_axis": self.payload_bytes_by_axis,
            "payload_bytes": self.payload_bytes,
            "wire_bytes": self.wire_bytes,
        }


def _check_sizes(**sizes: int) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(
                f"must be an integer >= 1, got {value!r}", key=key, fix="pass a positive integer axis size"
            )


def ddp(param_bytes: int, /, *, data_size: int, axes: tuple[str, ...] = ("data",)) -> Theory:
    """DDP: one all-reduce of the gradients (``param_bytes``) over ``axes``.

    Example:
        >>> ddp(1000, data_size=4).collectives[0].wire_bytes
        1500.0
    """
    _check_sizes(data_size=data_size)
    return Theory(
        f"DDP over {'+'.join(axes)}={data_size}",
        (TheoryCollective("all-reduce", axes, param_bytes, data_size),),
    )


def _param_gathers(param_bytes, stage, axes, size, compute_param_bytes, regather) -> tuple:
    """Parameter all-gathers: stages 1-2 gather the updated parameters (``compute_param_bytes``
    then means the master parameter bytes), stage 3 gathers in the compute dtype, plus a
    backward re-gather of the ``regather`` fraction (True = all, False = none)."""
    gathered = param_bytes if compute_param_bytes is None else compute_param_bytes
    if stage != 3:
        return (TheoryCollective("all-gather", axes, gathered, size),)
    first = TheoryCollective("all-gather", axes, gathered, size)
    again = round(gathered * float(regather))
    return (first, TheoryCollective("all-gather", axes, again, size)) if again else (first,)


def _per_micro_step(stage, micro_steps, gather, reductions, hoisted: float = 0.0):
    """Counts per optimizer step: stage 2 reduces, stage 3 also gathers, every micro-step.

    The ``hoisted`` fraction of stage 3's first gather (parameters used the same way by every
    micro-step outside the stacked layers: embeddings, head, a plain loss's parameters) is
    gathered once per step: the compiler moves that loop-invariant gather out of the
    accumulation loop.
    """
    times = lambda c: replace(c, count=c.count * micro_steps)
    if stage >= 2:
        reductions = tuple(times(c) for c in reductions)
    if stage == 3:
        first, *again = gather
        once = round(first.payload_bytes * hoisted) if micro_steps > 1 else 0
        each = (replace(first, payload_bytes=first.payload_bytes - once), *again)
        gather = tuple(times(c) for c in each if c.payload_bytes)
        gather += (replace(first, payload_bytes=once),) if once else ()
    return gather, reductions


def zero(
    param_bytes: int,
    /,
    *,
    stage: int,
    fsdp_size: int,
    compute_param_bytes: int | None = None,
    regather: bool | float = True,
    micro_steps: int = 1,
    hoisted: float = 0.0,
) -> Theory:
    """ZeRO over the ``fsdp`` axis (stage 0 is DDP over it).

    Args:
        param_bytes: parameter (gradient) bytes in the reduction dtype.
        stage: 0-3.
        fsdp_size: size of the ``fsdp`` axis.
        compute_param_bytes: bytes of the gathered parameters: stage 3
            gathers in the compute dtype, stages 1-2 gather the updated
            master parameters (parameter dtype); defaults to ``param_bytes``.
        regather: stage 3: parameters are gathered again in the backward
            pass (``zero.reshard_after_forward``); a float is the fraction
            of the parameter bytes gathered again.
        micro_steps: accumulation micro-steps per optimizer step. Stage 1
            reduces once per step; stage 2 reduce-scatters every micro-step
            (gradients stay sharded); stage 3 also gathers every micro-step.
        hoisted: stage 3 with micro-steps: the fraction of the gathered bytes
            gathered once per step (parameters outside the stacked layers).

    Example:
        >>> zero(1000, stage=1, fsdp_size=4).payload_bytes_by_kind
        {'reduce-scatter': 1000, 'all-gather': 1000}
    """
    _check_sizes(fsdp_size=fsdp_size)
    if stage not in (0, 1, 2, 3):
        raise PlanError(
            f"must be 0, 1, 2 or 3, got {stage!r}", key="zero.stage", fix="use a ZeRO stage of 0, 1, 2 or 3"
        )
    if stage == 0:
        return ddp(param_bytes, data_size=fsdp_size, axes=("fsdp",))
    axes = ("fsdp",)
    gather = _param_gathers(param_bytes, stage, axes, fsdp_size, compute_param_bytes, regather)
    scatter = TheoryCollective("reduce-scatter", axes, param_bytes, fsdp_size)
    gather, scatter = _per_micro_step(stage, micro_steps, gather, (scatter,), hoisted)
    ordered = (*gather, *scatter) if stage == 3 else (*scatter, *gather)
    return Theory(f"ZeRO-{stage} over fsdp={fsdp_size}", ordered)


def hsdp(
    param_bytes: int,
    /,
    *,
    data_size: int,
    fsdp_size: int,
    stage: int = 3,
    compute_param_bytes: int | None = None,
    regather: bool | float = True,
    micro_steps: int = 1,
    hoisted: float = 0.0,
) -> Theory:
    """HSDP: ZeRO ``stage`` inside a slice (``fsdp``), replicas across slices (``data``).

    Gradients are reduce-scattered over ``fsdp`` (payload P), the shards
    all-reduced over ``data`` (payload P/fsdp), parameters all-gathered over
    ``fsdp`` as in :func:`zero`.

    Example:
        >>> hsdp(1000, data_size=2, fsdp_size=4, stage=2).payload_bytes_by_axis
        {'fsdp': 2000, 'data': 250}
    """
    _check_sizes(data_size=data_size, fsdp_size=fsdp_size)
    if stage not in (1, 2, 3):
        raise PlanError(
            f"HSDP needs ZeRO stage 1, 2 or 3, got {stage!r}",
            key="zero.stage",
            fix="use zero.stage = 1, 2 or 3 with an fsdp axis, or a data-only mesh for DDP",
        )
    fsdp = ("fsdp",)
    gather = _param_gathers(param_bytes, stage, fsdp, fsdp_size, compute_param_bytes, regather)
    steps = (
        TheoryCollective("reduce-scatter", fsdp, param_bytes, fsdp_size),
        TheoryCollective("all-reduce", ("data",), math.ceil(param_bytes / fsdp_size), data_size),
    )
    gather, steps = _per_micro_step(stage, micro_steps, gather, steps, hoisted)
    ordered = (*gather, *steps) if stage == 3 else (*steps, *gather)
    return Theory(f"HSDP ZeRO-{stage}: data={data_size} x fsdp={fsdp_size}", ordered)


def pipeline_stages(
    activation_bytes: int,
    /,
    *,
    stages: int,
    microbatches: int,
    passes: int = 1,
    shared_grad_bytes: int = 0,
    virtual_stages: int = 1,
) -> Theory:
    """``stage``-axis traffic of a pipeline, per device (averaged over the stages).

    Each of the ``m`` micro-batches crosses each of the ``p v - 1`` boundaries
    between consecutive layer chunks (``p - 1`` without interleaving; with
    ``v`` chunks per stage the last stage also sends back to the first)
    twice (its activation forward, the activation's gradient backward), in
    every accumulation pass; nothing is sent on an idle slot.
    The gradients of parameters every stage holds (embedding and head; made on
    one stage each) and the loss are summed over ``stage`` once per step.

    Example:
        >>> pipeline_stages(1024, stages=4, microbatches=8).wire_bytes
        12288.0
    """
    _check_sizes(stages=stages, microbatches=microbatches, passes=passes, virtual_stages=virtual_stages)
    sent = 2 * microbatches * (stages * virtual_stages - 1) * passes * activation_bytes / stages
    collectives = [TheoryCollective("collective-permute", ("stage",), sent, stages)]
    if shared_grad_bytes:
        collectives.append(TheoryCollective("all-reduce", ("stage",), shared_grad_bytes, stages))
    chunks = f" ({virtual_stages} chunks each)" if virtual_stages > 1 else ""
    return Theory(f"pipeline over stage={stages}{chunks}, {microbatches} micro-batches x {passes} pass(es)",
                  tuple(collectives))  # fmt: skip


def megatron_blocks(
    activation_bytes: int,
    /,
    *,
    tensor_size: int,
    layers: int,
    sequence_parallel: bool = False,
    token_bytes: int = 0,
    replicated_grad_bytes: int = 0,
    recomputed: bool = False,
    micro_steps: int = 1,
) -> Theory:
    """Tensor-axis collectives of ``layers`` transformer blocks (attention + MLP) made of tensor blocks.

    Megatron (Shoeybi et al. 2019, section 3): per block two all-reduces of the
    activations in the forward pass and two in the backward pass; with
    sequence parallelism (Korthikanti et al. 2022, section 4.2.2) each becomes an
    all-gather before the column-parallel matmul and a reduce-scatter after the
    row-parallel one (the same ring bytes). Around the blocks: the
    vocabulary-parallel embedding sums its output (a reduce-scatter with
    sequence parallelism), the head's input gradient is summed (the head's
    input is all-gathered, its gradient reduce-scattered with sequence
    parallelism), and the loss reduces three per-token values (the maximum,
    the sum of exponentials and the target logit). With sequence parallelism
    the gradients of parameters replicated over ``tensor`` (norm weights,
    positions) are summed too.

    Args:
        activation_bytes: one micro-batch's activations ``[b, T, D]`` in the compute dtype (full sequence).
        tensor_size: devices along ``tensor``.
        layers: transformer blocks.
        sequence_parallel: activations split on the sequence between blocks.
        token_bytes: ``b * T * 4`` (the loss's float32 per-token reductions).
        replicated_grad_bytes: bytes of the parameters replicated over ``tensor``.
        recomputed: the blocks run forward again in the backward pass (remat,
            ZeRO-3 re-gathering), repeating their forward collectives but the
            last (the block's output is not needed to differentiate it).
        micro_steps: accumulation micro-steps per optimizer step.

    Example:
        >>> t = megatron_blocks(1024, tensor_size=2, layers=2, token_bytes=32)
        >>> t.payload_bytes_by_kind
        {'all-reduce': 10336}
    """
    axes, t, m, again = ("tensor",), tensor_size, micro_steps, int(recomputed)
    out = [TheoryCollective("all-reduce", axes, token_bytes, t, 3 * m)]
    if sequence_parallel:
        # per block: 2 gathers + 2 scatters forward, their transposes backward; a recomputed
        # forward repeats all but the block's last scatter (its output is not needed again);
        # + the embedding's scatter and the head's gather, each with its transpose
        gathers, scatters = layers * (4 + 2 * again) + 2, layers * (4 + again) + 2
        out += [
            TheoryCollective("all-gather", axes, activation_bytes, t, gathers * m),
            TheoryCollective("reduce-scatter", axes, activation_bytes, t, scatters * m),
        ]
        if replicated_grad_bytes:
            out.append(TheoryCollective("all-reduce", axes, replicated_grad_bytes, t, m))
    else:
        # per block: 2 forward + 2 backward; a recomputed forward repeats the first (attention's);
        # + the embedding's sum forward and the head's input gradient backward
        reductions = layers * (4 + again) + 2
        out.append(TheoryCollective("all-reduce", axes, activation_bytes, t, reductions * m))
    sp = " with sequence parallelism" if sequence_parallel else ""
    described = f"Megatron blocks over tensor={t}{sp} ({layers} layers)"
    return Theory(described, tuple(c for c in out if c.payload_bytes))


def pipelined_megatron_blocks(
    activation_bytes: int,
    /,
    *,
    tensor_size: int,
    layers: int,
    microbatches: int,
    passes: int = 1,
    virtual_stages: int = 1,
    splits_backward: bool = False,
) -> Theory:
    """Tensor-axis collectives of the first pipeline stage's ``layers`` Megatron blocks (attention +
    MLP, no sequence parallelism), for every micro-batch of every pass.

    A stage's backward recomputes its chunk from the stashed input (``jax.vjp``), so each block's two
    forward all-reduces run again before its two backward ones; the first stage also sums the
    embedding's output, in the forward and in the recomputed forward. The recomputed chunk's output
    is not used, but its last all-reduce runs all the same inside the loop over the chunk's layers;
    a chunk of one layer has no loop and drops it. A split backward (ZB-H1) runs that
    input-gradient pass as it is, and its ``W`` slot recomputes each block's forward once more with
    the MLP's input-gradient all-reduce (the attention's weight gradients need the gradient at its
    output). Per micro-batch, for ``k`` layers: ``6 k + 2`` all-reduces of the activations,
    ``9 k + 2`` with ``W`` slots, one fewer per one-layer chunk. (The last stage runs one fewer: the
    head's input gradient for the embedding's two sums, plus the loss's per-token reductions, a
    few bytes per token.)

    Args:
        activation_bytes: one micro-batch's activations ``[b, T, D]`` in the compute dtype.
        tensor_size: devices along ``tensor``.
        layers: the stage's blocks (over all its chunks when interleaved).
        microbatches: micro-batches per pass.
        passes: accumulation passes per optimizer step.
        virtual_stages: chunks per stage.
        splits_backward: the schedule has ``W`` slots.

    Example:
        >>> pipelined_megatron_blocks(1024, tensor_size=2, layers=4, microbatches=2).count_by_kind
        {'all-reduce': 52}
        >>> one_layer_chunks = pipelined_megatron_blocks(
        ...     1024, tensor_size=2, layers=2, microbatches=2, virtual_stages=2
        ... )
        >>> one_layer_chunks.count_by_kind
        {'all-reduce': 24}
    """
    _check_sizes(
        tensor_size=tensor_size, layers=layers, microbatches=microbatches, passes=passes,
        virtual_stages=virtual_stages,
    )  # fmt: skip
    per_block = 9 if splits_backward else 6
    one_layer_chunks = virtual_stages if layers == virtual_stages else 0
    runs = (per_block * layers + 2 - one_layer_chunks) * microbatches * passes
    reductions = TheoryCollective("all-reduce", ("tensor",), activation_bytes, tensor_size, runs)
    split = ", W slots" if splits_backward else ""
    described = (
        f"Megatron blocks over tensor={tensor_size} in the first pipeline stage ({layers} layers{split})"
    )
    return Theory(described, (reductions,))


def plan_theory(
    plan,
    /,
    *,
    param_count: int,
    num_devices: int,
    num_slices: int = 1,
    layer_fraction: float = 1.0,
    layers: int | None = None,
    head_fraction: float = 0.0,
) -> Theory:
    """The theory for a :class:`~torsh_jax.plan.ParallelPlan`'s data-parallel axes.

    For a plan with compression sections this is the *uncompressed* minimum
    (the description says so); the measured/theory ratio then shows the saving.

    Args:
        plan: the plan (its mesh, ZeRO stage and precision are used).
        param_count: parameters of one tensor × stage shard of the model.
        num_devices: devices the mesh is resolved for.
        num_slices: slices (DCN) the mesh is resolved for.
        layer_fraction: the part of the parameters in stacked layers (a
            layered model's; 0 for a plain loss). ZeRO-3 gathers them per
            layer, per micro-step, and again in the backward pass with
            ``reshard_after_forward``; the rest (embeddings, head, a plain
            loss's parameters) stays gathered through the backward pass, as
            FSDP keeps its root, and once per step under accumulation.
        layers: the number of stacked layers, if known: one layer is not
            gathered again (nothing is freed between its forward and backward
            passes, and the compiler keeps the one gather).
        head_fraction: the part of the parameters in the head (not a tied
            table). Where the step finishes the head's backward first
            (:func:`~torsh_jax.plan.roles.head_backward_first`), the head's
            parameters pass a barrier with each micro-step's hidden state, so
            they are gathered every micro-step, not once per step.

    Example:
        >>> from torsh_jax.plan import ParallelPlan
        >>> plan_theory(ParallelPlan(), param_count=1000, num_devices=8).description
        'DDP over data=8'
    """
    regathered = 0.0 if layers == 1 else layer_fraction
    sizes = plan.mesh.resolve(num_devices, num_slices=num_slices).shape
    hoisted = 1.0 - layer_fraction - (head_fraction if head_backward_first(plan, sizes) else 0.0)
    theory = _uncompressed_theory(plan, sizes, param_count, hoisted, regathered)
    if plan.compression:  # the minimum without compression: the plan sends fewer bytes than this
        return replace(theory, description=f"{theory.description} (uncompressed minimum)")
    return theory


def _uncompressed_theory(plan, sizes, param_count, hoisted, regathered) -> Theory:
    roles = compose(plan, sizes)
    stage = roles.zero_stage
    param_bytes = param_count * DTYPE_BYTES[plan.precision.reduce_dtype]
    gathered_dtype = plan.precision.compute_dtype if stage == 3 else plan.precision.param_dtype
    compute = param_count * DTYPE_BYTES[gathered_dtype]
    regather = regathered if plan.zero.reshard_after_forward else 0.0
    gathers = {
        "compute_param_bytes": compute,
        "regather": regather,
        "micro_steps": plan.batch.accumulation_steps,
        "hoisted": hoisted,
    }
    if roles.shard_axis is None:
        axes = roles.batch_axes or ("data",)
        return ddp(param_bytes, data_size=roles.batch_size, axes=axes)
    if not roles.hybrid:
        return zero(param_bytes, stage=stage, fsdp_size=roles.size("fsdp"), **gathers)
    return hsdp(
        param_bytes, data_size=roles.size("data"), fsdp_size=roles.size("fsdp"), stage=stage, **gathers
    )


def compressed_payload_bytes(
    method: str,
    elements: int,
    /,
    *,
    block_size: int = 256,
    chunk_size: int = 4096,
    topk_fraction: float = 0.01,
    rank: int = 4,
) -> int:
    """Bytes one device's compressed payload of a buffer of ``elements`` values takes (a padded
    buffer: whole blocks, whole top-k chunks). The settings are
    :class:`~torsh_jax.plan.CompressorSpec`'s (its defaults here):

    * fixed-size methods (int8, fp8, ...): bits per value plus a float32 scale per block;
    * ``topk``: per chunk of ``chunk_size``, its kept values (float32) and their positions in the
      chunk (int16);
    * ``powersgd``: the buffer viewed as a ``[rows, cols]`` matrix
      (:func:`~torsh_jax.plan.compressors.matrix_shape`) sends ``P [rows, r]`` and ``Q [cols, r]``
      in float32, ``r = min(rank, rows, cols)``.

    Example:
        >>> compressed_payload_bytes("int8", 4096), compressed_payload_bytes("bf16", 4096)
        (4160, 8192)
        >>> compressed_payload_bytes("topk", 8192), compressed_payload_bytes("powersgd", 4096)
        (492, 2048)
    """
    if method == "topk":
        kept = kept_per_chunk(chunk_size=chunk_size, fraction=topk_fraction)
        return -(-elements // chunk_size) * kept * (4 + 2)
    if method == "powersgd":
        rows, cols = matrix_shape(elements)
        return (rows + cols) * min(rank, rows, cols) * 4
    size = METHODS[method].payload_bytes(elements, block_size=block_size) if method in METHODS else None
    if size is None:
        raise PlanError(
            f"{method!r} is not a compression method",
            key="compression.method",
            fix=f"use one of {sorted(METHODS)}",
        )
    return size


def compressed_reduction(
    method: str,
    elements: int | Sequence[int],
    /,
    *,
    axis: str,
    axis_size: int,
    scatter: bool = False,
    **settings,
) -> tuple[TheoryCollective, ...]:
    """A compressed gradient reduction over ``axis`` as the runtime runs it
    (:mod:`torsh_jax.compress.collectives`), per device:

    * two-phase methods (int8, fp8, ...): an all-to-all of the payload (each device sums its
      slice), then, for an all-reduce (not ``scatter``), an all-gather of the re-compressed sums;
    * ``topk``: an all-gather of every device's payload (a reduce-scatter: an all-to-all of it);
    * ``powersgd``: per buffer, an all-reduce of ``P`` and one of ``Q`` (a reduce-scatter too).

    ``elements`` is the padded buffer's length, or each buffer's (bucket's) length: PowerSGD views
    each as its own matrix. It counts the padding: each parameter is padded to whole blocks, each
    buffer to whole blocks (chunks) per device (:func:`torsh_jax.runtime.sync.compressed_lengths`).
    ``settings``: :func:`compressed_payload_bytes`'s ``block_size``, ``chunk_size``,
    ``topk_fraction``, ``rank``.

    Example:
        >>> reduction = compressed_reduction("int8", 4096, axis="data", axis_size=8)
        >>> [(c.kind, c.payload_bytes, c.wire_bytes) for c in reduction]
        [('all-to-all', 4160, 3640.0), ('all-gather', 4160, 3640.0)]
        >>> [(c.kind, c.payload_bytes) for c in compressed_reduction("topk", 8192, axis="data", axis_size=8)]
        [('all-gather', 3936)]
        >>> low_rank = compressed_reduction("powersgd", [8192, 4096], axis="data", axis_size=8)
        >>> [(c.kind, c.payload_bytes, c.count) for c in low_rank]  # [128, 64] and [64, 64] at rank 4
        [('all-reduce', 2048, 1), ('all-reduce', 1024, 3)]
    """
    buffers = [elements] if isinstance(elements, int) else list(elements)
    reduce = METHODS[method].all_reduce if method in METHODS else "two_phase"
    one = lambda kind, payload, count=1: TheoryCollective(kind, (axis,), payload, axis_size, count)
    if reduce == "low_rank":
        return _low_rank(buffers, settings.get("rank", 4), one)
    payload = compressed_payload_bytes(method, sum(buffers), **settings)
    if reduce == "sparse_gather":
        return (one("all-to-all", payload),) if scatter else (one("all-gather", payload * axis_size),)
    kinds = ("all-to-all",) if scatter else ("all-to-all", "all-gather")
    return tuple(one(kind, payload) for kind in kinds)


def _low_rank(buffers: list[int], rank: int, one) -> tuple[TheoryCollective, ...]:
    """PowerSGD's all-reduces of ``P [rows, r]`` and ``Q [cols, r]`` (float32) per buffer, those of
    one size counted together."""
    sizes: dict[int, int] = {}
    for length in buffers:
        rows, cols = matrix_shape(length)
        r = min(rank, rows, cols)
        for nbytes in (rows * r * 4, cols * r * 4):
            sizes[nbytes] = sizes.get(nbytes, 0) + 1
    return tuple(one("all-reduce", nbytes, count) for nbytes, count in sizes.items())


@dataclass(frozen=True)
class MemoryTheory:
    """Minimum bytes per device of the training state, by part."""

    param_bytes: int
    grad_bytes: int
    opt_state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.opt_state_bytes


def theoretical_memory_per_device(
    param_bytes: int,
    opt_state_bytes: int,
    grad_bytes: int,
    stage: int,
    fsdp_size: int,
) -> MemoryTheory:
    """Training-state bytes per device under ZeRO ``stage`` over ``fsdp_size`` devices.

    Stage 1 divides the optimizer state by ``fsdp_size``, stage 2 also the
    gradients, stage 3 also the parameters (rounded up: uneven shards are
    padded). Activations and temporaries are not included.

    Example:
        >>> theoretical_memory_per_device(400, 800, 400, 2, 4).total_bytes
        700
    """
    _check_sizes(fsdp_size=fsdp_size)
    if stage not in (0, 1, 2, 3):
        raise PlanError(
            f"must be 0, 1, 2 or 3, got {stage!r}", key="zero.stage", fix="use a ZeRO stage of 0, 1, 2 or 3"
        )

    def part(nbytes: int, sharded_from: int) -> int:
        return math.ceil(nbytes / fsdp_size) if stage >= sharded_from else nbytes

    return MemoryTheory(part(param_bytes, 3), part(grad_bytes, 2), part(opt_state_bytes, 1))
