"""Pipeline parallelism over the ``stage`` axis: schedules as tables, one executor inside the step.

Example:
    >>> from torsh_jax.pipeline import build_pipeline_schedule
    >>> build_pipeline_schedule("gpipe", stages=4, microbatches=4).bubble
    0.42857142857142855
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Schedule": "torsh_jax.pipeline.schedule",
    "ScheduleKind": "torsh_jax.pipeline.schedule",
    "build_pipeline_schedule": "torsh_jax.pipeline.schedule",
    "PIPELINE_SCHEDULES": "torsh_jax.pipeline.schedule",
}

__all__ = sorted(_EXPORTS)

_lazy_getattr, __dir__ = lazy_exports("torsh_jax.pipeline", _EXPORTS, globals())
#: earlier names, still importable (not in ``__all__``): ``build_schedule`` and ``SCHEDULES`` also
#: name the learning-rate schedules in :mod:`torsh_jax.optim`.
_OLD_NAMES = {"build_schedule": "build_pipeline_schedule", "SCHEDULES": "PIPELINE_SCHEDULES"}


def __getattr__(name: str) -> object:
    return _lazy_getattr(_OLD_NAMES.get(name, name))


if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.pipeline.schedule import (
        PIPELINE_SCHEDULES,
        Schedule,
        ScheduleKind,
        build_pipeline_schedule,
    )
