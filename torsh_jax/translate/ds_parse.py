"""Reading DeepSpeed config files: JSON, with DeepSpeed's hjson leniency, and gpt-neox YAML.

DeepSpeed reads its config with ``hjson``, so comments, unquoted keys and
trailing commas are accepted; so are they here. A key written twice in one
object is refused, as DeepSpeed refuses it (``dict_raise_error_on_duplicate_keys``
in ``deepspeed/runtime/config_utils.py``). ``.yml``/``.yaml`` files are
gpt-neox configs, read as YAML.

Example:
    >>> parse_text('{"train_batch_size": 8, /* hjson */ "fp16": {enabled: true},}', source="x.json")
    {'train_batch_size': 8, 'fp16': {'enabled': True}}
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import hjson

from torsh_jax.errors import TranslationError

__all__ = ["load_deepspeed_config", "parse_text", "plain"]


def plain(value: Any) -> Any:
    """Ordered dicts to dicts, recursively (hjson returns OrderedDicts)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


class _Duplicated(dict):
    """A parsed JSON object whose text wrote some keys more than once (the last value kept)."""

    duplicates: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook``: a plain dict, or a :class:`_Duplicated` naming the repeated keys."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked = _Duplicated(obj)
    marked.duplicates = tuple(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
    return marked


def _first_duplicate(data: Any) -> str | None:
    """The key path of the first key written twice in one object, or None (no recursion)."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Duplicated):
            return f"{path}.{value.duplicates[0]}" if path else value.duplicates[0]
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else k, v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


def _refuse_duplicates(data: Any, source: str) -> None:
    duplicate = _first_duplicate(data)
    if duplicate:
        raise TranslationError(
            f"written more than once in one object of {source}; DeepSpeed refuses duplicate keys "
            '("Duplicate keys in DeepSpeed config")',
            key=duplicate,
            fix="keep one entry for the key and delete the others",
        )


def _parse_yaml(text: str, source: str) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML normally present
        return _parse_hjson(text, source)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise TranslationError(
            f"not valid YAML: {err}".replace("\n", " "),
            key=source,
            fix="correct the YAML syntax at the line and column given",
        ) from None


def _parse_hjson(text: str, source: str) -> Any:
    try:
        return hjson.loads(text, object_pairs_hook=_object)
    # hjson raises IndexError on some truncated input (an unterminated "/*")
    except (hjson.HjsonDecodeError, ValueError, RecursionError, IndexError) as err:
        raise TranslationError(
            f"not valid JSON or hjson: {err}",
            key=source,
            fix="fix the syntax (DeepSpeed reads configs with hjson)",
        ) from None


def parse_text(text: str, *, source: str = "<deepspeed>") -> dict:
    """Parse config text; JSON first, then hjson (or YAML for ``.yml``/``.yaml`` sources).

    Raises:
        TranslationError: bad syntax, a key written twice in one object (JSON
            and hjson), or the top level is not an object.
    """
    if source.endswith((".yml", ".yaml")):
        data = _parse_yaml(text, source)
    else:
        try:
            data = json.loads(text, object_pairs_hook=_object)
        except (json.JSONDecodeError, RecursionError):
            data = _parse_hjson(text, source)
        _refuse_duplicates(data, source)
    if not isinstance(data, dict):
        raise TranslationError(
            f"the top level must be an object, got {type(data).__name__}",
            key=source,
            fix='write the config as {"key": value, ...}',
        )
    return data


def load_deepspeed_config(path: str | Path) -> dict:
    """Read a DeepSpeed config file (hjson-lenient; YAML for gpt-neox files).

    Raises:
        TranslationError: missing or unreadable file, bad syntax.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TranslationError(
            f"cannot read the file: {err}", key=str(path), fix="pass a readable UTF-8 text file"
        ) from None
    if not text.strip():
        raise TranslationError("the file is empty", key=str(path), fix="pass a DeepSpeed config file")
    return parse_text(text, source=str(path))
