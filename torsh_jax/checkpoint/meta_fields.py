"""The fields of a checkpoint step's ``meta`` item and the JSON types they must have.

:func:`meta_problem` names the first field of a ``meta`` item (read from ``DIR/<step>/meta/metadata``)
whose type is wrong, so that a damaged or hand-edited file is one error naming the field, not a
``TypeError`` deep in ``checkpoint show`` or ``restore``. ``plan`` is required; the other fields
may be absent or ``null`` (steps saved without checksums or an RNG key have them ``null``).
``data_position`` is whatever the training loop handed over, and is not checked.

Example:
    >>> meta_problem({"plan": 'name = "ddp"', "items": 5})
    'items must be a list of item names, got 5'
    >>> meta_problem({"plan": 'name = "ddp"', "items": ["state"], "mesh": {"data": 8}}) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["meta_problem"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_mesh(value: Any) -> bool:
    return isinstance(value, dict) and all(_is_int(size) and size >= 1 for size in value.values())


def _is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _is_rng(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("data"), list)


def _is_checksums(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(sums, dict) and all(_is_int(s) for s in sums.values()) for sums in value.values()
    )


#: field -> (what it must be, its test); ``plan`` is required, the others may be absent or null.
_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "plan": ("the plan as TOML text", lambda v: isinstance(v, str)),
    "format": ("an integer", _is_int),
    "step": ("an integer", _is_int),
    "mesh": ("an object of axis sizes (positive integers)", _is_mesh),
    "items": ("a list of item names", _is_names),
    "bytes": ("an integer byte count", lambda v: _is_int(v) and v >= 0),
    "rng": ("an object with the key's data list", _is_rng),
    "checksums": ("an object of item names to objects of array paths to integers", _is_checksums),
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def meta_problem(meta: Any) -> str | None:
    """What is wrong with the first malformed field of a ``meta`` item (``None``: nothing)."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    for name, (kind, valid) in _FIELDS.items():
        value = meta.get(name)
        if (name == "plan" or value is not None) and not valid(value):
            return f"{name} must be {kind}, got {_shown(value)}"
    return None
