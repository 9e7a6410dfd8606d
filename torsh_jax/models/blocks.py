"""A model's repeated blocks, stacked on a leading layer dim, and back.

A model keeps its blocks as numbered children (``blocks_0 ... blocks_7``); a
:class:`~torsh_jax.runtime.layered.LayeredModel` holds them stacked under one key. Blocks of one
structure stack one per layer; blocks of different kinds in a fixed repeating pattern (recurrent,
recurrent, attention) stack one period per layer, as ``{"0": first, "1": second, ...}``.

Example:
    >>> import numpy as np
    >>> params = {"embed": 1.0, "h_0": {"w": np.ones(2)}, "h_1": {"w": np.zeros(2)}}
    >>> names = block_names(params, "h")
    >>> period(params, names)
    1
    >>> stacked = stack_blocks(params, names, 1)
    >>> stacked["w"].shape, unstack_blocks(stacked, names, 1)["h_1"]["w"].tolist()
    ((2, 2), [0.0, 0.0])
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from torsh_jax.errors import ModelStructureError
from torsh_jax.models.nesting import lift, nest
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.typing import PyTree

__all__ = [
    "FlaxLayers",
    "HiddenState",
    "block_names",
    "check_same_loss",
    "period",
    "stack_blocks",
    "unstack_blocks",
    "zeros_like",
]


@dataclass(frozen=True)
class FlaxLayers:
    """A flax model as a :class:`LayeredModel`, and its parameters converted both ways.

    Attributes:
        model: embed (everything before the blocks), layer (one period of blocks), head
            (everything after, then the loss).
        params: the model's parameters in the layered layout (blocks stacked under ``layers_key``).
        block_names: the blocks' keys, in call order (``()`` for blocks stacked by the model).
        period: blocks per layer (1 when every block has one structure).
        layers_key: the stacked blocks' key.
        layout: where the model keeps its blocks: ``"children"`` (top-level ``blocks_0, ...``:
            linen), ``"list"`` (``params[layers_key][0, 1, ...]``: an nnx list), ``"stacked"``
            (already stacked: a scanned stack).
        lifted: the modules on the way to blocks kept below the top level, outermost first
            (:func:`~torsh_jax.models.nesting.lifted_chain`); their children are top-level keys
            in the layered layout.
    """

    model: LayeredModel
    params: PyTree
    block_names: tuple = ()
    period: int = 1
    layers_key: str = "layers"
    layout: str = "children"
    lifted: tuple[str, ...] = ()

    def to_layered(self, params: PyTree) -> dict:
        """The model's own parameters in the layered layout."""
        params = lift(params, self.lifted)
        if self.layout == "stacked":
            return params
        source = params if self.layout == "children" else params[self.layers_key]
        others = {k: v for k, v in params.items() if k not in self.block_names and k != self.layers_key}
        return {**others, self.layers_key: stack_blocks(source, self.block_names, self.period)}

    def to_flax(self, params: PyTree) -> dict:
        """Layered parameters (a train state's, a checkpoint's) back in the model's own layout."""
        if self.layout == "stacked":
            return nest(params, self.lifted)
        others = {k: v for k, v in params.items() if k != self.layers_key}
        blocks = unstack_blocks(params[self.layers_key], self.block_names, self.period)
        if self.layout == "children":
            return nest({**others, **blocks}, self.lifted)
        return nest({**others, self.layers_key: blocks}, self.lifted)


def block_names(params: PyTree, prefix: str) -> tuple[str, ...]:
    """``prefix_0 ... prefix_{n-1}`` (or ``prefix.0 ...``, or ``prefix/0 ...``: blocks lifted from a
    numbered collection): the top-level keys of the blocks, in order.

    Raises:
        ModelStructureError: no such key, or a number is missing.
    """
    pattern = re.compile(rf"{re.escape(prefix)}[_./](\d+)")
    found = {int(m.group(1)): k for k in params if (m := pattern.fullmatch(k))}
    if not found:
        raise ModelStructureError(
            f"no parameters named {prefix}_0, {prefix}_1, ... "
            f"(top-level keys: {', '.join(map(str, params))})",
            key=prefix,
            fix="pass blocks= the name of the model's list of blocks (linen names them name_0, name_1, ...)",
        )
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ModelStructureError(
            f"{prefix}_{missing[0]} is missing between {prefix}_0 and {prefix}_{max(found)}",
            key=f"{prefix}_{missing[0]}",
            fix="number the blocks 0 .. n-1 without gaps",
        )
    return tuple(found[i] for i in range(len(found)))


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)


def _signature(tree: PyTree) -> tuple:
    leaves, structure = jax.tree_util.tree_flatten(tree)
    return structure, tuple((np.shape(x), _dtype(x)) for x in leaves)


def period(params: PyTree, names: tuple[str, ...]) -> int:
    """The fewest blocks after which the blocks' structures (pytree, shapes, dtypes) repeat.

    Raises:
        ModelStructureError: they do not repeat (names the first block that breaks the pattern of
            block 0).
    """
    signatures = [_signature(params[n]) for n in names]
    n = len(names)
    for p in range(1, n // 2 + 1):
        if n % p == 0 and all(signatures[i] == signatures[i % p] for i in range(n)):
            return p
    if n == 1:
        return 1
    odd = next((name for name, sig in zip(names[1:], signatures[1:]) if sig != signatures[0]), names[-1])
    raise ModelStructureError(
        f"{odd} differs from {names[0]} and the blocks do not repeat in a fixed pattern that divides "
        f"their {n}",
        key=odd,
        fix="convert the blocks that repeat (blocks=) and keep the others in the model's embedding or head",
    )


def _grouped(blocks: list, p: int) -> list:
    """One tree per layer: the block itself (``p = 1``) or ``{"0": ..., "1": ...}`` of its period."""
    if p == 1:
        return blocks
    return [{str(k): blocks[j + k] for k in range(p)} for j in range(0, len(blocks), p)]


def stack_blocks(params: PyTree, names: tuple[str, ...], p: int) -> PyTree:
    """The blocks' parameters stacked on a leading dim of ``len(names) // p`` layers."""
    stack: Callable = lambda *xs: np.stack(xs) if isinstance(xs[0], np.ndarray) else jax.numpy.stack(xs)
    return jax.tree.map(stack, *_grouped([params[n] for n in names], p))


def unstack_blocks(stacked: PyTree, names: tuple[str, ...], p: int) -> dict:
    """Inverse of :func:`stack_blocks`: ``{name: the block's parameters}``."""
    layers = len(names) // p
    per_layer = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(layers)]
    blocks = per_layer if p == 1 else [layer[str(k)] for layer in per_layer for k in range(p)]
    return dict(zip(names, blocks))


def zeros_like(tree: PyTree) -> PyTree:
    """Zeros of every leaf's shape and dtype (arrays or ``jax.ShapeDtypeStruct``)."""
    return jax.tree.map(lambda x: jax.numpy.zeros(np.shape(x), _dtype(x)), tree)


class HiddenState(Exception):
    """The first block's input, carried out of the model's ``__call__`` (the embedding's output)."""

    def __init__(self, value):
        super().__init__("hidden state")
        self.value = value


def check_same_loss(layered: FlaxLayers, own_loss: Callable, params: PyTree, example, /, *, key: str) -> None:
    """The converted model's loss equals ``own_loss(params, example)``, the model's (round-off
    aside); nothing is computed when ``params`` are shapes.

    Raises:
        ModelStructureError: they differ (``key``: the blocks).
    """
    if not all(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(params)):
        return
    from torsh_jax.runtime.layered import layered_loss

    theirs = jax.jit(own_loss)(params, example)
    ours = jax.jit(layered_loss(layered.model))(layered.params, example)
    if not np.allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=1e-6):
        raise ModelStructureError(
            f"the converted model's loss {float(ours):.6g} differs from the model's {float(theirs):.6g}: "
            "the head reads something the embedding computed besides the blocks' input, a block's "
            "output is not the next block's input (a residual added outside the block), or the blocks "
            "are given different arrays besides their hidden state (a mask of their own)",
            key=key,
            fix="compute what the head reads from the batch, or keep each block's residual inside it",
        )
