"""ZeRO-3's layer scan with the next layer's gather and the previous layer's reduction in flight.

A scan that gathers each layer's parameters where it uses them cannot overlap that gather with
anything: the layer's first op needs it. Neither can the gradient's reduce-scatter at the end of a
backward iteration: nothing follows it. This scan moves both by one layer (PyTorch FSDP's forward
and backward prefetch):

* forward, iteration ``i``: start gathering layer ``i + 1`` and run layer ``i`` with the weights
  gathered in the previous iteration;
* backward, iteration ``i``: start gathering layer ``i - 1``, reduce-scatter layer ``i + 1``'s
  gradient, and recompute and differentiate layer ``i`` (the layer's activations are not kept:
  only its input is, as under ``jax.checkpoint`` with ``nothing_saveable``).

The first and last iterations are peeled so that no gather or reduction is done twice or for
nothing: the bytes are those of the plain scan, and one more layer's gathered weights are alive
at a time. The compiler can then run each collective while the neighbouring layer computes
(compiled for TPU, ``collective_overlap`` sees compute between every in-loop start and done).

Example:
    >>> import jax, jax.numpy as jnp
    >>> layer = lambda w, h: jnp.tanh(h @ w)
    >>> run = prefetched_scan(layer, gather=lambda s: s, reduce=lambda g: g)
    >>> ws, h = jnp.ones((3, 4, 4)) / 8, jnp.ones((2, 4))
    >>> plain = lambda ws, h: jax.lax.scan(lambda h, w: (layer(w, h), None), h, ws)[0]
    >>> bool(jnp.allclose(run(ws, h), plain(ws, h)))
    True
    >>> g, g_plain = (jax.grad(lambda w: f(w, h).sum())(ws) for f in (run, plain))
    >>> bool(jnp.allclose(g, g_plain))
    True
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from torsh_jax.tensor.axis import varying_axes
from torsh_jax.typing import PyTree

__all__ = ["prefetched_scan"]


def _take(tree: PyTree, index) -> PyTree:
    """One layer's slice of a stacked tree (``index`` may be traced: no copy of the stack)."""
    return jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), tree)


def _put(stacked: PyTree, index, layer: PyTree) -> PyTree:
    """``stacked`` with one layer's slice replaced (in place inside a loop)."""
    return jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x, index, 0), stacked, layer)


def _anchored(tree: PyTree, zeros: PyTree) -> PyTree:
    """``tree``'s values made to depend on the cotangent (``+ zeros``, see :func:`_zeros_like_from`).

    The backward pass gathers shards read through this, so that no compiler merges its gathers
    with the forward's gathers of the same shards or starts them before the backward pass: either
    would keep whole layers alive between the passes. (An optimization barrier does this on TPU
    and GPU, but the CPU compiler drops barriers before it merges equal ops.)
    """
    return jax.tree.map(lambda x, zero: x if zero is None else x + zero, tree, zeros)


def _zeros_like_from(anchor: PyTree, tree: PyTree) -> PyTree:
    """Per floating leaf of ``tree``: a scalar zero computed from ``anchor`` (``0 x`` one of its
    elements: zero unless the cotangent is not finite, and then every gradient is anyway), varying
    over no more mesh axes than the leaf (summed over the others: a scalar all-reduce), so adding
    it changes neither a shard's value nor its type. ``None`` for other leaves."""
    first = jnp.ravel(jax.tree.leaves(anchor)[0])[0] * 0
    made: dict[tuple[str, ...], jax.Array] = {}

    def one(x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return None
        extra = tuple(sorted(set(varying_axes(first)) - set(varying_axes(x))))
        if extra not in made:
            made[extra] = jax.lax.psum(first, extra) if extra else first
        return made[extra].astype(x.dtype)

    return jax.tree.map(one, tree)


def _layers(tree: PyTree) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


def prefetched_scan(layer: Callable, *, gather: Callable, reduce: Callable) -> Callable:
    """``run(shards, hidden)``: ``layer`` applied for each layer of the stacked ``shards``.

    Args:
        layer: ``layer(params, hidden) -> hidden`` for one layer's gathered parameters.
        gather: one layer's parameter shards -> its whole parameters (a collective).
        reduce: one layer's whole-parameter gradient -> the gradient of its shards (a collective).

    ``run`` differentiates as the plain scan of ``layer`` over ``gather`` ed layers, with
    ``reduce`` as the gather's transpose; its backward recomputes each layer from its input.
    The loops index the stacked shards, inputs and gradients in place (no copies of a stack).
    """

    def forward(shards: PyTree, hidden: PyTree) -> tuple[PyTree, PyTree]:
        """The output; the inputs of every layer but the last (stacked) and the last's input."""
        count = _layers(shards)
        weights = gather(_take(shards, 0))
        if count == 1:
            return layer(weights, hidden), (None, hidden)

        def body(carry, i):
            h, w = carry
            upcoming = gather(_take(shards, i + 1))
            return (layer(w, h), upcoming), h

        (hidden, weights), inputs = jax.lax.scan(body, (hidden, weights), jnp.arange(count - 1))
        return layer(weights, hidden), (inputs, hidden)

    @jax.custom_vjp
    def run(shards: PyTree, hidden: PyTree) -> PyTree:
        return forward(shards, hidden)[0]

    def run_forward(shards, hidden):
        out, inputs = forward(shards, hidden)
        return out, (shards, inputs)

    def differentiate(weights, h, d_out):
        _, pullback = jax.vjp(layer, weights, h)
        return pullback(d_out)

    def run_backward(residuals, d_out):
        shards, (inputs, last_input) = residuals
        count, zeros = _layers(shards), _zeros_like_from(d_out, _take(shards, 0))
        fetch = lambda i: gather(_anchored(_take(shards, i), zeros))
        grads = jax.tree.map(jnp.zeros_like, shards)
        weights = fetch(count - 1)
        if count == 1:
            d_weights, d_hidden = differentiate(weights, last_input, d_out)
            return _put(grads, 0, reduce(d_weights)), d_hidden
        upcoming = fetch(count - 2)
        pending, d_hidden = differentiate(weights, last_input, d_out)

        def body(carry, i):
            d_h, w, pending, grads = carry
            previous = fetch(i - 1)
            grads = _put(grads, i + 1, reduce(pending))
            d_w, d_h = differentiate(w, _take(inputs, i), d_h)
            return (d_h, previous, d_w, grads), None

        carry = (d_hidden, upcoming, pending, grads)
        if count > 2:
            carry, _ = jax.lax.scan(body, carry, jnp.arange(1, count - 1), reverse=True)
        d_hidden, weights, pending, grads = carry
        grads = _put(grads, 1, reduce(pending))
        d_first, d_hidden = differentiate(weights, _take(inputs, 0), d_hidden)
        return _put(grads, 0, reduce(d_first)), d_hidden

    run.defvjp(run_forward, run_backward)
    return run
