"""Varying-axis types inside the pipeline's ``shard_map``: every stage runs a different branch of one
``lax.switch``, and the branches must agree on which manual axes each value varies over.

A value made on one stage only (a parameter gradient in a backward branch) varies over ``stage``;
the same value in the idle branch (zeros) does not. These helpers type each branch's outputs, and
the carry going in, as varying over the union of what the branches make, so that ``lax.switch``
and ``lax.scan`` accept them. No data moves: only types change.

Example:
    >>> import jax.numpy as jnp
    >>> cast_vma({"w": jnp.zeros(2)}, {"w": frozenset()})["w"].shape
    (2,)
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from torsh_jax.tensor.axis import vary_over, varying_axes
from torsh_jax.typing import PyTree

__all__ = ["cast_vma", "cotangent_like", "settled", "typed_switch", "vmas"]


def cotangent_like(cotangent: jax.Array, output: jax.Array) -> jax.Array:
    """``cotangent`` with ``output``'s dtype and varying axes (what ``vjp`` expects)."""
    return cast_vma(cotangent.astype(output.dtype), varying_axes(output))


def cast_vma(tree: PyTree, axes: PyTree) -> PyTree:
    """``tree`` typed as varying over ``axes`` (per leaf; no data moves)."""

    return jax.tree.map(lambda x, want: vary_over(x, sorted(want)), tree, axes,
                        is_leaf=lambda a: isinstance(a, frozenset))  # fmt: skip


def _kinds(tree: PyTree) -> PyTree:
    return jax.tree.map(varying_axes, tree)


def _union(trees: list) -> PyTree:
    return jax.tree.map(lambda *s: frozenset().union(*s), *trees, is_leaf=lambda a: isinstance(a, frozenset))


def settled(fn: Callable, carry):
    """``carry`` typed as varying over every axis ``fn(carry)`` makes it vary over (a scan's carry
    must keep its type)."""
    for _ in range(4):
        want = _union([_kinds(carry), vmas(jax.eval_shape(fn, carry))])
        if want == _kinds(carry):
            break
        carry = cast_vma(carry, want)
    return carry


def typed_switch(index, branches: list[Callable], carry, ints, types: dict):
    """``lax.switch`` whose branches may differ in which manual axes a value varies over: every
    output (and the carry going in) is typed as varying over the union. ``types`` keeps each
    branch's output types by input types across ticks (a branch is traced for them once)."""
    kinds, union = _kinds, _union
    for _ in range(3):  # the carry's type settles after a pass or two
        target = union([_output_vmas(b, carry, ints, types) for b in branches])
        carry_target = union([kinds(carry), target[0]])
        if carry_target == kinds(carry):
            break
        carry = cast_vma(carry, carry_target)
    target = (carry_target, *target[1:])
    return jax.lax.switch(index, [_typed(b, target, types) for b in branches], carry, ints)


def _typed(branch: Callable, target: PyTree, types: dict) -> Callable:
    """``branch`` with its outputs cast to ``target``'s varying axes; one function per branch and
    target, so ``lax.switch`` reuses its trace in later ticks."""
    key = ("typed", branch, _frozen(target))
    if key not in types:
        types[key] = lambda carry, ints: cast_vma(branch(carry, ints), target)
    return types[key]


def _frozen(tree: PyTree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda a: isinstance(a, frozenset))
    return treedef, tuple(leaves)


def _output_vmas(branch: Callable, carry, ints, types: dict) -> PyTree:
    """Varying axes of ``branch(carry, ints)``'s outputs, traced once per branch and input types."""
    key = (branch, *(_avals(tree) for tree in (carry, ints)))
    if key not in types:
        types[key] = vmas(jax.eval_shape(branch, carry, ints))
    return types[key]


def _avals(tree: PyTree) -> tuple:
    """Hashable types of ``tree`` (structure, and shape, dtype and varying axes of each leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(jax.typeof(leaf) for leaf in leaves)


def vmas(tree: PyTree) -> PyTree:
    """Varying axes of every leaf of an ``eval_shape`` result."""

    def one(leaf):
        manual = getattr(leaf, "manual_axis_type", None)
        return frozenset(manual.varying) if manual is not None else frozenset(getattr(leaf, "vma", ()))

    return jax.tree.map(one, tree)
