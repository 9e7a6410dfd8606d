"""A flax nnx model, as its authors wrote it, as a :class:`~torsh_jax.runtime.layered.LayeredModel`.

The model's parameters (``nnx.Param``) become a pure dict (``nnx.split``, ``to_pure_dict``); the
model is called through ``nnx.merge`` on them. Its blocks (``blocks``: the attribute) are either

* **a scanned stack** (blocks made by ``nnx.vmap``, run by ``nnx.scan``): the loss is cut at the
  scan (:func:`~torsh_jax.models.scanned.from_scan`); or
* **a list** (``nnx.List`` of identical blocks, each mapping the hidden state to the next, run one
  after the other): the blocks' parameters
  are stacked; the embedding is the model's ``__call__`` with the list replaced by one that stops at
  the first block, the head the same with the first block returning the layers' output and the
  others passing it on, a layer one block merged with its slice.

Blocks kept below the top level (``blocks="transformer/h"``: a decoder module inside a causal-LM
module, as Hugging Face nests its models) are lifted (:mod:`~torsh_jax.models.nesting`): each
module on the way is replaced by its children, so the embedding and head read keys such as
``transformer/wte``, and the parameters convert back to the model's own nesting.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.linear = nnx.Linear(8, 8, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + self.linear(x)
    >>> class LM(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.embed = nnx.Embed(16, 8, rngs=rngs)
    ...         self.blocks = nnx.List([Block(rngs) for _ in range(2)])
    ...     def __call__(self, tokens):
    ...         x = self.embed(tokens)
    ...         for block in self.blocks:
    ...             x = block(x)
    ...         return self.embed.attend(x)
    >>> batch = {"inputs": jnp.zeros((2, 4), jnp.int32), "targets": jnp.zeros((2, 4), jnp.int32)}
    >>> xent = lambda logits, b: -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    >>> layered = from_nnx(LM(nnx.Rngs(0)), batch, loss=xent)
    >>> layered.model.head_keys, layered.params["blocks"]["linear"]["kernel"].shape
    (('embed',), (2, 8, 8))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from torsh_jax.errors import ModelStructureError, NotSupportedYetError
from torsh_jax.models.blocks import FlaxLayers, HiddenState, check_same_loss, period, zeros_like
from torsh_jax.models.linen import _model_inputs
from torsh_jax.models.nesting import lift, lifted_chain, nest
from torsh_jax.models.scanned import from_scan, keys_read
from torsh_jax.runtime.layered import LayeredModel

__all__ = ["from_nnx"]


class _Stop:
    """Stands in for the first block: carries its input out of the model's ``__call__``."""

    def __call__(self, x, *args, **kwargs):
        raise HiddenState(x)


class _Pass:
    """Stands in for a block: returns ``given`` (the first) or its input (the others)."""

    def __init__(self, given=None):
        self.given = given

    def __call__(self, x, *args, **kwargs):
        return x if self.given is None else self.given


def _split(model):
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, rest, nnx.to_pure_dict(params)


def _merged(graphdef, params_state, rest, pure: dict):
    from flax import nnx

    state = jax.tree.map(lambda x: x, params_state)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state, rest)


def from_nnx(
    model,
    example: Any,
    /,
    *,
    loss: Callable[[Any, Any], jax.Array],
    blocks: str = "blocks",
    inputs: Callable[[Any], tuple] = _model_inputs,
) -> FlaxLayers:
    """``model`` (an nnx model with a list or a scanned stack of blocks) as a :class:`FlaxLayers`.

    Args:
        model: the model, unchanged.
        example: a batch, to see how the model runs its blocks.
        loss: ``loss(model output, batch) -> scalar``.
        blocks: the attribute holding the blocks (a path ``a/b`` below the top level).
        inputs: ``inputs(batch) -> the model's positional arguments`` (default ``(batch["inputs"],)``).

    Raises:
        ModelStructureError: no such attribute, or blocks that do not split into layers.
        NotSupportedYetError: a scanned block reads values computed outside the scan.
    """
    split = _split(model)
    graphdef, params_state, rest, pure = split
    chain = _modules_above(pure, blocks)
    lifted = lift(pure, chain)
    if blocks not in lifted:
        raise ModelStructureError(
            f"the model has no parameters under {blocks!r} (it has {', '.join(map(str, lifted))})",
            key=blocks,
            fix="pass blocks= the attribute holding the blocks ('transformer/h' below the top level)",
        )

    def pure_loss(p, batch):
        return loss(_merged(graphdef, params_state, rest, p)(*inputs(batch)), batch)

    if not _is_list(lifted[blocks]):
        scanned = from_scan(lambda p, batch: pure_loss(nest(p, chain), batch), lifted, example, layers=blocks)
        return dataclasses.replace(scanned, lifted=chain)
    return _from_list(model, split, example, blocks, loss, inputs, pure_loss, chain)


def _modules_above(pure: dict, blocks: str) -> tuple[str, ...]:
    """The modules on the way to ``blocks`` (lifted so that the blocks are a top-level key).

    Raises:
        ModelStructureError: one of them is missing (names it and the keys there).
    """
    return tuple(path for path in lifted_chain(pure, blocks) if path != blocks)


def _attribute(model, path: str):
    """``model.a.b`` for the path ``a/b``."""
    return functools.reduce(getattr, path.split("/"), model)


def _set_attribute(model, path: str, value) -> None:
    """``model.a.b = value`` for the path ``a/b``."""
    *parents, name = path.split("/")
    setattr(functools.reduce(getattr, parents, model), name, value)


def _is_list(tree) -> bool:
    return isinstance(tree, dict) and bool(tree) and all(isinstance(k, int) for k in tree)


def _from_list(model, split: tuple, example, blocks, loss, inputs, pure_loss, chain) -> FlaxLayers:
    """``split``: the model's :func:`_split` (graph, parameters, other state, parameters as a dict);
    ``chain``: the modules lifted on the way to the blocks."""
    from flax import nnx

    graphdef, params_state, rest, pure = split
    lifted = lift(pure, chain)
    items = lifted[blocks]
    names = tuple(range(len(items)))
    if period(items, names) != 1:
        raise NotSupportedYetError(
            f"the blocks of {blocks} repeat in a pattern of {period(items, names)}: an nnx list converts "
            "when its blocks are alike",
            key=blocks,
            fix="make the blocks alike, or write the LayeredModel with one layer per period",
        )
    block_graphdef, block_state, block_rest = nnx.split(_attribute(model, blocks)[0], nnx.Param, ...)
    others = [k for k in lifted if k != blocks]

    def run(p: dict, batch, stand_ins: list):
        full = {k: p[k] if k in p else zeros_like(lifted[k]) for k in others}
        full[blocks] = {i: zeros_like(items[i]) for i in names}
        merged = _merged(graphdef, params_state, rest, nest(full, chain))
        _set_attribute(merged, blocks, stand_ins)
        return merged(*inputs(batch))

    def embed(p, batch):
        try:
            run(p, batch, [_Stop()] + [_Pass()] * (len(names) - 1))
        except HiddenState as hidden:
            return hidden.value
        raise ModelStructureError(
            "the model returned without calling a block on this batch",
            key=blocks,
            fix="call the blocks on every batch (no branch that skips them)",
        )

    def head(p, h, batch):
        return loss(run(p, batch, [_Pass(h)] + [_Pass()] * (len(names) - 1)), batch)

    def layer(one, h):
        return _merged(block_graphdef, block_state, block_rest, one)(h)

    keys = _list_keys(others, embed, head, lifted, example)
    model_ = LayeredModel(embed, layer, head, embed_keys=keys[0], head_keys=keys[1], layers_key=blocks)
    layered = FlaxLayers(model_, None, names, 1, blocks, layout="list", lifted=chain)
    layered = dataclasses.replace(layered, params=layered.to_layered(pure))
    check_same_loss(layered, pure_loss, pure, example, key=blocks)
    return layered


def _list_keys(others: list, embed: Callable, head: Callable, pure: dict, example) -> tuple:
    """(embed keys, head keys): the top-level keys each part's output depends on."""
    own = {k: pure[k] for k in others}
    hidden = jax.eval_shape(lambda p: embed(p, example), own)
    h = jax.numpy.zeros(hidden.shape, hidden.dtype)
    return keys_read(lambda p: embed(p, example), own), keys_read(lambda p: head(p, h, example), own)
