"""The inspect report: collectives, bytes per axis and kind, memory, and the theory.

:func:`summarize` turns a compiled program into a JSON-able dict;
:func:`render_text` draws it as tables. Bytes are per device; ``*_per_step``
totals multiply each collective by its executions (loop trip counts).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...                   in_specs=P("data"), out_specs=P(), check_vma=False)
    >>> summary = summarize(jax.jit(f).lower(jnp.ones((mesh.size, 4))).compile(), mesh)
    >>> sorted(summary)
    ['collectives', 'memory', 'mesh', 'theory', 'totals']
    >>> "Collectives" in render_text(summary)
    True
"""

from __future__ import annotations

import io
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from torsh_jax.analysis.hlo import Collective
from torsh_jax.analysis.memory import memory_report, peak_bytes
from torsh_jax.analysis.overlap import collectives_once
from torsh_jax.analysis.theory import Theory, ring_wire_bytes
from torsh_jax.units import format_bytes

__all__ = [
    "summarize",
    "render_text",
    "axis_key",
    "axis_theory_section",
    "widening_note",
    "collective_totals",
    "sent_per_device",
]


def axis_key(axes: tuple[str, ...] | None) -> str:
    """``("data", "fsdp")`` -> ``"data+fsdp"``; ``()`` -> ``"-"`` (one device); ``None`` -> ``"?"``."""
    if axes is None:
        return "?"
    return "+".join(axes) if axes else "-"


def _row(c: Collective) -> dict:
    return {
        "kind": c.kind,
        "opcode": c.opcode,
        "name": c.name,
        "axes": None if c.axes is None else list(c.axes),
        "dtype": c.dtype,
        "operand_shapes": list(c.operand_shapes),
        "result_shapes": list(c.result_shapes),
        "operand_bytes": c.operand_bytes,
        "result_bytes": c.result_bytes,
        "payload_bytes": c.payload_bytes,
        "wire_bytes": c.wire_bytes,
        "widened_from": c.widened_from,
        "unwidened_payload_bytes": c.unwidened_payload_bytes,
        "group_size": c.group_size,
        "replica_groups": [list(g) for g in c.replica_groups],
        "executions": c.executions,
        "in_loop": c.in_loop,
        "trip_count": c.trip_count,
        "computation": c.computation,
        "op_name": c.op_name,
    }


def _empty_entry() -> dict:
    return {
        "count": 0,
        "payload_bytes": 0,
        "unwidened_payload_bytes": 0,
        "wire_bytes": 0.0,
        "unwidened_wire_bytes": 0.0,
    }


def _unwidened_wire(c: Collective) -> float:
    return ring_wire_bytes(c.kind, c.unwidened_payload_bytes, c.group_size) * c.executions


def collective_totals(found: list[Collective]) -> dict:
    """Payload and wire bytes of ``found`` per step (each collective times its executions), in all,
    per axis and per kind (with the counts and the bytes before any widening)."""
    by_axis: dict[str, dict] = {}
    by_kind: dict[str, dict] = {}
    for c in found:
        for table, key in ((by_axis, axis_key(c.axes)), (by_kind, c.kind)):
            entry = table.setdefault(key, _empty_entry())
            entry["count"] += c.executions
            entry["payload_bytes"] += c.payload_bytes_per_step
            entry["unwidened_payload_bytes"] += c.unwidened_payload_bytes * c.executions
            entry["wire_bytes"] += c.wire_bytes_per_step
            entry["unwidened_wire_bytes"] += _unwidened_wire(c)
    return {
        "payload_bytes": sum(c.payload_bytes_per_step for c in found),
        "unwidened_payload_bytes": sum(c.unwidened_payload_bytes * c.executions for c in found),
        "wire_bytes": sum(c.wire_bytes_per_step for c in found),
        "unwidened_wire_bytes": sum(_unwidened_wire(c) for c in found),
        "by_axis": by_axis,
        "by_kind": by_kind,
    }


def sent_per_device(summary: dict) -> dict:
    """What one device sends per step, as ``summary["totals"]`` has it (``wire_bytes``,
    ``payload_bytes``, ``by_axis``); under a pipeline, the stage that sends most
    (``summary["stage_totals"]``: a device runs only its stage's branches)."""
    stages = summary.get("stage_totals")
    return max(stages, key=lambda s: s["wire_bytes"]) if stages else summary["totals"]


def _covered(key: str, axes: set[str]) -> bool:
    """Whether collectives over the axes of ``key`` are ones the theory models."""
    return key == "-" or (key != "?" and set(key.split("+")) <= axes)


def _theory_section(theory: Theory | None, totals: dict, found: list[Collective]) -> dict | None:
    """The theory with measured/theory ratios over the axes it models (its data-parallel axes).

    Collectives over other axes (``tensor`` activations) are left out of the
    ratios and reported as ``other_axes_wire_bytes``.
    """
    if theory is None:
        return None
    section = theory.to_dict()
    axes = {a for c in theory.collectives for a in c.axes} or {"data", "fsdp"}
    covered = {k: v for k, v in totals["by_axis"].items() if _covered(k, axes)}
    # Ratios use the data's own dtype: the CPU backend widens bf16/f16 collectives to f32
    # (``wire_ratio_as_compiled`` keeps the widened figure).
    measured = sum(v["unwidened_wire_bytes"] for v in covered.values())
    as_compiled = sum(v["wire_bytes"] for v in covered.values())
    section["wire_ratio"] = measured / theory.wire_bytes if theory.wire_bytes else None
    section["wire_ratio_as_compiled"] = as_compiled / theory.wire_bytes if theory.wire_bytes else None
    section["other_axes_wire_bytes"] = {
        k: v["wire_bytes"] for k, v in totals["by_axis"].items() if not _covered(k, axes)
    }
    by_kind: dict[str, int] = {}
    for c in found:
        if _covered(axis_key(c.axes), axes):
            by_kind[c.kind] = by_kind.get(c.kind, 0) + c.unwidened_payload_bytes * c.executions
    section["payload_ratio_by_kind"] = {
        kind: by_kind.get(kind, 0) / want for kind, want in theory.payload_bytes_by_kind.items() if want
    }
    return section


def widening_note(rows: list[dict]) -> str | None:
    """One line on the collectives the backend ran wider than their data (``summary["collectives"]``).

    XLA's CPU compiler runs bf16 and f16 collectives in f32 (it converts
    before and after them); the program as lowered asks for the 16-bit
    dtype. Ratios use the data's own dtype.

    Example:
        >>> widening_note([{"kind": "reduce-scatter", "dtype": "f32", "widened_from": "bf16"}])[:56]
        'the backend runs 1 bf16 collective (1 reduce-scatter) in'
    """
    widened = [r for r in rows if r.get("widened_from")]
    if not widened:
        return None
    kinds: dict[str, int] = {}
    for r in widened:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    narrow = "/".join(dict.fromkeys(r["widened_from"] for r in widened))
    wide = "/".join(dict.fromkeys(r["dtype"] for r in widened))
    counts = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    plural = "s" if len(widened) > 1 else ""
    return (
        f"the backend runs {len(widened)} {narrow} collective{plural} ({counts}) in {wide}; "
        f"wire_ratio counts the {narrow} data (as lowered), wire_ratio_as_compiled what this backend sends"
    )


def _sent_per_device(c: Collective, devices: int | None) -> float:
    """Wire bytes per device; a collective-permute's as sent by its pairs, averaged over ``devices``
    (a pipeline permute sends only from the stages that have something to send)."""
    if c.kind != "collective-permute" or not devices or not c.source_target_pairs:
        return _unwidened_wire(c)
    return c.unwidened_payload_bytes * len(c.source_target_pairs) / devices * c.executions


def axis_theory_section(
    theory: Theory, found: list[Collective], axis: str, devices: int | None = None
) -> dict:
    """``theory`` of one mesh axis against the collectives measured over exactly that axis.

    Adds ``measured_wire_bytes``, ``wire_ratio`` and, per kind,
    ``measured_wire_bytes_by_kind``, ``wire_ratio_by_kind`` (measured / theory),
    ``count_by_kind`` (theory) and ``measured_count_by_kind`` (executions; the
    compiler may combine small all-reduces into one). With ``devices`` (the
    mesh size) a collective-permute counts the bytes its pairs send, averaged
    over the devices.
    """
    measured: dict[str, float] = {}
    counts: dict[str, int] = {}
    for c in found:
        if c.axes == (axis,):
            measured[c.kind] = measured.get(c.kind, 0.0) + _sent_per_device(c, devices)
            counts[c.kind] = counts.get(c.kind, 0) + c.executions
    wanted: dict[str, float] = {}
    for c in theory.collectives:
        wanted[c.kind] = wanted.get(c.kind, 0.0) + c.wire_bytes
    section = theory.to_dict()
    section["measured_wire_bytes"] = sum(measured.values())
    section["wire_ratio"] = section["measured_wire_bytes"] / theory.wire_bytes if theory.wire_bytes else None
    section["measured_wire_bytes_by_kind"] = measured
    section["wire_ratio_by_kind"] = {k: measured.get(k, 0.0) / v for k, v in wanted.items() if v}
    section["count_by_kind"] = theory.count_by_kind
    section["measured_count_by_kind"] = counts
    return section


def summarize(
    compiled,
    mesh,
    *,
    theory: Theory | None = None,
    axis_theories: dict[str, Theory] | None = None,
    as_run: Callable[[list[Collective]], list[Collective]] | None = None,
) -> dict:
    """A JSON-able summary of a compiled program's collectives and memory.

    Args:
        compiled: ``jax.jit(f).lower(*args).compile()``.
        mesh: the mesh it was compiled for.
        theory: the plan's minimum (:mod:`torsh_jax.analysis.theory`), to
            report measured/theory ratios.
        axis_theories: theories of single other axes (``{"tensor": ...}``),
            reported under ``theory["axes"]`` (:func:`axis_theory_section`).
        as_run: the collectives one device runs, of all the program holds (a pipeline's first
            stage: it takes one branch of each tick); the theories are measured against them.

    Returns:
        ``{"mesh": {axis: size}, "collectives": [...], "totals": {...},
        "memory": {...}, "theory": {...} | None}``. ``totals`` has per-step
        ``payload_bytes``, ``unwidened_payload_bytes`` (payload in the
        data's own dtype where the backend widened it, see
        :attr:`~torsh_jax.analysis.Collective.widened_from`) and
        ``wire_bytes``, and the same per ``by_axis`` and ``by_kind`` entry
        (with ``count`` = executions per step). ``memory`` holds the
        :class:`~torsh_jax.analysis.memory.MemoryReport` fields and ``peak_bytes``
        (:func:`~torsh_jax.analysis.memory.peak_bytes` on the mesh's platform).
    """
    found = collectives_once(compiled, mesh)
    totals = collective_totals(found)
    run = as_run(found) if as_run else found
    section = _theory_section(theory, collective_totals(run) if as_run else totals, run)
    if section is not None and axis_theories:
        section["axes"] = {
            axis: axis_theory_section(t, run, axis, devices=mesh.size) for axis, t in axis_theories.items()
        }
    return {
        "mesh": {name: int(size) for name, size in mesh.shape.items()},
        "collectives": [_row(c) for c in found],
        "totals": totals,
        "memory": _memory(compiled, mesh),
        "theory": section,
    }


def _memory(compiled, mesh) -> dict[str, int | None]:
    """The memory report's fields, ``peak_estimate_bytes`` and ``peak_bytes``: the peak the mesh's
    platform holds to its memory (libtpu's own on a TPU, where ``temp`` is not what it holds at
    its peak)."""
    report = memory_report(compiled)
    return {**report.to_dict(), "peak_bytes": peak_bytes(report, mesh.devices.flat[0].platform)}


def _shapes(shapes: list[str], *, limit: int = 3) -> str:
    shown = " ".join(shapes[:limit])
    return f"{shown} +{len(shapes) - limit} more" if len(shapes) > limit else shown


def _collectives_table(summary: dict) -> Table:
    """One row per distinct collective (kind, axes, dtype, shapes, bytes, loop): ``ops`` counts the
    HLO instructions it stands for, ``x/step`` their executions per step together."""
    table = Table(title="Collectives (per device)")
    for column in ("kind", "axes", "dtype", "shapes", "payload", "wire", "ops", "x/step", "where"):
        table.add_column(
            column, justify="right" if column in ("payload", "wire", "ops", "x/step") else "left"
        )
    for row, (ops, executions) in _distinct_collectives(summary["collectives"]).items():
        table.add_row(*row[:6], str(ops), str(executions), row[6])
    return table


def _distinct_collectives(rows: list[dict]) -> dict[tuple, list[int]]:
    """``(kind, axes, dtype, shapes, payload, wire, where) -> [ops, executions]`` in first-seen order."""
    merged: dict[tuple, list[int]] = {}
    for c in rows:
        axes = axis_key(None if c["axes"] is None else tuple(c["axes"]))
        loop = f"loop x{c['trip_count'] or '?'}" if c["in_loop"] else "top"
        dtype = f"{c['dtype']} (from {c['widened_from']})" if c["widened_from"] else c["dtype"]
        shapes = f"{_shapes(c['operand_shapes'])} -> {_shapes(c['result_shapes'])}"
        key = (
            c["kind"],
            axes,
            dtype,
            shapes,
            format_bytes(c["payload_bytes"]),
            format_bytes(c["wire_bytes"]),
            loop,
        )
        counts = merged.setdefault(key, [0, 0])
        counts[0] += 1
        counts[1] += c["executions"]
    return merged


def _totals_table(summary: dict) -> Table:
    table = Table(title="Bytes per step (per device)")
    for column in ("group", "count", "payload", "wire"):
        table.add_column(column, justify="left" if column == "group" else "right")
    totals = summary["totals"]
    for prefix, section in (("axis", "by_axis"), ("kind", "by_kind")):
        for key, entry in totals[section].items():
            row = (f"{prefix} {key}", str(entry["count"]), format_bytes(entry["payload_bytes"]))
            table.add_row(*row, format_bytes(entry["wire_bytes"]))
    table.add_row("total", "", format_bytes(totals["payload_bytes"]), format_bytes(totals["wire_bytes"]))
    theory = summary.get("theory")
    if theory:
        table.add_row(f"theory: {theory['description']}", "", format_bytes(theory["payload_bytes"]),
                      format_bytes(theory["wire_bytes"]))  # fmt: skip
        ratio = theory["wire_ratio"]
        table.add_row("measured / theory", "", "", "n/a" if ratio is None else f"{ratio:.2f}")
        for axis, section in theory.get("axes", {}).items():
            sizes = format_bytes(section["payload_bytes"]), format_bytes(section["wire_bytes"])
            table.add_row(f"theory {axis}: {section['description']}", "", *sizes)
            ratios = ", ".join(f"{k} {v:.2f}" for k, v in section["wire_ratio_by_kind"].items())
            table.add_row(f"measured / theory ({axis}: {ratios})", "", "", f"{section['wire_ratio']:.2f}")
    return table


def _memory_table(summary: dict) -> Table:
    table = Table(title="Memory (per device)")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    for key, value in summary["memory"].items():
        if key.startswith("host_") and not value:
            continue
        table.add_row(key.removesuffix("_bytes"), format_bytes(value))
    return table


def render_text(summary: dict, *, width: int = 140) -> str:
    """The summary as plain-text tables (collectives, bytes per step, memory)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    mesh = " x ".join(f"{name}={size}" for name, size in summary["mesh"].items())
    console.print(f"mesh: {mesh}")
    for table in (_collectives_table(summary), _totals_table(summary), _memory_table(summary)):
        console.print(table)
    return console.file.getvalue()
