"""Per-device memory of a step as an accelerator's compiler holds it.

The rest of the cost model (:mod:`torsh_jax.planner.cost`) is measured on XLA:CPU's programs. The
TPU compiler keeps other buffers. Read from its buffer reports (``--xla_dump_to``:
``*-memory-usage-report.txt``) of the demo transformer's steps in float32, and counted against
libtpu's own peak (``peak_memory_in_bytes``, :func:`~torsh_jax.analysis.memory.peak_bytes`), a
step holds:

* its **arguments**: the parameters (ZeRO-3: a ``1/fsdp`` shard) and the optimizer state (ZeRO-1
  and up: a shard); no stored gradients;
* **residuals** per layer and token, stacked over the layers (:attr:`CompilerProfile.attention`,
  ``mlp`` and the ``d`` terms: bytes per unit of ``heads · seq_len / t``, ``mlp / t`` and
  ``d_model``). XLA:TPU keeps the attention probabilities in float32 and the bfloat16 copy its
  matrix unit reads (``6 a s / t``), five float32 MLP intermediates and a bfloat16 one
  (``22 m / t``) and ``30 d``;
* where each layer is recomputed (remat, ZeRO-3 gathering on use), each layer's float32 input
  instead (``4 d``, split by sequence parallelism) and one recomputed layer's working set
  (:attr:`CompilerProfile.recompute`; gathering on use, ``recompute_on_use``);
* the **logits** once, in float32 (``4 V / t`` per token): the CPU programs keep their gradient
  beside them;
* float32 buffers the size of the device's parameters, ``P``, as many as
  :attr:`CompilerProfile.parameter_buffers` says for how the step makes its gradient (the
  step's sum, a micro-step's gradients as it makes them, the reduction's buffers; on a TPU the
  weights' bfloat16 copies too); accumulating, the embedding's and head's parameters count at
  :attr:`CompilerProfile.shared_accumulating` of a layer parameter's;
* gathering each layer on use (ZeRO-3), the head's float32 weights. A step without a pipeline
  finishes the head's backward before the layers' (:func:`~torsh_jax.runtime.layered.head_first`,
  ZeRO-3's gathered head likewise), so where its layers are recomputed (remat, ZeRO-3) its logits
  and a recomputed layer's working set are never held at once: the larger of the two
  (:func:`~torsh_jax.planner.per_device.logits_apart_from_layers`).

In a pipeline stage, libtpu's scheduler either keeps the logits through the layers' backward,
beside its chunk's residuals, or frees them first: the peak lies between the larger of the two
phases and their sum (:func:`apart_bytes`; the profile counts the sum, and ``plan --verify``
compiles a plan whose lower end fits to decide).

A pipeline stage holds the same parts as the step of a model of its chunk's layers on one
micro-batch, with the stage's stash (the runtime's slots) among the activations and
:attr:`~CompilerProfile.stage_buffers`: the stage's float32 gradient carry, each layer's gradient
added into it in place, and the bfloat16 copy of the stage's weights the matrix unit reads, made
once before the tick loop (1.5; read from libtpu's live ranges, ``--xla_dump_to``'s
``*-live-range.txt``, of layer-bound stages: 8 layers of ``d_model`` 2048 on v5e-8). ZeRO-3
gathers the stage's parameters once instead of each layer on use, so its layers are not
recomputed; libtpu gathers what the matrix unit reads (the layers' and the head's weights) in
bfloat16 (:attr:`~CompilerProfile.matrix_bytes`), and that gather is the weights' copy, so the
layers keep their carry alone beside it; the embedding, read by a lookup, is gathered in the
compute dtype (the optimized HLO's ``all-gather`` results). Compiled
(``bench_planner_memory.py --tpu d512_pp|150m_pp|1b_pp|d2048_pp``): the ``d_model`` 512 model's
10 pipelined plans 3 within 5 % (-3.6 % to +15.3 %), 150 M's 6 of 10 (-7.6 % to +23.6 %), 1 B's
one at +9.5 %, the layer-bound set 6 of 8 (-1.7 % to +12.7 %: its stage of one layer peaks at the
tick loop's entry, 970 MB live there against libtpu's 979 MB, with no layer's working set beside
it). The embedding and head count at :attr:`~CompilerProfile.shared_staged` of a layer
parameter's buffers (0.5, 0.75 of their float32 bytes: the one float32 sum a stage carries for
the two, :mod:`torsh_jax.runtime.pipeline.ends`, and the head's bfloat16 copy; where a stage
carries the two apart, the smaller one's more). The small model puts more of its plans within
5 % at 0.083 to 0.167 (8 and 7 of its 10; 17 of all 29), as its buffers sit in the chip's VMEM,
the larger at 0.5 to 0.75, and 0.5's misses are over (docs/planner.md). Before the carry
was read (2.53, the accumulating steps' figure with each micro-step's gradient made whole), 10 of
the 29 came within 5 %. Activations scale with the compute dtype from float32 and with the
machine's ``activation_scale`` (which ``plan --verify`` learns from a refusal). How close the
profile comes to the compiled peaks: :data:`TPU`, ``benchmarks/bench_planner_memory.py --tpu SET``.
A GPU profile read the same way from XLA:GPU's H100 programs was not kept: on the two model sizes
it was not read from, 4 of 7 plans came within 5 %, against 6 of 7 with the formulas
(docs/planner.md).

Example:
    >>> from torsh_jax.planner.shape import ModelShape
    >>> from torsh_jax.planner.space import candidates
    >>> shape = ModelShape.demo("150m")
    >>> [plan] = [c for c in candidates(shape, devices=16, global_batch=128)
    ...           if c.label == "zero1 fsdp=16 acc=4"]
    >>> shared = shape.embed_params + shape.head_params
    >>> parts = step_memory(plan, shape, TPU, local_params=shape.param_count, shared_params=shared,
    ...                     opt_factor=2.0)
    >>> round(sum(parts.values()) / 2**30, 2)  # compiled for v5e-16: 5.28 GiB (libtpu's peak)
    5.19
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torsh_jax.analysis.theory import DTYPE_BYTES
from torsh_jax.plan.roles import Roles, compose
from torsh_jax.planner.per_device import (
    chunk_layers,
    head_params_on_device,
    logits_apart_from_layers,
    paired_end_sums,
    split_part,
    tensor_shares,
    tokens_per_micro_step,
)
from torsh_jax.planner.shape import ModelShape
from torsh_jax.planner.space import Candidate

__all__ = ["CompilerProfile", "TPU", "PROFILES", "step_memory", "apart_bytes", "residual_bytes"]


@dataclass(frozen=True)
class CompilerProfile:
    """What one compiler's train steps hold (module docstring), in float32 bytes per token.

    Attributes:
        name: the compiler and version the figures were read from.
        attention: residual bytes per layer and unit of ``heads · seq_len / tensor``.
        mlp: per unit of ``mlp / tensor``.
        d_alone: per unit of ``d_model`` without ``tensor``.
        d_split: ``(whole, split)``: with ``tensor = t``, ``whole · d + split · d / t``.
        d_sequence_parallel: the same with sequence parallelism.
        recompute: ``(attention, mlp, d)`` of one recomputed layer's working set (remat).
        recompute_on_use: the same where ZeRO-3 gathers each layer on use, or ``None``: as
            ``recompute``.
        parameter_buffers: float32 buffers of the device's parameters' size beside the state, by
            ``(reduce, recomputed)`` and how the gradient is made: ``reduce`` ``per_step`` (DDP,
            ZeRO-1: the whole gradient reduced once) or ``per_micro_step`` (ZeRO-2: each
            micro-step's reduce-scattered); made ``once`` (one micro-step) or ``summed``
            (accumulating micro-steps).
        shared_accumulating: accumulating, the share of ``parameter_buffers`` the embedding's and
            head's parameters hold, of what a layer's parameter holds.
        stage_buffers: the same buffers in a pipeline stage, whatever its reduction and remat
            (its gradient carry and the weights' copy in the compiler's matrix dtype; ZeRO-3's
            layers without the copy, which is what they gather).
        shared_staged: the embedding's and head's share of ``stage_buffers``.
        matrix_bytes: bytes of the dtype the compiler's matrix unit reads weights in (libtpu:
            bfloat16, whatever the compute dtype), whose copy of a stage's weights
            ``stage_buffers`` counts: a ZeRO-3 stage gathers its layers and head in it, and the
            gather is that copy; ``None``: no such copy.
        logits_apart: the steps whose logits the compiler may free before the layers' backward
            instead of holding them beside it (:func:`apart_bytes`): ``"staged"``, a pipeline
            stage (beside its chunk's residuals).
    """

    name: str
    attention: float
    mlp: float
    d_alone: float
    d_split: tuple[float, float]
    d_sequence_parallel: tuple[float, float]
    recompute: tuple[float, float, float]
    recompute_on_use: tuple[float, float, float] | None = None
    parameter_buffers: dict[tuple[str, bool], dict[str, float]] = field(default_factory=dict)
    shared_accumulating: float = 1.0
    stage_buffers: float = 1.0
    shared_staged: float = 1.0
    matrix_bytes: int | None = None
    logits_apart: tuple[str, ...] = ()


#: libtpu 0.0.42.1, against its own peak: the demo model at 150 M on v5e-16 and 1 B on v5e-256
#: (read from), 350 M on v5e-32 and 7 B on v5e-256 (not): 41 of 47 compiled plans within 5 %, the
#: mean absolute error 2.8 %; DDP and ZeRO-1 11 of 11, ZeRO-2 9 of 9, remat 12 of 15 (-7.4 % to
#: +9.3 %), ZeRO-3 9 of 12 (-8.7 % to +6.3 %, its reductions as rows; in their own shape 7 of
#: 15, -4.7 % to +56.1 %, an upper bound, below); the plans not read from 8 of 10 (compiled with
#: DDP's and ZeRO-1's accumulation summing in place; the CPU formulas had 11 of 45 within 5 %
#: before it); a small model held out (``d_model`` 512, 4 layers, v5e-8) 6 of 10, to +18.7 % (its
#: ZeRO-3 step keeps part of a layer's working set and the gathered weights in the chip's VMEM,
#: where the larger models' buffers do not fit: docs/planner.md). The recomputed working sets were
#: fitted to those peaks. Parameter buffers, the median over the compiled plans of 150 M and 1 B
#: of each kind: DDP and ZeRO-1 1.38 not accumulating (1.32-1.45, 2), 1.80 accumulating
#: (1.58-2.20, 8: each layer's gradient added into the step's sum in place,
#: :mod:`torsh_jax.runtime.sink`; 2.53 when each micro-step's whole gradient was made beside the
#: sum); ZeRO-2 1.73 accumulating (7), 1.45
#: not (1); recomputing 1.42 (1.37-1.57, 5), accumulating 1.54 (1.08-1.82, 9, with 1 B's ``ddp
#: data=32 remat acc=8`` on two v5e-16 slices: higher the fewer tokens a micro-step has, 1.08-1.11
#: at 150 M's 4 examples a chip, 1.82 at one; 1 B's 1.54-1.60; 2.07 with the sum beside); ZeRO-2
#: recomputing 1.97 (1, accumulating). Accumulating, the embedding and head hold half a layer
#: parameter's buffers (:attr:`~CompilerProfile.shared_accumulating`, chosen on the small model,
#: where they are 73 % of the parameters: its accumulating plans had been +6.3 % and +7.6 % with
#: the same count; at 150 M and 1 B, 40 % and 14 %, the medians absorb it). Checked on a model
#: compiled after that choice (``d_model`` 768, 6 layers, v5e-8, global batch 32; the embedding
#: and head 54 % of it): its 5 accumulating plans without remat came within -0.7 % to +3.8 %
#: (+3.2 % to +10.0 % counting them whole), the one recomputing at +14.1 % (+18.0 %). Read with every
#: gradient reduced as a flat row; since a float32 one alone in its bucket is reduced in its own
#: shape, 150 M's 12 plans without ZeRO-3 came within -4.6 % to +3.8 % again. ZeRO-3 gathering on
#: use finishes the head's backward before the layers', so holds the larger of its logits and a
#: recomputed layer's working set, not both (libtpu had computed the head's weight gradient after
#: the layers' backward, holding the logits' gradient through it, on 150 M's ``fsdp=16``, 1 B and
#: 7 B): the 15 plans of ``150m|350m|1b|7b|d512``, 8 within 5 %, -9.1 % to +13.1 %
#: (docs/planner.md). Steps recomputing their layers that make each micro-step's gradient whole
#: finish the head's backward first too (:func:`~torsh_jax.runtime.layered.head_first`): counted
#: so, the six such plans of the sets within -1.2 % to +1.2 % but the small model's (+16.6 %). A
#: pipeline stage's buffers (``stage_buffers``) are the module docstring's; no pipeline with remat was
#: compiled, and its carry and copy are the same.
TPU = CompilerProfile(
    name="libtpu 0.0.42.1",
    attention=6,
    mlp=22,
    d_alone=30,
    d_split=(28, 8),
    d_sequence_parallel=(0, 30),
    recompute=(4, 6, 18),
    recompute_on_use=(8, 6, 12),
    parameter_buffers={  # by how the gradient is made: once, summed
        ("per_step", False): {"once": 1.38, "summed": 1.80},
        ("per_step", True): {"once": 1.42, "summed": 1.54},
        ("per_micro_step", False): {"once": 1.45, "summed": 1.73},
        ("per_micro_step", True): {"once": 1.58, "summed": 1.97},
    },
    shared_accumulating=0.5,
    stage_buffers=1.5,
    shared_staged=0.5,
    matrix_bytes=2,
    logits_apart=("staged",),
)

#: Profiles by :attr:`~torsh_jax.planner.machine.Machine.platform`.
PROFILES = {"tpu": TPU}


def residual_bytes(
    profile: CompilerProfile, shape: ModelShape, tensor: int = 1, sequence_parallel: bool = False
) -> float:
    """Float32 bytes per token one layer keeps for its backward pass under ``profile``.

    Example:
        >>> shape = ModelShape(0, 0, 1, 0, d_model=1024, seq_len=1024, vocab=8, heads=16, mlp=4096)
        >>> residual_bytes(TPU, shape) == 6 * 16 * 1024 + 22 * 4096 + 30 * 1024
        True
    """
    d, t = shape.d_model, tensor
    if t == 1:
        per_d = profile.d_alone
    else:
        whole, split = profile.d_sequence_parallel if sequence_parallel else profile.d_split
        per_d = whole + split / t
    return profile.attention * shape.heads * shape.seq_len / t + profile.mlp * shape.mlp / t + per_d * d


def step_memory(
    c: Candidate,
    shape: ModelShape,
    profile: CompilerProfile,
    *,
    local_params: int,
    shared_params: int,
    opt_factor: float,
    activation_scale: float = 1.0,
    stash_bytes: float = 0.0,
) -> dict[str, int]:
    """The parts of a device's peak (``state``, ``gradients``, ``gathered``, ``activations``,
    ``logits``; not the caller's ``feedback`` and ``total``) for candidate ``c`` under
    ``profile``, whose devices each hold ``local_params`` parameters before ZeRO (its ``1/tensor``),
    ``shared_params`` of them the embedding's and head's. A pipeline stage's is the step of a model
    of its chunk's layers on one micro-batch with the stage's buffers (its backward recomputes the
    chunk from a stashed input; ZeRO-3 gathers the stage's parameters once), with ``stash_bytes``
    (its stash, the caller's slots) among the activations. Where the step finishes the head's
    backward before its recomputed layers'
    (:func:`~torsh_jax.planner.per_device.logits_apart_from_layers`), ``logits`` is what the
    logits hold beyond a recomputed layer's working set (:func:`_beside_working_set`)."""
    plan, fsdp = c.plan, c.sizes["fsdp"]
    roles = compose(plan, c.sizes)
    on_use = roles.gather == "on_use"  # ZeRO-3: every layer recomputed
    staged = c.sizes["stage"] > 1
    count = local_params
    pb, cb = DTYPE_BYTES[plan.precision.param_dtype], DTYPE_BYTES[plan.precision.compute_dtype]
    layers = chunk_layers(c, shape) if staged else shape.layers
    per_token = _activation_bytes_per_token(c, shape, profile, _recomputed(c, profile, on_use), layers)
    tokens = tokens_per_micro_step(c, shape)
    logits = _logits_bytes(c, shape, tokens)
    if logits_apart_from_layers(c):
        logits = _beside_working_set(c, shape, profile, logits, tokens, activation_scale)
    parts = {
        "state": count * pb / (fsdp if plan.zero.stage == 3 else 1)
        + count * opt_factor * 4 / (fsdp if plan.zero.stage >= 1 else 1),
        "gradients": 0.0 if on_use else _buffer_bytes(c, shape, profile, roles, count, shared_params),
        "gathered": _gathered(
            c, shape, roles.gather, _stage_gather_bytes(shape, profile, count, shared_params, cb)
        ),
        "activations": _activation_bytes(c, per_token, tokens, activation_scale) + stash_bytes,
        "logits": logits,
    }
    return {k: int(v) for k, v in parts.items()}


def _beside_working_set(
    c: Candidate, shape: ModelShape, profile: CompilerProfile, logits: float, tokens: int, scale: float
) -> float:
    """What ``logits`` bytes hold beyond a recomputed layer's working set, where ZeRO-3 gathers each
    layer on use: the step finishes the head's backward before the layers'
    (:func:`~torsh_jax.runtime.fsdp.gathered_loss`), so the two are never held at once.

    Example (the ``d_model`` 512 model's ``zero3 fsdp=8 acc=1`` on v5e-8: its 500 MiB of logits,
    a working set of 328 MiB; libtpu's peak 639 MiB, predicted 660 MiB):
        >>> from torsh_jax.planner.shape import parse_model
        >>> from torsh_jax.planner.space import candidates
        >>> shape = parse_model("demo:d_model=512,layers=4")
        >>> c = {c.label: c for c in candidates(shape, devices=8, global_batch=32)}["zero3 fsdp=8 acc=1"]
        >>> _beside_working_set(c, shape, TPU, 500 * 2**20, 4 * 1024, 1.0) / 2**20
        172.0
    """
    return max(0.0, logits - _working_set_bytes(c, shape, profile, tokens, scale))


def _working_set_bytes(
    c: Candidate, shape: ModelShape, profile: CompilerProfile, tokens: int, scale: float
) -> float:
    """One recomputed layer's working set (remat's, or ZeRO-3's gathering each layer on use), of
    ``tokens`` tokens at the activation ``scale``."""
    on_use = compose(c.plan, c.sizes).gather == "on_use"
    per_token = _working_set_per_token(c, shape, _recomputed(c, profile, on_use))
    return _activation_bytes(c, per_token, tokens, scale)


def _recomputed(c: Candidate, profile: CompilerProfile, on_use: bool) -> tuple[float, float, float] | None:
    """The working set of a layer recomputed in the backward pass (gathering on use, ZeRO-3's;
    else remat's), or ``None`` where the layers keep their residuals."""
    if on_use:
        return profile.recompute_on_use or profile.recompute
    return profile.recompute if c.remat else None


def _activation_bytes(c: Candidate, per_token: float, tokens: int, activation_scale: float) -> float:
    """Activations of ``tokens`` tokens at ``per_token`` float32 bytes (the profile's), held in the
    plan's compute dtype and scaled by the machine's ``activation_scale``."""
    return per_token * DTYPE_BYTES[c.plan.precision.compute_dtype] / 4 * activation_scale * tokens


def apart_bytes(
    c: Candidate, shape: ModelShape, profile: CompilerProfile, *, activation_scale: float = 1.0
) -> int:
    """Bytes of :func:`step_memory`'s sum the compiler may never hold at once: in the steps of
    :attr:`~CompilerProfile.logits_apart` (a pipeline stage), the smaller of the float32 logits and
    the chunk's residuals, as the scheduler holds the logits through the layers' backward or frees
    them first; else 0. The step's peak lies between the sum less these bytes and the sum.
    Compiled for TPU targets (libtpu 0.0.42.1, ``bench_planner_memory.py --tpu SET``): the
    pipelined plans of ``d512_pp|150m_pp``, the sum -7.6 % to +23.6 % of the peak, less these
    bytes -27.0 % to -4.1 % (docs/planner.md). (A ZeRO-3 step finishes its head's backward first:
    one figure, :func:`step_memory`.)

    Example (the ``d_model`` 512 model on v5e-8: a pipeline stage, ZeRO-3 over ``data`` too, and
    ZeRO-3 over ``fsdp`` alone):
        >>> from torsh_jax.planner.shape import parse_model
        >>> from torsh_jax.planner.space import candidates
        >>> shape = parse_model("demo:d_model=512,layers=4")
        >>> found = {c.label: c for c in candidates(shape, devices=8, global_batch=32)}
        >>> labels = ("pp fsdp=2 stage=4 1f1b m=8 zero2 acc=1", "zero3 data=2 fsdp=4 acc=1")
        >>> [apart_bytes(found[k], shape, TPU) > 0 for k in (*labels, "zero3 fsdp=8 acc=1")]
        [True, False, False]
    """
    if c.sizes["stage"] == 1 or "staged" not in profile.logits_apart:
        return 0
    tokens = tokens_per_micro_step(c, shape)
    recomputed = _recomputed(c, profile, compose(c.plan, c.sizes).gather == "on_use")
    per_token = _activation_bytes_per_token(c, shape, profile, recomputed, chunk_layers(c, shape))
    residuals = _activation_bytes(c, per_token, tokens, activation_scale)  # as step_memory counts them
    return int(min(residuals, _logits_bytes(c, shape, tokens)))


def _logits_bytes(c: Candidate, shape: ModelShape, tokens: int) -> float:
    """The float32 logits of ``tokens`` tokens, of the device's share of the vocabulary."""
    t = c.sizes["tensor"]
    return split_part(tensor_shares(c, shape).vocab, 4 * shape.vocab / t, 4 * shape.vocab) * tokens


def _buffer_bytes(
    c: Candidate, shape: ModelShape, profile: CompilerProfile, roles: Roles, count: int, shared: int
) -> float:
    """The float32 parameter-sized buffers of a step reducing as ``roles.reduce`` (a pipeline
    stage's :attr:`~CompilerProfile.stage_buffers`, else :attr:`~CompilerProfile.parameter_buffers`)
    for ``count`` parameters, ``shared`` of them the embedding's and head's, at their share. A
    stage gathered once (ZeRO-3) has its layers' copy in the matrix dtype in what it gathers
    (:func:`_stage_gather_bytes`): its layers keep the carry alone. A stage that carries the
    embedding's and head's sums apart (:func:`~torsh_jax.planner.per_device.paired_end_sums`) holds
    the smaller one's more."""
    if c.sizes["stage"] > 1:
        factor, share = profile.stage_buffers, profile.shared_staged
        gathered_copy = roles.gather == "per_stage" and profile.matrix_bytes is not None
        copy = profile.matrix_bytes / 4 if gathered_copy else 0.0
        smaller_end, paired = paired_end_sums(c, shape)
        unpaired = 0 if paired else smaller_end  # both sums carried: the smaller one more
        return ((factor - copy) * (count - shared) + factor * share * shared + unpaired) * 4
    summed = c.plan.batch.accumulation_steps > 1
    kind = "per_step" if roles.reduce == "per_step" else "per_micro_step"
    factor = profile.parameter_buffers[kind, c.remat]["summed" if summed else "once"]
    share = profile.shared_accumulating if summed else 1.0
    return factor * (count - (1 - share) * shared) * 4


def _gathered(c: Candidate, shape: ModelShape, gather: str, stage_bytes: float) -> float:
    """ZeRO-3's gathered parameters: gathering each layer on use, the head's float32 weights (of
    the device's share over ``tensor``); a pipeline stage gathered once, ``stage_bytes``
    (:func:`_stage_gather_bytes`); else none."""
    if gather == "on_use":
        return head_params_on_device(c, shape) * 4
    return stage_bytes if gather == "per_stage" else 0.0


def _stage_gather_bytes(
    shape: ModelShape, profile: CompilerProfile, count: int, shared: int, cb: int
) -> float:
    """Bytes of a pipeline stage's ``count`` parameters gathered whole (ZeRO-3): the embedding's
    share of the ``shared`` embedding and head, which a lookup reads, in the compute dtype (``cb``
    bytes); the rest (the layers, their norms' few bytes too, and the head) in the dtype the matrix
    unit reads (:attr:`~CompilerProfile.matrix_bytes`), where the profile has one and it is the
    narrower.

    Example (a stage of two layers with the embedding and head, on a TPU: the embedding in
    float32, the rest in bfloat16):
        >>> shape = ModelShape.demo("tiny")
        >>> shared = shape.embed_params + shape.head_params
        >>> count = 2 * shape.layer_params + shared
        >>> in_bfloat16 = count - shape.embed_params
        >>> _stage_gather_bytes(shape, TPU, count, shared, 4) == shape.embed_params * 4 + in_bfloat16 * 2
        True
    """
    matrix = min(cb, profile.matrix_bytes or cb)
    both = shape.embed_params + shape.head_params
    embedding = shared * shape.embed_params / both if both else 0.0
    return (count - embedding) * matrix + embedding * cb


def _activation_bytes_per_token(
    c: Candidate,
    shape: ModelShape,
    profile: CompilerProfile,
    recomputed: tuple[float, float, float] | None,
    layers: int,
) -> float:
    """Float32 bytes per token of ``layers`` layers' residuals, or, each layer ``recomputed`` (the
    working set's ``(attention, mlp, d)``), of every layer's input and one layer's working set;
    over ``tensor``, of the share of a layer the plan splits at ``tensor``, the rest whole."""
    t, layer = c.sizes["tensor"], tensor_shares(c, shape).layer
    sp = t > 1 and c.plan.tensor.sequence_parallel
    if recomputed is None:
        split = residual_bytes(profile, shape, t, sp)
        return layers * split_part(layer, split, residual_bytes(profile, shape))
    inputs = layers * 4 * shape.d_model / (t if sp else 1)
    return inputs + _working_set_per_token(c, shape, recomputed)


def _working_set_per_token(c: Candidate, shape: ModelShape, recomputed: tuple[float, float, float]) -> float:
    """Float32 bytes per token of one recomputed layer's working set (``(attention, mlp, d)``), of
    the share of a layer the plan splits at ``tensor``, the rest whole."""
    t, layer = c.sizes["tensor"], tensor_shares(c, shape).layer
    attention, mlp, d = recomputed
    working = lambda t: attention * shape.heads * shape.seq_len / t + mlp * shape.mlp / t + d * shape.d_model
    return split_part(layer, working(t), working(1))
