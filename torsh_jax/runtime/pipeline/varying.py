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
from functools import partial
from typing import NamedTuple

import jax

from torsh_jax.runtime.traced import traced_once
from torsh_jax.tensor.axis import vary_over, varying_axes
from torsh_jax.typing import PyTree

__all__ = ["cast_vma", "cotangent_like", "settled", "typed_cond", "typed_switch", "vmas"]


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


def settled(fn: Callable, carry, *rest) -> tuple[Callable, PyTree]:
    """``(fn, carry)``: ``carry`` typed as varying over every axis ``fn(carry, *rest)``'s first output
    makes it vary over (a scan's carry must keep its type), and ``fn`` replaying its trace for that
    carry (the model's Python runs again only while the type moves)."""
    for _ in range(4):
        run, shapes = traced_once(fn, carry, *rest)
        want = _union([_kinds(carry), vmas(shapes[0])])
        if want == _kinds(carry):
            return run, carry
        carry = cast_vma(carry, want)
    return fn, carry


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
    return jax.lax.switch(index, [_typed(b, carry, ints, target, types) for b in branches], carry, ints)


def typed_cond(pred: jax.Array, on_true: Callable, on_false: Callable, *operands):
    """``lax.cond`` whose ways may differ in which manual axes an output varies over: both typed
    as varying over the union. Each way is traced once, for its output types and the ``cond``."""
    ways = [traced_once(way, *operands) for way in (on_false, on_true)]
    target = _union([vmas(shapes) for _, shapes in ways])
    typed = [partial(_cast_outputs, run, target) for run, _ in ways]
    return jax.lax.cond(pred, typed[1], typed[0], *operands)


def _cast_outputs(run: Callable, target: PyTree, *operands):
    return cast_vma(run(*operands), target)


def _typed(branch: Callable, carry, ints, target: PyTree, types: dict) -> Callable:
    """``branch``'s traced program for these inputs with its outputs cast to ``target``'s varying
    axes; one function per branch, input types and target, so ``lax.switch`` reuses its trace in
    later ticks."""
    inputs = _input_key(branch, carry, ints)
    key = ("typed", inputs, _frozen(target))
    if key not in types:
        traced = _traced(branch, carry, ints, types, inputs)
        types[key] = lambda carry, ints: cast_vma(traced.run(carry, ints), target)
    return types[key]


def _frozen(tree: PyTree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda a: isinstance(a, frozenset))
    return treedef, tuple(leaves)


def _output_vmas(branch: Callable, carry, ints, types: dict) -> PyTree:
    """Varying axes of ``branch(carry, ints)``'s outputs."""
    return _traced(branch, carry, ints, types).vmas


class _Traced(NamedTuple):
    """A branch traced for one set of input types: ``run(carry, ints)`` replays its program (the
    model's Python is not run again), ``vmas`` its outputs' varying axes."""

    run: Callable
    vmas: PyTree


def _traced(branch: Callable, carry, ints, types: dict, key: tuple | None = None) -> _Traced:
    """``branch`` traced once per input types (``key``: :func:`_input_key`, when known), for both
    its output types and ``lax.switch``."""
    key = key or _input_key(branch, carry, ints)
    if key not in types:
        run, shapes = traced_once(branch, carry, ints)
        types[key] = _Traced(run, vmas(shapes))
    return types[key]


def _input_key(branch: Callable, carry, ints) -> tuple:
    return (branch, *(_avals(tree) for tree in (carry, ints)))


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
