"""Run logs: what a training run writes (``RunLog``), what is read back (``read_run``), the
bottleneck findings, the HTML report and the live dashboard.

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.runlog import ProfileWindow
    >>> ProfileWindow.parse("3:5").last
    5
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "RunLog": "torsh_jax.runlog.log",
    "Run": "torsh_jax.runlog.read",
    "read_run": "torsh_jax.runlog.read",
    "Finding": "torsh_jax.runlog.findings",
    "findings": "torsh_jax.runlog.findings",
    "report_html": "torsh_jax.runlog.page",
    "comparison_html": "torsh_jax.runlog.page",
    "ProfileWindow": "torsh_jax.runlog.profile",
    "step_flops": "torsh_jax.runlog.flops",
    "peak_flops": "torsh_jax.runlog.flops",
    "mfu": "torsh_jax.runlog.flops",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.runlog", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.runlog.findings import Finding, findings
    from torsh_jax.runlog.flops import mfu, peak_flops, step_flops
    from torsh_jax.runlog.log import RunLog
    from torsh_jax.runlog.page import comparison_html, report_html
    from torsh_jax.runlog.profile import ProfileWindow
    from torsh_jax.runlog.read import Run, read_run
