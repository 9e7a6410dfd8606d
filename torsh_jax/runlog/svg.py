"""Inline SVG charts drawn in Python: line charts, bars and the pipeline grid (no scripts, no fetches).

Every data point of a line chart is a ``<circle class="pt">`` with a ``<title>`` (its step and value),
so a page shows one mark per logged step.

Example:
    >>> svg = line_chart({"loss": [(1, 2.0), (2, 1.5)]}, title="loss")
    >>> svg.count('class="pt"')
    2
"""

from __future__ import annotations

from html import escape

__all__ = ["line_chart", "stacked_bar", "bars", "pipeline_grid", "COLORS"]

#: Series colours, in order (colour-blind safe).
COLORS = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9")
_W, _H, _PAD_L, _PAD_B, _PAD_T = 640, 220, 72, 28, 24


def _el(tag: str, text: str = "", /, **attrs) -> str:
    """``<tag a="1">text</tag>``; attribute names with ``_`` become ``-`` (``text_anchor``)."""
    shown = " ".join(f'{k.rstrip("_").replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f"<{tag} {shown}>{text}</{tag}>"


def _label(x: float, y: float, text: str, *, anchor: str = "start", cls: str = "tick") -> str:
    return _el("text", escape(text), x=f"{x:.1f}", y=f"{y:.1f}", class_=cls, text_anchor=anchor)


def _tick(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3g}"


def _scale(lo: float, hi: float, size: float, *, flip: bool):
    span = (hi - lo) or 1.0
    return (lambda v: size - (v - lo) / span * size) if flip else (lambda v: (v - lo) / span * size)


def _svg(width: float, height: float, body: list[str], *, cls: str = "chart") -> str:
    head = f'<svg class="{cls}" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
    return head + "".join(body) + "</svg>"


def _series(name: str, pts: list[tuple[float, float]], color: str, sx, sy) -> list[str]:
    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
    out = [f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>']
    for x, y in pts:
        tip = _el("title", f"{escape(name)} step {x:g}: {_tick(y)}")
        out.append(
            _el(
                "circle",
                tip,
                class_="pt",
                data_series=escape(name),
                cx=f"{sx(x):.1f}",
                cy=f"{sy(y):.1f}",
                r="2.5",
                fill=color,
            )
        )
    return out


def line_chart(series: dict[str, list[tuple[float, float]]], /, *, title: str, y_label: str = "") -> str:
    """One SVG with a line per series of ``(step, value)`` points (``None`` values left out)."""
    points = {name: [(x, y) for x, y in pts if y is not None] for name, pts in series.items()}
    every = [p for pts in points.values() for p in pts]
    if not every:
        return _svg(_W, 40, [_label(8, 24, f"{title}: no data")])
    xs, ys = [x for x, _ in every], [y for _, y in every]
    plot_w, plot_h = _W - _PAD_L - 12, _H - _PAD_B - _PAD_T
    sx = _scale(min(xs), max(xs), plot_w, flip=False)
    sy = _scale(min(ys), max(ys), plot_h, flip=True)
    plot = [f'<rect width="{plot_w}" height="{plot_h}" class="frame"/>']
    plot += [
        _label(-6, sy(v) + 4, _tick(v), anchor="end") for v in (min(ys), (min(ys) + max(ys)) / 2, max(ys))
    ]
    plot += [_label(sx(v), plot_h + 16, _tick(v), anchor="middle") for v in sorted({min(xs), max(xs)})]
    for color, (name, pts) in zip(COLORS * 4, points.items()):
        plot += _series(name, pts, color, sx, sy)
    body = [
        _label(_PAD_L, 16, title, cls="title"),
        f'<g transform="translate({_PAD_L},{_PAD_T})">',
        *plot,
        "</g>",
    ]
    return _svg(_W, _H, body + _legend(list(points), y_label))


def _legend(names: list[str], y_label: str) -> list[str]:
    out = [_label(_W - 8, 16, y_label, anchor="end")] if y_label else []
    if len(names) > 1:
        for i, (name, color) in enumerate(zip(names, COLORS * 4)):
            out.append(
                _el(
                    "text",
                    f"■ {escape(name)}",
                    x=_PAD_L + 160 + 150 * i,
                    y=16,
                    style=f"fill:{color}",
                    class_="tick",
                )
            )
    return out


def stacked_bar(parts: list[tuple[str, float]], /) -> str:
    """One horizontal bar split into ``(label, share)`` segments (shares of 1)."""
    width, x, body = _W - 20, 10.0, []
    for (label, share), color in zip(parts, COLORS * 4):
        w = max(share, 0.0) * width
        tip = _el("title", f"{escape(label)}: {100 * share:.1f} %")
        body.append(
            _el("rect", tip, class_="seg", x=f"{x:.1f}", y=8, width=f"{w:.1f}", height=24, fill=color)
        )
        if w > 60:
            body.append(_label(x + 4, 25, f"{label} {100 * share:.0f} %", cls="seglabel"))
        x += w
    return _svg(_W, 40, body)


def bars(rows: list[tuple[str, float]], /, *, limit: float | None, unit) -> str:
    """Horizontal bars of ``(label, value)`` against ``limit`` (a dashed line), labelled ``unit(value)``."""
    top, span = max([v for _, v in rows] + [limit or 0]) or 1.0, _W - 300
    height = 26 * len(rows) + 30
    body = []
    for i, ((label, value), color) in enumerate(zip(rows, COLORS * 4)):
        y, w = 6 + 26 * i, max(value / top * span, 1.0)
        body += [
            _label(8, y + 15, label),
            _label(154 + w, y + 15, unit(value)),
            _el("rect", class_="bar", x=150, y=y, width=f"{w:.1f}", height=20, fill=color),
        ]
    if limit:
        x = 150 + limit / top * span
        body += [
            _el("line", x1=f"{x:.1f}", x2=f"{x:.1f}", y1=0, y2=height - 18, class_="limit"),
            _label(x, height - 4, f"capacity {unit(limit)}", anchor="middle"),
        ]
    return _svg(_W, height, body)


def pipeline_grid(grid: list[list[str]], /) -> str:
    """The schedule table as coloured cells: rows stages, columns ticks; forward, backward, idle."""
    ticks = max(len(row) for row in grid)
    cell = max(8, min(28, (_W - 70) // max(ticks, 1)))
    height = cell * len(grid) + 24
    fill = {"F": "#56b4e9", "B": "#d55e00", "W": "#e69f00"}
    body = []
    for s, row in enumerate(grid):
        body.append(_label(4, s * cell + cell * 0.7, f"stage {s}"))
        for t, label in enumerate(row):
            tip = _el("title", f"tick {t}, stage {s}: {escape(label)}")
            body.append(
                _el(
                    "rect",
                    tip,
                    class_="cell",
                    x=70 + t * cell,
                    y=s * cell,
                    width=cell - 1,
                    height=cell - 1,
                    fill=fill.get(label[:1], "#eeeeee"),
                )
            )
            if cell >= 20 and label != ".":
                body.append(_label(72 + t * cell, s * cell + cell * 0.65, label, cls="cellt"))
    body.append(_label(70, height - 6, "ticks →  F forward, B backward, W weight gradient, grey idle"))
    return _svg(70 + cell * ticks, height, body, cls="chart grid")
