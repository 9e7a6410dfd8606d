"""Tensor-parallel names for a model that carries none: Megatron's split, read from the weights' shapes.

With ``[tensor] rules = "auto"``, every parameter that no logical name (flax metadata) and no
``param_dims`` entry names gets names from its shape and its place (``d``: the model's width):

* **in the stacked layers** (after their leading layer dim): a kernel ``[d, n]`` is
  column-parallel (``embed, mlp``), ``[n, d]`` row-parallel (``mlp, embed``); ``[d, h, k]`` splits
  its heads (``embed, heads, kv``), ``[h, k, d]`` too (``heads, kv, embed``); a column-parallel
  layer's bias (``[n]``, ``[h, k]``) is split with it;
* **outside them**: a table or kernel with the vocabulary on one side (``[V, d]`` or ``[d, V]``,
  ``V`` the largest such dim) is split over the vocabulary;
* **replicated**: ``[d]`` vectors (norm scales, a row-parallel layer's bias), a square ``[d, d]``
  kernel (its role is not in its shape), anything else, and any dim the tensor axis does not divide
  (the heads of a grouped-query key projection fewer than the tensor devices).

``d`` is the size most vectors in the layers have (their norms' scales).

Example:
    >>> import numpy as np
    >>> params = {"embed": np.zeros((64, 8)), "layers": {"norm": np.zeros((2, 8)),
    ...     "up": np.zeros((2, 8, 32)), "down": np.zeros((2, 32, 8))}}
    >>> for pattern, names in auto_param_dims(params, "layers", tensor=2):
    ...     print(pattern, names)
    ^embed$ ('vocab', 'embed')
    ^layers/down$ ('layers', 'mlp', 'embed')
    ^layers/norm$ ('layers', '')
    ^layers/up$ ('layers', 'embed', 'mlp')
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np

from torsh_jax.runtime.specs import path_str
from torsh_jax.typing import PyTree

__all__ = ["auto_param_dims", "model_width"]

_COLUMN_BIAS = {1: ("mlp",), 2: ("heads", "kv")}


def model_width(params: PyTree, stacked_key: str | None) -> int | None:
    """The size most vectors in the stacked layers have (the norms' scales); ``None``: no vectors."""
    layers = params.get(stacked_key) if stacked_key and isinstance(params, dict) else params
    sizes = Counter(
        np.shape(x)[-1] for x in jax.tree.leaves(layers) if len(np.shape(x)) == 1 + bool(stacked_key)
    )
    return sizes.most_common(1)[0][0] if sizes else None


def _layer_names(shape: tuple[int, ...], d: int, columns: set) -> tuple[str, ...]:
    if len(shape) == 2 and shape[0] == d and shape[1] != d:
        columns.add(shape[1])
        return ("embed", "mlp")
    if len(shape) == 2 and shape[1] == d and shape[0] != d:
        return ("mlp", "embed")
    if len(shape) == 3 and shape[0] == d:
        columns.add(shape[1:])
        return ("embed", "heads", "kv")
    if len(shape) == 3 and shape[2] == d:
        return ("heads", "kv", "embed")
    return ("",) * len(shape)


def _bias_names(shape: tuple[int, ...], d: int, columns: set) -> tuple[str, ...] | None:
    """A column-parallel layer's bias: ``[n]`` of a ``[d, n]`` kernel, ``[h, k]`` of ``[d, h, k]``."""
    key = shape[0] if len(shape) == 1 else shape
    if shape != (d,) and key in columns and len(shape) in _COLUMN_BIAS:
        return _COLUMN_BIAS[len(shape)]
    return None


def _outer_names(shape: tuple[int, ...], d: int, vocab: int | None) -> tuple[str, ...]:
    if len(shape) == 2 and vocab is not None and shape == (vocab, d):
        return ("vocab", "embed")
    if len(shape) == 2 and vocab is not None and shape == (d, vocab):
        return ("embed", "vocab")
    return ("",) * len(shape)


def _divisible(names: tuple[str, ...], shape: tuple[int, ...], tensor: int) -> tuple[str, ...]:
    split = {"mlp", "heads", "vocab"}
    return tuple(n if n not in split or shape[i] % tensor == 0 else "" for i, n in enumerate(names))


def auto_param_dims(
    params: PyTree, stacked_key: str | None, /, *, tensor: int, skip=lambda path, shape: False
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``param_dims`` entries (exact path regexes) naming every parameter (see the module docstring);
    ``skip(path, shape)``: a parameter already named elsewhere."""
    d = model_width(params, stacked_key)
    if d is None:
        return ()
    flat = [(path_str(p), tuple(np.shape(x))) for p, x in jax.tree_util.tree_leaves_with_path(params)]
    inside = lambda path: stacked_key is not None and path.split("/")[0] == stacked_key
    outer = [s for p, s in flat if not inside(p) and len(s) == 2 and d in s]
    vocab = max((s[0] if s[1] == d else s[1] for s in outer), default=None)
    columns: set = set()
    layer_names = {p: ("layers", *_layer_names(s[1:], d, columns)) for p, s in flat if inside(p)}
    out = []
    for path, shape in flat:
        if skip(path, shape):
            continue
        if inside(path):
            bias = _bias_names(shape[1:], d, columns)
            names = ("layers", *bias) if bias else layer_names[path]
        else:
            names = _outer_names(shape, d, vocab)
        out.append((f"^{re.escape(path)}$", _divisible(names, shape, tensor)))
    return tuple(out)
