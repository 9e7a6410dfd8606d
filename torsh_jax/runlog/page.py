"""A run's page: ``report_html(run)``, ``comparison_html(a, b)`` and the parts the dashboard refreshes.

The pages are self-contained: styles inline, charts inline SVG, no script and nothing fetched
(the dashboard's page adds a script that asks its own server for new parts).

Example:
    >>> from torsh_jax.runlog.read import Run
    >>> html = report_html(Run(Path("runs/a"), {"plan": "ddp"}, steps=[{"step": 1, "loss": 2.0}]))
    >>> html.startswith("<!DOCTYPE html>"), "<script" in html
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from html import escape
from pathlib import Path

from torsh_jax.runlog import sections
from torsh_jax.runlog.findings import Finding
from torsh_jax.runlog.read import Run

__all__ = ["report_html", "comparison_html", "live_parts", "page"]

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.chart .frame{fill:none;stroke:#ccc}.chart .title{font-weight:600;font-size:13px}
.chart .tick{font-size:11px;fill:#444}.chart .seglabel{font-size:11px;fill:#fff}
.chart .cellt{font-size:9px;fill:#000}.chart .limit{stroke:#000;stroke-dasharray:4 3}
.curve{display:inline-block;margin:4px}.note{color:#666;font-size:12px}
.finding{border-left:4px solid #999;padding:4px 10px;margin:8px 0}
.finding.high{border-color:#c00}.finding.medium{border-color:#e69f00}.finding.low{border-color:#56b4e9}
.cols{display:flex;gap:24px}.cols>div{flex:1;min-width:0}pre{background:#f6f6f6;padding:8px}
"""


def page(title: str, body: str, *, script: str = "") -> str:
    """A whole HTML document around ``body``."""
    tag = f"<script>{script}</script>" if script else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}{tag}</body></html>"
    )


def _describe(run: Run) -> str:
    h = run.header
    mesh = " x ".join(f"{k}={v}" for k, v in (h.get("mesh") or {}).items()) or "?"
    state = "finished" if h.get("finished") else "running (or stopped without closing the log)"
    return (
        f"plan <b>{escape(str(h.get('plan')))}</b> · mesh {escape(mesh)} · {h.get('devices')} "
        f"{escape(str(h.get('device_kind')))} devices ({escape(str(h.get('platform')))}) · "
        f"{len(run.steps)} steps logged · {state}"
    )


def live_parts(
    run: Run, *, href: Callable[[Path], str | None], found: list[Finding] | None = None
) -> dict[str, str]:
    """The page's parts by element id (the dashboard replaces them as the log grows); ``href`` makes
    a link to a file of the run; ``found``: its findings when already computed."""
    return {
        "describe": _describe(run),
        "headline": sections.headline_table([run]),
        "curves": sections.curves([run]),
        "breakdown": sections.breakdown(run),
        "findings": sections.findings_list(run, found=found),
        "profile": sections.profile_links(run, href=href),
        "bytes": sections.bytes_table(run),
        "memory": sections.memory(run),
        "pipeline": sections.pipeline(run),
        "plan": sections.plan_text(run),
    }


def _section(title: str, part_id: str, html: str) -> str:
    return f'<h2>{escape(title)}</h2><div id="{part_id}">{html}</div>'


def run_body(run: Run, *, href: Callable[[Path], str | None], found: list[Finding] | None = None) -> str:
    """The report of one run (the dashboard's page around the same parts)."""
    live = live_parts(run, href=href, found=found)
    return "".join(
        [
            f"<h1>torsh-jax run {escape(run.name)}</h1>",
            f'<p id="describe">{live["describe"]}</p>',
            _section("Findings", "findings", live["findings"]),
            _section("Headline", "headline", live["headline"]),
            _section("Curves", "curves", live["curves"]),
            _section("Where the step's time goes", "breakdown", live["breakdown"]),
            _section("Bytes per step by mesh axis (per device)", "bytes", live["bytes"]),
            _section("Memory per device", "memory", live["memory"]),
            _section("Pipeline schedule", "pipeline", live["pipeline"]),
            _section("Profile", "profile", live["profile"]),
            _section("Plan", "plan", live["plan"]),
        ]
    )


def report_html(run: Run, *, page_dir: Path | None = None, found: list[Finding] | None = None) -> str:
    """The self-contained report of ``run``; trace links relative to ``page_dir`` (where it is saved);
    ``found``: its findings when already computed."""
    body = run_body(run, href=sections.relative_to(page_dir), found=found)
    return page(f"torsh-jax run {run.name}", body)


def comparison_html(
    a: Run, b: Run, *, page_dir: Path | None = None, found: tuple[list[Finding], list[Finding]] | None = None
) -> str:
    """Two runs side by side: the headline with B / A, the curves overlaid, each one's findings,
    memory, bytes and plan in two columns; ``found``: the two runs' findings when already computed."""
    found_a, found_b = found or (None, None)
    listed = sections.findings_list(a, found=found_a), sections.findings_list(b, found=found_b)
    a, b = replace(a, label=f"A: {a.path.name}"), replace(b, label=f"B: {b.path.name}")
    cols = lambda part: f'<div class="cols"><div>{part(a)}</div><div>{part(b)}</div></div>'
    titled = lambda r: f"<h3>{escape(r.name)}</h3>{_describe(r)}"
    body = "".join(
        [
            f"<h1>torsh-jax runs {escape(a.name)} and {escape(b.name)}</h1>",
            cols(titled),
            _section("Headline", "headline", sections.headline_table([a, b])),
            _section("Curves", "curves", sections.curves([a, b])),
            _section(
                "Findings",
                "findings",
                f'<div class="cols"><div>{listed[0]}</div><div>{listed[1]}</div></div>',
            ),
            _section("Where the step's time goes", "breakdown", cols(sections.breakdown)),
            _section("Bytes per step by mesh axis", "bytes", cols(sections.bytes_table)),
            _section("Memory per device", "memory", cols(sections.memory)),
            _section("Pipeline schedule", "pipeline", cols(sections.pipeline)),
            _section(
                "Profile",
                "profile",
                cols(lambda r: sections.profile_links(r, href=sections.relative_to(page_dir))),
            ),
            _section("Plan", "plan", cols(sections.plan_text)),
        ]
    )
    return page(f"torsh-jax runs {a.name} and {b.name}", body)
