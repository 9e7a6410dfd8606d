"""Pieces shared by the Horovod and FSDP translators: notes, ``--set`` overrides, values.

Example:
    >>> parse_set_value("8"), parse_set_value("true"), parse_set_value("auto")
    (8, True, 'auto')
    >>> from torsh_jax.plan import ParallelPlan
    >>> apply_plan_overrides(ParallelPlan(), {"batch.micro_batch_size": 4}).batch.micro_batch_size
    4
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from torsh_jax.errors import PlanError, TranslationError
from torsh_jax.plan.io import plan_from_dict, plan_to_dict
from torsh_jax.plan.spec import MAX_BATCH_SIZE, ParallelPlan
from torsh_jax.translate.messages import clip
from torsh_jax.translate.result import Note, Notes, Status

__all__ = [
    "NoteBook",
    "PLAN_SECTIONS",
    "parse_set_value",
    "parse_set_items",
    "apply_plan_overrides",
    "plain",
    "as_int",
    "MAX_PROCESSES",
    "as_float",
    "as_bool",
]

#: Largest process count a launch line may ask for (no cluster has more).
MAX_PROCESSES = 2**20

#: First key segments that address the plan itself in ``--set``.
PLAN_SECTIONS = tuple(f.name for f in dataclasses.fields(ParallelPlan))


def parse_set_value(text: str) -> Any:
    """A ``--set`` value: JSON when it parses (numbers, true/false, null), else the string."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError, RecursionError):
        return text


def parse_set_items(items: list[str] | None, *, flag: str = "--set") -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": 1, "c": "x"}``.

    Raises:
        TranslationError: an item has no ``=`` or an empty key.
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TranslationError(
                f"expected KEY=VALUE, got {clip(repr(item))}", key=flag, fix=f"write {flag} key=value"
            )
        out[key.strip()] = parse_set_value(value.strip())
    return out


def plain(value: Any) -> Any:
    """``value`` as JSON-able data (tuples to lists, other objects to strings)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


class NoteBook(Notes):
    """:class:`Notes` keyed by input key, for translators that may note a key twice.

    A later note for a key replaces the earlier one, values are stored as
    JSON-able data (:func:`plain`), and :meth:`unsupported` raises unless lenient.

    Args:
        lenient: record unsupported keys as notes instead of raising.

    Example:
        >>> book = NoteBook()
        >>> book.ignored("fp16", (1, 2), "first")
        >>> book.mapped("fp16", (1, 2), "second")
        >>> [(n.status, n.value) for n in book.notes()], "fp16" in book
        ([('mapped', [1, 2])], True)
    """

    def __init__(self, *, lenient: bool = False):
        super().__init__()
        self.lenient = lenient

    def add(self, key: str, status: Status, value: Any, detail: str) -> None:
        self.items = [note for note in self.items if note.key != key]
        super().add(key, status, plain(value), detail)

    def unsupported(self, key: str, value: Any, detail: str, *, fix: str) -> None:
        """Record an unsupported key, or raise :class:`TranslationError` unless lenient."""
        if not self.lenient:
            raise TranslationError(
                f"{detail} (value {plain(value)!r})", key=key, fix=f"{fix}, or pass --lenient"
            )
        self.add(key, "unsupported", value, f"{detail}; {fix}")

    def __contains__(self, key: str) -> bool:
        return any(note.key == key for note in self.items)

    def notes(self) -> tuple[Note, ...]:
        return tuple(self.items)


def _set_path(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {"ici": child} if isinstance(child, int) and not isinstance(child, bool) else {}
            node[part] = child
        node = child
    node[path[-1]] = value


def apply_plan_overrides(plan: ParallelPlan, overrides: dict[str, Any]) -> ParallelPlan:
    """``plan`` with dotted plan paths replaced (``batch.micro_batch_size=4``).

    Raises:
        PlanError: a path or value is not valid for the plan (names the path).
    """
    if not overrides:
        return plan
    data = plan_to_dict(plan)
    for key, value in overrides.items():
        parts = key.split(".")
        if parts[0] not in PLAN_SECTIONS or any(not p for p in parts):
            raise PlanError("not a plan field", key=key, fix=f"start with one of {list(PLAN_SECTIONS)}")
        _set_path(data, parts, value)
    return plan_from_dict(data)


def as_int(value: Any, key: str, *, minimum: int = 0, maximum: int = MAX_BATCH_SIZE) -> int:
    """``value`` as an int in ``minimum..maximum`` (numeric strings accepted)."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            number = None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        number = int(number)
    if not isinstance(number, int) or isinstance(number, bool) or number < minimum:
        raise TranslationError(
            f"must be an integer >= {minimum}, got {plain(value)!r}",
            key=key,
            fix=f"use a whole number >= {minimum}",
        )
    if number > maximum:
        raise TranslationError(
            f"must be at most {maximum:,}, got {plain(value)!r}", key=key, fix=f"use at most {maximum}"
        )
    return number


def as_float(value: Any, key: str, *, minimum: float = 0.0) -> float:
    """``value`` as a finite float >= ``minimum`` (numeric strings accepted)."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    ok = isinstance(number, (int, float)) and not isinstance(number, bool)
    if not ok or not math.isfinite(number) or number < minimum:
        raise TranslationError(
            f"must be a number >= {minimum}, got {plain(value)!r}", key=key, fix=f"use a number >= {minimum}"
        )
    return float(number)


def as_bool(value: Any, key: str) -> bool:
    """``value`` as a bool; accepts 0/1 and true/false/yes/no strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise TranslationError(
        f"must be a boolean (0/1, true/false), got {plain(value)!r}", key=key, fix="use 0/1 or true/false"
    )
