"""The embedding's and head's gradient sums of a pipeline stage, sharing buffers where no stage makes
both.

Every stage runs the same program, so every stage carries the same sums. Only the first stage adds
into the embedding's and only the last into the head's, so on every other stage both are zeros for
the whole step. Where the first and last stages differ, an embedding parameter and a head parameter
that vary over the same axes and have the same shape (a tied table and its use in the head, or a
norm's scale and another's) or one 2-D shape and its transpose (a token table ``[vocab, d]`` and an
untied head ``[d, vocab]``) share one buffer. It holds the sum its stage makes: the embedding's on
the first stage, the head's (transposed where it is) on the last. Each stage then carries one
vocabulary-sized float32 sum, not two. A leaf is kept in its own shape or its transpose, never
flattened (a flattened buffer raised two TPU stages' peaks: docs/pipeline.md).
:meth:`EndSums.parts` reads the sums back, zero where the stage made none, before they are summed
over ``stage``.

Nothing is paired where a stage makes both (the first and last stages meet), nor where the caller
says not to: the step does not pair where the compiler partitions a mesh axis inside the
``shard_map`` (``tensor`` for a model without tensor blocks: :func:`pairs_end_sums`). There a
flattened buffer moved data between devices inside the first stage's branch alone and the step
hung; pairing is not tried.

Example (an untied table and head sharing one buffer: the embedding's sum on stage 0 of 2):
    >>> import jax.numpy as jnp
    >>> from torsh_jax.pipeline.schedule import build_pipeline_schedule
    >>> from torsh_jax.pipeline.slots import slot_plan
    >>> table = slot_plan(build_pipeline_schedule("1f1b", stages=2, microbatches=2)).branch
    >>> ends = EndSums.of({"table": jnp.zeros((3, 2))}, {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)},
    ...                   table=table)
    >>> sums = ends.add(ends.zeros(), "embed", {"table": jnp.ones((3, 2))})
    >>> embed, head = ends.parts(sums, stage=jnp.int32(0))
    >>> float(embed["table"].sum()), float(head["w"].sum()), head["w"].shape, len(sums)
    (6.0, 0.0, (2, 3), 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from torsh_jax.pipeline.slots import BRANCHES
from torsh_jax.tensor.axis import varying_axes
from torsh_jax.typing import PyTree

__all__ = ["EndSums", "end_stages", "pairs_end_sums"]

_PARTS = ("embed", "head")


def pairs_end_sums(compiler_axis_sizes: Iterable[int]) -> bool:
    """Whether a step's stages may pair their end sums, given the sizes of the mesh axes the
    compiler partitions inside the ``shard_map``: only where each is 1. The compiler lays each
    part out on its own along such an axis, and a sum held in the other part's layout would move
    between devices inside one stage's branch. The planner asks the same
    (:func:`torsh_jax.planner.per_device.paired_end_sums`).

    Example:
        >>> pairs_end_sums([]), pairs_end_sums([1]), pairs_end_sums([2])
        (True, True, False)
    """
    return all(n == 1 for n in compiler_axis_sizes)


def end_stages(table: np.ndarray, end: str) -> tuple[int, ...]:
    """The stages of the slot table ``table`` (``[ticks, stages]`` indices into
    :data:`~torsh_jax.pipeline.slots.BRANCHES`) that run the ``first`` (``last``) stage's branches.

    Example:
        >>> first, last = BRANCHES.index("F_first"), BRANCHES.index("B_last")
        >>> end_stages(np.array([[first, 0], [0, last]]), "last")
        (1,)
    """
    names = np.asarray(BRANCHES)[table]
    return tuple(np.flatnonzero(np.isin(names, (f"F_{end}", f"B_{end}")).any(axis=0)).tolist())


class _Slot(NamedTuple):
    """Where one parameter's gradient sum is carried: the buffer's index, whether the parameter is
    laid out transposed there, and whether the other part's parameter shares the buffer."""

    buffer: int
    transposed: bool
    paired: bool


@dataclasses.dataclass(frozen=True)
class EndSums:
    """How a stage carries the embedding's and head's gradient sums, in ``dtype``: the buffers'
    ``shapes``, each part's parameters' :class:`_Slot` (``slots``, per part in leaf order) and
    tree (``trees``), and the stages that make each part (``stages``: first, last)."""

    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[_Slot, ...], tuple[_Slot, ...]]
    trees: tuple
    stages: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: Any

    @classmethod
    def of(
        cls, embed: PyTree, head: PyTree, *, table: np.ndarray, pair: bool = True, dtype: Any = jnp.float32
    ):
        """The sums of gradients shaped and typed as ``embed``'s and ``head``'s parameters under the
        slot table ``table``; ``pair``: let the two parts' parameters share buffers where no stage
        makes both."""
        stages = (end_stages(table, "first"), end_stages(table, "last"))
        leaves = (jax.tree.leaves(embed), jax.tree.leaves(head))
        apart = all(stages) and not set(stages[0]) & set(stages[1])
        partners = _partners(*leaves) if pair and apart else {}
        shapes = [tuple(leaf.shape) for leaf in leaves[0]]
        embed_slots = tuple(_Slot(i, False, i in partners.values()) for i in range(len(shapes)))
        head_slots = []
        for j, leaf in enumerate(leaves[1]):
            if j in partners:
                head_slots.append(_Slot(partners[j], tuple(leaf.shape) != shapes[partners[j]], True))
            else:
                head_slots.append(_Slot(len(shapes), False, False))
                shapes.append(tuple(leaf.shape))
        trees = (jax.tree.structure(embed), jax.tree.structure(head))
        return cls(tuple(shapes), (embed_slots, tuple(head_slots)), trees, stages, dtype)

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

    def parts(self, sums: tuple, *, stage: jax.Array) -> tuple[PyTree, PyTree]:
        """``(embed, head)`` sums on ``stage`` (a paired buffer read as zero for the part that
        stage does not make)."""
        return self._read(sums, 0, stage), self._read(sums, 1, stage)

    def _read(self, sums: tuple, index: int, stage: jax.Array) -> PyTree:
        makes = jnp.isin(stage, jnp.asarray(self.stages[index], jnp.int32))

        def leaf(slot: _Slot):
            value = jnp.where(makes, sums[slot.buffer], 0) if slot.paired else sums[slot.buffer]
            return value.T if slot.transposed else value

        return jax.tree.unflatten(self.trees[index], [leaf(slot) for slot in self.slots[index]])


def _partners(embed: list, head: list) -> dict[int, int]:
    """``{head leaf: embedding leaf}`` for the leaves that can share a buffer: the same varying axes
    and the same shape, or else a 2-D shape and its transpose (each leaf once)."""
    free, partners = set(range(len(embed))), {}
    same = lambda e, h: e.shape == h.shape
    transposed = lambda e, h: e.ndim == 2 and h.shape == e.shape[::-1]
    for fits in (same, transposed):
        for j, h in enumerate(head):
            if j in partners:
                continue
            match = next((i for i in sorted(free) if _fits(embed[i], h, fits)), None)
            if match is not None:
                partners[j] = match
                free.discard(match)
    return partners


def _fits(e, h, shapes_fit) -> bool:
    return varying_axes(e) == varying_axes(h) and shapes_fit(e, h)
