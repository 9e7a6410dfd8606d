"""A flax linen model, as its authors wrote it, as a :class:`~torsh_jax.runtime.layered.LayeredModel`.

The model is called as it is; its calls into its top-level children (or the children of the
modules holding the blocks, :mod:`torsh_jax.models.nesting`) are watched
(``flax.linen.intercept_methods``) on an example batch, without computing (``jax.eval_shape``):

* **embed**: the model's ``__call__`` up to its first block, whose input it returns;
* **layer**: the blocks of one period, each applied on its own (the block module, unbound), given
  what the model gives them besides the hidden state. When that holds arrays (positions, a mask),
  each layer computes them from its batch, running the model up to the first block with the
  embedding's parameters zero (they must not depend on parameters: the loss check below catches
  that). A block returning more than its hidden state (``x, cache``) passes on the part the next
  block reads (:mod:`torsh_jax.models.block_calls`);
* **head**: the model's ``__call__`` with the first block returning the layers' output and the
  others passing it on (what else a block returns is zeros), then ``loss(output, batch)``.

Each part gets the parameters of the children it calls: a child called before and after the blocks
(a tied embedding's ``attend``) is read by both, its gradient the sum of both uses. The converted
model is checked against the model itself on the example batch (the same loss) when the parameters
are arrays.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.Dense(x.shape[-1])(x)
    >>> class LM(nn.Module):
    ...     def setup(self):
    ...         self.embed = nn.Embed(16, 8)
    ...         self.blocks = [Block() for _ in range(2)]
    ...     def __call__(self, tokens):
    ...         x = self.embed(tokens)
    ...         for block in self.blocks:
    ...             x = block(x)
    ...         return self.embed.attend(x)
    >>> batch = {"inputs": jnp.zeros((2, 4), jnp.int32), "targets": jnp.zeros((2, 4), jnp.int32)}
    >>> params = LM().init(jax.random.key(0), batch["inputs"])["params"]
    >>> xent = lambda logits, b: -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    >>> layered = from_linen(LM(), params, batch, loss=xent)
    >>> layered.model.embed_keys, layered.model.head_keys, layered.params["blocks"]["Dense_0"]["kernel"].shape
    (('embed',), ('embed',), (2, 8, 8))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from torsh_jax.errors import ModelStructureError
from torsh_jax.models.block_calls import block_extras, hidden_path, is_array, select, with_hidden
from torsh_jax.models.blocks import FlaxLayers, block_names, check_same_loss, period, zeros_like
from torsh_jax.models.nesting import lift, lifted_chain, nest
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.typing import PyTree

__all__ = ["from_linen"]

Batch = PyTree


def _model_inputs(batch: Batch) -> tuple:
    return (batch["inputs"],)


@dataclass
class _Calls:
    """What the model calls at its top level, in order; each block's module, arguments (the hidden
    state first) and output."""

    order: list[str] = field(default_factory=list)
    blocks: dict[str, tuple[Any, tuple, dict]] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)


def _key_of(context, keys: frozenset[str]) -> str | None:
    """The top-level key (lifted: ``model/embed_tokens``) of the called module, if it has one."""
    name = "/".join(getattr(context.module, "path", ()))
    return name if name in keys and context.method_name != "setup" else None


def _watch(module, params, example: Batch, inputs: Callable, names: tuple[str, ...], keys) -> _Calls:
    import flax.linen as nn

    calls, inside = _Calls(), []

    def record(next_fun, args, kwargs, context):
        name = _key_of(context, keys)
        if name is None or inside:  # a child's calls of its own methods are part of its call
            return next_fun(*args, **kwargs)
        calls.order.append(name)
        if name in names:
            calls.blocks.setdefault(name, (context.module.clone(parent=None), args, kwargs))
        inside.append(name)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            inside.pop()
        if name in names:
            calls.outputs.setdefault(name, out)
        return out

    with nn.intercept_methods(record):
        jax.eval_shape(lambda p, b: module.apply({"params": p}, *inputs(b)), params, example)
    return calls


def _check_order(calls: _Calls, names: tuple[str, ...]) -> tuple[int, int]:
    """(first, last) index of the block calls in ``calls.order``; each block once, in order, and
    nothing else between them."""
    at = [i for i, name in enumerate(calls.order) if name in names]
    called = [calls.order[i] for i in at]
    if called != list(names):
        wrong = next((a for a, b in zip(called, names) if a != b), None) or _first_extra(called, names)
        raise ModelStructureError(
            f"the blocks are called as {', '.join(called)}: each block once, in order, is what "
            "stacks into layers",
            key=wrong,
            fix="call every block once, in its order, in the model's __call__",
        )
    between = [calls.order[i] for i in range(at[0], at[-1]) if calls.order[i] not in names]
    if between:
        raise ModelStructureError(
            f"{between[0]} is called between the blocks: the layers would not repeat",
            key=between[0],
            fix=f"move {between[0]} into the blocks or before or after them",
        )
    return at[0], at[-1]


def _first_extra(called: list[str], names: tuple[str, ...]) -> str:
    """The first block missing from ``called``, else the one called more than once."""
    return names[len(called)] if len(called) < len(names) else called[-1]


#: The collection the first block's arguments are sown into (:func:`_layered`).
_CAPTURE = "torsh_jax_block_arguments"


def _shapes(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


@dataclass(frozen=True)
class _BlockCalls:
    """How the blocks are called: the output leaf the next block reads, each block's output
    shapes, and what else each is given (``reads_arrays``: positions or masks, from the batch)."""

    path: tuple
    outputs: dict
    args: tuple
    kwargs: dict
    reads_arrays: bool


def _block_calls(calls: _Calls, names: tuple[str, ...]) -> _BlockCalls:
    inputs = [calls.blocks[n][1][0] for n in names]
    outputs = [calls.outputs[n] for n in names]
    path = hidden_path(outputs, inputs, names)
    args, kwargs, reads = block_extras([(calls.blocks[n][1][1:], calls.blocks[n][2]) for n in names], names)
    return _BlockCalls(path, {n: _shapes(o) for n, o in zip(names, outputs)}, args, kwargs, reads)


def _parts(params: PyTree, calls: _Calls, first: int, last: int, names: tuple[str, ...]):
    """(embed keys, head keys): the children called before the first block, after the last; keys
    of the model's own parameters (not a child's) in both."""
    before, after = set(calls.order[:first]), set(calls.order[last + 1 :])
    called = set(calls.order)
    own = [k for k in params if k not in names and k not in called]
    embed = tuple(k for k in params if k in before or k in own)
    head = tuple(k for k in params if k in after or k in own)
    return embed, head


def _layered(module, params, calls, names, p, inputs, loss, keys, remat, chain) -> LayeredModel:
    import flax.linen as nn

    embed_keys, head_keys = keys
    blocks = frozenset(names)
    others = {k: _shapes(params[k]) for k in params if k not in names}
    how = _block_calls(calls, names)
    modules = [calls.blocks[n][0] for n in names[:p]]

    def first_block_call(e, batch) -> tuple[tuple, dict]:
        """The first block's arguments (its hidden state first), from the model run with every
        block passing its input on. They are sown into a collection of the block's own: a block
        under a lifted transform (``nn.remat``) is seen inside it, and only what it sows leaves it."""

        def capture(next_fun, a, k, context):
            if (name := _key_of(context, blocks)) is None:
                return next_fun(*a, **k)
            if name == names[0]:
                context.module.sow(_CAPTURE, "arguments", [x for x in jax.tree.leaves((a, k)) if is_array(x)])
            return with_hidden(how.outputs[name], how.path, a[0])

        with nn.intercept_methods(capture):
            _, captured = module.apply({"params": with_zeros(e)}, *inputs(batch), mutable=[_CAPTURE])
        if not captured:
            raise ModelStructureError(
                "the model returned without calling a block on this batch",
                key=names[0],
                fix="call the blocks on every batch (no branch that skips them)",
            )
        arrays = iter(jax.tree.leaves(captured))
        watched = (calls.blocks[names[0]][1], calls.blocks[names[0]][2])
        return jax.tree.map(lambda x: next(arrays) if is_array(x) else x, watched)

    def with_zeros(part: dict) -> dict:
        """``part``'s parameters, zeros for the others the model's ``__call__`` touches besides the
        blocks (made where the part is traced: no array of them is kept), in the model's nesting."""
        zeros = {k: zeros_like(shape) for k, shape in others.items() if k not in part}
        return nest({**zeros, **part}, chain)

    def embed(e, batch):
        return first_block_call(e, batch)[0][0]

    def layer(one, h, batch=None):
        if how.reads_arrays:  # computed from the batch alone: the embedding's parameters are zeros
            a, kwargs = first_block_call({}, batch)
            args = a[1:]
        else:
            args, kwargs = how.args, how.kwargs
        for k, block in enumerate(modules):
            out = block.apply({"params": one if p == 1 else one[str(k)]}, h, *args, **kwargs)
            h = select(out, how.path)
        return h

    def head(hp, h, batch):
        seen = []

        def inject(next_fun, a, k, context):
            if (name := _key_of(context, blocks)) is not None:
                seen.append(name)
                return with_hidden(how.outputs[name], how.path, h if len(seen) == 1 else a[0])
            return next_fun(*a, **k)

        with nn.intercept_methods(inject):
            output = module.apply({"params": with_zeros(hp)}, *inputs(batch))
        return loss(output, batch)

    return LayeredModel(
        embed, layer, head, embed_keys=embed_keys, head_keys=head_keys, remat=remat,
        layer_reads_batch=how.reads_arrays,
    )  # fmt: skip


def _layers_key(params: PyTree, prefix: str) -> str:
    return prefix if prefix not in params else f"{prefix}_stacked"


def from_linen(
    module,
    params: PyTree,
    example: Batch,
    /,
    *,
    loss: Callable[[Any, Batch], jax.Array],
    blocks: str = "blocks",
    inputs: Callable[[Batch], tuple] = _model_inputs,
    remat: bool = False,
) -> FlaxLayers:
    """``module`` (a linen model with a list of blocks) as a :class:`FlaxLayers`.

    Args:
        module: the model, unchanged.
        params: its parameters (``module.init(...)["params"]``; flax boxes are unboxed).
        example: a batch (arrays or shapes), to see how the model calls its blocks.
        loss: ``loss(model output, batch) -> scalar``.
        blocks: the blocks' name: children ``blocks_0 ... blocks_{n-1}`` (``self.blocks = [...]``
            in ``setup``, or ``Block(name=f"blocks_{i}")``); or their path below the top level,
            ``transformer/h`` for ``transformer/h_0 ...`` or ``transformer/h/0 ...`` (a collection
            module with numbered children, as Hugging Face's Flax models keep them).
        inputs: ``inputs(batch) -> the model's positional arguments`` (default ``(batch["inputs"],)``).
        remat: recompute each layer in the backward pass.

    Raises:
        ModelStructureError: the model does not split into embedding, blocks and head (names the
            child that breaks the pattern).
        NotSupportedYetError: the blocks are given different arguments besides their hidden state.
    """
    from flax.linen import meta

    params = meta.unbox(params)
    chain = lifted_chain(params, blocks)
    lifted = lift(params, chain)
    names = block_names(lifted, blocks)
    p = period(lifted, names)
    calls = _watch(module, params, example, inputs, names, frozenset(lifted))
    first, last = _check_order(calls, names)
    keys = _parts(lifted, calls, first, last, names)
    model = _layered(module, lifted, calls, names, p, inputs, loss, keys, remat, chain)
    key = _layers_key(lifted, blocks)
    model = model._replace(layers_key=key)
    layered = FlaxLayers(model, None, names, p, key, lifted=chain)
    layered = dataclasses.replace(layered, params=layered.to_layered(params))
    own = lambda p, b: loss(module.apply({"params": p}, *inputs(b)), b)
    check_same_loss(layered, own, params, example, key=names[0])
    return layered
