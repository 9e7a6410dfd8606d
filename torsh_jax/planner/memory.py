"""Predicted memory per device of a candidate plan, by part.

**Memory per device** = training state (the ZeRO split of parameters, gradients and optimizer state,
:func:`~torsh_jax.analysis.theory.theoretical_memory_per_device`) + gradient buffers (below ZeRO-3
the whole local gradient, and its reduced copy where the layers are recomputed, accumulating or not,
less a share of a pipeline stage's layers': :func:`_gradient_buffers`; ZeRO-3 gathering on use: one
layer's whole gradient with the embedding's and head's; accumulating with each micro-step reduced
apart, the step's sum beside each micro-step's, :func:`_accumulated_sum_bytes`; ZeRO-3 on the
compiled recomputing gradient, :func:`_accumulated_on_use_bytes`) + ZeRO-3's gathered working set
(one layer twice, embedding and head once, in the compute dtype; on the compiled recomputing
gradient, :data:`ZERO3_GATHERED_LAYERS` of one layer; under a pipeline, the stage's parameters
gathered once: :func:`_gathered_bytes`) + compressed reductions' error feedback (a residual of the
reduced gradient; two-phase methods such as int8 one more of its ``1/n`` chunk) + activations.
Activations per token and layer follow Korthikanti et al. 2022 (eq. 2 and 4; ``34 d + 5 a s`` bytes
in 16-bit with no tensor parallelism, ``(10 + 24/t) d + 5 a s / t`` with ``t``, ``34 d / t + 5 a s /
t`` with sequence parallelism), scaled by the compute dtype and the machine's ``activation_scale``,
plus the working set of one layer's backward pass; a recomputed layer (the model's remat, or ZeRO-3
gathering each layer on use) keeps its input only (``2 d`` bytes), plus the working set of one layer
while it is recomputed (the formula times the machine's ``recompute_scale``; not divided by
``tensor``: measured on CPU, that set does not shrink with it). The logits and their gradient are
float32; where the layers are recomputed, the step finishes the head's backward before theirs
(:func:`~torsh_jax.planner.per_device.logits_apart_from_layers`), so the formulas count what the
logits hold beyond one recomputed layer's working set, as the two are never held at once (XLA:GPU's
peaks of 12 ZeRO-3 plans on H100 targets: +26 % to +109 % counting both, +7.7 % to +47.5 % so). A
pipeline stage holds its stash, the runtime's slots for the activations and gradients it receives
(about the inputs its schedule table holds in flight: ``min(microbatches, stages)`` for 1F1B and
ZB-H1, interleaved's cap in chunk inputs, all ``microbatches`` for GPipe), ZB-H1's ``W`` slots and
the tick's sends; its backward recomputes a chunk from a stashed input, which is the gradient of a
model of the chunk's layers on one micro-batch: as the machine compiled it
(:attr:`Machine.chunk_gradient_bytes`; split over ``tensor``, its layers' bytes per token at the
formula's share, :func:`_tensor_share`, the rest whole but the logits), else the chunk's layers by
the formula. Where each layer is recomputed without a pipeline, the model's gradient recomputing
every layer as the machine compiled it (:attr:`Machine.remat_gradient_bytes`, likewise over
``tensor``: :func:`_compiled_remat_bytes`). An accelerator target's plan is costed as its compiler
holds the buffers instead where that compiler has a profile (:mod:`~torsh_jax.planner.compilers`:
the TPU's, read from its buffer reports; a pipeline stage as the step of its chunk on one
micro-batch, with its stash).

Example:
    >>> from torsh_jax.planner.machine import Machine
    >>> from torsh_jax.planner.shape import ModelShape
    >>> from torsh_jax.planner.space import candidates
    >>> shape = ModelShape.demo("tiny")
    >>> found = {c.label: c for c in candidates(shape, devices=8, global_batch=64)}
    >>> parts = memory_parts(found["zero3 fsdp=8 acc=1"], shape, 2.0, Machine.from_target("v5e-8"))
    >>> parts["total"] == sum(v for k, v in parts.items() if k != "total")
    True
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torsh_jax.analysis.theory import DTYPE_BYTES, theoretical_memory_per_device
from torsh_jax.compress.feedback import feedback_shapes
from torsh_jax.plan.roles import compose, head_backward_first, sums_in_place
from torsh_jax.planner.compilers import PROFILES, apart_bytes, step_memory
from torsh_jax.planner.machine import Machine, nearest_in_ratio
from torsh_jax.planner.per_device import (
    chunk_layers,
    compressed_buffers_of,
    head_params_on_device,
    layer_remat,
    local_params,
    logits_apart_from_layers,
    paired_end_sums,
    recomputed,
    schedule_figures,
    split_part,
    tensor_shares,
    tokens_per_micro_step,
)
from torsh_jax.planner.shape import ModelShape
from torsh_jax.planner.space import Candidate

__all__ = [
    "memory_parts",
    "memory_floor",
    "full_layer_bytes_per_token",
    "SCANNED_STAGE",
    "ScannedStage",
    "ZB_H1_CHUNK_SHARE",
    "ZERO3_GATHERED_LAYERS",
]


#: Share of the compiled chunk gradient (:attr:`Machine.chunk_gradient_bytes`) a ZB-H1 stage holds
#: for its chunk: ``B`` runs the chunk's ``vjp`` for its input only and ``W`` one layer's weight
#: gradients at a time, neither the whole gradient. Read from XLA:CPU's compiled steps of the
#: smaller benchmark model (all 90 ZB-H1 candidates at global batch 32: 83 within 5 %, -7.7 % to
#: +6.2 %); the whole chunk gradient had them +1 % to +26 % once the branches stopped copying.
ZB_H1_CHUNK_SHARE = 0.7


class ScannedStage(NamedTuple):
    """What a pipeline stage's compiled step holds against the formulas on XLA:CPU
    (:data:`SCANNED_STAGE`)."""

    layer_gradients_fewer: float
    hidden_states_more: float
    accumulating_fewer: float  # layer gradients fewer where the step accumulates


#: What a pipeline stage's compiled step holds against the formulas, by schedule. The executor runs
#: every tick in one scan whose carry holds the stage's layers' gradient, so the stage makes no
#: whole reduced copy of it; a backward adds each layer's gradient into the carry as it makes it
#: (:func:`~torsh_jax.runtime.tap.scan_into`; ZB-H1's ``W`` one layer at a time), so no chunk's
#: whole gradient beside the carry either; and every tick makes the activation and gradient it
#: sends, whether it sends or not (hidden states per token of a micro-batch, beside the stash
#: slots). Read from XLA:CPU's compiled steps of the smaller benchmark model: all 243 pipelined
#: candidates within 5 %, -4.6 % to +2.2 % (mean 1.2 %). Adding into the carry in place moved
#: 1F1B's peaks (0.45 before, where 40 of its 90 went 5.1 % to 10.6 % over), most where the step
#: accumulates, whose smaller micro-batches leave the peak in a chunk's backward: 1.4 there, one
#: stage's layer gradient more than before, 1.1 in one pass. Held out, every fourth of the larger
#: model's (77): 71 within 5 %, -4.9 % to +11.3 % (mean 2.5 %), the six over accumulating over tensor.
#: GPipe runs 1F1B's branches. A TPU target's stages do not read it (:mod:`~.compilers`). The rows
#: were read while every stage carried the embedding's and head's gradient sums apart; a stage that
#: pairs them holds the smaller one's less (:func:`~torsh_jax.planner.per_device.paired_end_sums`).
SCANNED_STAGE = {
    "gpipe": ScannedStage(1.1, 0.5, 1.4),
    "1f1b": ScannedStage(1.1, 0.5, 1.4),
    "interleaved": ScannedStage(0.65, 1.0, 0.7),
    "zb_h1": ScannedStage(1.3, 2.0, 1.3),
}


#: Layers a ZeRO-3 step gathering on use holds gathered beside the compiled recomputing gradient's
#: temporaries (:attr:`Machine.remat_gradient_bytes`): half of one, in the compute dtype. Read from
#: XLA:CPU's compiled ``zero3 fsdp=8 acc=1`` of the two benchmark models (a whole layer was 0.40
#: of 0.79 MB and 1.57 of 3.15 MB over). At half, all 49 of the two models' ZeRO-3 candidates
#: without a pipeline came within -3.8 % to +3.8 %, 47 of them not read from; at one, 42 (-2.5 %
#: to +6.7 %).
ZERO3_GATHERED_LAYERS = 0.5


def memory_parts(c: Candidate, shape: ModelShape, opt_factor: float, machine: Machine) -> dict[str, int]:
    plan = c.plan
    layers, shared = local_params(c, shape)
    count = layers + shared
    pb, cb = DTYPE_BYTES[plan.precision.param_dtype], DTYPE_BYTES[plan.precision.compute_dtype]
    parts = _as_compiled(c, shape, count, shared, opt_factor, machine)
    if parts is not None:
        parts["feedback"] = _feedback_bytes(c, shape)
        return {**parts, "total": sum(parts.values())}
    zero_stage, fsdp = plan.zero.stage, c.sizes["fsdp"]
    state = theoretical_memory_per_device(
        count * pb, int(count * opt_factor * 4), count * pb, zero_stage, fsdp
    )
    one_layer = layers // max(1, shape.layers // c.sizes["stage"])
    roles = compose(plan, c.sizes)
    on_use = roles.gather == "on_use"
    gathered = _gathered_bytes(roles.gather, cb, count, one_layer, shared)
    activations, logits = _activation_bytes(c, shape, machine)
    one_gathered = (one_layer + shared) * pb if on_use else 0
    smaller_end, paired = paired_end_sums(c, shape)
    staged = _scanned_layer_gradients(c, layers * pb) + (smaller_end * pb if paired else 0)
    gradients = _gradient_buffers(count * pb, state.grad_bytes, one_gathered, recomputed(c), staged)
    if _compiled_remat_bytes(c, shape, machine) is not None:
        # the compiled gradient's buffers hold the local gradient: the stored gradients are the
        # rest, but ZeRO-2's, a shard of it made beside it; ZeRO-3's, what its loop adds
        if on_use:  # and a share of a gathered layer beside them
            gathered = int(ZERO3_GATHERED_LAYERS * one_layer * cb)
            head = head_params_on_device(c, shape) * pb
            gradients = _accumulated_on_use_bytes(c, count * pb, shared * pb, head)
        else:
            gradients = count * pb - state.grad_bytes
    gradients += _accumulated_sum_bytes(c, roles.reduce, count * pb)
    parts = {
        "state": state.total_bytes,
        "gradients": gradients,
        "gathered": gathered,
        "activations": activations,
        "logits": logits,
        "feedback": _feedback_bytes(c, shape),
    }
    parts["gradients"] += _sum_after_backward(c, count * pb, parts)
    return {**parts, "total": sum(parts.values())}


def memory_floor(c: Candidate, shape: ModelShape, machine: Machine, parts: dict[str, int]) -> int | None:
    """The least the peak may be where the machine's compiler schedules some of ``parts`` (
    :func:`memory_parts`'s) apart or together as it chooses
    (:func:`~torsh_jax.planner.compilers.apart_bytes`: on a TPU, a pipeline stage): their ``total``
    less what may never be held at once; ``None`` where ``total`` is the one figure.

    Example:
        >>> from torsh_jax.planner.machine import Machine
        >>> from torsh_jax.planner.shape import ModelShape
        >>> from torsh_jax.planner.space import candidates
        >>> shape, tpu = ModelShape.demo("tiny"), Machine.from_target("v5e-8")
        >>> found = {c.label: c for c in candidates(shape, devices=8, global_batch=64)}
        >>> floors = {k: memory_floor(found[k], shape, tpu, memory_parts(found[k], shape, 2.0, tpu))
        ...           for k in ("pp fsdp=4 stage=2 1f1b m=2 zero1 acc=1", "zero3 fsdp=8 acc=1")}
        >>> floors["pp fsdp=4 stage=2 1f1b m=2 zero1 acc=1"] > 0, floors["zero3 fsdp=8 acc=1"]
        (True, None)
    """
    profile = _compiler_profile(c, shape, machine)
    if profile is None:
        return None
    apart = apart_bytes(c, shape, profile, activation_scale=machine.activation_scale)
    return parts["total"] - apart if apart else None


def _compiler_profile(c: Candidate, shape: ModelShape, machine: Machine):
    """The machine's accelerator compiler's profile
    (:data:`~torsh_jax.planner.compilers.PROFILES`), where it has one and the machine has no
    compiled gradients of the model; else ``None``: the formulas."""
    profile = PROFILES.get(machine.platform)
    return None if profile is None or _of_compiled_model(c, shape, machine) else profile


def _as_compiled(
    c: Candidate, shape: ModelShape, count: int, shared: int, opt_factor: float, machine: Machine
) -> dict | None:
    """The parts of the peak as the machine's accelerator compiler holds them
    (:func:`~torsh_jax.planner.compilers.step_memory`, of the device's ``count`` parameters,
    ``shared`` of them its embedding's and head's), where it has a profile and the machine has no
    compiled gradients of the model; else ``None``: the formulas."""
    profile = _compiler_profile(c, shape, machine)
    if profile is None:
        return None
    return step_memory(
        c,
        shape,
        profile,
        local_params=count,
        shared_params=shared,
        opt_factor=opt_factor,
        activation_scale=machine.activation_scale,
        stash_bytes=_stash_bytes(c, shape) if c.sizes["stage"] > 1 else 0,
    )


def _gathered_bytes(gather: str, cb: int, count: int, one_layer: int, shared: int) -> int:
    """ZeRO-3's gathered parameters (:attr:`~torsh_jax.plan.roles.Roles.gather`) at ``cb`` bytes
    each: gathering ``on_use``, one layer twice (the one computing, the next arriving) and the
    embedding and head; ``per_stage`` (under a pipeline), the stage's ``count`` parameters whole,
    for every pass of the step."""
    if gather == "on_use":
        return (2 * one_layer + shared) * cb
    return count * cb if gather == "per_stage" else 0


def _gradient_buffers(
    param_bytes: int, stored_grads: int, one_gathered: int, recomputed: bool, staged_bytes: int
) -> int:
    """Buffers beyond the stored gradients. Below ZeRO-3 the whole local gradient exists at the
    peak, in the backward pass beside the activations (1 parameter-sized buffer); where the layers
    are recomputed (remat, a pipeline stage), the peak holds it next to its reduced copy (2; the
    updated parameters reuse the donated ones), less ``staged_bytes`` in a pipeline stage
    (:func:`_scanned_layer_gradients`). ZeRO-3 gathering on use (``one_gathered``: the bytes of one
    gathered layer with the embedding and head) reduces each layer's whole gradient as the backward
    pass makes it, so one layer's and the embedding's and head's are alive at once; under a
    pipeline gathering once, a stage's pass makes its whole gradient as below ZeRO-3.
    Accumulating: :func:`_accumulated_sum_bytes`. What the compiled CPU programs of the demo models
    hold (tests/test_planner.py, benchmarks/bench_planner.py, benchmarks/bench_planner_memory.py)."""
    if one_gathered:
        return one_gathered
    held = 2 * param_bytes - staged_bytes if recomputed else param_bytes
    return held - stored_grads


def _scanned_layer_gradients(c: Candidate, layer_bytes: int) -> int:
    """What a pipeline stage holds less of its layers' gradient (``layer_bytes``) than its reduced
    copy beside it: the gradient is the carry of the executor's scan over the ticks
    (:data:`SCANNED_STAGE`); ``0`` without a pipeline."""
    if c.sizes["stage"] == 1:
        return 0
    scanned = SCANNED_STAGE[c.plan.pipeline.schedule]
    accumulating = c.plan.batch.accumulation_steps > 1
    fewer = scanned.accumulating_fewer if accumulating else scanned.layer_gradients_fewer
    return int(fewer * layer_bytes)


def _accumulated_sum_bytes(c: Candidate, reduce: str, param_bytes: int) -> int:
    """What accumulating adds: where each micro-step is reduced apart (ZeRO-2 uncompressed, a stage gathered
    once), the step's ``fsdp`` shard of the gradient sum (of ``param_bytes``) beside each micro-step's
    own gradient. Nothing where the step reduces once (:attr:`~torsh_jax.plan.roles.Roles.reduce`
    ``per_step``: DDP, ZeRO-1, ZeRO-2 with compressed gradients), whose layers' gradients add into the
    sum in place (:mod:`torsh_jax.runtime.sink`; under a pipeline, into the stage's one gradient
    carry), nor where ZeRO-3 reduces each layer's gradient into the stored shard in the backward pass.
    With :func:`_sum_after_backward`, the smaller benchmark model's 52 accumulating DDP and ZeRO-1
    candidates without a pipeline all came within 5 % on XLA:CPU (-4.5 % to +2.3 %); held out, every
    second of the larger model's (38), 34 (-7.0 % to +4.4 %; the four under, over ``tensor = 4`` with
    sequence parallelism, were under before too)."""
    if c.plan.batch.accumulation_steps == 1 or reduce != "per_micro_step":
        return 0
    return param_bytes // c.sizes["fsdp"]


def _sum_after_backward(c: Candidate, param_bytes: int, parts: dict) -> int:
    """What a step accumulating in place (:func:`~torsh_jax.plan.roles.sums_in_place`) adds where its peak is
    after the backward pass: the step's sum, the whole local gradient (``param_bytes``), lives through
    the reduction and the update beside the state, so the step holds at least that much more than its
    state, however small a micro-step's buffers (``parts``) are. On XLA:CPU the benchmark models'
    steps recomputing each layer held exactly one such gradient beside the state at 2 and 4
    accumulation steps (the larger model's ``ddp data=8 remat``: 147.55 MB, its state and 29.51 MB),
    where a micro-step's buffers came to less."""
    if not sums_in_place(c.plan, c.sizes):
        return 0
    backward = parts["gradients"] + parts["gathered"] + parts["activations"] + parts["logits"]
    return max(0, param_bytes - backward)


def _accumulated_on_use_bytes(c: Candidate, param_bytes: int, shared_bytes: int, head_bytes: float) -> int:
    """What ZeRO-3 gathering on use adds accumulating, beside its compiled recomputing gradient:
    the step's gradient sum, a ``1/fsdp`` shard carried through the micro-step loop, and the
    embedding's and head's whole gradient (``shared_bytes``, of the device's ``1/tensor``); where
    the step finishes the head's backward first (:func:`~torsh_jax.plan.roles.head_backward_first`),
    the head's (``head_bytes``) is reduced before the layers' backward and only the embedding's is
    held. On XLA:CPU the smaller benchmark model's three families without ``tensor`` (``fsdp`` 8, 4
    and 2) held that much more at 2 and 4 accumulation steps than at one (1.65, 2.18 and 3.24 MB:
    their shards and 1.11 MB, before the head's backward came first; ``fsdp=8 acc=2`` holds 0.46 MB
    less since); with ``tensor = 2`` its 12 plans came within -1.8 % to +3.0 %."""
    if c.plan.batch.accumulation_steps == 1:
        return 0
    held = shared_bytes - head_bytes if head_backward_first(c.plan, c.sizes) else shared_bytes
    return int(param_bytes // c.sizes["fsdp"] + held)


def _feedback_bytes(c: Candidate, shape: ModelShape) -> int:
    """Compression's state, float32, per compressed axis of ``n`` devices and buffer its
    reductions encode (:func:`~torsh_jax.planner.per_device.compressed_buffers_of`: where ZeRO
    shards the state, of the ``1/fsdp`` shard reduce-scattered first): with error feedback a
    residual of the buffer and, for two-phase methods, one of the ``1/n`` chunk the second phase
    sends on; PowerSGD's warm start. As :func:`torsh_jax.compress.init_feedback` makes them.
    Counted whole under ZeRO-1, 350 M's ``zero1 data=2 fsdp=32 int8@data acc=4`` on two v5e-32
    slices was predicted 2.06 GiB of residuals and +22 % over libtpu's peak; it holds 64 MiB
    (-0.4 % now)."""
    specs = {a.axis: a.gradients for a in c.plan.compression if a.gradients is not None}
    total = 0
    for axis, lengths in compressed_buffers_of(c, shape).items():
        for length in lengths:
            shapes = feedback_shapes(specs[axis], length=length, axis_size=c.sizes[axis])
            total += sum(math.prod(s) for s in (shapes.worker, shapes.server, shapes.warm_start))
    return total * 4


def _stash_rows(c: Candidate, chunk: int) -> float:
    """Hidden states per token a pipeline stage's stash holds: the runtime's slots
    (:func:`~torsh_jax.pipeline.slots.slot_plan`) for received activations and gradients, and
    ZB-H1's ``W`` slots of every chunk layer's input and output gradient."""
    activations, gradients, weights = schedule_figures(c).stash
    return activations + gradients + 2 * chunk * weights


def _stash_bytes(c: Candidate, shape: ModelShape, more_rows: float = 0.0) -> float:
    """A pipeline stage's stash (:func:`_stash_rows` hidden states per token of a micro-batch, and
    ``more_rows``) in the compute dtype."""
    rows = _stash_rows(c, chunk_layers(c, shape)) + more_rows
    return (
        rows * shape.d_model * DTYPE_BYTES[c.plan.precision.compute_dtype] * tokens_per_micro_step(c, shape)
    )


def full_layer_bytes_per_token(shape: ModelShape, tensor: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al.'s activation bytes of one layer per token, at 16 bits, at the shape's MLP
    width: ``10 d`` whole over ``tensor`` (the norms' inputs, the blocks' inputs, the dropout
    masks), ``8 d + 4 mlp`` split (queries, keys, values, the projection's input, the MLP's two
    intermediates), ``5 heads · seq_len`` of attention scores split; with the paper's ``mlp = 4 d``,
    ``34 d + 5 a s`` and ``(10 + 24 / t) d + 5 a s / t``. Sequence parallelism splits all of it.

    Example:
        >>> from torsh_jax.planner.shape import ModelShape
        >>> shape = ModelShape(0, 0, 1, 0, d_model=1024, seq_len=1024, vocab=8, heads=16, mlp=4096)
        >>> full_layer_bytes_per_token(shape) == 34 * 1024 + 5 * 16 * 1024
        True
    """
    d, heads, s, t = shape.d_model, shape.heads, shape.seq_len, tensor
    whole, split = 10 * d, 8 * d + 4 * shape.mlp + 5 * heads * s
    if sequence_parallel:
        return (whole + split) / t
    return whole + split / t


def _logit_bytes_per_token(shape: ModelShape, tensor: int = 1) -> float:
    """The float32 logits and their gradient per token, of a device's ``1/tensor`` of the
    vocabulary."""
    return 2 * shape.vocab / tensor * 4


def _split_layer_bytes_per_token(c: Candidate, shape: ModelShape) -> float:
    """:func:`full_layer_bytes_per_token` at the candidate's ``tensor``, for the share of a layer
    the plan splits over it; the rest of the layer's activations whole
    (:func:`~torsh_jax.planner.per_device.tensor_shares`)."""
    t, sp = c.sizes["tensor"], c.plan.tensor.sequence_parallel
    split = full_layer_bytes_per_token(shape, t, sp)
    return split_part(tensor_shares(c, shape).layer, split, full_layer_bytes_per_token(shape))


def _split_logit_bytes_per_token(c: Candidate, shape: ModelShape) -> float:
    """:func:`_logit_bytes_per_token` of a device: over ``tensor``, split as the plan splits the
    vocabulary projection (whole where it keeps it whole)."""
    split = _logit_bytes_per_token(shape, c.sizes["tensor"])
    return split_part(tensor_shares(c, shape).vocab, split, _logit_bytes_per_token(shape))


def _activation_bytes(c: Candidate, shape: ModelShape, machine: Machine) -> tuple[int, int]:
    """(activations, logits) of one device at its peak (see the module docstring)."""
    t = c.sizes["tensor"]
    scale = DTYPE_BYTES[c.plan.precision.compute_dtype] / 2  # the formulas count 16-bit activations
    full = _split_layer_bytes_per_token(c, shape) * machine.activation_scale
    tokens = tokens_per_micro_step(c, shape)
    logits = int(_split_logit_bytes_per_token(c, shape) * tokens)
    if c.sizes["stage"] > 1:
        return _stage_activation_bytes(c, shape, machine, full * scale, tokens, logits), logits
    compiled = _compiled_remat_bytes(c, shape, machine)
    if compiled is not None:  # the model's gradient with each layer recomputed, as compiled
        return int(compiled[0] + compiled[1] * tokens - logits), logits
    layers = shape.layers
    # one layer's backward working set, whole over ``tensor`` (XLA:CPU's recomputed layer at
    # tensor=2 held 1.17x its set at 1)
    working = full_layer_bytes_per_token(shape) * machine.recompute_scale
    if layer_remat(c):  # every layer's input (split over ``tensor`` by sequence parallelism)
        per_token = (
            _saved_input_bytes_per_token(shape) / (t if c.plan.tensor.sequence_parallel else 1) + working
        )
    else:  # every layer's activations
        per_token = full * layers + working
    if logits_apart_from_layers(c):
        logits = max(0, logits - int(working * scale * tokens))
    return int(per_token * scale * tokens), logits


def _stage_activation_bytes(
    c: Candidate, shape: ModelShape, machine: Machine, layer_bytes: float, tokens: int, logits: int
) -> int:
    """A pipeline stage's activations beside the logits: its stash (:func:`_stash_rows` hidden
    states per token, and the tick's activation and gradient sent on: :data:`SCANNED_STAGE`) and
    its chunk's backward, which recomputes the chunk from a stashed input
    on one micro-batch: the gradient of a model of the chunk's layers, as compiled on the machine
    (:attr:`Machine.chunk_gradient_bytes`, less the logits counted beside it; ZB-H1's split
    backward :data:`ZB_H1_CHUNK_SHARE` of it), else the chunk's layers at ``layer_bytes`` per token
    each (the formula's)."""
    chunk = chunk_layers(c, shape)
    stash = _stash_bytes(c, shape, SCANNED_STAGE[c.plan.pipeline.schedule].hidden_states_more)
    compiled = _compiled_chunk_bytes(c, shape, machine, chunk, tokens, layer_bytes)
    if compiled is not None:
        share = ZB_H1_CHUNK_SHARE if schedule_figures(c).splits_backward else 1.0
        return int(stash + share * (compiled - logits))
    return int(stash + layer_bytes * chunk * tokens)


def _tensor_share(c: Candidate, shape: ModelShape) -> float:
    """A device's share under ``tensor`` of a layer's activations (the formula's, at ``tensor``
    over at 1): what scales the compiled whole-layer programs' bytes per token."""
    return _split_layer_bytes_per_token(c, shape) / full_layer_bytes_per_token(shape)


def _compiled_chunk_bytes(
    c: Candidate, shape: ModelShape, machine: Machine, chunk: int, tokens: int, layer_bytes: float
) -> float | None:
    """The gradient temporaries of ``chunk`` layers on ``tokens``, from the machine's compiled
    ones (the nearest measured length of 2 or more, plus or less ``layer_bytes`` per token per
    layer). Split over ``tensor``, the layers' bytes per token scale at the formula's share
    (:func:`_tensor_share`); the rest of the program's (:func:`_outside_layers_per_token`: the
    embedding's output, the final norm, the head's input and their gradients, whole over
    ``tensor``) do not, but the logits, split over the vocabulary. ``None`` where none applies
    (:func:`_of_compiled_model`, remat, a lone layer unmeasured)."""
    found = machine.chunk_gradient_bytes
    if not found or c.remat or not _of_compiled_model(c, shape, machine):
        return None
    share = _tensor_share(c, shape)
    if chunk in found:
        fixed, per_token = found[chunk]
    else:
        scanned = [k for k in found if k >= 2]
        if chunk == 1 or not scanned:
            return None
        k = nearest_in_ratio(chunk, scanned)
        fixed, per_token = found[k]
        per_token += (chunk - k) * layer_bytes / share  # a whole layer's
    logits = _logit_bytes_per_token(shape)
    outside = _outside_layers_per_token(found, logits)
    split_logits = _split_logit_bytes_per_token(c, shape)
    return fixed + ((per_token - outside) * share + outside - logits + split_logits) * tokens


def _outside_layers_per_token(found: dict[int, tuple[float, float]], logits: float) -> float:
    """Bytes per token of a compiled chunk gradient outside its layers: the line through the two
    shortest scanned lengths (``k >= 2``) at no layers; the logits alone where fewer are measured.
    The smaller benchmark model's 1F1B and interleaved chunks over ``tensor = 2`` had been 2-14 %
    under with every byte but the logits' scaled (its chunk programs: 14.1 KB per token outside
    the layers, 8.2 KB of them the logits)."""
    scanned = sorted(k for k in found if k >= 2)
    if len(scanned) < 2:
        return logits
    a, b = scanned[:2]
    per_layer = (found[b][1] - found[a][1]) / (b - a)
    return max(found[a][1] - a * per_layer, logits)  # the logits at least


def _compiled_remat_bytes(c: Candidate, shape: ModelShape, machine: Machine) -> tuple[float, float] | None:
    """``(fixed, per token)`` of the machine's compiled gradient with every layer recomputed, where
    the candidate recomputes each layer without a pipeline (:func:`layer_remat`) and runs the
    compiled model (:func:`_of_compiled_model`); else ``None``. Split over ``tensor``, the saved
    layer inputs are split only by sequence parallelism, and the rest of its bytes per token but
    the logits scale at the formula's share (:func:`_tensor_share`), as a pipeline chunk's do (the
    smaller benchmark model's 16 ZeRO-1 and -2 plans with remat over ``tensor = 2``: -3.5 % to
    +0.8 %; the formula had -2.0 % to +17.2 %), ZeRO-3's too (its 4 plans without accumulation:
    -3.8 % to -2.0 %; the formula had -2.1 % to +5.9 %). ZeRO-3 accumulating holds its micro-step
    loop's buffers beside it (:func:`_accumulated_on_use_bytes`)."""
    compiled = machine.remat_gradient_bytes
    if compiled is None or c.sizes["stage"] > 1 or not layer_remat(c):
        return None
    t = c.sizes["tensor"]
    if not _of_compiled_model(c, shape, machine):
        return None
    if t == 1:
        return compiled
    fixed, per_token = compiled
    saved = _saved_input_bytes_per_token(shape) * 2  # compiled in float32
    rest = max(per_token - saved - _logit_bytes_per_token(shape), 0.0)
    split = t if c.plan.tensor.sequence_parallel else 1
    return fixed, saved / split + rest * _tensor_share(c, shape) + _split_logit_bytes_per_token(c, shape)


def _saved_input_bytes_per_token(shape: ModelShape) -> float:
    """Every layer's saved input per token, at 16 bits: what a pass recomputing each layer keeps."""
    return 2 * shape.d_model * shape.layers


def _of_compiled_model(c: Candidate, shape: ModelShape, machine: Machine) -> bool:
    """The machine's compiled gradients are of this model (:attr:`Machine.compiled_for`) and the
    candidate computes in float32, as they were compiled."""
    f32 = DTYPE_BYTES[c.plan.precision.compute_dtype] == 4
    return f32 and machine.compiled_gradients_of(shape.signature)
