"""How a model calls its blocks: which part of a block's output the next block reads, and what
else each block is given.

A block may return more than its hidden state (Griffin's ``x, cache = block(x, segment_pos, ...)``,
Hugging Face's ``outputs = layer(hidden, attention_mask=..., position_ids=...)`` then
``outputs[0]``). Watching one call of the model (:mod:`torsh_jax.models.linen`) gives each
block's arguments and output; :func:`hidden_path` finds the output leaf that is the next block's
input, :func:`block_extras` the arguments besides it (positions, masks, flags), which must be the
same for every block: equal values, and arrays of one shape and dtype. Whether those arrays hold
the same values a trace cannot tell (each block may compute its own, and a block under ``nn.remat``
sees copies): the converted model's loss, checked against the model's own, shows it.

Example:
    >>> import numpy as np
    >>> x1, x2 = np.ones(2), np.zeros(2)
    >>> outputs = [(x1, None), (x2, None)]
    >>> inputs = [np.ones(3), x1]
    >>> path = hidden_path(outputs, inputs, ["b_0", "b_1"])
    >>> select(outputs[1], path) is x2
    True
    >>> cache = {"c": np.zeros(1, np.float32)}  # a block's outputs are JAX's, float32 by default
    >>> with_hidden((np.zeros(2), cache), (0,), np.full(2, 7.0))[0].tolist()
    [7.0, 7.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from torsh_jax.errors import ModelStructureError, NotSupportedYetError
from torsh_jax.typing import PyTree

__all__ = ["block_extras", "hidden_path", "is_array", "select", "with_hidden"]

Path = tuple


def is_array(x) -> bool:
    """An array or a tracer of one."""
    return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def _leaf_path(tree: PyTree, leaf) -> Path | None:
    """The path of ``leaf`` in ``tree``: the leaf itself, else the one leaf of its shape and dtype (a
    block in a lifted transform, ``nn.remat``, is seen with the transform's own copies of its
    arguments and output)."""
    flat, _ = _flat(tree)
    same = [path for path, x in flat if x is leaf]
    alike = [path for path, x in flat if _abstract(x) == _abstract(leaf)]
    return same[0] if same else (alike[0] if len(alike) == 1 else None)


def _abstract(x) -> tuple:
    return (np.shape(x), np.dtype(x.dtype)) if hasattr(x, "dtype") else (type(x), x)


def _flat(tree: PyTree) -> tuple[list[tuple[Path, object]], object]:
    """``([(path, leaf), ...], treedef)``, each path the keys that index the leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_key(k) for k in path), x) for path, x in flat], treedef


def _key(entry):
    for attribute in ("idx", "key", "name"):
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    raise TypeError(f"unknown pytree key {entry!r}")


def hidden_path(outputs: Sequence[PyTree], inputs: Sequence, names: Sequence[str]) -> Path:
    """The path in a block's output of the next block's input (``()``: the output itself); one
    block: its output, or the first leaf of it.

    Raises:
        ModelStructureError: a block's input is not one of the previous block's outputs (a residual
            added between blocks), or the place differs between blocks.
    """
    if len(names) == 1:
        return () if is_array(outputs[0]) else _leaf_path(outputs[0], jax.tree.leaves(outputs[0])[0])
    paths = [_leaf_path(out, nxt) for out, nxt in zip(outputs[:-1], inputs[1:])]
    for name, path in zip(names[1:], paths):
        if path is None:
            raise ModelStructureError(
                f"{name} is not given an output of the block before it: something is computed "
                "between the blocks (a residual or a norm outside them)",
                key=name,
                fix="keep each block's computation inside the block",
            )
        if path != paths[0]:
            raise ModelStructureError(
                f"{name} reads output {path} of the block before it, {names[1]} reads {paths[0]}",
                key=name,
                fix="pass every block the same part of the previous block's output",
            )
    return paths[0]


def select(output: PyTree, path: Path):
    """The leaf of ``output`` at ``path``."""
    for key in path:
        output = output[key]
    return output


def with_hidden(structure: PyTree, path: Path, hidden) -> PyTree:
    """A block's output of ``structure`` (shapes or arrays) with ``hidden`` at ``path`` and zeros
    elsewhere (what a block returns besides its hidden state: a cache the loss does not read)."""
    if not path:
        return hidden
    flat, treedef = _flat(structure)
    leaves = [hidden if keys == path else jax.numpy.zeros(np.shape(x), x.dtype) for keys, x in flat]
    return jax.tree.unflatten(treedef, leaves)


def _same(a, b) -> bool:
    """The same argument: equal values, or arrays of one shape and dtype (whether their values agree
    is what the converted model's loss check shows)."""
    if is_array(a) or is_array(b):
        return a is b or (is_array(a) and is_array(b) and _abstract(a) == _abstract(b))
    return type(a) is type(b) and a == b


def block_extras(arguments: Sequence[tuple[tuple, dict]], names: Sequence[str]) -> tuple[tuple, dict, bool]:
    """``(args, kwargs, reads arrays)``: what every block is given besides its hidden state, and
    whether that holds arrays (then each layer computes them from the batch).

    Raises:
        NotSupportedYetError: blocks given different arrays or values (a per-block mask).
    """
    (args, kwargs), first = arguments[0], names[0]
    leaves, structure = jax.tree.flatten((args, kwargs))
    for name, (a, k) in zip(names[1:], arguments[1:]):
        others, other_structure = jax.tree.flatten((a, k))
        if other_structure != structure or not all(map(_same, leaves, others)):
            raise NotSupportedYetError(
                f"{name} is given other arguments besides its hidden state than {first}: blocks "
                "stack into layers when they are given the same",
                key=name,
                fix="give every block the same arguments (compute what differs inside the block)",
            )
    return args, kwargs, any(map(is_array, leaves))
