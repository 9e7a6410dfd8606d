"""Render a :class:`TranslationResult`: a notes table, JSON or the plan as TOML.

Example:
    >>> from torsh_jax.translate.horovod import translate_horovod
    >>> result = translate_horovod("horovodrun -np 4 python train.py")
    >>> sorted(to_json_dict(result))
    ['extras', 'kind', 'notes', 'plan', 'source', 'summary']
    >>> "horovodrun.-np" in render_text(result)
    True
"""

from __future__ import annotations

import io
import json
from typing import Any

from torsh_jax.plan.io import plan_to_dict, plan_to_toml
from torsh_jax.translate.messages import clip
from torsh_jax.translate.overrides import plain
from torsh_jax.translate.result import STATUSES, TranslationResult

__all__ = ["summary", "to_json_dict", "render_json", "render_toml", "render_text", "render_plain_table"]

_STYLES = {
    "mapped": "green",
    "approximated": "yellow",
    "ignored": "dim",
    "unsupported": "red",
    "removed": "magenta",
}


def summary(result: TranslationResult) -> dict[str, int]:
    """Note counts per status."""
    return {status: len(result.by_status(status)) for status in STATUSES}


def to_json_dict(result: TranslationResult) -> dict[str, Any]:
    """``{"plan", "notes", "extras", "kind", "source", "summary"}`` as JSON-able data."""
    return {
        "plan": plan_to_dict(result.plan),
        "notes": [plain(n.to_dict()) for n in result.notes],
        "extras": plain(result.extras),
        "kind": result.kind,
        "source": result.source,
        "summary": summary(result),
    }


def render_json(result: TranslationResult) -> str:
    return json.dumps(to_json_dict(result), indent=2)


def render_toml(result: TranslationResult) -> str:
    """The plan as TOML, headed by comments naming the source (loads with ``load_plan``)."""
    counts = ", ".join(f"{n} {s}" for s, n in summary(result).items() if n)
    header = f"# translated from {result.kind} {result.source}\n# notes: {counts or 'none'}\n"
    return header + plan_to_toml(result.plan)


def _value_text(value: Any, width: int = 40) -> str:
    return clip(value if isinstance(value, str) else json.dumps(plain(value)), width)


def render_plain_table(result: TranslationResult) -> str:
    """The notes as an aligned plain-text table (no colours)."""
    rows = [("KEY", "STATUS", "VALUE", "DETAIL")]
    rows += [(clip(n.key), n.status, _value_text(n.value), n.detail) for n in result.notes]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    return "\n".join(lines)


def render_text(result: TranslationResult, *, color: bool = False, width: int = 160) -> str:
    """A readable table of the notes (rich when available) and a one-line summary."""
    counts = ", ".join(f"{n} {s}" for s, n in summary(result).items() if n)
    title = f"{result.kind}: {result.source} ({counts or 'no notes'})"
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        return f"{title}\n{render_plain_table(result)}"
    table = Table(title=title, show_lines=False, expand=False)
    for column in ("key", "status", "value", "detail"):
        table.add_column(column, overflow="fold")
    for note in result.notes:
        style = _STYLES.get(note.status, "")
        status = f"[{style}]{note.status}[/{style}]" if style else note.status
        table.add_row(escape(clip(note.key)), status, escape(_value_text(note.value)), escape(note.detail))
    buffer = io.StringIO()
    console = Console(
        file=buffer, width=width, color_system="standard" if color else None, force_terminal=color
    )
    console.print(table)
    return buffer.getvalue().rstrip("\n")
