"""Resolve mesh axis sizes (``-1`` = the rest) against a device count, suggesting fixes.

Works on plain ``{axis: (ici, dcn)}`` sizes, so that :class:`~torsh_jax.plan.spec.MeshSpec`
can call it without this module knowing the plan's classes.

Example:
    >>> resolve_sizes({"data": (2, 1), "fsdp": (-1, 1)}, num_devices=8, num_slices=1)
    ({'data': 2, 'fsdp': 4}, {'data': 1, 'fsdp': 1})
"""

from __future__ import annotations

from torsh_jax.errors import MeshError, PlanError

__all__ = ["resolve_sizes", "factorisations", "link_kind"]

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


def _suggest(used_axes: tuple[str, ...], total: int) -> str:
    axes = used_axes or ("data",)
    options = [", ".join(f"{a}={s}" for a, s in f.items()) for f in factorisations(total, axes)]
    shown = "; ".join(options[:_MAX_SUGGESTIONS])
    more = f" (+{len(options) - _MAX_SUGGESTIONS} more)" if len(options) > _MAX_SUGGESTIONS else ""
    return f"sizes that multiply to {total}, e.g. {shown}{more}, or set one axis to -1"


def _resolve_part(
    sizes: dict[str, int], part: str, total: int, where: str, used_axes: tuple[str, ...]
) -> dict[str, int]:
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
            fix=f"use {_suggest(used_axes, total)}",
        )
    return filled


def resolve_sizes(
    sizes: dict[str, tuple[int, int]],
    /,
    *,
    num_devices: int,
    num_slices: int,
    used_axes: tuple[str, ...] = (),
) -> tuple[dict[str, int], dict[str, int]]:
    """``(ici, dcn)`` sizes of every axis for ``num_devices`` devices in ``num_slices`` slices.

    Args:
        sizes: ``{axis: (ici, dcn)}``, at most one ``-1`` per part.
        num_devices: devices in all.
        num_slices: slices they form (cross-slice, DCN).
        used_axes: axes the error message suggests sizes for (default: ``data``).

    Raises:
        MeshError: the sizes cannot multiply to the counts; the fix lists factorisations.
        PlanError: more than one ``-1`` in a part.
    """
    if num_slices < 1 or num_devices % num_slices:
        raise MeshError(
            f"{num_devices} devices cannot form {num_slices} equal slices",
            key="num_slices",
            fix="use a slice count that divides the device count",
        )
    per_slice = num_devices // num_slices
    parts = {part: {a: pair[i] for a, pair in sizes.items()} for i, part in enumerate(("ici", "dcn"))}
    dcn = _resolve_part(parts["dcn"], "dcn", num_slices, "slices", used_axes)
    ici = _resolve_part(
        parts["ici"], "ici", per_slice, f"devices per slice ({num_slices} slice(s))", used_axes
    )
    return ici, dcn


def link_kind(axes: tuple[str, ...] | list[str], dcn: dict[str, int], /) -> str:
    """``"dcn"`` when a collective over ``axes`` crosses slices (a ``dcn`` size > 1), else ``"ici"``.

    >>> link_kind(("data", "fsdp"), {"data": 2}), link_kind(("fsdp",), {"data": 2})
    ('dcn', 'ici')
    """
    return "dcn" if any(dcn.get(a, 1) > 1 for a in axes) else "ici"
