"""Pipeline parallelism over the ``stage`` axis: schedules as tables, one executor inside the step.

Example:
    >>> from torsh_jax.pipeline import build_schedule
    >>> build_schedule("gpipe", stages=4, microbatches=4).bubble
    0.42857142857142855
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Schedule": "torsh_jax.pipeline.schedule",
    "build_schedule": "torsh_jax.pipeline.schedule",
    "SCHEDULES": "torsh_jax.pipeline.schedule",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.pipeline", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.pipeline.schedule import SCHEDULES, Schedule, build_schedule
