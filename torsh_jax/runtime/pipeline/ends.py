"""The embedding's and head's gradient sums of a pipeline stage, sharing buffers where no stage makes
both.

Every stage runs the same program, so every stage carries the same sums. Only the first stage adds
into the embedding's and only the last into the head's, so on every other stage both are zeros for
the whole step. Where the first and last stages differ, an embedding parameter and a head parameter
of the same shape (a tied table and its use in the head), or of one 2-D shape and its transpose
(a token table ``[vocab, d]`` and an untied head ``[d, vocab]``), and of the same varying axes,
share one buffer: it holds the sum its stage makes, the embedding's on the first stage, the head's
(transposed where it is) on the last. Each stage then carries one vocabulary-sized float32 sum, not
two. Leaves have no other layout than their own (a flattened or reshaped sum is a relayout copy of
the gradient each micro-batch on a TPU). :meth:`EndSums.parts` reads the sums back, zero where the
stage made none, before they are summed over ``stage``. Nothing is shared where a stage makes both
(the first and last stages meet) or where the compiler partitions a mesh axis inside the
``shard_map`` (``tensor.rules = "auto"``): a leaf laid out in another's shape there can be moved
between devices inside the first stage's branch alone, which the other stages never join.

Example (an untied table and head sharing one buffer: the embedding's sum on stage 0):
    >>> import jax.numpy as jnp
    >>> ends = EndSums.of({"table": jnp.zeros((3, 2))}, {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)},
    ...                   shared=True)
    >>> sums = ends.add(ends.zeros(), "embed", {"table": jnp.ones((3, 2))})
    >>> embed, head = ends.parts(sums, first=jnp.bool_(True), last=jnp.bool_(False))
    >>> embed["table"].shape, head["w"].shape, float(head["w"].sum()), len(sums)
    ((3, 2), (2, 3), 0.0, 2)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from torsh_jax.pipeline.slots import BRANCHES
from torsh_jax.tensor.axis import varying_axes
from torsh_jax.typing import PyTree

__all__ = ["EndSums", "end_stages", "ends_apart", "every_axis_manual"]

_PARTS = ("embed", "head")


def end_stages(branch: np.ndarray, end: str) -> np.ndarray:
    """The stages of the slot table ``branch`` (``[ticks, stages]`` indices into
    :data:`~torsh_jax.pipeline.slots.BRANCHES`) that run the ``first`` (``last``) stage's branches.

    Example:
        >>> first, last = BRANCHES.index("F_first"), BRANCHES.index("B_last")
        >>> end_stages(np.array([[first, 0], [0, last]]), "last").tolist()
        [1]
    """
    names = np.asarray(BRANCHES)[branch]
    return np.flatnonzero(np.isin(names, (f"F_{end}", f"B_{end}")).any(axis=0))


def ends_apart(branch: np.ndarray) -> bool:
    """Whether no stage of the slot table ``branch`` runs both a first and a last stage's branch.

    Example:
        >>> first, last = BRANCHES.index("F_first"), BRANCHES.index("F_last")
        >>> ends_apart(np.array([[first, 0], [0, last]])), ends_apart(np.array([[first], [last]]))
        (True, False)
    """
    return not set(end_stages(branch, "first").tolist()) & set(end_stages(branch, "last").tolist())


def every_axis_manual() -> bool:
    """Whether every axis of the mesh being traced over that has more than one device is a
    ``shard_map`` manual axis (no leaf is split by the compiler here).

    Example:
        >>> every_axis_manual()  # outside any mesh
        True
    """
    mesh = jax.sharding.get_abstract_mesh()
    sizes = zip(mesh.axis_types, mesh.axis_sizes, strict=True)
    return all(kind == AxisType.Manual or size == 1 for kind, size in sizes)


class _Slot(NamedTuple):
    """Where one parameter's gradient sum is carried: the buffer's index, whether the parameter is
    laid out transposed there, and whether the other part's parameter shares the buffer."""

    buffer: int
    transposed: bool
    shared: bool


class EndSums(NamedTuple):
    """How a stage carries the embedding's and head's gradient sums, in ``dtype``: the buffers'
    shapes, and each part's parameters' :class:`_Slot` in them (per part, in leaf order) and
    tree."""

    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[_Slot, ...], tuple[_Slot, ...]]
    trees: tuple
    dtype: Any

    @classmethod
    def of(cls, embed: PyTree, head: PyTree, *, shared: bool, dtype: Any = jnp.float32) -> EndSums:
        """The sums of gradients shaped and typed as ``embed``'s and ``head``'s parameters;
        ``shared``: pair the two parts' parameters that can share a buffer."""
        leaves = (jax.tree.leaves(embed), jax.tree.leaves(head))
        pairs = _pairs(*leaves) if shared else {}
        shapes, slots = [], ([], [])
        for i, leaf in enumerate(leaves[0]):
            slots[0].append(_Slot(len(shapes), False, i in pairs))
            shapes.append(tuple(leaf.shape))
        partners = {j: (i, transposed) for i, (j, transposed) in pairs.items()}
        for j, leaf in enumerate(leaves[1]):
            if j in partners:
                i, transposed = partners[j]
                slots[1].append(_Slot(slots[0][i].buffer, transposed, True))
            else:
                slots[1].append(_Slot(len(shapes), False, False))
                shapes.append(tuple(leaf.shape))
        trees = (jax.tree.structure(embed), jax.tree.structure(head))
        return cls(tuple(shapes), (tuple(slots[0]), tuple(slots[1])), trees, dtype)

    def zeros(self) -> tuple:
        """The sums before any gradient, one buffer each."""
        return tuple(jnp.zeros(shape, self.dtype) for shape in self.shapes)

    def add(self, sums: tuple, part: str, gradients: PyTree) -> tuple:
        """``sums`` with ``gradients`` of ``part`` (``embed`` or ``head``) added."""
        sums = list(sums)
        for slot, g in zip(self.slots[_PARTS.index(part)], jax.tree.leaves(gradients), strict=True):
            g = g.astype(self.dtype)
            sums[slot.buffer] = sums[slot.buffer] + (g.T if slot.transposed else g)
        return tuple(sums)

    def parts(self, sums: tuple, *, first: jax.Array, last: jax.Array) -> tuple[PyTree, PyTree]:
        """``(embed, head)`` sums of a stage that is the ``first`` and / or ``last`` one (a shared
        buffer's read as zero where the stage is not the end that part is made on)."""
        return self._read(sums, 0, first), self._read(sums, 1, last)

    def _read(self, sums: tuple, index: int, made: jax.Array) -> PyTree:
        def leaf(slot: _Slot):
            value = jnp.where(made, sums[slot.buffer], 0) if slot.shared else sums[slot.buffer]
            return value.T if slot.transposed else value

        return jax.tree.unflatten(self.trees[index], [leaf(slot) for slot in self.slots[index]])


def _pairs(embed: list, head: list) -> dict[int, tuple[int, bool]]:
    """``{embedding leaf: (head leaf, transposed)}`` for the leaves that can share a buffer: the
    same varying axes and the same shape, or a 2-D shape and its transpose; the largest first."""
    by_size = sorted(range(len(embed)), key=lambda i: -math.prod(embed[i].shape))
    free, pairs = set(range(len(head))), {}
    for i in by_size:
        e = embed[i]
        for j in sorted(free):
            h = head[j]
            if varying_axes(h) != varying_axes(e):
                continue
            if h.shape == e.shape or (e.ndim == 2 and h.shape == e.shape[::-1] and e.shape[0] != e.shape[1]):
                pairs[i] = (j, h.shape != e.shape)
                free.discard(j)
                break
    return pairs
