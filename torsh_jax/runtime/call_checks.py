"""What a train step is called with: the state against the step's layout, the loss's value.

Both checks cost nothing per step: :func:`check_state` runs when the step is
traced (a new state structure, shape or dtype retraces) and when the jitted
call refuses its arguments (a state laid out by another plan), and
:func:`scalar_loss` checks the loss's shape while it is traced.

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.runtime.state import TrainState
    >>> want = TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.zeros(2)}, opt_state=())
    >>> check_state(want._replace(params={"w": jnp.ones(2)}), want)
    >>> try:
    ...     check_state(want._replace(params={"w": jnp.ones(3)}), want)
    ... except ArgumentError as err:
    ...     print(err.key)
    state.params['w']
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from torsh_jax.errors import ArgumentError
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.runtime.mesh import mesh_shape_str
from torsh_jax.runtime.state import TrainState
from torsh_jax.tensor.axis import has_tensor_blocks
from torsh_jax.typing import PyTree

__all__ = ["check_state", "check_params", "require_train_state", "scalar_loss"]

_ANOTHER = {
    "step": "not a train step's state",
    "params": "a state of another model",
    "opt_state": "a state made with another optimizer",
    "loss_scale": "a state of a plan with other loss scaling (precision.loss_scale)",
    "feedback": "a state of a plan with other compression (error feedback)",
}
_PARAMS_FIX = "make the step with these parameters (or their jax.eval_shape shapes)"
_FIX = (
    "pass the state this step's init (or its last call) returned; to change plans, restore a "
    "checkpoint into this step"
)


def _kinds(tree: PyTree) -> str:
    """``(ScaleByAdamState, EmptyState)``: the containers of a pytree, for messages."""
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return "(" + ", ".join(_kinds(x) for x in tree) + ")"
    if isinstance(tree, dict):
        return "{" + ", ".join(map(str, tree)) + "}"
    return "None" if tree is None else type(tree).__name__


def _paths(tree: PyTree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _structure_difference(got: PyTree, want: PyTree) -> str:
    got_kinds, want_kinds = _kinds(got), _kinds(want)
    if got_kinds != want_kinds:
        return f"is {got_kinds}, this step's is {want_kinds}"
    got_paths, want_paths = _paths(got), _paths(want)
    extra = [p for p in got_paths if p not in set(want_paths)][:3]
    missing = [p for p in want_paths if p not in set(got_paths)][:3]
    parts = ([f"has {extra}, which this step's has not"] if extra else []) + (
        [f"lacks {missing}"] if missing else []
    )
    return " and ".join(parts) or f"is {jax.tree.structure(got)}, this step's is {jax.tree.structure(want)}"


def _shape_text(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}{list(x.shape)}"


def _layout_text(sharding: Any) -> str:
    if isinstance(sharding, NamedSharding):
        return f"{sharding.spec} over mesh {mesh_shape_str(sharding.mesh)}"
    return str(sharding)


def _leaf_difference(got: Any, want: jax.ShapeDtypeStruct, shardings: bool, reason: str) -> str | None:
    if not (hasattr(got, "shape") and hasattr(got, "dtype")):
        return f"is a {type(got).__name__}, this step's is an array {_shape_text(want)}: {reason}"
    if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
        return f"is {_shape_text(got)}, this step's is {_shape_text(want)}: {reason}"
    concrete = isinstance(got, jax.Array) and not isinstance(got, jax.core.Tracer) and got.committed
    if shardings and concrete and not got.sharding.is_equivalent_to(want.sharding, got.ndim):
        return (
            f"is laid out as {_layout_text(got.sharding)}, this step's as {_layout_text(want.sharding)}: "
            "a state made by another plan's step"
        )
    return None


def require_train_state(state: Any) -> None:
    """Raise :class:`ArgumentError` unless ``state`` is a :class:`TrainState`."""
    if not isinstance(state, TrainState):
        raise ArgumentError(f"the state is a {type(state).__name__}, not a TrainState", key="state", fix=_FIX)


def check_state(state: Any, expected: TrainState, *, shardings: bool = True) -> None:
    """Raise :class:`ArgumentError` when ``state`` is not laid out as ``expected``.

    Args:
        state: what the step was called with.
        expected: the step's state (``jax.ShapeDtypeStruct`` s, with shardings when ``shardings``).
        shardings: compare the shardings of committed arrays too.
    """
    require_train_state(state)
    for field in TrainState._fields:
        got, want = getattr(state, field), getattr(expected, field)
        if jax.tree.structure(got) != jax.tree.structure(want):
            raise ArgumentError(
                f"{_structure_difference(got, want)}: {_ANOTHER[field]}", key=f"state.{field}", fix=_FIX
            )
        got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
        for (path, leaf), want_leaf in zip(got_leaves, jax.tree.leaves(want)):
            difference = _leaf_difference(leaf, want_leaf, shardings, _ANOTHER[field])
            if difference:
                raise ArgumentError(
                    difference,
                    key=f"state.{field}{jax.tree_util.keystr(path)}",
                    fix=_FIX,
                )


def _value_text(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array {_shape_text(value)}"
    return f"a {type(value).__name__}"


def _scalar_checked(fn: Callable, where: str) -> Callable:
    @functools.wraps(fn)
    def checked(*args):
        value = fn(*args)
        if getattr(value, "shape", None) != ():
            raise ArgumentError(
                f"returned {_value_text(value)}; a train step differentiates a scalar loss",
                key=where,
                fix="return the mean loss over the batch as a scalar, e.g. jnp.mean(per_example_loss)",
            )
        return value

    checked.tensor_blocks = has_tensor_blocks(fn)  # also when ``fn`` is an object marked by its class
    return checked


def scalar_loss(model: LayeredModel) -> LayeredModel:
    """``model`` whose head (a plain loss's whole function) is checked to return a scalar when traced.

    Raises (when traced):
        ArgumentError: the loss returned a non-scalar (names its shape) or no array.
    """
    where = "loss_fn" if model.head_keys is None else "LayeredModel.head"
    return model._replace(head=_scalar_checked(model.head, where))


def check_params(params: PyTree, expected: PyTree) -> None:
    """Raise :class:`ArgumentError` when ``params`` are not shaped as the step's (``expected``:
    shapes and dtypes of the parameters the step was made for)."""
    if jax.tree.structure(params) != jax.tree.structure(expected):
        raise ArgumentError(
            f"{_structure_difference(params, expected)}: other parameters than the step was made for",
            key="params",
            fix=_PARAMS_FIX,
        )
    for (path, leaf), want in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(expected)):
        if tuple(leaf.shape) != tuple(want.shape):
            raise ArgumentError(
                f"is {_shape_text(leaf)}, the step's is {_shape_text(want)}: other parameters than the "
                "step was made for",
                key=f"params{jax.tree_util.keystr(path)}",
                fix=_PARAMS_FIX,
            )
