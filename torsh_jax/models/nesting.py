"""Blocks kept below the top level (``model/layers/0``, ``transformer/h_0``), lifted to it.

A model may keep its blocks inside a submodule: Hugging Face's Flax models keep them as
``model/layers/0 ... model/layers/n`` (a collection module whose children are numbered) or
``transformer/h/0``. Lifting replaces each module on the way to the blocks by its children, keyed
by their joined path, so the blocks and everything beside them become top-level keys:

``{"model": {"embed_tokens": e, "layers": {"0": b0, "1": b1}, "norm": n}, "lm_head": h}`` lifts to
``{"model/embed_tokens": e, "model/layers/0": b0, "model/layers/1": b1, "model/norm": n, "lm_head": h}``.

A lifted key names its parameters by the same paths as before (``model/embed_tokens/embedding``).

Example:
    >>> params = {"model": {"embed": 1, "layers": {"0": 2, "1": 3}}, "head": 4}
    >>> chain = lifted_chain(params, "model/layers")
    >>> chain
    ('model', 'model/layers')
    >>> lifted = lift(params, chain)
    >>> sorted(lifted)
    ['head', 'model/embed', 'model/layers/0', 'model/layers/1']
    >>> nest(lifted, chain) == params
    True
"""

from __future__ import annotations

from torsh_jax.errors import ModelStructureError
from torsh_jax.typing import PyTree

__all__ = ["lift", "lifted_chain", "nest"]


def _child(params: PyTree, path: list[str], blocks: str) -> PyTree:
    node = params
    for depth, name in enumerate(path):
        if not isinstance(node, dict) or name not in node:
            where = "/".join(path[:depth]) or "the top level"
            shown = ", ".join(map(str, node)) if isinstance(node, dict) else "none"
            raise ModelStructureError(
                f"no submodule {name!r} at {where} on the way to the blocks (keys there: {shown})",
                key=blocks,
                fix="pass blocks= the path of the model's blocks, e.g. 'model/layers' or 'transformer/h'",
            )
        node = node[name]
    return node


def _numbered(node: PyTree) -> bool:
    return isinstance(node, dict) and bool(node) and all(str(k).isdigit() for k in node)


def lifted_chain(params: PyTree, blocks: str) -> tuple[str, ...]:
    """The modules to lift, outermost first, for the blocks at path ``blocks``: the modules above
    the blocks, and the blocks' collection itself when its children are numbered (``layers/0``);
    ``()`` for blocks at the top level (``blocks_0``).

    Raises:
        ModelStructureError: a module on the way is missing (names it and the keys there).
    """
    parts = blocks.split("/")
    parent = parts[:-1]
    holder = _child(params, parent, blocks)
    chain = ["/".join(parts[: i + 1]) for i in range(len(parent))]
    if _numbered(holder.get(parts[-1])):
        chain.append(blocks)
    return tuple(chain)


def lift(params: PyTree, chain: tuple[str, ...]) -> dict:
    """``params`` with each module of ``chain`` replaced by its children (keys ``path/child``)."""
    out = dict(params)
    for path in chain:
        inner = out.pop(path)
        out.update({f"{path}/{key}": value for key, value in inner.items()})
    return out


def nest(params: PyTree, chain: tuple[str, ...]) -> dict:
    """Inverse of :func:`lift` (for any subset of the lifted keys)."""
    out = dict(params)
    for path in reversed(chain):
        prefix = f"{path}/"
        keys = [k for k in out if k.startswith(prefix) and "/" not in k[len(prefix) :]]
        out[path] = {k[len(prefix) :]: out.pop(k) for k in keys}
    return out
