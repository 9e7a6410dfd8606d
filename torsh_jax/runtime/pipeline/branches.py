"""The branches of one pipeline pass: forward, backward (or input-gradient ``B`` and weight-gradient
``W``) and idle slots of one stage, and the carry the ticks thread through them.

A backward recomputes its chunk's forward from the stashed input (``jax.vjp``) and adds each layer's
gradient into the stage's gradient carry as it makes it (:func:`~torsh_jax.runtime.tap.scan_into`).
Under a schedule with ``W`` slots, ``B`` runs one ``vjp`` with respect to the chunk's input only
(zeros added to every layer's output make their gradients the layers' output gradients) and leaves
each layer's input and output gradient in a ``W`` stash slot; ``W`` makes the weight gradients from
that slot, one layer at a time, adding each into the carry. :mod:`torsh_jax.runtime.pipeline.executor`
runs the branches.

The stages running a kind of branch at a tick (:data:`~torsh_jax.pipeline.slots.KINDS`: every
forward, ``F_first``, ``F_mid`` and ``F_last``, is one kind) share one copy of its code: the chunk
once, the embedding and the head under a ``lax.cond`` on the stages whose branch runs them. The
compiled step (one scanned tick) holds one chunk per kind, not one per branch.

Example:
    >>> Carry._fields
    ('acts', 'cots', 'wstash', 'grads', 'loss_sum', 'counts')
    >>> from torsh_jax.pipeline.slots import KINDS, kind_of
    >>> sorted({kind_of(b) for b in BRANCHES} - {"idle"}) == sorted(KINDS)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from torsh_jax.pipeline.schedule import Schedule
from torsh_jax.pipeline.slots import BRANCHES, slot_scope
from torsh_jax.runtime.accumulate import split_micro_batches
from torsh_jax.runtime.layered import LayeredModel, scan_layers, split_params
from torsh_jax.runtime.pipeline.ends import EndSums
from torsh_jax.runtime.pipeline.varying import cast_vma, cotangent_like, typed_cond
from torsh_jax.runtime.tap import at_leading, scan_into
from torsh_jax.tensor.axis import varying_axes
from torsh_jax.typing import PyTree

__all__ = ["Carry", "StagePass"]


class Carry(NamedTuple):
    """What the ticks thread through: the stashes, gradients, loss and slot counts of one stage."""

    acts: jax.Array  # [activation slots, *hidden]: inputs received, until their backward
    cots: jax.Array  # [gradient slots, *hidden]: gradients received, until their backward
    wstash: jax.Array  # [weight slots, 2, layers per chunk, *hidden]: (inputs, output grads) for W
    grads: tuple  # (the embedding's and head's sums as StagePass.ends holds them, chunks' sums)
    loss_sum: jax.Array
    counts: jax.Array  # [3]: forward, backward, weight slots run


def _take(tree: PyTree, index: jax.Array) -> PyTree:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), tree)


def _put(tree: PyTree, index: jax.Array, value: PyTree) -> PyTree:
    """``tree`` with ``value`` at ``index`` of the leading axis, written in place. (A slice of one
    row, not ``dynamic_update_index_in_dim``: where the axis has one row, XLA turns that into a new
    array, which a branch of a ``lax.switch`` then copies into its output.)"""
    write = lambda x, row: jax.lax.dynamic_update_slice_in_dim(x, row.astype(x.dtype)[None], index, 0)
    return jax.tree.map(write, tree, value)


def _add_at(tree: PyTree, at: tuple, value: PyTree) -> PyTree:
    """``tree`` with ``value`` added at the leading indices ``at``, in place (:func:`_put`; the
    one-row slice is added to, not a row taken out and put back, which XLA copies again)."""

    def add(x, v):
        start, row = at_leading(at, v.astype(x.dtype))
        return jax.lax.dynamic_update_slice(x, jax.lax.dynamic_slice(x, start, row.shape) + row, start)

    return jax.tree.map(add, tree, value)


class StagePass:
    """The branches of pipeline passes over ``m`` micro-batches each (closes over parameters and
    the passes' batch: micro-batch ``i`` of pass ``k`` is ``k m + i``)."""

    def __init__(
        self, model: LayeredModel, schedule: Schedule, params, batch, seed, passes: int = 1, *,
        table: np.ndarray, pair_ends: bool = True, accum_dtype=jnp.float32,
    ):  # fmt: skip
        """``table``: the schedule's slot table (:attr:`~torsh_jax.pipeline.slots.SlotPlan.branch`);
        ``pair_ends``: let the embedding's and head's gradient sums share buffers
        (:class:`EndSums`), summed in ``accum_dtype``."""
        self.model, self.v = model, schedule.virtual_stages
        self.split = schedule.splits_backward
        self.embed_p, layers, self.head_p = split_params(model, params)
        # this stage's chunks [v, layers per chunk, ...]: stored so when interleaved (layer_chunks)
        self.chunks = layers if self.v > 1 else jax.tree.map(lambda x: x[None], layers)
        self.per_chunk = jax.tree.leaves(self.chunks)[0].shape[1]  # layers per chunk
        self.m = schedule.microbatches
        self.micro = split_micro_batches(batch, self.m * passes)
        self.seed = seed
        self.ends = EndSums.of(self.embed_p, self.head_p, table=table, pair=pair_ends, dtype=accum_dtype)
        self._made: dict = {}

    def batch_of(self, micro):
        return _take(self.micro, micro)

    def layer_of(self, micro) -> Callable:
        """``layer(one, hidden)`` for micro-batch ``micro`` (a layer that reads its batch gets it)."""
        return self.model.on(self.batch_of(micro)).layer

    def run_chunk(self, chunk_params, hidden, micro):
        return scan_layers(self.layer_of(micro), chunk_params, hidden, remat=self.model.remat)

    def _chunk_typed(self, g_chunks):
        """The chunks' gradient sums typed as varying over every axis the chunks do too (what a
        layer's gradient varies over), so adding into them in a scan keeps their type."""
        axes = jax.tree.map(lambda g, c: varying_axes(g) | varying_axes(c), g_chunks, self.chunks)
        return cast_vma(g_chunks, axes)

    def _chunk_into(self, g_chunks, hidden, chunk, micro):
        """``(chunk's output, g_chunks)``, differentiated with the chunks' gradient sums as the
        second's cotangent: the backward adds each layer's gradient into ``g_chunks[chunk]`` in
        place (:func:`~torsh_jax.runtime.tap.scan_into`), no chunk's whole gradient beside them."""
        layer, params = self.layer_of(micro), _take(self.chunks, chunk)
        return scan_into(layer, params, hidden, g_chunks, remat=self.model.remat, at=(chunk,))

    def branch(self, kind: str, variants: frozenset[str]) -> Callable:
        """``(carry, ints) -> (carry, sent forward, sent backward)`` of the stages running ``kind``
        (:data:`~torsh_jax.pipeline.slots.KINDS`) as one of ``variants`` at a tick: one copy of the
        chunk's code, in the kind's name scope (:func:`~torsh_jax.pipeline.slots.slot_scope`);
        the embedding and the head, in their branch's scope, under a ``lax.cond`` on the stages
        whose branch runs them when others run the kind too. Made once per kind and variants."""
        key = (kind, variants)
        if key not in self._made:
            run = {"F": self.forward, "W": self.W}.get(kind, self.backward)
            self._made[key] = partial(_in_scope, kind, partial(run, _Ends(kind[0], variants)))
        return self._made[key]

    def idle(self, carry: Carry, ints):
        return carry, self.zeros, self.zeros

    def forward(self, ends: _Ends, carry: Carry, ints):
        """``F``: the chunk on its input (the embedding on the first stage, else the stashed
        activation), then the head's loss on the last stage."""
        micro = ints["micro"]
        hidden = self.run_chunk(_take(self.chunks, ints["chunk"]), self._input(ends, carry, ints), micro)
        last = ends.last(ints)
        if last is not False:
            loss = lambda h: self.model.head(self.head_p, h, self.batch_of(micro)).astype(jnp.float32)
            loss = _where(last, ends.name("last"), loss, lambda h: jnp.float32(0.0), hidden)
            carry = carry._replace(loss_sum=carry.loss_sum + loss)
        return _counted(carry, 0), hidden.astype(self.dtype), self.zeros

    def backward(self, ends: _Ends, carry: Carry, ints):
        """``B``: one ``vjp`` of the chunk recomputed from its input, at the gradient received (or,
        on the last stage, the head's gradient of the loss); on the first stage the embedding's
        gradient from the input's. Under a schedule with ``W`` slots the ``vjp`` is with respect
        to the input only, and every layer's input and output gradient go to the ``W`` stash."""
        micro, chunk = ints["micro"], ints["chunk"]
        hidden = self._input(ends, carry, ints)
        if self.split:
            probes = jnp.broadcast_to(self.zeros, (self.per_chunk, *self.zeros.shape))
            chunk_fn = lambda h, z: self._probed_chunk(_take(self.chunks, chunk), h, z, micro)
            out, pull, inputs = jax.vjp(chunk_fn, hidden, probes, has_aux=True)
        else:
            sums = self._chunk_typed(carry.grads[1])
            chunk_fn = lambda sink, h: self._chunk_into(sink, h, chunk, micro)
            (out, _), pull = jax.vjp(chunk_fn, sums, hidden)
        carry, cotangent = self._output_gradient(ends, carry, ints, out)
        if self.split:
            g_in, g_outs = pull(cotangent)
            saved = jnp.stack([inputs, g_outs.astype(inputs.dtype)])
            carry = carry._replace(wstash=_put(carry.wstash, ints["weight_stash"], saved))
        else:
            g_chunks, g_in = pull((cotangent, sums))
            carry = _with_chunk_gradients(carry, g_chunks)
        carry = self._embed_gradient(ends, carry, ints, g_in)
        return _counted(carry, 1), self.zeros, g_in.astype(self.dtype)

    def _input(self, ends: _Ends, carry: Carry, ints) -> jax.Array:
        """The chunk's input: the embedding of the micro-batch on the first stage, else the
        activation stashed in slot ``activation_in``."""
        embed = lambda row: self.model.embed(self.embed_p, self.batch_of(ints["micro"])).astype(self.dtype)
        return _where(
            ends.first(ints), ends.name("first"), embed, lambda row: row, carry.acts[ints["activation_in"]]
        )

    def _output_gradient(self, ends: _Ends, carry: Carry, ints, out) -> tuple[Carry, jax.Array]:
        """``(carry, gradient of the chunk's output)``: on the last stage the head's ``vjp`` at the
        seed (its parameters' gradient added to the carry's), else the gradient received."""
        last = ends.last(ints)
        received = carry.cots[ints["gradient_in"]]
        if last is False:
            return carry, cotangent_like(received, out)
        batch = self.batch_of(ints["micro"])
        sums, g_chunks = carry.grads

        def through_head(sums, received):
            loss, pull = jax.vjp(lambda p, h: self.model.head(p, h, batch), self.head_p, out)
            g_params, g_out = pull(cotangent_like(self.seed, loss))
            return self.ends.add(sums, "head", g_params), g_out.astype(out.dtype)

        passed = lambda sums, received: (sums, cotangent_like(received, out))
        sums, g_out = _where(last, ends.name("last"), through_head, passed, sums, received)
        return carry._replace(grads=(sums, g_chunks)), cotangent_like(g_out, out)

    def _embed_gradient(self, ends: _Ends, carry: Carry, ints, g_in) -> Carry:
        """``carry`` with, on the first stage, the embedding's gradient at the input's ``g_in``. Its
        ``vjp`` runs the embedding again (the chunk's input ran it outside the ``lax.cond``)."""
        first = ends.first(ints)
        if first is False:
            return carry
        batch = self.batch_of(ints["micro"])
        sums, g_chunks = carry.grads

        def through_embed(sums, g_in):
            hidden, pull = jax.vjp(lambda p: self.model.embed(p, batch), self.embed_p)
            return self.ends.add(sums, "embed", pull(cotangent_like(g_in, hidden))[0])

        sums = _where(first, ends.name("first"), through_embed, lambda sums, g_in: sums, sums, g_in)
        return carry._replace(grads=(sums, g_chunks))

    def W(self, ends: _Ends, carry: Carry, ints):
        """The weight gradients of a chunk whose ``B`` ran: one ``vjp`` per layer with respect to its
        parameters, at the input and output gradient ``B`` left in the ``W`` stash."""
        chunk, layer_fn = ints["chunk"], self.layer_of(ints["micro"])
        inputs, g_outs = carry.wstash[ints["weight_stash"]]

        def one(g_chunks, layer):
            params, hidden, g_out, index = layer
            out, vjp = jax.vjp(lambda w: layer_fn(w, hidden), params)
            return _add_at(g_chunks, (chunk, index), vjp(cotangent_like(g_out, out))[0]), None

        layers = (_take(self.chunks, chunk), inputs, g_outs, jnp.arange(self.per_chunk, dtype=jnp.int32))
        g_chunks, _ = jax.lax.scan(one, self._chunk_typed(carry.grads[1]), layers)
        return _counted(_with_chunk_gradients(carry, g_chunks), 2), self.zeros, self.zeros

    def _probed_chunk(self, chunk_params, hidden, probes, micro):
        """The chunk's output with ``probes[i]`` added to layer ``i``'s output, and every layer's
        input ``[layers per chunk, *hidden]``. Probes are zeros: their gradients are the layers'
        output gradients."""
        layer = self.layer_of(micro)
        body = jax.checkpoint(layer) if self.model.remat else layer

        def one(h, layer):
            params, probe = layer
            return body(params, h) + probe, h

        return jax.lax.scan(one, hidden, (chunk_params, probes))


class _Ends(NamedTuple):
    """What a copy of a kind's code at a tick runs as: ``direction`` (``F`` or ``B``) and
    ``variants``, the branches of the stages running it there. Whether this stage is the first
    (last) is known when every variant is (none is) the first (last) one."""

    direction: str
    variants: frozenset

    def name(self, end: str) -> str:
        return f"{self.direction}_{end}"

    def first(self, ints) -> bool | jax.Array:
        return self._is(self.name("first"), ints)

    def last(self, ints) -> bool | jax.Array:
        return self._is(self.name("last"), ints)

    def _is(self, branch: str, ints) -> bool | jax.Array:
        if branch not in self.variants:
            return False
        if self.variants == {branch}:
            return True
        return ints["branch"] == BRANCHES.index(branch)


def _where(runs: bool | jax.Array, branch: str, on: Callable, off: Callable, *operands):
    """``on(*operands)`` in ``branch``'s scope where ``runs``, else ``off(*operands)``: a
    ``lax.cond`` when ``runs`` differs between stages, whose first way is ``off`` (XLA copies
    what a later way passes on unchanged)."""
    scoped = lambda *args: _in_scope(branch, on, *args)
    if runs is True:
        return scoped(*operands)
    if runs is False:
        return off(*operands)
    return typed_cond(runs, scoped, off, *operands)


def _in_scope(name: str, branch: Callable, *args):
    with jax.named_scope(slot_scope(name)):
        return branch(*args)


def _counted(carry: Carry, which: int) -> Carry:
    return carry._replace(counts=carry.counts.at[which].add(1))


def _with_chunk_gradients(carry: Carry, g_chunks: PyTree) -> Carry:
    """``carry`` with the chunks' gradient sums ``g_chunks`` (the embedding's and head's as they were)."""
    return carry._replace(grads=(carry.grads[0], g_chunks))
