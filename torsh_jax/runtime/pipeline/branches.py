"""The branches of one pipeline pass: forward, backward (or input-gradient ``B`` and weight-gradient
``W``) and idle slots of one stage, and the carry the ticks thread through them.

A backward recomputes its chunk's forward from the stashed input (``jax.vjp``). Under a schedule
with ``W`` slots, ``B`` runs one ``vjp`` with respect to the chunk's input only (zeros added to every
layer's output make their gradients the layers' output gradients) and leaves each layer's input
and output gradient in a ``W`` stash slot; ``W`` makes the weight gradients from that slot, one
layer at a time. :mod:`torsh_jax.runtime.pipeline.executor` runs the branches.

Example:
    >>> Carry._fields
    ('acts', 'cots', 'wstash', 'grads', 'loss_sum', 'counts')
    >>> sorted(BRANCHES) == sorted(name for name in dir(StagePass) if name in BRANCHES)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from torsh_jax.pipeline.schedule import Schedule
from torsh_jax.pipeline.slots import BRANCHES, slot_scope
from torsh_jax.runtime.accumulate import split_micro_batches
from torsh_jax.runtime.layered import LayeredModel, scan_layers, split_params
from torsh_jax.runtime.pipeline.varying import cotangent_like
from torsh_jax.typing import PyTree

__all__ = ["Carry", "StagePass"]


class Carry(NamedTuple):
    """What the ticks thread through: the stashes, gradients, loss and slot counts of one stage."""

    acts: jax.Array  # [activation slots, *hidden]: inputs received, until their backward
    cots: jax.Array  # [gradient slots, *hidden]: gradients received, until their backward
    wstash: jax.Array  # [weight slots, 2, layers per chunk, *hidden]: (inputs, output grads) for W
    grads: tuple  # (embed, chunks, head) accumulated in accum_dtype
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


def _add_at(tree: PyTree, index: jax.Array, value: PyTree) -> PyTree:
    """``tree`` with ``value`` added at ``index`` of the leading axis, in place (:func:`_put`; the
    one-row slice is added to, not a row taken out and put back, which XLA copies again)."""
    row = lambda x, v: jax.lax.dynamic_slice_in_dim(x, index, 1) + v.astype(x.dtype)[None]
    return jax.tree.map(lambda x, v: jax.lax.dynamic_update_slice_in_dim(x, row(x, v), index, 0), tree, value)


def _add(tree: PyTree, value: PyTree) -> PyTree:
    return jax.tree.map(lambda x, v: x + v.astype(x.dtype), tree, value)


class StagePass:
    """The branches of one pipeline pass over ``m`` micro-batches (closes over parameters and batch)."""

    def __init__(self, model: LayeredModel, schedule: Schedule, params, batch, seed):
        self.model, self.v = model, schedule.virtual_stages
        self.split = schedule.splits_backward
        self.embed_p, layers, self.head_p = split_params(model, params)
        # this stage's chunks [v, layers per chunk, ...]: stored so when interleaved (layer_chunks)
        self.chunks = layers if self.v > 1 else jax.tree.map(lambda x: x[None], layers)
        self.per_chunk = jax.tree.leaves(self.chunks)[0].shape[1]  # layers per chunk
        self.micro = split_micro_batches(batch, schedule.microbatches)
        self.seed = seed

    def batch_of(self, micro):
        return _take(self.micro, micro)

    def layer_of(self, micro) -> Callable:
        """``layer(one, hidden)`` for micro-batch ``micro`` (a layer that reads its batch gets it)."""
        return self.model.on(self.batch_of(micro)).layer

    def run_chunk(self, chunk_params, hidden, micro):
        return scan_layers(self.layer_of(micro), chunk_params, hidden, remat=self.model.remat)

    def branches(self) -> dict[str, Callable]:
        """``name -> (carry, ints) -> (carry, sent forward, sent backward)``, each run in its slot's
        name scope (:func:`~torsh_jax.pipeline.slots.slot_scope`)."""
        return {name: partial(_in_scope, name, getattr(self, name)) for name in BRANCHES}

    def idle(self, carry: Carry, ints):
        return carry, self.zeros, self.zeros

    def F_first(self, carry: Carry, ints):
        batch = self.batch_of(ints["micro"])
        hidden = self.run_chunk(
            _take(self.chunks, ints["chunk"]), self.model.embed(self.embed_p, batch), ints["micro"]
        )
        return _counted(carry, 0), hidden.astype(self.dtype), self.zeros

    def F_mid(self, carry: Carry, ints):
        hidden = self.run_chunk(
            _take(self.chunks, ints["chunk"]), carry.acts[ints["activation_in"]], ints["micro"]
        )
        return _counted(carry, 0), hidden.astype(self.dtype), self.zeros

    def F_last(self, carry: Carry, ints):
        batch = self.batch_of(ints["micro"])
        hidden = self.run_chunk(
            _take(self.chunks, ints["chunk"]), carry.acts[ints["activation_in"]], ints["micro"]
        )
        loss = self.model.head(self.head_p, hidden, batch).astype(jnp.float32)
        return _counted(carry._replace(loss_sum=carry.loss_sum + loss), 0), self.zeros, self.zeros

    def B_first(self, carry: Carry, ints):
        batch, chunk = self.batch_of(ints["micro"]), ints["chunk"]
        if self.split:
            chunk_params = _take(self.chunks, chunk)
            forward = lambda e, z: self._probed_chunk(
                chunk_params, self.model.embed(e, batch), z, ints["micro"]
            )
            cotangent = carry.cots[ints["gradient_in"]]
            carry, (g_embed,) = self._split_backward(carry, ints, forward, (self.embed_p,), cotangent)
            return _counted(_added(carry, embed=g_embed), 1), self.zeros, self.zeros
        forward = lambda e, c: self.run_chunk(c, self.model.embed(e, batch), ints["micro"])
        out, vjp = jax.vjp(forward, self.embed_p, _take(self.chunks, chunk))
        g_embed, g_chunk = vjp(cotangent_like(carry.cots[ints["gradient_in"]], out))
        return _counted(_added(carry, embed=g_embed, chunk=(chunk, g_chunk)), 1), self.zeros, self.zeros

    def B_mid(self, carry: Carry, ints):
        chunk, hidden = ints["chunk"], carry.acts[ints["activation_in"]]
        if self.split:
            forward = lambda h, z: self._probed_chunk(_take(self.chunks, chunk), h, z, ints["micro"])
            cotangent = carry.cots[ints["gradient_in"]]
            carry, (g_in,) = self._split_backward(carry, ints, forward, (hidden,), cotangent)
            return _counted(carry, 1), self.zeros, g_in.astype(self.dtype)
        out, vjp = jax.vjp(
            lambda c, h: self.run_chunk(c, h, ints["micro"]), _take(self.chunks, chunk), hidden
        )
        g_chunk, g_in = vjp(cotangent_like(carry.cots[ints["gradient_in"]], out))
        return _counted(_added(carry, chunk=(chunk, g_chunk)), 1), self.zeros, g_in.astype(self.dtype)

    def B_last(self, carry: Carry, ints):
        batch, chunk, hidden = self.batch_of(ints["micro"]), ints["chunk"], carry.acts[ints["activation_in"]]
        if self.split:

            def forward(head_p, h, z):
                out, inputs = self._probed_chunk(_take(self.chunks, chunk), h, z, ints["micro"])
                return self.model.head(head_p, out, batch), inputs

            primals = (self.head_p, hidden)
            carry, (g_head, g_in) = self._split_backward(carry, ints, forward, primals, self.seed)
            return _counted(_added(carry, head=g_head), 1), self.zeros, g_in.astype(self.dtype)
        forward = lambda c, h, x: self.model.head(h, self.run_chunk(c, x, ints["micro"]), batch)
        loss, vjp = jax.vjp(forward, _take(self.chunks, chunk), self.head_p, hidden)
        g_chunk, g_head, g_in = vjp(cotangent_like(self.seed, loss))
        carry = _added(carry, chunk=(chunk, g_chunk), head=g_head)
        return _counted(carry, 1), self.zeros, g_in.astype(self.dtype)

    def W(self, carry: Carry, ints):
        """The weight gradients of a chunk whose ``B`` ran: one ``vjp`` per layer with respect to its
        parameters, at the input and output gradient ``B`` left in the ``W`` stash."""
        chunk, layer_fn = ints["chunk"], self.layer_of(ints["micro"])
        inputs, g_outs = carry.wstash[ints["weight_stash"]]

        def one(_, layer):
            params, hidden, g_out = layer
            out, vjp = jax.vjp(lambda w: layer_fn(w, hidden), params)
            return None, vjp(cotangent_like(g_out, out))[0]

        _, g_chunk = jax.lax.scan(one, None, (_take(self.chunks, chunk), inputs, g_outs))
        return _counted(_added(carry, chunk=(chunk, g_chunk)), 2), self.zeros, self.zeros

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

    def _split_backward(self, carry: Carry, ints, forward, primals: tuple, seed):
        """``B`` of a split backward: ``forward(*primals, probes) -> (output, layer inputs)`` runs the
        chunk (:meth:`_probed_chunk`); one ``vjp`` at ``seed`` gives the gradients of ``primals``
        (no weight gradients) and every layer's output gradient, which goes to the ``W`` stash with
        the layer inputs. Returns the carry and the gradients of ``primals``."""
        probes = jnp.broadcast_to(self.zeros, (self.per_chunk, *self.zeros.shape))
        out, vjp, inputs = jax.vjp(forward, *primals, probes, has_aux=True)
        *grads, g_outs = vjp(cotangent_like(seed, out))
        saved = jnp.stack([inputs, g_outs.astype(inputs.dtype)])
        return carry._replace(wstash=_put(carry.wstash, ints["weight_stash"], saved)), tuple(grads)


def _in_scope(name: str, branch: Callable, carry: Carry, ints):
    with jax.named_scope(slot_scope(name)):
        return branch(carry, ints)


def _counted(carry: Carry, which: int) -> Carry:
    return carry._replace(counts=carry.counts.at[which].add(1))


def _added(carry: Carry, *, embed=None, chunk=None, head=None) -> Carry:
    """``carry`` with gradients added: of the embedding, of chunk ``(index, grads)``, of the head."""
    g_embed, g_chunks, g_head = carry.grads
    g_embed = g_embed if embed is None else _add(g_embed, embed)
    g_chunks = g_chunks if chunk is None else _add_at(g_chunks, chunk[0], chunk[1])
    g_head = g_head if head is None else _add(g_head, head)
    return carry._replace(grads=(g_embed, g_chunks, g_head))
