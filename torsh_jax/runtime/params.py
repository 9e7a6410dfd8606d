"""What a train step accepts as parameters, and what it does to them.

* **flax boxes**: linen ``LogicallyPartitioned`` / ``Partitioned`` leaves
  (straight from ``model.init``) and an ``nnx.State`` are unboxed to plain
  arrays; their logical axis names become ``param_dims`` rules, so the plan's
  sharding rules apply to them. The train state holds the plain arrays
  (``nnx.replace_by_pure_dict(state, train_state.params)`` puts them back).
* **Integer and boolean leaves** (a step counter, an index table) cannot be
  differentiated: they are refused at ``init`` with the parameter path. Keep
  them outside the parameters (in the batch or a closure).
* **Floating leaves** are kept in ``precision.param_dtype``: a leaf of another
  dtype is cast once, with a :class:`~torsh_jax.errors.PrecisionWarning` and
  a note that ``inspect`` reports.

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.plan import ParallelPlan
    >>> intake = take_params({"w": jnp.ones(2, jnp.bfloat16)}, ParallelPlan())
    >>> intake.params["w"].dtype, intake.notes
    (dtype(bfloat16), ('w: bfloat16 is kept as float32 (precision.param_dtype)',))
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from torsh_jax.errors import ParameterError, PrecisionWarning
from torsh_jax.plan.spec import DEFAULT_PARAM_DIMS, ParallelPlan
from torsh_jax.runtime.specs import is_boxed, logical_dims, param_dims_from_metadata, path_str
from torsh_jax.typing import PyTree

__all__ = ["ParamIntake", "take_params", "unbox", "with_auto_tensor_names"]


class ParamIntake(NamedTuple):
    """Plain parameters, the plan with their flax axis names, and what will change."""

    params: PyTree
    plan: ParallelPlan
    notes: tuple[str, ...]


def unbox(params: PyTree) -> tuple[PyTree, tuple]:
    """``(plain arrays, param_dims rules from flax metadata)`` of linen boxes or an ``nnx.State``."""
    rules = param_dims_from_metadata(params)
    if callable(getattr(params, "to_pure_dict", None)):  # nnx.State (its own method is deprecated)
        from flax import nnx

        return nnx.to_pure_dict(params), rules
    if any(is_boxed(x) for x in jax.tree.leaves(params, is_leaf=is_boxed)):
        from flax.linen import meta

        return meta.unbox(params), rules
    return params, rules


def _check_trainable(params: PyTree) -> None:
    def one(path, leaf):
        dtype = jnp.dtype(getattr(leaf, "dtype", jnp.result_type(leaf)))
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ParameterError(
                f"has dtype {dtype}: only floating parameters can be trained",
                key=path_str(path),
                fix="keep integer state (counters, index tables) out of params: in the batch or a closure",
            )

    jax.tree_util.tree_map_with_path(one, params)


def _dtype_notes(params: PyTree, param_dtype: str) -> tuple[str, ...]:
    target = jnp.dtype(param_dtype)
    notes = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = jnp.dtype(leaf.dtype)
        if jnp.issubdtype(dtype, jnp.floating) and dtype != target:
            notes.append(f"{path_str(path)}: {dtype} is kept as {target} (precision.param_dtype)")
    return tuple(notes)


def take_params(params: PyTree, plan: ParallelPlan, *, warn: bool = False) -> ParamIntake:
    """Unbox ``params``, refuse what cannot be trained and note dtype changes.

    Raises:
        ParameterError: a non-floating leaf (names its path).
    """
    plain, rules = unbox(params)
    _check_trainable(plain)
    notes = _dtype_notes(plain, plan.precision.param_dtype)
    if warn and notes:
        shown = "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3 else "")
        warnings.warn(f"parameters change dtype: {shown}", PrecisionWarning, stacklevel=3)
    plan = plan.replace(param_dims=rules + tuple(plan.param_dims)) if rules else plan
    return ParamIntake(plain, plan, notes)


def with_auto_tensor_names(plan: ParallelPlan, params: PyTree, loss_fn, mesh) -> ParallelPlan:
    """``plan`` with Megatron's names (:func:`~torsh_jax.runtime.tensor_names.auto_param_dims`) for the
    parameters neither the model's own names nor the plan's ``param_dims`` name, when
    ``tensor.rules = "auto"`` and the mesh has a ``tensor`` axis. They come before the default
    ``param_dims`` (the demo model's names: a flax ``Embed``'s ``embedding`` is not always a
    vocabulary)."""
    tensor = dict(mesh.shape).get("tensor", 1)
    if plan.tensor.rules != "auto" or tensor <= 1:
        return plan
    from torsh_jax.runtime.layered import as_model
    from torsh_jax.runtime.tensor_names import auto_param_dims

    model = as_model(loss_fn)
    own = tuple(entry for entry in plan.param_dims if entry not in DEFAULT_PARAM_DIMS)
    by_own = plan.replace(param_dims=own)
    named = lambda path, shape: any(logical_dims(path, jax.ShapeDtypeStruct(shape, jnp.float32), by_own))
    found = auto_param_dims(params, model.layers_key if model.stacked else None, tensor=tensor, skip=named)
    return plan.replace(param_dims=own + found + DEFAULT_PARAM_DIMS)
