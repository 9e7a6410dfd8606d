"""Predicted memory and step time of a candidate plan, from the plan's theory and the machine.

**Memory per device** = training state (the ZeRO split of parameters, gradients and optimizer state,
:func:`~torsh_jax.analysis.theory.theoretical_memory_per_device`) + gradient buffers (below ZeRO-3
the whole local gradient, and its reduced copy where the layers are recomputed, accumulating or not:
:func:`_gradient_buffers`; ZeRO-3 gathering on use: one layer's whole gradient with the embedding's
and head's; accumulating, the step's sum beside each micro-step's, :func:`_accumulated_sum_bytes`;
ZeRO-3 on the compiled recomputing gradient, :func:`_accumulated_on_use_bytes`)
+ ZeRO-3's gathered working set (one layer twice, embedding and head once, in the compute dtype;
on the compiled recomputing gradient, :data:`ZERO3_GATHERED_LAYERS` of one layer; under a pipeline,
the stage's parameters gathered once: :func:`_gathered_bytes`) + an interleaved
stage's copies of a chunk's parameters and of its layers' gradients (:func:`_interleaved_copies`) +
compressed reductions' error feedback (a residual of the reduced gradient; two-phase methods such as
int8 one more of its ``1/n`` chunk) + activations. Activations per token and layer follow
Korthikanti et al. 2022 (eq. 2 and 4; ``34 d + 5 a s`` bytes in 16-bit with no tensor parallelism,
``(10 + 24/t) d + 5 a s / t`` with ``t``, ``34 d / t + 5 a s / t`` with sequence parallelism),
scaled by the compute dtype and the machine's ``activation_scale``, plus the working set of one
layer's backward pass; a recomputed layer (the model's remat, or ZeRO-3 gathering each layer on use)
keeps its input only (``2 d`` bytes), plus the working set of one layer while it is recomputed (the
formula times the machine's ``recompute_scale``; not divided by ``tensor``: measured on CPU, that
set does not shrink with it). The logits and their gradient are float32. A pipeline stage holds
its stash, the runtime's slots for the activations and gradients it receives (about the inputs its
schedule table holds in flight: ``min(microbatches, stages)`` for 1F1B and ZB-H1, interleaved's cap
in chunk inputs, all ``microbatches`` for GPipe) and ZB-H1's ``W`` slots; its backward recomputes a
chunk from a stashed input, which is the gradient of a model of the chunk's layers on one
micro-batch: as the machine compiled it (:attr:`Machine.chunk_gradient_bytes`; split over ``tensor``,
its layers' bytes per token at the formula's share, :func:`_tensor_share`, the rest whole but the
logits), else the chunk's layers by the formula. Where each layer is recomputed without a pipeline,
the model's gradient recomputing every layer as the machine compiled it
(:attr:`Machine.remat_gradient_bytes`, likewise over ``tensor``: :func:`_compiled_remat_bytes`).
An accelerator target's plan without a pipeline is costed as its compiler holds the buffers instead
where that compiler has a profile (:mod:`~torsh_jax.planner.compilers`: the TPU's, read from its
buffer reports).

**Step time** = the machine's per-step overhead + compute + pipeline bubble + exposed communication:

* compute: the busiest device's FLOPs (its tokens × :meth:`ModelShape.train_flops_per_token`,
  split over ``tensor`` and ``stage``) over the machine's sustained FLOP/s at the size of its
  micro-steps (:meth:`Machine.flops_per_s_at`), times
  :func:`recompute_cost` where the layers' forward runs again (remat and ZeRO-3 on use per layer,
  a pipeline stage per chunk, and a ZB-H1 stage once more per layer in its ``W`` slots), plus
  encoding and decoding compressed gradients at the machine's rate for the method
  (:meth:`Machine.codec_seconds_per_element`);
* update: the optimizer's pass over the device's parameters, gradients and state (its ``1/fsdp``
  slice under ZeRO; :func:`update_bytes` at the machine's ``update_bytes_per_s``), counted in the
  compute time;
* bubble: the schedule table's idle slots over its busy ones, of the forward and backward passes'
  time (1F1B and GPipe ``(p - 1) / m``, interleaved ``(p - 1) / v m``, ZB-H1 ``(p - 1) / 3 m``;
  none where the devices share the host's cores: an idle stage's core works for the others);
* communication per axis: the plan theory's collectives (:mod:`torsh_jax.analysis.theory`: the
  same bytes ``inspect`` compares with the compiled program), each ``steps × α + wire bytes / β``
  on the axis's link (DCN when the axis crosses slices), ring steps ``2 (n - 1)`` for an
  all-reduce (or a tree's ``2 ceil(log2 n)`` with the ring's bytes times ``n / (n - 1)``, where the
  link's library runs trees and that is faster: NCCL across GPU nodes), ``n - 1`` for a gather or
  scatter, and for a pipeline one per ``ppermute`` its
  schedule table runs (a tick's sends forward, its sends backward) in each accumulation pass. A
  compressed gradient reduction is the runtime's compressed collective of the buffers it
  compresses: the model's parameters laid out in the runtime's buckets
  (:mod:`~torsh_jax.planner.buffers`), so int8's block padding, top-k's chunks and PowerSGD's
  matrix view of each bucket are counted as compiled;
* exposed: where the machine overlaps (accelerators), the share of each axis's time in
  :data:`OVERLAP` hides behind compute, at most the compute itself; the rest is exposed.

Example:
    >>> from torsh_jax.planner.machine import Machine
    >>> from torsh_jax.planner.shape import ModelShape
    >>> from torsh_jax.planner.space import candidates
    >>> shape = ModelShape.demo("tiny")
    >>> found = candidates(shape, devices=8, global_batch=64)
    >>> [zero3] = [c for c in found if c.label == "zero3 fsdp=8 acc=1"]
    >>> p = predict(zero3, shape, Machine.from_target("v5e-8"))
    >>> sorted(p.comm_s), p.bubble_s
    (['fsdp'], 0.0)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from torsh_jax.analysis.theory import (
    DTYPE_BYTES,
    Theory,
    TheoryCollective,
    compressed_reduction,
    megatron_blocks,
    pipeline_stages,
    plan_theory,
    theoretical_memory_per_device,
)
from torsh_jax.pipeline.schedule import IDLE, build_pipeline_schedule
from torsh_jax.pipeline.slots import slot_plan
from torsh_jax.plan import CompressorSpec
from torsh_jax.plan.compressors import METHODS
from torsh_jax.plan.factor import link_kind
from torsh_jax.plan.roles import compose
from torsh_jax.planner.buffers import compressed_buffers, tensor_replicated_elements
from torsh_jax.planner.compilers import PROFILES, step_memory
from torsh_jax.planner.machine import Machine, nearest_in_ratio
from torsh_jax.planner.shape import ModelShape
from torsh_jax.planner.space import Candidate

__all__ = ["Prediction", "predict", "OVERLAP", "optimizer_state_factor", "scheduled_step"]

#: Share of an axis's collective time that can hide behind compute on an accelerator, measured on
#: v5e-16 with libtpu 0.0.42.1 (docs/targets.md, benchmarks/README.md): ZeRO-3's in-loop gathers and
#: reductions 0.75-0.96; the stage axis's permutes 0.91; Megatron's activation all-reduces are each
#: needed by the next matmul (0); a data axis's gradient all-reduce runs once after the backward pass (0).
OVERLAP = {"fsdp": 0.75, "stage": 0.9, "tensor": 0.0, "data": 0.0}
#: Share of the compiled chunk gradient (:attr:`Machine.chunk_gradient_bytes`) a ZB-H1 stage holds
#: for its chunk: ``B`` runs the chunk's ``vjp`` for its input only and ``W`` one layer's weight
#: gradients at a time, neither the whole gradient. Read from XLA:CPU's compiled steps of the
#: smaller benchmark model (all 90 ZB-H1 candidates at global batch 32: 83 within 5 %, -7.7 % to
#: +6.2 %); the whole chunk gradient had them +1 % to +26 % once the branches stopped copying.
ZB_H1_CHUNK_SHARE = 0.7
#: Layers a ZeRO-3 step gathering on use holds gathered beside the compiled recomputing gradient's
#: temporaries (:attr:`Machine.remat_gradient_bytes`): half of one, in the compute dtype. Read from
#: XLA:CPU's compiled ``zero3 fsdp=8 acc=1`` of the two benchmark models (a whole layer was 0.40
#: of 0.79 MB and 1.57 of 3.15 MB over). At half, all 49 of the two models' ZeRO-3 candidates
#: without a pipeline came within -3.8 % to +3.8 %, 47 of them not read from; at one, 42 (-2.5 %
#: to +6.7 %).
ZERO3_GATHERED_LAYERS = 0.5
#: Ring steps per collective kind over ``n`` devices, where not ``n - 1`` (an all-reduce:
#: :meth:`~torsh_jax.planner.machine.Link.all_reduce_seconds`).
_STEPS = {"collective-permute": lambda n: 1}


@dataclass(frozen=True)
class Prediction:
    """What the cost model says of one candidate.

    Attributes:
        candidate: the plan.
        memory: bytes per device by part (``state``, ``gradients``: buffers beyond the stored
            gradients, ``gathered``, ``activations``, ``logits``) and ``total``.
        compute_s: the busiest device's compute time.
        bubble_s: pipeline idle time.
        comm_s: communication time per mesh axis (before overlap).
        exposed_s: communication time not hidden behind compute.
        memory_limit: bytes one device may use.
        compiled: the compiler's memory when the plan was compiled (:func:`~torsh_jax.planner.verify`).
        overhead_s: the machine's per-step overhead.
        codec_s: encoding and decoding compressed gradients (part of ``compute_s``).
        update_s: the optimizer's update (part of ``compute_s``).
        break_even_bytes_per_s: the link bandwidth below which the compression pays.
    """

    candidate: Candidate
    memory: dict[str, int]
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]
    exposed_s: float
    memory_limit: int
    compiled: dict = field(default_factory=dict)

    overhead_s: float = 0.0
    codec_s: float = 0.0
    update_s: float = 0.0
    break_even_bytes_per_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.overhead_s + self.compute_s + self.bubble_s + self.exposed_s

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory_limit

    def to_dict(self) -> dict:
        c = self.candidate
        return {
            "label": c.label,
            "sizes": c.sizes,
            "dcn": c.dcn,
            "zero_stage": c.plan.zero.stage,
            "micro_batch_size": c.plan.batch.micro_batch_size,
            "accumulation_steps": c.plan.batch.accumulation_steps,
            "microbatches": c.plan.pipeline.microbatches if c.sizes["stage"] > 1 else None,
            "schedule": c.plan.pipeline.schedule if c.sizes["stage"] > 1 else None,
            "virtual_stages": c.plan.pipeline.virtual_stages if c.sizes["stage"] > 1 else None,
            "sequence_parallel": c.sizes["tensor"] > 1 and c.plan.tensor.sequence_parallel,
            "remat": c.remat,
            "compression": {a.axis: a.gradients.method for a in c.plan.compression if a.gradients},
            "step_s": self.step_s,
            "overhead_s": self.overhead_s,
            "compute_s": self.compute_s,
            "codec_s": self.codec_s,
            "update_s": self.update_s,
            "break_even_bytes_per_s": self.break_even_bytes_per_s,
            "bubble_s": self.bubble_s,
            "comm_s": self.comm_s,
            "exposed_s": self.exposed_s,
            "memory": self.memory,
            "memory_limit": self.memory_limit,
            "fits": self.fits,
            "compiled": self.compiled or None,
        }


def optimizer_state_factor(plan) -> float:
    """Optimizer-state elements per parameter element of ``plan``'s optimizer (adamw when unset): 2 for
    adam, 0 for sgd; read from ``optax``'s state shapes on a probe."""
    import jax
    import jax.numpy as jnp

    from torsh_jax.optim.optimizers import build_optimizer

    probe = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    state = jax.eval_shape(build_optimizer(plan.optimizer).init, probe)
    elements = sum(x.size for x in jax.tree.leaves(state) if x.ndim >= 1)
    return elements / 4096


def predict(
    candidate: Candidate, shape: ModelShape, machine: Machine, *, opt_factor: float = 2.0
) -> Prediction:
    """Memory and step time of ``candidate`` for ``shape`` on ``machine`` (see the module docstring)."""
    codec = codec_seconds(candidate, shape, machine)
    update = update_seconds(candidate, shape, machine, opt_factor)
    passes = _compute_seconds(candidate, shape, machine)
    compute = passes + codec + update
    bubble = 0.0 if machine.shared_cores else passes * _bubble_fraction(candidate)
    plain = theories(candidate, shape, compressed=False)
    sent = _as_sent(plain, candidate, shape)
    comm = _comm_seconds(candidate, sent, machine)
    return Prediction(
        candidate,
        _memory(candidate, shape, opt_factor, machine),
        compute,
        bubble,
        comm,
        _exposed(comm, compute, machine, _overlap_shares(candidate)),
        machine.memory_bytes,
        overhead_s=machine.step_overhead_s,
        codec_s=codec,
        update_s=update,
        break_even_bytes_per_s=_break_even(plain, sent, codec),
    )


# -- memory --------------------------------------------------------------------------------------
def _local_params(c: Candidate, shape: ModelShape) -> tuple[int, int]:
    """(parameters of one device's layers, of its embedding and head) before ZeRO, per tensor shard."""
    t, s = c.sizes["tensor"], c.sizes["stage"]
    return shape.layers // s * shape.layer_params // t, (shape.embed_params + shape.head_params) // t


def _memory(c: Candidate, shape: ModelShape, opt_factor: float, machine: Machine) -> dict[str, int]:
    plan = c.plan
    layers, shared = _local_params(c, shape)
    count = layers + shared
    pb, cb = DTYPE_BYTES[plan.precision.param_dtype], DTYPE_BYTES[plan.precision.compute_dtype]
    parts = _as_compiled(c, shape, count, opt_factor, machine)
    if parts is not None:
        parts["feedback"] = _feedback_bytes(c, count * pb)
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
    gradients = _gradient_buffers(count * pb, state.grad_bytes, one_gathered, _recomputed(c))
    if _compiled_remat_bytes(c, shape, machine) is not None:
        # the compiled gradient's buffers hold the local gradient: the stored gradients are the
        # rest, but ZeRO-2's, a shard of it made beside it; ZeRO-3's, what its loop adds
        if on_use:  # and a share of a gathered layer beside them
            gathered = int(ZERO3_GATHERED_LAYERS * one_layer * cb)
            gradients = _accumulated_on_use_bytes(c, count * pb, shared * pb)
        else:
            gradients = count * pb - state.grad_bytes
    gradients += _accumulated_sum_bytes(c, roles.reduce, count * pb, layers * pb)
    chunk_copy, sum_copy = _interleaved_copies(c, layers, pb, cb)
    gathered += chunk_copy
    gradients += sum_copy
    parts = {
        "state": state.total_bytes,
        "gradients": gradients,
        "gathered": gathered,
        "activations": activations,
        "logits": logits,
        "feedback": _feedback_bytes(c, count * pb),
    }
    return {**parts, "total": sum(parts.values())}


def _as_compiled(
    c: Candidate, shape: ModelShape, count: int, opt_factor: float, machine: Machine
) -> dict | None:
    """The parts of the peak as the machine's accelerator compiler holds them
    (:func:`~torsh_jax.planner.compilers.step_memory`, of the device's ``count`` parameters), where it
    has a profile and the machine has no compiled gradients of the model; else ``None``: the
    formulas."""
    profile = PROFILES.get(machine.platform)
    if profile is None or _of_compiled_model(c, shape, machine):
        return None
    scale = machine.activation_scale
    return step_memory(c, shape, profile, local_params=count, opt_factor=opt_factor, activation_scale=scale)


def _interleaved_copies(c: Candidate, layers: int, pb: int, cb: int) -> tuple[int, int]:
    """(parameters, gradients) an interleaved stage copies: each branch indexes its chunk out of
    the stage's ``[v, layers / v, ...]`` parameters (one chunk's ``layers / v`` in the compute
    dtype) and adds the chunk's gradient into the pass's ``[v, ...]`` sum through a copy of the
    stage's ``layers`` gradients; accumulating passes, the compiled CPU programs hold no such copy
    (the smaller benchmark model: 22 of its 39 interleaved candidates within 5 % with them, none
    without). ``(0, 0)`` for one chunk per stage."""
    v = c.plan.pipeline.virtual_stages
    if v == 1 or c.sizes["stage"] == 1:
        return 0, 0
    return layers // v * cb, layers * pb if c.plan.batch.accumulation_steps == 1 else 0


def _gathered_bytes(gather: str, cb: int, count: int, one_layer: int, shared: int) -> int:
    """ZeRO-3's gathered parameters (:attr:`~torsh_jax.plan.roles.Roles.gather`) at ``cb`` bytes
    each: gathering ``on_use``, one layer twice (the one computing, the next arriving) and the
    embedding and head; ``per_stage`` (under a pipeline), the stage's ``count`` parameters whole,
    for every pass of the step."""
    if gather == "on_use":
        return (2 * one_layer + shared) * cb
    return count * cb if gather == "per_stage" else 0


def _gradient_buffers(param_bytes: int, stored_grads: int, one_gathered: int, recomputed: bool) -> int:
    """Buffers beyond the stored gradients. Below ZeRO-3 the whole local gradient exists at the
    peak, in the backward pass beside the activations (1 parameter-sized buffer); where the layers
    are recomputed (remat, a pipeline stage), the peak holds it next to its reduced copy (2; the
    updated parameters reuse the donated ones). ZeRO-3 gathering on use (``one_gathered``: the
    bytes of one gathered layer with the embedding and head) reduces each layer's whole gradient as
    the backward pass makes it, so one layer's and the embedding's and head's are alive at once;
    under a pipeline gathering once, a stage's pass makes its whole gradient as below ZeRO-3.
    Accumulating: :func:`_accumulated_sum_bytes`. What the compiled CPU programs of the demo models
    hold (tests/test_planner.py, benchmarks/bench_planner.py, benchmarks/bench_planner_memory.py)."""
    if one_gathered:
        return one_gathered
    held = 2 * param_bytes if recomputed else param_bytes
    return held - stored_grads


def _accumulated_sum_bytes(c: Candidate, reduce: str, param_bytes: int, layer_bytes: int) -> int:
    """What accumulating adds: the step's gradient sum beside each micro-step's (a pipeline pass's)
    own gradient. Where the step reduces once (:attr:`~torsh_jax.plan.roles.Roles.reduce`
    ``per_step``: DDP, ZeRO-1), the whole local gradient (``param_bytes``), or with each layer
    recomputed the stacked layers' (``layer_bytes``: the embedding's and head's are made after the
    peak); the ``fsdp`` shard where each micro-step is reduced (ZeRO-2, a pipeline stage gathered
    once); nothing where ZeRO-3 reduces each layer's gradient into the stored shard in the
    backward pass."""
    if c.plan.batch.accumulation_steps == 1 or reduce == "in_backward":
        return 0
    if reduce == "per_step":
        return layer_bytes if _layer_remat(c) else param_bytes
    return param_bytes // c.sizes["fsdp"]


def _accumulated_on_use_bytes(c: Candidate, param_bytes: int, shared_bytes: int) -> int:
    """What ZeRO-3 gathering on use adds accumulating, beside its compiled recomputing gradient:
    the step's gradient sum, a ``1/fsdp`` shard carried through the micro-step loop, and the
    embedding's and head's whole gradient (``shared_bytes``, of the device's ``1/tensor``). On
    XLA:CPU the smaller benchmark model's three families without ``tensor`` (``fsdp`` 8, 4 and 2)
    held that much more at 2 and 4 accumulation steps than at one (1.65, 2.18 and 3.24 MB: their
    shards and 1.11 MB); with ``tensor = 2`` its 12 plans came within -1.8 % to +3.0 %."""
    if c.plan.batch.accumulation_steps == 1:
        return 0
    return param_bytes // c.sizes["fsdp"] + shared_bytes


def _feedback_bytes(c: Candidate, param_bytes: int) -> int:
    """Compression's error feedback: per compressed axis of ``n`` devices, a residual of the
    gradient the axis reduces (ZeRO-2 and -3 reduce-scatter it over ``fsdp`` first) and one of the
    ``1/n`` chunk the reduction's second phase sends on."""
    fsdp = c.sizes["fsdp"] if c.plan.zero.stage >= 2 else 1
    total = 0.0
    for compression in c.plan.compression:
        n, spec = c.sizes.get(compression.axis, 1), compression.gradients
        if spec is not None and spec.error_feedback and n > 1:
            server = 1 / n if METHODS[spec.method].all_reduce == "two_phase" else 0  # top-k, PowerSGD: none
            total += param_bytes / fsdp * (1 + server)
    return int(total)


def _layer_remat(c: Candidate) -> bool:
    """Each layer runs forward again in its backward pass, from its saved input: ZeRO-3 gathering
    each layer on use."""
    return c.remat or c.plan.zero.stage == 3 and c.sizes["fsdp"] > 1 and c.sizes["stage"] == 1


def _recomputed(c: Candidate) -> bool:
    """The layers' forward runs twice: per layer (:func:`_layer_remat`) or per pipeline chunk (a
    stage's backward recomputes its chunk from the stashed input)."""
    return _layer_remat(c) or c.sizes["stage"] > 1


def _tokens_per_micro_step(c: Candidate, shape: ModelShape) -> int:
    """Tokens of one device's micro-step (a pipeline micro-batch under a pipeline)."""
    rows = c.plan.batch.micro_batch_size
    if c.sizes["stage"] > 1:
        rows //= c.plan.pipeline.microbatches
    return rows * shape.seq_len


def _rate_tokens(c: Candidate, shape: ModelShape) -> int:
    """The tokens a device's measured rates are read at: its micro-step's over ``tensor`` (a
    device's share of a tensor-split layer is as much work as that many whole tokens)."""
    return _tokens_per_micro_step(c, shape) // c.sizes["tensor"]


def _stash_rows(c: Candidate, chunk: int) -> int:
    """Hidden states per token a pipeline stage's stash holds: the runtime's slots
    (:func:`~torsh_jax.pipeline.slots.slot_plan`) for received activations and gradients, and
    ZB-H1's ``W`` slots of every chunk layer's input and output gradient."""
    activations, gradients, weights = _schedule_figures(c).stash
    return activations + gradients + 2 * chunk * weights


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


def _activation_bytes(c: Candidate, shape: ModelShape, machine: Machine) -> tuple[int, int]:
    """(activations, logits) of one device at its peak (see the module docstring)."""
    t = c.sizes["tensor"]
    scale = DTYPE_BYTES[c.plan.precision.compute_dtype] / 2  # the formulas count 16-bit activations
    formula = full_layer_bytes_per_token(shape, t, c.plan.tensor.sequence_parallel)
    full = formula * machine.activation_scale
    tokens = _tokens_per_micro_step(c, shape)
    logits = int(_logit_bytes_per_token(shape, t) * tokens)
    if c.sizes["stage"] > 1:
        return _stage_activation_bytes(c, shape, machine, full * scale, tokens, logits), logits
    compiled = _compiled_remat_bytes(c, shape, machine)
    if compiled is not None:  # the model's gradient with each layer recomputed, as compiled
        return int(compiled[0] + compiled[1] * tokens - logits), logits
    layers = shape.layers
    # one layer's backward working set, whole over ``tensor`` (XLA:CPU's recomputed layer at
    # tensor=2 held 1.17x its set at 1)
    working = full_layer_bytes_per_token(shape) * machine.recompute_scale
    if _layer_remat(c):  # every layer's input (split over ``tensor`` by sequence parallelism)
        per_token = (
            _saved_input_bytes_per_token(shape) / (t if c.plan.tensor.sequence_parallel else 1) + working
        )
    else:  # every layer's activations
        per_token = full * layers + working
    return int(per_token * scale * tokens), logits


def _stage_activation_bytes(
    c: Candidate, shape: ModelShape, machine: Machine, layer_bytes: float, tokens: int, logits: int
) -> int:
    """A pipeline stage's activations beside the logits: its stash (:func:`_stash_rows` hidden
    states per token) and its chunk's backward, which recomputes the chunk from a stashed input
    on one micro-batch: the gradient of a model of the chunk's layers, as compiled on the machine
    (:attr:`Machine.chunk_gradient_bytes`, less the logits counted beside it; ZB-H1's split
    backward :data:`ZB_H1_CHUNK_SHARE` of it), else the chunk's layers at ``layer_bytes`` per token
    each (the formula's)."""
    chunk = _chunk_layers(c, shape)
    stash = _stash_rows(c, chunk) * shape.d_model * DTYPE_BYTES[c.plan.precision.compute_dtype] * tokens
    compiled = _compiled_chunk_bytes(c, shape, machine, chunk, tokens, layer_bytes)
    if compiled is not None:
        share = ZB_H1_CHUNK_SHARE if _schedule_figures(c).splits_backward else 1.0
        return int(stash + share * (compiled - logits))
    return int(stash + layer_bytes * chunk * tokens)


def _tensor_share(c: Candidate, shape: ModelShape) -> float:
    """A device's share under ``tensor`` of a layer's activations (the formula's, at ``tensor``
    over at 1): what scales the compiled whole-layer programs' bytes per token."""
    t, sp = c.sizes["tensor"], c.plan.tensor.sequence_parallel
    return full_layer_bytes_per_token(shape, t, sp) / full_layer_bytes_per_token(shape)


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
    split_logits = _logit_bytes_per_token(shape, c.sizes["tensor"])
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
    the candidate recomputes each layer without a pipeline (:func:`_layer_remat`) and runs the
    compiled model (:func:`_of_compiled_model`); else ``None``. Split over ``tensor``, the saved
    layer inputs are split only by sequence parallelism, and the rest of its bytes per token but
    the logits scale at the formula's share (:func:`_tensor_share`), as a pipeline chunk's do (the
    smaller benchmark model's 16 ZeRO-1 and -2 plans with remat over ``tensor = 2``: -3.5 % to
    +0.8 %; the formula had -2.0 % to +17.2 %), ZeRO-3's too (its 4 plans without accumulation:
    -3.8 % to -2.0 %; the formula had -2.1 % to +5.9 %). ZeRO-3 accumulating holds its micro-step
    loop's buffers beside it (:func:`_accumulated_on_use_bytes`)."""
    compiled = machine.remat_gradient_bytes
    if compiled is None or c.sizes["stage"] > 1 or not _layer_remat(c):
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
    return fixed, saved / split + rest * _tensor_share(c, shape) + _logit_bytes_per_token(shape, t)


def _saved_input_bytes_per_token(shape: ModelShape) -> float:
    """Every layer's saved input per token, at 16 bits: what a pass recomputing each layer keeps."""
    return 2 * shape.d_model * shape.layers


def _of_compiled_model(c: Candidate, shape: ModelShape, machine: Machine) -> bool:
    """The machine's compiled gradients are of this model (:attr:`Machine.compiled_for`) and the
    candidate computes in float32, as they were compiled."""
    f32 = DTYPE_BYTES[c.plan.precision.compute_dtype] == 4
    return f32 and machine.compiled_gradients_of(shape.signature)


# -- time ----------------------------------------------------------------------------------------
def _compute_seconds(c: Candidate, shape: ModelShape, machine: Machine) -> float:
    """Each device's share of the step's FLOPs (the replica's tokens split over ``tensor`` and
    ``stage``) at the machine's per-device rate for its micro-steps (:meth:`Machine.flops_per_s_at`
    :func:`_rate_tokens`)."""
    replicas = c.sizes["data"] * c.sizes["fsdp"]
    tokens = c.plan.batch.global_batch_size(replicas) * shape.seq_len // replicas
    flops = tokens * shape.train_flops_per_token(recompute=False) / (c.sizes["tensor"] * c.sizes["stage"])
    rate = machine.flops_per_s_at(_rate_tokens(c, shape))
    return flops / rate * recompute_cost(c, shape, machine)


def update_bytes(elements: float, /, *, param_bytes: int, opt_factor: float) -> float:
    """Bytes an optimizer's update moves for ``elements`` parameters: each parameter read and
    written, its float32 gradient read, its ``opt_factor`` float32 state elements read and written.

    Example:
        >>> update_bytes(1, param_bytes=4, opt_factor=2)  # AdamW in float32
        28
    """
    return elements * (2 * param_bytes + 4 + 2 * 4 * opt_factor)


def update_seconds(c: Candidate, shape: ModelShape, machine: Machine, opt_factor: float) -> float:
    """The optimizer's update of the device's parameters (its ``1/fsdp`` slice under ZeRO) at the
    machine's :attr:`~Machine.update_bytes_per_s`; 0 where it is not known."""
    if machine.update_bytes_per_s is None:
        return 0.0
    layers, shared = _local_params(c, shape)
    split = c.sizes["fsdp"] if c.plan.zero.stage >= 1 else 1
    pb = DTYPE_BYTES[c.plan.precision.param_dtype]
    return (
        update_bytes((layers + shared) / split, param_bytes=pb, opt_factor=opt_factor)
        / machine.update_bytes_per_s
    )


def recompute_cost(c: Candidate, shape: ModelShape, machine: Machine) -> float:
    """Time of the candidate's step over the same step that recomputes nothing: 1 where nothing is
    recomputed; else the machine's measured ratio for the layers recomputed one at a time
    (remat, ZeRO-3: ``k`` = 1) or in a pipeline stage's chunks of ``k`` layers, the measured ``k``
    nearest in ratio: by the tokens of the micro-step (:attr:`Machine.recompute_costs_by_tokens`,
    the measured count nearest), else at the calibration's size (:attr:`Machine.recompute_cost`,
    :attr:`Machine.chunk_recompute_costs`); unmeasured, the FLOPs' ratio (:func:`forward_share`).
    A ZB-H1 stage runs its layers' forward once more, in its ``W`` slots (each recomputes its
    layer from the ``W`` stash, docs/pipeline.md), at what the chunk's recomputed forward cost:
    ``1 + 2 (r - 1)`` for the chunk's ratio ``r`` (none where recomputing measured no slower)."""
    if not _recomputed(c):
        return 1.0
    ratio = _measured_recompute_ratio(c, shape, machine) or 1.0 + forward_share(shape)
    if c.sizes["stage"] > 1 and _schedule_figures(c).splits_backward:
        return ratio + max(0.0, ratio - 1.0)
    return ratio


def _measured_recompute_ratio(c: Candidate, shape: ModelShape, machine: Machine) -> float | None:
    k = _chunk_layers(c, shape) if c.sizes["stage"] > 1 else 1
    if machine.recompute_costs_by_tokens:
        by_tokens = machine.recompute_costs_by_tokens[nearest_in_ratio(k, machine.recompute_costs_by_tokens)]
        return by_tokens[nearest_in_ratio(_rate_tokens(c, shape), by_tokens)]
    measured = {1: machine.recompute_cost} if machine.recompute_cost is not None else {}
    measured.update(machine.chunk_recompute_costs)
    return measured[nearest_in_ratio(k, measured)] if measured else None


def forward_share(shape: ModelShape) -> float:
    """The layers' forward FLOPs over the step's (forward and backward, nothing recomputed): what
    running every layer's forward once more adds.

    Example:
        >>> from torsh_jax.planner.shape import parse_model
        >>> round(forward_share(parse_model("demo:d_model=256,layers=4,vocab=256")), 3)
        0.329
    """
    return shape.train_flops_per_token(recompute=True) / shape.train_flops_per_token(recompute=False) - 1


def _chunk_layers(c: Candidate, shape: ModelShape) -> int:
    """Layers of one pipeline chunk (a stage's layers over its virtual stages)."""
    return max(1, shape.layers // (c.sizes["stage"] * c.plan.pipeline.virtual_stages))


def _bubble_fraction(c: Candidate) -> float:
    """Idle over busy time of a stage, from the schedule table: its idle slots over its busy ones
    (every stage runs as many; a slot is one chunk's forward or backward, or a third of a forward
    and backward with ZB-H1's ``W`` slots, so busy slots are the compute in equal units). 1F1B:
    ``(p - 1) / m``; ZB-H1: ``(p - 1) / 3 m``; interleaved: ``(p - 1) / v m`` (``m`` a multiple of
    ``p``)."""
    return _schedule_figures(c).idle_fraction if c.sizes["stage"] > 1 else 0.0


class _ScheduleFigures(NamedTuple):
    """What the cost model reads of a pipeline's schedule table: idle over busy slots, the runtime's
    activation, gradient and ``W`` stash slots, the ``ppermute`` collectives one pass runs
    (each tick that sends forward runs one, each that sends backward another), and whether its
    backwards are split into ``B`` and ``W`` (ZB-H1)."""

    idle_fraction: float
    stash: tuple[int, int, int]
    permutes: int
    splits_backward: bool


def _schedule_figures(c: Candidate) -> _ScheduleFigures:
    pipe = c.plan.pipeline
    return _table_figures(pipe.schedule, c.sizes["stage"], pipe.microbatches, pipe.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _table_figures(name: str, stages: int, microbatches: int, virtual_stages: int) -> _ScheduleFigures:
    table = build_pipeline_schedule(
        name, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages
    )
    idle = int((table.table[..., 0] == IDLE).sum())
    slots = slot_plan(table)
    stash = (slots.activation_slots, slots.gradient_slots, slots.weight_slots)
    permutes = int(slots.sends_forward.any(axis=1).sum() + slots.sends_backward.any(axis=1).sum())
    idle_fraction = idle / (table.table[..., 0].size - idle)
    return _ScheduleFigures(idle_fraction, stash, permutes, table.splits_backward)


def theories(c: Candidate, shape: ModelShape, *, compressed: bool = True) -> list[Theory]:
    """The candidate's collectives per step: data-parallel axes (gradient reductions over a
    compressed axis in their compressed form unless ``compressed`` is false), ``tensor``, ``stage``."""
    plan, sizes = c.plan, c.sizes
    layers, shared = _local_params(c, shape)
    devices = math.prod(sizes.values())
    slices = math.prod(c.dcn.values()) if c.dcn else 1
    fraction = layers / (layers + shared) if sizes["stage"] == 1 else 0.0
    local_layers = shape.layers // sizes["stage"]
    data = plan_theory(
        plan,
        param_count=layers + shared,
        num_devices=devices,
        num_slices=slices,
        layer_fraction=fraction,
        layers=local_layers,
    )
    out = [data]
    cb = DTYPE_BYTES[plan.precision.compute_dtype]
    micro_tokens = _tokens_per_micro_step(c, shape)
    if sizes["tensor"] > 1 and sizes["stage"] == 1:
        out.append(
            megatron_blocks(
                micro_tokens * shape.d_model * cb,
                tensor_size=sizes["tensor"],
                layers=local_layers,
                sequence_parallel=plan.tensor.sequence_parallel,
                token_bytes=micro_tokens * 4,
                replicated_grad_bytes=_replicated_bytes(c, shape) if plan.tensor.sequence_parallel else 0,
                recomputed=_recomputed(c),
                micro_steps=plan.batch.accumulation_steps,
            )
        )
    if sizes["stage"] > 1:
        shared_grads = shared * DTYPE_BYTES[plan.precision.param_dtype] + 4
        out.append(
            pipeline_stages(
                micro_tokens * shape.d_model * cb,
                stages=sizes["stage"],
                microbatches=plan.pipeline.microbatches,
                passes=plan.batch.accumulation_steps,
                shared_grad_bytes=shared_grads,
                virtual_stages=plan.pipeline.virtual_stages,
            )
        )
    return _as_sent(out, c, shape) if compressed else out


def _as_sent(plain: list[Theory], c: Candidate, shape: ModelShape) -> list[Theory]:
    """``plain`` (:func:`theories` uncompressed) with the data-parallel theory's gradient reductions
    over a compressed axis in their compressed form."""
    if not _gradient_compression(c.plan):
        return plain
    data, *rest = plain
    return [replace(data, collectives=tuple(_compressed(data.collectives, c, shape))), *rest]


def _replicated_bytes(c: Candidate, shape: ModelShape) -> int:
    """Compute-dtype bytes of the parameters replicated over ``tensor`` (their gradients are summed
    over it under sequence parallelism)."""
    return tensor_replicated_elements(shape, c.plan, c.sizes) * DTYPE_BYTES[c.plan.precision.compute_dtype]


def _gradient_compression(plan) -> dict[str, CompressorSpec]:
    """Mesh axis -> the compressor of its gradient reductions."""
    return {
        a.axis: a.gradients
        for a in plan.compression
        if a.gradients is not None and a.gradients.method != "none"
    }


def _compressed(collectives, c: Candidate, shape: ModelShape) -> list[TheoryCollective]:
    """The collectives with each gradient reduction over a compressed axis replaced by its compressed
    form (:func:`~torsh_jax.analysis.theory.compressed_reduction`) of the buffers the runtime
    compresses (:func:`~torsh_jax.planner.buffers.compressed_buffers`: padded per parameter and per
    bucket); without the model's leaves, of the reduction's elements as one buffer."""
    plan = c.plan
    compressors, out = _gradient_compression(plan), []
    buffers = compressed_buffers(shape, plan, c.sizes) if compressors else {}
    for col in collectives:
        spec = compressors.get(col.axes[0]) if len(col.axes) == 1 else None
        if spec is None or col.kind not in ("all-reduce", "reduce-scatter"):
            out.append(col)
            continue
        scatter = col.kind == "reduce-scatter"
        axis, size = col.axes[0], col.group_size
        elements = col.payload_bytes // DTYPE_BYTES[plan.precision.reduce_dtype]
        settings = {k: getattr(spec, k) for k in ("block_size", "chunk_size", "topk_fraction", "rank")}
        reduction = compressed_reduction(
            spec.method, buffers.get(axis, elements), axis=axis, axis_size=size, scatter=scatter, **settings
        )
        out += [replace(r, count=r.count * col.count) for r in reduction]
    return out


def codec_seconds(c: Candidate, shape: ModelShape, machine: Machine) -> float:
    """Encoding and decoding the compressed gradients: the gradient elements of each compressed
    axis at the machine's rate for its method (:meth:`Machine.codec_seconds_per_element`)."""
    layers, shared = _local_params(c, shape)
    methods = [spec.method for spec in _gradient_compression(c.plan).values()]
    return sum((layers + shared) * machine.codec_seconds_per_element(m) for m in methods)


def break_even_bytes_per_s(c: Candidate, shape: ModelShape, machine: Machine) -> float | None:
    """The link bandwidth below which the candidate's gradient compression pays: bytes it saves
    per step over its encode and decode time (``None`` without compression)."""
    plain = theories(c, shape, compressed=False)
    return _break_even(plain, _as_sent(plain, c, shape), codec_seconds(c, shape, machine))


def _break_even(plain: list[Theory], sent: list[Theory], codec_s: float) -> float | None:
    """Bytes per second that ``sent`` saves over ``plain`` per second of encoding and decoding
    (``None`` where nothing is compressed)."""
    if sent is plain:
        return None
    wire = lambda theories: sum(x.wire_bytes for t in theories for x in t.collectives)
    return (wire(plain) - wire(sent)) / codec_s if codec_s > 0 else float("inf")


def _comm_seconds(c: Candidate, sent: list[Theory], machine: Machine) -> dict[str, float]:
    """Seconds per axis of the collectives ``sent`` (:func:`theories`) on the machine's links: an
    all-reduce by the faster algorithm its link runs (``Link.all_reduce_seconds``), the rest as
    rings."""
    seconds: dict[str, float] = {}
    for theory in sent:
        for col in theory.collectives:
            if col.group_size <= 1 and col.kind != "collective-permute":
                continue
            link = machine.link(link_kind(col.axes, c.dcn))
            if col.kind == "all-reduce":
                spent = link.all_reduce_seconds(col.wire_bytes, col.group_size, col.count)
            else:
                spent = link.seconds(col.wire_bytes, _steps(col, c), col.kind)
            axis = "+".join(col.axes)
            seconds[axis] = seconds.get(axis, 0.0) + spent
    return seconds


def _steps(col: TheoryCollective, c: Candidate) -> int:
    """Latency steps of ``col`` as a ring (each pays the link's α): ``n - 1``, ``count`` times; a
    pipeline's activations and their gradients, one per ``ppermute`` its schedule runs, in every
    accumulation pass."""
    if col.kind == "collective-permute" and col.axes == ("stage",):
        return _schedule_figures(c).permutes * c.plan.batch.accumulation_steps
    return _STEPS.get(col.kind, lambda n: n - 1)(col.group_size) * col.count


def _exposed(comm: dict[str, float], compute: float, machine: Machine, shares: dict[str, float]) -> float:
    """Communication not hidden behind compute: each axis set's share (``shares`` by the set, else
    the largest of its axes'), at most the compute itself."""
    if not machine.overlaps:
        return sum(comm.values())
    share = lambda axis: shares.get(axis, max(shares.get(a, 0.0) for a in axis.split("+")))
    hidden = min(sum(t * share(axis) for axis, t in comm.items()), compute)
    return sum(comm.values()) - hidden


def _overlap_shares(c: Candidate) -> dict[str, float]:
    """:data:`OVERLAP` for the candidate: ``fsdp``'s share only where ZeRO-3 gathers each layer on
    use, whose gathers and reductions run inside the layer loop beside its compute; ZeRO-1 and -2
    reduce and gather around the step's compute, as does a pipeline stage gathered once (v5e-256,
    the 1 B model: none of ZeRO-1's and ZeRO-2's ``fsdp`` bytes overlapped in the compiled
    schedules)."""
    on_use = compose(c.plan, c.sizes).gather == "on_use"
    return {**OVERLAP, "fsdp": OVERLAP["fsdp"] if on_use else 0.0}


def scheduled_step(prediction: Prediction, machine: Machine, overlap: dict[str, float]) -> dict[str, float]:
    """``exposed_s`` and ``step_s`` of ``prediction`` with each axis's overlapped share read from its
    compiled schedule (``overlap``: fraction of the axes' collective bytes with compute between
    their start and done, :func:`~torsh_jax.analysis.overlap.collective_overlap`; axes it does not
    name keep the candidate's :data:`OVERLAP`).

    Example (a schedule that overlaps nothing exposes all of the communication):
        >>> from torsh_jax.planner import Machine, ModelShape, search
        >>> tpus = Machine.from_target("v5e-8")
        >>> best = search(ModelShape.demo("tiny"), tpus, global_batch=64)[0]
        >>> figures = scheduled_step(best, tpus, {axis: 0.0 for axis in best.comm_s})
        >>> figures["exposed_s"] == sum(best.comm_s.values()) >= best.exposed_s
        True
    """
    shares = {**_overlap_shares(prediction.candidate), **overlap}
    exposed = _exposed(prediction.comm_s, prediction.compute_s, machine, shares)
    return {"exposed_s": exposed, "step_s": prediction.step_s - prediction.exposed_s + exposed}
