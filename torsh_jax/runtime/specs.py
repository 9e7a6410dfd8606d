"""Logical axis rules -> ``PartitionSpec`` for every parameter of a pytree.

A parameter's logical dimension names come from flax partitioning metadata
(``nn.with_logical_partitioning`` / ``nnx`` ``sharding``) when present,
otherwise from the plan's ``param_dims`` (regex on the ``/``-joined pytree
path, first match wins). The plan's ``rules`` map each logical name to mesh
axes; a mesh axis is used at most once per parameter, and axes of size 1 are
left out (they shard nothing).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from torsh_jax.plan import ParallelPlan
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> mesh = build_mesh(ParallelPlan(), jax.devices()[:1])
    >>> param_specs({"embed": {"embedding": jnp.zeros((256, 64))}}, ParallelPlan(), mesh)
    {'embed': {'embedding': P(None, None)}}
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.errors import ShardingError
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.mesh import mesh_shape_str
from torsh_jax.typing import PyTree

__all__ = [
    "path_str",
    "logical_dims",
    "param_specs",
    "named_shardings",
    "check_divisible",
    "entry_axes",
    "is_boxed",
    "param_dims_from_metadata",
]


def path_str(path: Sequence) -> str:
    """A pytree key path as the ``/``-separated name that plan keys, errors, ``inspect`` and
    checkpoints show: ``jax.tree_util.keystr`` in its simple form.

    Example:
        >>> path_str(jax.tree_util.tree_flatten_with_path({"layers": {"wq": 0}})[0][0][0])
        'layers/wq'
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _metadata_names(leaf: object) -> tuple[str | None, ...] | None:
    """Logical names from flax partitioning metadata, if the leaf carries any.

    linen: ``nn.with_logical_partitioning`` / ``nn.with_partitioning`` boxes
    (``.names``); nnx: ``nnx.Param(..., sharding_names=...)`` variables.
    """
    names = getattr(leaf, "names", None)
    get_metadata = getattr(leaf, "get_metadata", None)
    if names is None and callable(get_metadata):
        meta = get_metadata()
        names = next((meta[k] for k in ("out_sharding", "sharding_names", "sharding") if meta.get(k)), None)
    if isinstance(names, (tuple, list)) and all(n is None or isinstance(n, str) for n in names):
        return tuple(names)
    return None


def is_boxed(x: object) -> bool:
    """A flax parameter box (linen partitioning metadata or an nnx variable)."""
    nnx_variable = callable(getattr(x, "get_value", None)) and callable(getattr(x, "get_metadata", None))
    linen_box = hasattr(type(x), "unbox") and hasattr(x, "names")
    return nnx_variable or linen_box


def _shape(leaf: object) -> tuple[int, ...]:
    if callable(getattr(leaf, "get_value", None)):  # nnx variable
        leaf = leaf.get_value()
    elif is_boxed(leaf):  # linen partitioning box
        leaf = leaf.value
    return tuple(getattr(leaf, "shape", ()))


def param_dims_from_metadata(params: PyTree) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``param_dims`` entries (exact path regexes) from flax partitioning metadata.

    Use as ``plan.replace(param_dims=param_dims_from_metadata(boxed) + plan.param_dims)``
    so a train step on the unboxed parameters keeps the model's own annotations.
    """
    found = []

    def one(path, leaf):
        names = _metadata_names(leaf)
        if names is not None:
            found.append((f"^{re.escape(path_str(path))}$", tuple(n or "" for n in names)))

    jax.tree_util.tree_map_with_path(one, params, is_leaf=is_boxed)
    return tuple(found)


def logical_dims(path: str, leaf: object, plan: ParallelPlan) -> tuple[str | None, ...]:
    """Logical dimension names of one parameter (``None`` = unnamed dim).

    Raises:
        ShardingError: a ``param_dims`` rule matches but names a different
            number of dims than the parameter has.
    """
    ndim = len(_shape(leaf))
    names = _metadata_names(leaf)
    if names is None:
        for pattern, dims in plan.param_dims:
            if re.search(pattern, path):
                names = tuple(dims)
                break
    if names is None:
        return (None,) * ndim
    names = _leading_layers(names, ndim)
    if len(names) != ndim:
        raise ShardingError(
            f"logical dims {list(names)} name {len(names)} dims but the parameter has shape {_shape(leaf)}",
            key=path,
            fix="correct the matching param_dims entry (one name per dim, '' for none; a leading '...' "
            "for stacked layers)",
        )
    return tuple(n or None for n in names)


def _leading_layers(names: tuple[str, ...], ndim: int) -> tuple[str, ...]:
    """``("...", *rest)``: the dims before ``rest`` are stacked layers (none for a block's own
    parameter, one for blocks stacked on a leading dim)."""
    if not names or names[0] != "...":
        return names
    rest = names[1:]
    return ("layers",) * max(ndim - len(rest), 0) + rest


def _rule_axes(plan: ParallelPlan) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for logical, axes in plan.rules:
        out.setdefault(logical, tuple(axes))
    return out


def _spec_for(names: tuple[str | None, ...], rules: dict[str, tuple[str, ...]], mesh: Mesh) -> P:
    used: set[str] = set()
    entries = []
    for name in names:
        axes = tuple(
            a for a in rules.get(name, ()) if a in mesh.axis_names and mesh.shape[a] > 1 and a not in used
        )
        used.update(axes)
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*entries)


def entry_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry names: ``None`` -> ``()``, ``"x"`` -> ``("x",)``."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(path: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> None:
    """Raise :class:`ShardingError` when a dim does not divide its mesh axes."""
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        size = 1
        for axis in axes:
            size *= mesh.shape[axis]
        if size > 1 and shape[dim] % size:
            raise ShardingError(
                f"dim {dim} of shape {shape} is not divisible by {size} (mesh axes {list(axes)}; "
                f"mesh {mesh_shape_str(mesh)})",
                key=path,
                fix=f"make dim {dim} a multiple of {size}, or map its logical name to other mesh axes "
                "in the plan's rules",
            )


def param_specs(params: PyTree, plan: ParallelPlan, mesh: Mesh) -> PyTree:
    """A ``PartitionSpec`` per parameter leaf, validated against ``mesh``.

    Flax boxes (linen partitioning metadata, nnx variables) count as leaves and
    their annotations win over the plan's ``param_dims``.

    Raises:
        ShardingError: a dim does not divide its mesh axes (names the path).
    """
    rules = _rule_axes(plan)

    def one(path, leaf):
        where = path_str(path)
        spec = _spec_for(logical_dims(where, leaf, plan), rules, mesh)
        check_divisible(where, _shape(leaf), spec, mesh)
        return spec

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_boxed)


def named_shardings(specs: PyTree, mesh: Mesh) -> PyTree:
    """``NamedSharding`` for every ``PartitionSpec`` leaf of ``specs``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
