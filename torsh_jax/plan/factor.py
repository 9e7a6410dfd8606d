"""Resolve a :class:`MeshSpec` against a device count, suggesting fixes.

Example:
    >>> from torsh_jax.plan import MeshSpec, AxisSize
    >>> MeshSpec(data=AxisSize(ici=2), fsdp=AxisSize(ici=-1)).resolve(8).shape
    {'data': 2, 'stage': 1, 'fsdp': 4, 'tensor': 1}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax.errors import MeshError, PlanError

if TYPE_CHECKING:
    from torsh_jax.plan.spec import MeshSpec, ResolvedMesh

__all__ = ["check_mesh_fits", "factorisations"]

_MAX_SUGGESTIONS = 6


def factorisations(total: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every way to write ``total`` as a product of sizes over ``axes``.

    >>> factorisations(4, ("data", "fsdp"))
    [{'data': 1, 'fsdp': 4}, {'data': 2, 'fsdp': 2}, {'data': 4, 'fsdp': 1}]
    """
    if not axes:
        return [{}] if total == 1 else []
    out = []
    for size in range(1, total + 1):
        if total % size == 0:
            for rest in factorisations(total // size, axes[1:]):
                out.append({axes[0]: size, **rest})
    return out


def _fill(sizes: dict[str, int], total: int) -> dict[str, int] | None:
    """Replace a single ``-1`` so the sizes multiply to ``total``; None if impossible."""
    fixed = 1
    for size in sizes.values():
        fixed *= 1 if size == -1 else size
    free = [name for name, size in sizes.items() if size == -1]
    if free:
        if total % fixed:
            return None
        return {**sizes, free[0]: total // fixed}
    return sizes if fixed == total else None


def _suggest(spec: MeshSpec, total: int) -> str:
    from torsh_jax.plan.spec import AXES

    axes = spec.used_axes() or ("data",)
    options = [
        ", ".join(f"{a}={s}" for a, s in f.items())
        for f in factorisations(total, tuple(a for a in AXES if a in axes))
    ]
    shown = "; ".join(options[:_MAX_SUGGESTIONS])
    more = f" (+{len(options) - _MAX_SUGGESTIONS} more)" if len(options) > _MAX_SUGGESTIONS else ""
    return f"sizes that multiply to {total}, e.g. {shown}{more}, or set one axis to -1"


def _resolve_part(spec: MeshSpec, part: str, total: int, where: str) -> dict[str, int]:
    from torsh_jax.plan.spec import MESH_AXIS_ORDER

    sizes = {a: getattr(getattr(spec, a), part) for a in MESH_AXIS_ORDER}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise PlanError(
            f"only one axis may be -1 in the {part} part, got {free}",
            key=f"mesh.{free[1]}.{part}",
            fix="give every axis but one an explicit size",
        )
    filled = _fill(sizes, total)
    if filled is None:
        shape = {a: s for a, s in sizes.items() if s != 1}
        raise MeshError(
            f"mesh {part} sizes {shape or sizes} do not fit {total} {where}",
            key=f"mesh ({part})",
            fix=f"use {_suggest(spec, total)}",
        )
    return filled


def check_mesh_fits(spec: MeshSpec, num_devices: int, num_slices: int) -> ResolvedMesh:
    """Resolve ``spec`` for ``num_devices`` devices split into ``num_slices`` slices."""
    from torsh_jax.plan.spec import ResolvedMesh

    if num_slices < 1 or num_devices % num_slices:
        raise MeshError(
            f"{num_devices} devices cannot form {num_slices} equal slices",
            key="num_slices",
            fix="use a slice count that divides the device count",
        )
    per_slice = num_devices // num_slices
    dcn = _resolve_part(spec, "dcn", num_slices, "slices")
    ici = _resolve_part(spec, "ici", per_slice, f"devices per slice ({num_slices} slice(s))")
    return ResolvedMesh(ici=ici, dcn=dcn)
