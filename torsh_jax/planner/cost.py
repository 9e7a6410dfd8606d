"""Predicted memory and step time of a candidate plan, from the plan's theory and the machine.

**Memory per device**: :func:`~torsh_jax.planner.memory.memory_parts`.

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
  same bytes ``inspect`` compares with the compiled program; over ``tensor`` Megatron's per block,
  under a pipeline the stage's blocks for each of its micro-batches), each ``steps × α + wire bytes / β``
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

import math
from dataclasses import dataclass, field, replace

from torsh_jax.analysis.theory import (
    DTYPE_BYTES,
    Theory,
    TheoryCollective,
    compressed_reduction,
    megatron_blocks,
    pipeline_stages,
    pipelined_megatron_blocks,
    plan_theory,
)
from torsh_jax.plan import CompressorSpec
from torsh_jax.plan.factor import link_kind
from torsh_jax.plan.roles import compose
from torsh_jax.planner.buffers import compressed_buffers, tensor_replicated_elements
from torsh_jax.planner.machine import Machine, nearest_in_ratio
from torsh_jax.planner.memory import memory_floor, memory_parts
from torsh_jax.planner.per_device import (
    chunk_layers,
    compressed_buffers_of,
    head_params_on_device,
    local_params,
    recomputed,
    schedule_figures,
    split_part,
    tensor_shares,
    tokens_per_micro_step,
)
from torsh_jax.planner.shape import ModelShape
from torsh_jax.planner.space import Candidate
from torsh_jax.planner.tensor_counts import count_key, counted_tensor_theory

__all__ = ["Prediction", "predict", "OVERLAP", "optimizer_state_factor", "scheduled_step"]

#: Share of an axis's collective time that can hide behind compute on an accelerator, measured on
#: v5e-16 with libtpu 0.0.42.1 (docs/targets.md, benchmarks/README.md): ZeRO-3's in-loop gathers and
#: reductions 0.75-0.96; the stage axis's permutes 0.91; Megatron's activation all-reduces are each
#: needed by the next matmul (0); a data axis's gradient all-reduce runs once after the backward pass (0).
OVERLAP = {"fsdp": 0.75, "stage": 0.9, "tensor": 0.0, "data": 0.0}
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
        measured_s: the step's median seconds measured on this host's devices
            (:mod:`~torsh_jax.planner.measure`), where it was run.
        memory_floor: where the compiler's scheduler decides which parts it holds at once, the
            least the peak may be (``memory["total"]`` is the most:
            :func:`~torsh_jax.planner.memory.memory_floor`); else ``None``.
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
    measured_s: float | None = None
    memory_floor: int | None = None

    @property
    def step_s(self) -> float:
        return self.overhead_s + self.compute_s + self.bubble_s + self.exposed_s

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory_limit

    @property
    def may_fit(self) -> bool:
        """Fits, or its :attr:`memory_floor` does: only compiling it tells."""
        return self.fits or (self.memory_floor is not None and self.memory_floor <= self.memory_limit)

    @property
    def fits_as_compiled(self) -> bool:
        """Whether it fits as the compiler found, where it was compiled; else as predicted."""
        return self.compiled["fits"] if self.compiled else self.fits

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
            "memory_floor": self.memory_floor,
            "memory_limit": self.memory_limit,
            "fits": self.fits,
            "may_fit": self.may_fit,
            "fits_as_compiled": self.fits_as_compiled,
            "compiled": self.compiled or None,
            "measured_s": self.measured_s,
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
    memory = memory_parts(candidate, shape, opt_factor, machine)
    return Prediction(
        candidate,
        memory,
        compute,
        bubble,
        comm,
        _exposed(comm, compute, machine, _overlap_shares(candidate)),
        machine.memory_bytes,
        overhead_s=machine.step_overhead_s,
        codec_s=codec,
        update_s=update,
        break_even_bytes_per_s=_break_even(plain, sent, codec),
        memory_floor=memory_floor(candidate, shape, machine, memory),
    )


def _rate_tokens(c: Candidate, shape: ModelShape) -> int:
    """The tokens a device's measured rates are read at: its micro-step's over ``tensor`` (a
    device's share of a tensor-split layer is as much work as that many whole tokens)."""
    return tokens_per_micro_step(c, shape) // c.sizes["tensor"]


def _compute_seconds(c: Candidate, shape: ModelShape, machine: Machine) -> float:
    """Each device's share of the step's FLOPs (the replica's tokens split over ``tensor`` and
    ``stage``) at the machine's per-device rate for its micro-steps (:meth:`Machine.flops_per_s_at`
    :func:`_rate_tokens`)."""
    replicas = c.sizes["data"] * c.sizes["fsdp"]
    tokens = c.plan.batch.global_batch_size(replicas) * shape.seq_len // replicas
    flops = tokens * shape.train_flops_per_token(recompute=False) * _device_flops_share(c, shape)
    rate = machine.flops_per_s_at(_rate_tokens(c, shape))
    return flops / rate * recompute_cost(c, shape, machine)


def _device_flops_share(c: Candidate, shape: ModelShape) -> float:
    """The share of a replica's FLOPs one device runs: a ``1/stage`` of the layers, and over
    ``tensor`` a ``1/tensor`` share of the FLOPs of what the plan splits (the layers' at their
    parameters' split share, the head's projection as the plan splits it), the rest on
    every tensor device (:func:`~torsh_jax.planner.per_device.tensor_shares`)."""
    t, shares = c.sizes["tensor"], tensor_shares(c, shape)
    head = 2 * shape.vocab * shape.d_model
    layers = shape.forward_flops_per_token() - head
    run = split_part(shares.layer, layers / t, layers) + split_part(shares.vocab, head / t, head)
    return run / (layers + head) / c.sizes["stage"]


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
    layers, shared = local_params(c, shape)
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
    if not recomputed(c):
        return 1.0
    ratio = _measured_recompute_ratio(c, shape, machine) or 1.0 + forward_share(shape)
    if c.sizes["stage"] > 1 and schedule_figures(c).splits_backward:
        return ratio + max(0.0, ratio - 1.0)
    return ratio


def _measured_recompute_ratio(c: Candidate, shape: ModelShape, machine: Machine) -> float | None:
    k = chunk_layers(c, shape) if c.sizes["stage"] > 1 else 1
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


def _bubble_fraction(c: Candidate) -> float:
    """Idle over busy time of a stage, from the schedule table: its idle slots over its busy ones
    (every stage runs as many; a slot is one chunk's forward or backward, or a third of a forward
    and backward with ZB-H1's ``W`` slots, so busy slots are the compute in equal units). 1F1B:
    ``(p - 1) / m``; ZB-H1: ``(p - 1) / 3 m``; interleaved: ``(p - 1) / v m`` (``m`` a multiple of
    ``p``)."""
    return schedule_figures(c).idle_fraction if c.sizes["stage"] > 1 else 0.0


def theories(c: Candidate, shape: ModelShape, *, compressed: bool = True) -> list[Theory]:
    """The candidate's collectives per step: data-parallel axes (gradient reductions over a
    compressed axis in their compressed form unless ``compressed`` is false), ``tensor``, ``stage``."""
    plan, sizes = c.plan, c.sizes
    layers, shared = local_params(c, shape)
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
        head_fraction=head_params_on_device(c, shape) / (layers + shared) if sizes["stage"] == 1 else 0.0,
    )
    out = [data]
    cb = DTYPE_BYTES[plan.precision.compute_dtype]
    micro_tokens = tokens_per_micro_step(c, shape)
    if sizes["tensor"] > 1:
        out.append(_tensor_theory(c, shape, micro_tokens, local_layers))
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


def _tensor_theory(c: Candidate, shape: ModelShape, tokens: int, layers: int) -> Theory:
    """``tensor``'s collectives for micro-steps (pipeline micro-batches) of ``tokens``: those read
    from the model's compiled step where the compiler partitions it
    (:mod:`~torsh_jax.planner.tensor_counts`), else Megatron's: of the device's ``layers`` blocks
    per micro-step, or under a pipeline of the first stage's per micro-batch."""
    plan, common = c.plan, {"tensor_size": c.sizes["tensor"], "layers": layers}
    counts = shape.counted(count_key(c)) if c.sizes["stage"] == 1 else None
    if counts is not None:
        return counted_tensor_theory(counts, tokens, **common, micro_steps=plan.batch.accumulation_steps)
    activation_bytes = tokens * shape.d_model * DTYPE_BYTES[plan.precision.compute_dtype]
    if c.sizes["stage"] > 1:
        pipe = plan.pipeline
        return pipelined_megatron_blocks(
            activation_bytes, **common, microbatches=pipe.microbatches,
            passes=plan.batch.accumulation_steps, virtual_stages=pipe.virtual_stages,
            splits_backward=schedule_figures(c).splits_backward,
        )  # fmt: skip
    sp = plan.tensor.sequence_parallel
    return megatron_blocks(
        activation_bytes, **common, sequence_parallel=sp,
        token_bytes=tokens * 4,
        replicated_grad_bytes=_replicated_bytes(c, shape) if sp else 0,
        recomputed=recomputed(c), micro_steps=plan.batch.accumulation_steps,
    )  # fmt: skip


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
    """Encoding and decoding the compressed gradients: the elements each compressed axis's
    reductions encode (:func:`~torsh_jax.planner.per_device.compressed_buffers_of`: under ZeRO a
    ``1/fsdp`` shard) at the machine's rate for its method
    (:meth:`Machine.codec_seconds_per_element`)."""
    methods = {axis: spec.method for axis, spec in _gradient_compression(c.plan).items()}
    buffers = compressed_buffers_of(c, shape)
    return sum(sum(b) * machine.codec_seconds_per_element(methods[axis]) for axis, b in buffers.items())


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
        return schedule_figures(c).permutes * c.plan.batch.accumulation_steps
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
