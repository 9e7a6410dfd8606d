"""Inspection of compiled programs: every collective and per-device memory, from the HLO.

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.analysis import ring_wire_bytes
    >>> ring_wire_bytes("all-reduce", 1000, 4)
    1500.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "KINDS": "torsh_jax.analysis.hlo",
    "Collective": "torsh_jax.analysis.hlo",
    "collectives": "torsh_jax.analysis.hlo",
    "collectives_from_text": "torsh_jax.analysis.hlo",
    "MemoryReport": "torsh_jax.analysis.memory",
    "memory_report": "torsh_jax.analysis.memory",
    "summarize": "torsh_jax.analysis.report",
    "render_text": "torsh_jax.analysis.report",
    "Theory": "torsh_jax.analysis.theory",
    "TheoryCollective": "torsh_jax.analysis.theory",
    "plan_theory": "torsh_jax.analysis.theory",
    "ring_wire_bytes": "torsh_jax.analysis.theory",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.analysis", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.analysis.hlo import KINDS, Collective, collectives, collectives_from_text
    from torsh_jax.analysis.memory import MemoryReport, memory_report
    from torsh_jax.analysis.report import render_text, summarize
    from torsh_jax.analysis.theory import Theory, TheoryCollective, plan_theory, ring_wire_bytes
