"""A flax linen model, as its authors wrote it, as a :class:`~torsh_jax.runtime.layered.LayeredModel`.

The model is called as it is; its calls into its top-level children are watched
(``flax.linen.intercept_methods``) on an example batch, without computing (``jax.eval_shape``):

* **embed**: the model's ``__call__`` up to its first block, whose input it returns;
* **layer**: the blocks of one period, each applied on its own (the block module, unbound);
* **head**: the model's ``__call__`` with the first block returning the layers' output and the
  others passing it on, then ``loss(output, batch)``.

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

from torsh_jax.errors import ModelStructureError, NotSupportedYetError
from torsh_jax.models.blocks import FlaxLayers, HiddenState, block_names, check_same_loss, period, zeros_like
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.typing import PyTree

__all__ = ["from_linen"]

Batch = PyTree


def _model_inputs(batch: Batch) -> tuple:
    return (batch["inputs"],)


@dataclass
class _Calls:
    """What the model calls at its top level, in order, and each block's module and arguments."""

    order: list[str] = field(default_factory=list)
    blocks: dict[str, tuple[Any, tuple, dict]] = field(default_factory=dict)


def _top_level(context) -> str | None:
    path = getattr(context.module, "path", ())
    return path[0] if len(path) == 1 and context.method_name != "setup" else None


def _watch(module, params, example: Batch, inputs: Callable, names: tuple[str, ...]) -> _Calls:
    import flax.linen as nn

    calls, inside = _Calls(), []

    def record(next_fun, args, kwargs, context):
        name = _top_level(context)
        if name is None or inside:  # a child's calls of its own methods are part of its call
            return next_fun(*args, **kwargs)
        calls.order.append(name)
        if name in names:
            calls.blocks.setdefault(name, (context.module.clone(parent=None), args[1:], kwargs))
        inside.append(name)
        try:
            return next_fun(*args, **kwargs)
        finally:
            inside.pop()

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


def _block_arguments(calls: _Calls, names: tuple[str, ...]) -> tuple[tuple, dict]:
    """The arguments each block gets besides the hidden state: constants only, the same for all."""
    _, args, kwargs = calls.blocks[names[0]]
    for name in names:
        _, a, k = calls.blocks[name]
        arrays = [x for x in jax.tree.leaves((a, k)) if isinstance(x, (jax.Array, np.ndarray))]
        if arrays:
            raise NotSupportedYetError(
                "a block called with an array besides its hidden state (a mask, positions) cannot be "
                "stacked yet",
                key=name,
                fix="compute masks and positions inside the block, from the hidden state's shape",
            )
    return args, kwargs


def _parts(params: PyTree, calls: _Calls, first: int, last: int, names: tuple[str, ...]):
    """(embed keys, head keys): the children called before the first block, after the last; keys
    of the model's own parameters (not a child's) in both."""
    before, after = set(calls.order[:first]), set(calls.order[last + 1 :])
    called = set(calls.order)
    own = [k for k in params if k not in names and k not in called]
    embed = tuple(k for k in params if k in before or k in own)
    head = tuple(k for k in params if k in after or k in own)
    return embed, head


def _stand_ins(params: PyTree, keys: tuple[str, ...]) -> dict:
    """Zeros of the parameters a part does not read but the model's ``__call__`` touches."""
    return {k: zeros_like(params[k]) for k in keys}


def _layered(module, params, calls, names, p, inputs, loss, keys, remat) -> LayeredModel:
    import flax.linen as nn

    embed_keys, head_keys = keys
    others = tuple(k for k in params if k not in names)
    skipped_by_head = _stand_ins(params, tuple(k for k in others if k not in head_keys))
    args, kwargs = _block_arguments(calls, names)
    modules = [calls.blocks[n][0] for n in names[:p]]

    def embed(e, batch):
        def stop(next_fun, a, k, context):
            if _top_level(context) in names:
                raise HiddenState(a[0])
            return next_fun(*a, **k)

        try:
            with nn.intercept_methods(stop):
                module.apply({"params": e}, *inputs(batch))
        except HiddenState as hidden:
            return hidden.value
        raise ModelStructureError(
            "the model returned without calling a block on this batch",
            key=names[0],
            fix="call the blocks on every batch (no branch that skips them)",
        )

    def layer(one, h):
        if p == 1:
            return modules[0].apply({"params": one}, h, *args, **kwargs)
        for k, block in enumerate(modules):
            h = block.apply({"params": one[str(k)]}, h, *args, **kwargs)
        return h

    def head(hp, h, batch):
        seen = []

        def inject(next_fun, a, k, context):
            if _top_level(context) in names:
                seen.append(context)
                return h if len(seen) == 1 else a[0]
            return next_fun(*a, **k)

        with nn.intercept_methods(inject):
            output = module.apply({"params": {**skipped_by_head, **hp}}, *inputs(batch))
        return loss(output, batch)

    return LayeredModel(embed, layer, head, embed_keys=embed_keys, head_keys=head_keys, remat=remat)


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
            in ``setup``, or ``Block(name=f"blocks_{i}")``).
        inputs: ``inputs(batch) -> the model's positional arguments`` (default ``(batch["inputs"],)``).
        remat: recompute each layer in the backward pass.

    Raises:
        ModelStructureError: the model does not split into embedding, blocks and head (names the
            child that breaks the pattern).
        NotSupportedYetError: a block takes an array besides its hidden state.
    """
    from flax.linen import meta

    params = meta.unbox(params)
    names = block_names(params, blocks)
    p = period(params, names)
    calls = _watch(module, params, example, inputs, names)
    first, last = _check_order(calls, names)
    keys = _parts(params, calls, first, last, names)
    model = _layered(module, params, calls, names, p, inputs, loss, keys, remat)
    key = _layers_key(params, blocks)
    model = model._replace(layers_key=key)
    layered = FlaxLayers(model, None, names, p, key)
    layered = dataclasses.replace(layered, params=layered.to_layered(params))
    own = lambda p, b: loss(module.apply({"params": p}, *inputs(b)), b)
    check_same_loss(layered, own, params, example, key=names[0])
    return layered
