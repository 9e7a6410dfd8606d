"""What a translation produced: a plan plus one note per input key.

Example:
    >>> from torsh_jax.translate.result import Notes
    >>> notes = Notes()
    >>> notes.mapped("zero_optimization.stage", 3, "zero.stage = 3")
    >>> notes.ignored("wall_clock_breakdown", True, "profiling output has no equivalent")
    >>> [n.status for n in notes]
    ['mapped', 'ignored']
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from torsh_jax.plan.spec import ParallelPlan

__all__ = ["Note", "Notes", "Status", "TranslationResult", "STATUSES"]

Status = Literal["mapped", "approximated", "ignored", "unsupported", "removed"]
#: mapped: same behaviour; approximated: close but not identical (reason says
#: how); ignored: no effect on training here (reason says why); unsupported:
#: would change training and cannot be honoured (translation fails unless
#: lenient); removed: a section the source tool itself has removed.
STATUSES: tuple[str, ...] = ("mapped", "approximated", "ignored", "unsupported", "removed")


@dataclass(frozen=True)
class Note:
    """What happened to one input key.

    Args:
        key: key path in the input (``zero_optimization.offload_optimizer.device``).
        status: one of :data:`STATUSES`.
        value: the input value (JSON-able).
        detail: for mapped/approximated, the plan field(s) it became; otherwise the reason.
    """

    key: str
    status: Status
    value: Any
    detail: str

    def to_dict(self) -> dict:
        return {"key": self.key, "status": self.status, "value": self.value, "detail": self.detail}


@dataclass
class Notes:
    """An ordered collection of :class:`Note`, one per input key."""

    items: list[Note] = field(default_factory=list)

    def add(self, key: str, status: Status, value: Any, detail: str) -> None:
        self.items.append(Note(key, status, value, detail))

    def mapped(self, key: str, value: Any, detail: str) -> None:
        self.add(key, "mapped", value, detail)

    def approximated(self, key: str, value: Any, detail: str) -> None:
        self.add(key, "approximated", value, detail)

    def ignored(self, key: str, value: Any, detail: str) -> None:
        self.add(key, "ignored", value, detail)

    def unsupported(self, key: str, value: Any, detail: str) -> None:
        self.add(key, "unsupported", value, detail)

    def removed(self, key: str, value: Any, detail: str) -> None:
        self.add(key, "removed", value, detail)

    def keys(self) -> set[str]:
        return {n.key for n in self.items}

    def __iter__(self) -> Iterator[Note]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class TranslationResult:
    """A translated setup.

    Args:
        plan: the plan, including optimizer, schedule, precision and compression.
        notes: one note per input key.
        source: what was translated (file path or ``<env>``).
        kind: ``deepspeed``, ``horovod``, ``env`` or ``torch_fsdp``.
        extras: facts that are not part of a plan (process layout, launch
            arguments, world size used for batch inference).
    """

    plan: ParallelPlan
    notes: tuple[Note, ...]
    source: str
    kind: str
    extras: dict[str, Any] = field(default_factory=dict)

    def by_status(self, status: Status) -> list[Note]:
        return [n for n in self.notes if n.status == status]
