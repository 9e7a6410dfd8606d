"""Per-device memory of a step as XLA:TPU compiles it, for the planner's plans without a pipeline.

The TPU compiler keeps other buffers than XLA:CPU, whose programs the rest of the cost model is
measured on (:mod:`torsh_jax.planner.cost`). Read from libtpu 0.0.42.1's buffer reports
(``--xla_dump_to``: ``*-memory-usage-report.txt``) of the demo transformer's steps in float32
compiled for v5e-16 (150 M) and v5e-256 (1 B), a step holds:

* its **arguments**: the parameters (ZeRO-3: a ``1/fsdp`` shard) and the optimizer state (ZeRO-1
  and up: a shard); no stored gradients;
* **residuals** per layer and token, stacked over the layers, in bytes: ``6 a s / t`` (the
  attention probabilities in float32, and the bfloat16 copy the MXU reads), ``22 m / t`` (five
  float32 MLP intermediates and a bfloat16 one), ``30 d`` (over ``tensor``: ``28 d + 8 d / t``;
  with sequence parallelism ``30 d / t``), for heads ``a``, sequence ``s``, MLP width ``m``,
  width ``d``;
* where each layer is recomputed (remat, ZeRO-3 gathering on use), each layer's float32 input
  instead (``4 d``, split by sequence parallelism) and one recomputed layer's working set,
  ``12 a s / t + 6 m / t + 18 d``;
* the **logits** once, in float32 (``4 V / t`` per token): the CPU programs keep their gradient
  beside them, the TPU's do not;
* float32 buffers the size of the device's parameters, ``P``, as many as
  :data:`PARAMETER_BUFFERS` says for how the step makes its gradient (the micro-step's gradient,
  the step's sum, the reduction's buffers, the weights' bfloat16 copies);
* gathering each layer on use (ZeRO-3), the head's float32 weights.

Activations scale with the compute dtype from float32 and with the machine's ``activation_scale``
(which ``plan --verify`` learns from a refusal). Over 46 plans compiled (``python
benchmarks/bench_planner_memory.py --tpu 150m|350m|1b|7b``: 150 M on v5e-16, 350 M on v5e-32, 1 B
and 7 B on v5e-256), 33 predictions were within 5 % of the compiled peak, against 11 with the
CPU-measured formulas; the mean absolute error went from 26 % to 5 %. On the two sizes the figures
were not read from, 350 M and 7 B, 6 of 10 (2 before). ZeRO-3 is under by up to 29 % on the
larger models (7 B: 20 % and 29 %); on a small model (``d_model`` 512, 4 layers) the TPU compiler
keeps less than these figures, and they are over by 13-79 %.

Example:
    >>> from torsh_jax.planner.shape import ModelShape
    >>> from torsh_jax.planner.space import candidates
    >>> shape = ModelShape.demo("150m")
    >>> [plan] = [c for c in candidates(shape, devices=16, global_batch=128)
    ...           if c.label == "zero1 fsdp=16 acc=4"]
    >>> parts = tpu_step_memory(plan, shape, opt_factor=2.0)  # compiled for v5e-16: 6.61 GiB
    >>> round(sum(parts.values()) / 2**30, 2)
    6.86
"""

from __future__ import annotations

from torsh_jax.analysis.theory import DTYPE_BYTES
from torsh_jax.plan.roles import compose
from torsh_jax.planner.shape import ModelShape
from torsh_jax.planner.space import Candidate

__all__ = ["PARAMETER_BUFFERS", "tpu_step_memory", "layer_residual_bytes", "recompute_working_bytes"]

#: Float32 buffers of the device's parameters' size beside the state, by ``(reduce, recomputed,
#: accumulating)``: ``reduce`` is ``per_step`` (DDP, ZeRO-1: the whole gradient reduced once) or
#: ``per_micro_step`` (ZeRO-2: each micro-step's reduce-scattered); ``recomputed``, each layer
#: recomputed from its input (remat). The median over the compiled plans of each kind (v5e-16,
#: 150 M; v5e-256, 1 B; libtpu 0.0.42.1), with the range measured: DDP and ZeRO-1 accumulating
#: 4.12 (3.73-4.24, 9 plans); recomputing 1.69 (1.12-1.84, 5), accumulating 2.69 (2.66-2.71, 2);
#: ZeRO-2 accumulating 2.57 (2.31-4.09, 7: 2.31-2.57 on the 1 B model, 2.97-4.09 on the 150 M),
#: recomputing 1.68 (1). Not accumulating without remat: one fewer than accumulating, the step's
#: sum (then compiled: DDP and ZeRO-1 at 150 M, 2.64 and 2.81; ZeRO-2 2.81).
PARAMETER_BUFFERS = {
    ("per_step", False, True): 4.12,
    ("per_step", False, False): 3.12,
    ("per_step", True, False): 1.69,
    ("per_step", True, True): 2.69,
    ("per_micro_step", False, True): 2.57,
    ("per_micro_step", False, False): 2.57,
    ("per_micro_step", True, False): 1.68,
    ("per_micro_step", True, True): 1.68,
}


def layer_residual_bytes(shape: ModelShape, tensor: int = 1, sequence_parallel: bool = False) -> float:
    """Float32 bytes per token one layer keeps for its backward pass (module docstring).

    Example:
        >>> shape = ModelShape(0, 0, 1, 0, d_model=1024, seq_len=1024, vocab=8, heads=16, mlp=4096)
        >>> layer_residual_bytes(shape) == 6 * 16 * 1024 + 22 * 4096 + 30 * 1024
        True
    """
    d, t = shape.d_model, tensor
    if sequence_parallel and t > 1:
        whole = 30 * d / t
    else:
        whole = 30 * d if t == 1 else 28 * d + 8 * d / t
    return 6 * shape.heads * shape.seq_len / t + 22 * shape.mlp / t + whole


def recompute_working_bytes(shape: ModelShape, tensor: int = 1) -> float:
    """Float32 bytes per token of one layer recomputed in the backward pass (module docstring)."""
    t = tensor
    return 12 * shape.heads * shape.seq_len / t + 6 * shape.mlp / t + 18 * shape.d_model


def tpu_step_memory(
    c: Candidate, shape: ModelShape, *, opt_factor: float, activation_scale: float = 1.0
) -> dict[str, int]:
    """The parts of a device's peak (``state``, ``gradients``, ``gathered``, ``activations``,
    ``logits``; no ``total``'s ``feedback``: the caller's) for candidate ``c`` without a pipeline."""
    plan, t, fsdp = c.plan, c.sizes["tensor"], c.sizes["fsdp"]
    sp = t > 1 and plan.tensor.sequence_parallel
    zero = plan.zero.stage
    count = (shape.layers * shape.layer_params + shape.embed_params + shape.head_params) / t
    pb, cb = DTYPE_BYTES[plan.precision.param_dtype], DTYPE_BYTES[plan.precision.compute_dtype]
    params = count * pb / (fsdp if zero == 3 else 1)
    optimizer = count * opt_factor * 4 / (fsdp if zero >= 1 else 1)
    tokens = plan.batch.micro_batch_size * shape.seq_len
    scale = cb / 4 * activation_scale  # measured in float32
    roles = compose(plan, c.sizes)
    gathered = 0.0
    if roles.gather == "on_use":  # ZeRO-3: every layer recomputed, the head gathered whole
        per_token = shape.layers * 4 * shape.d_model / (t if sp else 1) + recompute_working_bytes(shape, t)
        buffers, gathered = 0.0, shape.head_params / t * 4
    elif c.remat:
        per_token = shape.layers * 4 * shape.d_model / (t if sp else 1) + recompute_working_bytes(shape, t)
        buffers = _buffers(roles.reduce, c)
    else:
        per_token = shape.layers * layer_residual_bytes(shape, t, sp)
        buffers = _buffers(roles.reduce, c)
    parts = {
        "state": params + optimizer,
        "gradients": buffers * count * 4,
        "gathered": gathered,
        "activations": per_token * scale * tokens,
        "logits": 4 * shape.vocab / t * tokens,
    }
    return {k: int(v) for k, v in parts.items()}


def _buffers(reduce: str, c: Candidate) -> float:
    """:data:`PARAMETER_BUFFERS` of ``c`` (ZeRO-2's ``in_backward`` reduction counts as per micro-step)."""
    key = "per_step" if reduce == "per_step" else "per_micro_step"
    return PARAMETER_BUFFERS[key, c.remat, c.plan.batch.accumulation_steps > 1]
