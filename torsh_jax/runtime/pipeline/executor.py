"""One executor for every schedule table, run per device inside the step's ``shard_map``.

The executor runs the table in one ``lax.scan`` over its ticks, reading
each stage's row at the scanned tick. At each tick every stage runs one
branch: the forward or backward of one chunk for one micro-batch, or nothing
(one two-way ``lax.switch`` per kind of branch, so that no branch copies the
gradients and stashes it passes on: :meth:`_Ticks._branch`). Then the stages
that produced an activation (a gradient) send it to the next (previous) stage
with one ``ppermute`` whose pairs are exactly the sending stages (one
``ppermute`` per sender pattern of the table, picked by the tick), so the bytes
over ``stage`` are the activations and their gradients per micro-batch per
boundary and nothing else. A backward recomputes its chunk's forward from
the stashed input (``jax.vjp``), so a stage holds the inputs of the
micro-batches in flight, which is what the schedule decides.

A schedule with ``W`` slots (``zb_h1``) splits each chunk's backward: ``B``
recomputes the chunk from its stashed input and runs one ``vjp`` with respect
to that input only (no weight-gradient matmuls); zeros added to every layer's
output make their gradients the layers' output gradients. It sends the chunk's
input gradient on and leaves each layer's input and output gradient in a
``W`` stash slot. ``W`` later makes the weight gradients from that slot, one
layer at a time (recomputing that layer's forward), with nothing waiting on
it. The embedding and head weight gradients are made in ``B`` of the first and
last stage.

Embedding and head parameters are replicated over ``stage``; their gradients,
made on the first and last stage, are summed over ``stage`` once per step. A
key both read (a tied embedding) gets the sum of its embedding and head
gradients (:func:`~torsh_jax.runtime.layered.join_params`) before that sum.
Until then a stage carries the two parts' sums in
:class:`~torsh_jax.runtime.pipeline.ends.EndSums`' buffers, where a table and
the head's transposed weight share one.

Inside ``shard_map`` over a mesh with a ``stage`` axis the step calls
``grads, loss, slots = pipeline_gradients(model, schedule)(params, batch, scale)``.

Example (two stages of one layer each, GPipe over two micro-batches):
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from torsh_jax.pipeline.schedule import build_pipeline_schedule
    >>> model = LayeredModel(embed=lambda p, b: b * p["embed"], layer=lambda w, h: h * w,
    ...                      head=lambda p, h, b: jnp.sum(h * p["head"]))
    >>> params = {"embed": jnp.float32(1.0), "layers": jnp.full((2,), 2.0), "head": jnp.float32(1.0)}
    >>> run = pipeline_gradients(model, build_pipeline_schedule("gpipe", stages=2, microbatches=2))
    >>> specs = {"embed": P(), "layers": P("stage"), "head": P()}
    >>> mesh = Mesh(jax.devices()[:2], ("stage",))
    >>> step = jax.shard_map(lambda p, b: reduce_over_stage(*run(p, b)[:2], "layers"),
    ...                      mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P()))
    >>> grads, loss = jax.jit(step)(params, jnp.ones(2))
    >>> float(loss), grads["layers"].tolist(), float(grads["embed"])
    (4.0, [2.0, 2.0], 4.0)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from torsh_jax.pipeline.schedule import Schedule
from torsh_jax.pipeline.slots import BRANCHES, KINDS, SlotPlan, kind_of, send_patterns, send_scope, slot_plan
from torsh_jax.plan.roles import STAGE_AXIS
from torsh_jax.runtime.layered import LayeredModel, join_params
from torsh_jax.runtime.pipeline.branches import Carry, StagePass
from torsh_jax.runtime.pipeline.varying import cast_vma, settled, typed_switch, vmas
from torsh_jax.tensor.axis import varying_axes

__all__ = ["pipeline_gradients", "reduce_over_stage"]


def _at(table: np.ndarray, tick: jax.Array, stage: jax.Array) -> jax.Array:
    """``table[tick, stage]`` at the scanned tick."""
    return jnp.asarray(table)[tick, stage]


def _ints(plan: SlotPlan, tick: jax.Array, stage: jax.Array) -> dict[str, jax.Array]:
    names = ("micro", "chunk", "activation_in", "gradient_in", "weight_stash")
    return {name: _at(getattr(plan, name), tick, stage) for name in names}


def _receive(buffer: jax.Array, received: jax.Array, slot: jax.Array) -> jax.Array:
    """Write ``received`` into this stage's ``slot`` (``-1``: keep the buffer). A select, not a ``cond``:
    XLA may sink the ``ppermute`` feeding a conditional into its branch, which only some devices run."""
    buffer = cast_vma(buffer, varying_axes(buffer) | varying_axes(received))
    row = jnp.maximum(slot, 0)
    kept = jax.lax.dynamic_index_in_dim(buffer, row, keepdims=False)
    value = jnp.where(slot >= 0, received.astype(buffer.dtype), kept)
    return jax.lax.dynamic_update_index_in_dim(buffer, value, row, 0)


def _pairs(sends: np.ndarray, step: int, stages: int) -> list[tuple[int, int]]:
    return [(s, (s + step) % stages) for s in np.flatnonzero(sends)]


def pipeline_gradients(
    model: LayeredModel,
    schedule: Schedule,
    *,
    accum_dtype: Any = jnp.float32,
    axis: str = STAGE_AXIS,
    pair_ends: bool = True,
) -> Callable:
    """Per device: ``(params, batch, scale, passes) -> (grads, loss, [[forward, backward, weight]]
    slots run)``.

    ``params`` hold this stage's layers (``[layers / stage, ...]``, or its
    ``[v, layers / (v stage), ...]`` chunks when interleaved); ``batch`` is
    ``passes`` passes' batches one after another, each split into
    ``schedule.microbatches``. Gradients are of each pass's mean loss times
    ``scale`` (1 when ``None``), summed over the passes in ``accum_dtype``, and
    the loss is that sum of means: the passes run one after another in the
    same scan, adding into one gradient carry (accumulating passes outside
    would hold a second sum of the stage's gradients beside it). The
    embedding and head gradients and the loss are this stage's share (zero
    off the first / last stage): :func:`reduce_over_stage` sums them once per
    step, after the last pass. ``pair_ends``: let the embedding's and head's gradient sums share
    buffers (:class:`~torsh_jax.runtime.pipeline.ends.EndSums`); not where the compiler partitions
    an axis inside the ``shard_map``.
    """
    plan = slot_plan(schedule)
    p, m = schedule.stages, schedule.microbatches

    def run(params, batch, scale=None, passes: int = 1):
        """``(grads, summed mean loss, slots run [1, 3])`` over ``passes`` passes."""
        stage = jax.lax.axis_index(axis)
        # every value below varies over stage: typed so up front, the backward of a branch sums no
        # parameter gradient over stage inside it (only some devices run it); the caller types the
        # parameters as varying over the batch axes whose sum it places itself
        params = cast_vma(params, jax.tree.map(lambda _: frozenset({axis}), params))
        seed = (jnp.float32(1.0) if scale is None else scale.astype(jnp.float32)) / m
        one = StagePass(model, schedule, params, batch, seed, passes, table=plan.branch,
                        pair_ends=pair_ends, accum_dtype=accum_dtype)  # fmt: skip
        shape = jax.eval_shape(lambda: model.embed(one.embed_p, one.batch_of(0)))
        # activations vary as the embedding's output does (and over stage) from the first tick on: a
        # scanned tick reading the stash before anything arrived sees the type it will have
        hidden = lambda *lead: cast_vma(jnp.zeros((*lead, *shape.shape), shape.dtype), vmas(shape) | {axis})
        one.dtype, one.zeros = shape.dtype, hidden()
        zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, accum_dtype), tree)
        grads = (one.ends.zeros(), zeros(one.chunks))
        carry = Carry(acts=hidden(plan.activation_slots), cots=hidden(plan.gradient_slots),
                       wstash=hidden(plan.weight_slots, 2, one.per_chunk), grads=grads,
                       loss_sum=jnp.float32(0.0), counts=jnp.zeros(3, jnp.int32))  # fmt: skip
        carry = _scan_ticks(_Ticks(stage, plan, one, axis, p, types={}, gated={}), carry, passes)
        sums, g_chunks = carry.grads
        g_embed, g_head = one.ends.parts(sums, stage=stage)
        g_layers = g_chunks if schedule.virtual_stages > 1 else jax.tree.map(lambda x: x[0], g_chunks)
        grads = join_params(model, g_embed, g_layers, g_head)  # a tied embedding: both parts summed
        return grads, carry.loss_sum / m, carry.counts[None]

    return run


def reduce_over_stage(grads: dict, loss: jax.Array, layers_key: str, axis: str = STAGE_AXIS):
    """Sum the embedding and head gradients (made on one stage each) and the loss over ``stage``;
    each stage keeps its own layers' gradients."""
    shared = {k: v for k, v in grads.items() if k != layers_key}
    shared, loss = jax.lax.psum((shared, loss), axis)
    return {**shared, layers_key: grads[layers_key]}, loss


def _scan_ticks(ticks: _Ticks, carry, passes: int):
    """Every tick of the table, ``passes`` times, in one ``lax.scan``: the step's code is one
    tick's, whatever the schedule, ``m``, ``p`` and the passes."""

    def tick(carry, t):
        return ticks.run(carry, t), None

    tick, carry = settled(tick, carry, jnp.int32(0))
    count = ticks.plan.branch.shape[0] * passes
    return jax.lax.scan(tick, carry, jnp.arange(count, dtype=jnp.int32))[0]


def _passed(state, ints) -> tuple:
    """The first way of a branch's ``lax.switch``: this stage runs another branch."""
    return (state,)


def _run_on_state(branch: Callable, state, ints) -> tuple:
    """A branch as the second way of its ``lax.switch`` (:meth:`_Ticks._branch`)."""
    return (branch(state[0], ints),)


class _Ticks(NamedTuple):
    """What every tick of the passes reads: this stage's index, the slot plan, the passes' branches,
    the stage axis and its size, and the branches' varying-axis types by input types
    (:func:`~torsh_jax.runtime.pipeline.varying.typed_switch`, filled as ticks are traced)."""

    stage: jax.Array
    plan: SlotPlan
    one: StagePass
    axis: str
    stages: int
    types: dict
    gated: dict  # by (kind, variants): ``((carry, sent forward, sent backward), ints) -> (that,)``

    def run(self, carry, t: jax.Array):
        """Tick ``t`` of the passes (traced once, scanned over all): each stage runs its branch at
        the table's tick, for that pass's micro-batch, then the senders ``ppermute`` forward and
        backward."""
        plan = self.plan
        ticks = plan.branch.shape[0]
        tick = t % ticks
        ints = _ints(plan, tick, self.stage)
        ints["micro"] = ints["micro"] + (t // ticks) * self.one.m
        carry, forward, backward = self._branch(carry, ints, _at(plan.branch, tick, self.stage))
        carry = self._send(carry, tick, forward, "F", plan.sends_forward, plan.receive_activation)
        return self._send(carry, tick, backward, "B", plan.sends_backward, plan.receive_gradient)

    def _send(self, carry, tick, value, direction: str, sends: np.ndarray, receive: np.ndarray):
        """``value`` from this tick's senders to the next stage (``direction`` ``F``) or the
        previous (``B``), written into the receiver's ``acts`` (``cots``) slot: one ``ppermute`` per
        sender pattern (:func:`~torsh_jax.pipeline.slots.send_patterns`), picked by a
        ``lax.switch`` on the tick, which every device takes the same way, so each ``ppermute``'s
        pairs are exactly the stages sending."""
        patterns, at = send_patterns(sends)
        step, field = (1, "acts") if direction == "F" else (-1, "cots")
        target = varying_axes(value) | {self.axis}

        def sent_from(pattern: tuple[bool, ...]) -> Callable:
            def send(v):
                if not any(pattern):
                    return cast_vma(jnp.zeros_like(v), target)
                with jax.named_scope(send_scope(direction, pattern)):
                    pairs = _pairs(np.asarray(pattern), step, self.stages)
                    return cast_vma(jax.lax.ppermute(v, self.axis, pairs), target)

            return send

        ways = [sent_from(pattern) for pattern in patterns]
        value = cast_vma(value, target)
        received = jax.lax.switch(jnp.asarray(at)[tick], ways, value)
        buffer = _receive(getattr(carry, field), received, _at(receive, tick, self.stage))
        return carry._replace(**{field: buffer})

    def _branch(self, carry, ints, branch: jax.Array):
        """``(carry, sent forward, sent backward)`` of this stage's branch (``branch``, its index in
        ``BRANCHES``): one two-way ``lax.switch`` per kind of branch the table runs
        (:data:`~torsh_jax.pipeline.slots.KINDS`), whose first way passes everything through. A
        pass-through way after the first makes XLA copy the buffers it passes (the stage's
        gradients and stashes, every tick); a first one it does not (jax-ml/jax#38145)."""
        present = {BRANCHES[b] for b in self.plan.branch.ravel().tolist()}
        kinds = {kind: frozenset(b for b in present if kind_of(b) == kind) for kind in KINDS}
        kinds = {kind: variants for kind, variants in kinds.items() if variants}
        ints = {**ints, "branch": branch}
        state = self.one.idle(carry, ints)  # nothing sent
        for kind, variants in kinds.items():
            indices = jnp.asarray([BRANCHES.index(b) for b in sorted(variants)])
            runs = jnp.isin(branch, indices).astype(jnp.int32)
            (state,) = typed_switch(runs, [_passed, self._gated(kind, variants)], state, ints, self.types)
        return state

    def _gated(self, kind: str, variants: frozenset) -> Callable:
        """The kind's branch as the second way of its ``lax.switch``; made once per run, so that
        :func:`typed_switch` finds it traced."""
        if (kind, variants) not in self.gated:
            self.gated[kind, variants] = partial(_run_on_state, self.one.branch(kind, variants))
        return self.gated[kind, variants]
