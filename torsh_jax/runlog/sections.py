"""The parts of a run's page (report and dashboard), each an HTML fragment built from a :class:`Run`.

Every figure is read from the run directory (the step log, ``run.json``, the ``inspect`` summary)
and shown with its source.

Example:
    >>> from torsh_jax.runlog.read import Run
    >>> steps = [{"step": 1, "step_time_s": 0.2}, {"step": 2, "step_time_s": 0.1}]
    >>> run = Run(Path("runs/a"), {}, steps=steps)
    >>> headline(run)["median_step_time_s"]
    0.1
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from html import escape
from pathlib import Path

from torsh_jax.analysis.memory import peak_of
from torsh_jax.runlog.findings import Finding, communication_share, findings, steady_steps
from torsh_jax.runlog.profile import HOW_TO_OPEN
from torsh_jax.runlog.read import Run
from torsh_jax.runlog.svg import bars, line_chart, pipeline_grid, stacked_bar
from torsh_jax.units import format_bytes

__all__ = [
    "headline",
    "headline_table",
    "curves",
    "breakdown",
    "bytes_table",
    "memory",
    "pipeline",
    "findings_list",
    "profile_links",
    "plan_text",
    "CURVES",
]

#: The curves drawn: (record key, title, scale, unit).
CURVES = (
    ("loss", "loss", 1.0, ""),
    ("step_time_s", "step time", 1e3, "ms"),
    ("tokens_per_s", "tokens / s", 1.0, "tokens/s"),
    ("mfu", "MFU", 100.0, "%"),
    ("grad_norm", "gradient norm", 1.0, ""),
    ("loss_scale", "loss scale", 1.0, ""),
)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def headline(run: Run) -> dict[str, float | int | None]:
    """The run's few numbers: medians over the steady steps, final loss, bytes and memory."""
    steady = steady_steps(run) or run.steps
    measured = run.header.get("inspect_headline") or {}
    return {
        "steps": len(run.steps),
        "final_loss": run.steps[-1].get("loss") if run.steps else None,
        "median_step_time_s": _median([s.get("step_time_s") for s in steady]),
        "median_tokens_per_s": _median([s.get("tokens_per_s") for s in steady]),
        "median_mfu": _median([s.get("mfu") for s in steady]),
        "compiles_after_first_step": sum(s.get("compiles") or 0 for s in run.steps[1:]),
        "wire_bytes_per_step": measured.get("wire_bytes_per_step"),
        "theoretical_wire_bytes_per_step": measured.get("theoretical_wire_bytes_per_step"),
        "wire_ratio_by_axis": measured.get("wire_ratio_by_axis"),
        "peak_memory_bytes": measured.get("memory_per_device_bytes"),
        "memory_capacity_bytes": run.header.get("memory_capacity_bytes"),
    }


def _fmt(key: str, value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, dict):
        return ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in value.items()) or "n/a"
    if key.endswith("_bytes") or key.endswith("_bytes_per_step"):
        return format_bytes(value)
    if key == "median_step_time_s":
        return f"{value * 1e3:.2f} ms"
    if key == "median_mfu":
        return f"{100 * value:.2f} %"
    return f"{value:,.4g}" if isinstance(value, float) else f"{value:,}"


_HEADLINE_SOURCES = {
    "median_step_time_s": "steady steps (after the first, not compiling, not profiled)",
    "median_mfu": "flops_source and peak_flops_source below",
    "wire_bytes_per_step": "compiled program (inspect), every axis, per device (a pipeline's busiest stage)",
    "theoretical_wire_bytes_per_step": "plan theory of the axes it models (inspect)",
    "wire_ratio_by_axis": "measured / theory per modelled axis (inspect)",
    "peak_memory_bytes": "compiled program's memory_analysis, per device",
    "memory_capacity_bytes": "memory_capacity_source below",
}


def headline_table(runs: list[Run]) -> str:
    """The headline numbers, one column per run (and B / A for two runs)."""
    numbers = [headline(r) for r in runs]
    cols = "".join(f"<th>{escape(r.name)}</th>" for r in runs) + ("<th>B / A</th>" if len(runs) == 2 else "")
    rows = [f"<tr><th>figure</th>{cols}<th>source</th></tr>"]
    for key in numbers[0]:
        cells = "".join(f'<td class="num">{_fmt(key, n[key])}</td>' for n in numbers)
        if len(runs) == 2:
            a, b = numbers[0][key], numbers[1][key]
            ratio = isinstance(a, int | float) and isinstance(b, int | float) and a
            cells += f'<td class="num">{b / a:.3g}</td>' if ratio else "<td>n/a</td>"
        rows.append(
            f"<tr><td>{key}</td>{cells}<td>{escape(_HEADLINE_SOURCES.get(key, 'step log'))}</td></tr>"
        )
    sources = "".join(
        f"<li>{escape(r.name)}: FLOPs {escape(str(r.header.get('flops_source')))}; peak "
        f"{escape(str(r.header.get('peak_flops_source')))}; memory capacity "
        f"{escape(str(r.header.get('memory_capacity_source')))}</li>"
        for r in runs
    )
    return f'<table class="headline">{"".join(rows)}</table><ul class="sources">{sources}</ul>'


def curves(runs: list[Run]) -> str:
    """One chart per logged quantity, a line per run."""
    out = []
    for key, title, scale, unit in CURVES:
        series = {
            r.name: [(s["step"], None if s.get(key) is None else s[key] * scale) for s in r.steps]
            for r in runs
        }
        if any(y is not None for pts in series.values() for _, y in pts):
            out.append(
                f'<div class="curve" data-key="{key}">{line_chart(series, title=title, y_label=unit)}</div>'
            )
    return "".join(out) or "<p>no steps logged yet</p>"


def breakdown(run: Run) -> str:
    """The step's time split into each axis's communication, the pipeline bubble and the rest."""
    comm, pipe = communication_share(run), (run.inspect or {}).get("pipeline")
    parts: list[tuple[str, float]] = []
    notes = []
    if comm:
        parts += [
            (f"{axes} communication", s / comm["step_s"])
            for axes, s in sorted(comm["seconds_by_axis"].items())
        ]
        notes.append(comm["source"])
    else:
        notes.append("communication not measured: run with --profile (or give RunLog a machine to model it)")
    if pipe:
        parts.append(("pipeline bubble", pipe["bubble"]))
        notes.append("bubble: idle share of the schedule table")
    used = sum(share for _, share in parts)
    if used > 1:
        parts = [(label, share / used) for label, share in parts]
        notes.append(f"the parts add up to {100 * used:.0f} % (they overlap): scaled to the step")
    parts.append(("compute and the rest", max(0.0, 1 - sum(share for _, share in parts))))
    listed = "".join(f"<li>{escape(label)}: {100 * share:.1f} %</li>" for label, share in parts)
    sources = "".join(f"<li>{escape(note)}</li>" for note in notes)
    return f'{stacked_bar(parts)}<ul class="note">{listed}{sources}</ul>'


def bytes_table(run: Run) -> str:
    """Per mesh-axis set: collectives per step, payload and wire bytes per device (compiled program)."""
    inspected = run.inspect or {}
    by_axis = (inspected.get("totals") or {}).get("by_axis") or {}
    rows = ["<tr><th>axes</th><th>collectives / step</th><th>payload</th><th>wire</th></tr>"]
    for axes, entry in by_axis.items():
        rows.append(
            f"<tr><td>{escape(axes)}</td><td class='num'>{entry['count']}</td>"
            f"<td class='num'>{format_bytes(entry['payload_bytes'])}</td>"
            f"<td class='num'>{format_bytes(entry['wire_bytes'])}</td></tr>"
        )
    theory = inspected.get("theory") or {}
    for section in [theory, *(theory.get("axes") or {}).values()] if theory else []:
        ratio = section.get("wire_ratio")
        rows.append(
            f"<tr><td>theory: {escape(section.get('description', ''))}</td><td></td>"
            f"<td class='num'>{format_bytes(section.get('payload_bytes'))}</td>"
            f"<td class='num'>{format_bytes(section.get('wire_bytes'))} (measured / theory "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'})</td></tr>"
        )
    return f'<table class="bytes">{"".join(rows)}</table>'


def memory(run: Run) -> str:
    """The compiled step's memory parts and peak against one device's capacity."""
    mem = (run.inspect or {}).get("memory") or {}
    keys = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes")
    rows = [(k.removesuffix("_bytes"), mem[k]) for k in keys if mem.get(k) is not None]
    peak = peak_of(mem)
    rows += [("peak", peak)] if rows and peak is not None else []
    if not rows:
        return "<p>no memory analysis</p>"
    capacity = run.header.get("memory_capacity_bytes")
    source = escape(str(run.header.get("memory_capacity_source")))
    return bars(rows, limit=capacity, unit=format_bytes) + f'<p class="note">capacity: {source}</p>'


def pipeline(run: Run) -> str:
    pipe = (run.inspect or {}).get("pipeline")
    if not pipe:
        return "<p>no pipeline (stage = 1)</p>"
    text = (
        f"{escape(pipe['schedule'])}: {pipe['stages']} stages, {pipe['microbatches']} micro-batches, "
        f"bubble {100 * pipe['bubble']:.1f} % (theory {100 * pipe['theory_bubble']:.1f} %)"
    )
    return f"<p>{text}</p>{pipeline_grid(pipe['grid'])}"


def _finding(f: Finding) -> str:
    items = "".join(f"<li>{escape(s)}</li>" for s in f.suggestions)
    return (
        f'<div class="finding {f.severity}" data-kind="{f.kind}"><b>{f.severity}</b> · {escape(f.title)}'
        f'<div class="note">{escape(f.source)}</div><ul>{items}</ul></div>'
    )


def findings_list(run: Run, *, found: list | None = None) -> str:
    """The run's findings (``found``, else computed) as HTML."""
    found = findings(run) if found is None else found
    return "".join(_finding(f) for f in found) or '<p class="healthy">no bottleneck found</p>'


def relative_to(page_dir: Path | None) -> Callable[[Path], str]:
    """Links from a page saved in ``page_dir`` (``None``: absolute ``file:`` addresses)."""
    return lambda path: os.path.relpath(path, page_dir) if page_dir else path.resolve().as_uri()


def profile_links(run: Run, *, href: Callable[[Path], str | None]) -> str:
    """Links (``href(path)``) to the run's profiler traces and how to open them; a trace ``href``
    gives ``None`` for is left out."""
    linked = [(p, link) for p in run.traces if (link := href(p)) is not None]
    if not linked:
        return "<p>no profile (demo --profile 3:5 or RunLog(profile=...) traces steps)</p>"
    window = run.header.get("profile") or {}
    links = "".join(f'<li><a href="{escape(link)}">{escape(p.name)}</a></li>' for p, link in linked)
    steps = f"steps {window.get('first')} to {window.get('last')}" if window else "traced steps"
    return f"<p>{steps}: </p><ul>{links}</ul><p class='note'>{escape(HOW_TO_OPEN)}</p>"


def plan_text(run: Run) -> str:
    return f"<pre>{escape(run.plan_toml or 'no plan.toml')}</pre>"
