"""Setting values in a DeepSpeed config before translation: ``--set`` overrides and Trainer ``"auto"`` values.

Example:
    >>> apply_overrides({"fp16": {"enabled": "auto"}}, {"fp16.enabled": "true"})
    {'fp16': {'enabled': True}}
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.translate.ds_context import AUTO

__all__ = ["apply_overrides", "fill_auto", "auto_paths", "leaf_paths", "get_path"]


def _coerce(value: Any) -> Any:
    """``--set`` values arrive as text: read JSON scalars/lists (``8``, ``true``, ``[0.9, 0.95]``)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _set(config: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise TranslationError(
            f"bad key path {dotted!r}", key=f"overrides[{dotted!r}]", fix="write keys as section.key"
        )
    node = config
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None or (part == "zero_optimization" and isinstance(child, bool)):
            child = {} if child is None else {"stage": 1 if child else 0}
            node[part] = child
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise TranslationError(
                f"cannot set {dotted!r}: {where} is not a table",
                key=where,
                fix=f"set a key inside {where}'s parent, or make {where} a table",
            )
        node = child
    node[parts[-1]] = value


def apply_overrides(config: dict, overrides: Mapping[str, Any] | None) -> dict:
    """A copy of ``config`` with dotted keys set (creating tables as needed)."""
    out = copy.deepcopy(config)
    for dotted, value in (overrides or {}).items():
        if not isinstance(dotted, str):
            raise TranslationError(
                f"override keys must be strings, got {dotted!r}",
                key=str(dotted),
                fix="use dotted string keys, e.g. zero_optimization.stage",
            )
        _set(out, dotted, _coerce(value))
    return out


def get_path(config: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``a.b.c`` in nested tables, or ``None`` where the path is missing."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def fill_auto(config: dict, values: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """Replace ``"auto"`` leaves that ``values`` has a value for; returns (config, filled keys)."""
    out = copy.deepcopy(config)
    filled = []
    for dotted, value in values.items():
        if get_path(out, dotted) == AUTO:
            _set(out, dotted, value)
            filled.append(dotted)
    return out, filled


def leaf_paths(value: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf of a config (lists are leaves)."""
    if isinstance(value, dict) and value:
        paths = []
        for key, item in value.items():
            paths += leaf_paths(item, f"{prefix}.{key}" if prefix else str(key))
        return paths
    return [prefix] if prefix else []


def auto_paths(config: dict) -> list[str]:
    """Dotted paths whose value is ``"auto"``."""
    return [p for p in leaf_paths(config) if get_path(config, p) == AUTO]
