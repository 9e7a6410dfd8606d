"""Reading DeepSpeed config files: JSON, with DeepSpeed's hjson leniency, and gpt-neox YAML.

DeepSpeed reads its config with ``hjson``, so comments, unquoted keys and
trailing commas are accepted; so are they here. ``.yml``/``.yaml`` files are
gpt-neox configs, read as YAML.

Example:
    >>> parse_text('{"train_batch_size": 8, /* hjson */ "fp16": {enabled: true},}', source="x.json")
    {'train_batch_size': 8, 'fp16': {'enabled': True}}
"""

from __future__ import annotations

import json
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
        return plain(hjson.loads(text))
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
        TranslationError: bad syntax, or the top level is not an object.
    """
    if source.endswith((".yml", ".yaml")):
        data = _parse_yaml(text, source)
    else:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            data = _parse_hjson(text, source)
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
