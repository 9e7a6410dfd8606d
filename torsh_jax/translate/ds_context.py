"""Shared state of one DeepSpeed translation: notes, strictness, typed readers.

Example:
    >>> ctx = Context(lenient=False)
    >>> ctx.read_int("zero_optimization.reduce_bucket_size", 5e8, minimum=0)
    500000000
    >>> ctx.read_int("train_batch_size", "auto") is None, ctx.missing_auto
    (True, ['train_batch_size'])
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any, NoReturn

from torsh_jax.errors import TranslationError
from torsh_jax.translate.result import Notes

__all__ = ["Context", "AUTO", "join"]

AUTO = "auto"


def join(path: str, key: str) -> str:
    """Dotted key path ``path.key`` (an empty key name is shown as ``""``)."""
    key = key if key else '""'
    return f"{path}.{key}" if path else key


#: Floats above this may not be the integer that was written.
_EXACT_FLOAT_INT = 2**53


class Context:
    """Collects notes; raises :class:`TranslationError` naming key paths.

    Args:
        lenient: record unsupported keys as notes instead of raising.
        strict: raise for keys DeepSpeed itself ignores (unknown top-level keys).
    """

    def __init__(self, *, lenient: bool = False, strict: bool = False):
        self.lenient = lenient
        self.strict = strict
        self.notes = Notes()
        self.extras: dict[str, Any] = {}
        self.missing_auto: list[str] = []

    # -- notes -----------------------------------------------------------------
    def mapped(self, key: str, value: Any, detail: str) -> None:
        self.notes.mapped(key, value, detail)

    def approximated(self, key: str, value: Any, detail: str) -> None:
        self.notes.approximated(key, value, detail)

    def ignored(self, key: str, value: Any, detail: str) -> None:
        self.notes.ignored(key, value, detail)

    def removed(self, key: str, value: Any, detail: str) -> None:
        self.notes.removed(key, value, detail)

    def unsupported(self, key: str, value: Any, reason: str, fix: str | None = None) -> None:
        """Note ``key`` as unsupported; raise unless lenient."""
        self.notes.unsupported(key, value, reason)
        if not self.lenient:
            raise TranslationError(reason, key=key, fix=fix or "remove the key, or pass --lenient")

    def fail(self, key: str, message: str, fix: str | None = None) -> NoReturn:
        """Raise for an invalid value (even when lenient)."""
        default = "give this key a value of the kind named (fill in any template placeholder)"
        raise TranslationError(message, key=key, fix=fix or default)

    def unknown(self, key: str, value: Any, known: Iterable[str], where: str) -> None:
        """An unknown key: unsupported, with the closest known spelling as the fix."""
        name = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
        fix = f"did you mean {close[0]!r}?" if close else f"remove it; DeepSpeed {where} has no such key"
        self.unsupported(key, value, f"unknown key in {where}", fix)

    def ignored_unknown(self, key: str, value: Any, known: Iterable[str], why: str) -> None:
        """A key DeepSpeed accepts and ignores: an ``ignored`` note (an error when strict)."""
        close = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(known), n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}?" if close else None
        if self.strict:
            raise TranslationError(f"unknown key; {why}", key=key, fix=hint or "remove it, or drop --strict")
        self.ignored(key, value, f"unknown key; {why}" + (f"; {hint}" if hint else ""))

    # -- typed readers (``"auto"`` -> None and remembered) ---------------------
    def _auto(self, key: str, value: Any) -> bool:
        if isinstance(value, str) and value == AUTO:
            if key not in self.missing_auto:
                self.missing_auto.append(key)
            return True
        return False

    def read_bool(self, key: str, value: Any) -> bool | None:
        if self._auto(key, value):
            return None
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {value!r}")
        return value

    def read_number(self, key: str, value: Any, *, minimum: float | None = None) -> float | None:
        if self._auto(key, value):
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value):
            self.fail(key, f"must be a number, got {value!r}")
        if minimum is not None and value < minimum:
            self.fail(key, f"must be >= {minimum}, got {value!r}")
        return float(value)

    def read_int(
        self, key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        """An integer; a float only when it is exactly a whole number (at most 2**53)."""
        number = self.read_number(key, value, minimum=minimum)
        if number is None:
            return None
        if not number.is_integer():
            self.fail(key, f"must be a whole number, got {value!r}", fix="write it as an integer, e.g. 32")
        if maximum is not None and number > maximum:
            self.fail(key, f"must be at most {maximum:,}, got {value!r}", fix=f"use at most {maximum}")
        if isinstance(value, float) and abs(value) > _EXACT_FLOAT_INT:
            self.fail(key, f"{value!r} is too large to be an exact integer", fix="write it as an integer")
        return int(value)

    def read_str(self, key: str, value: Any, *, choices: Iterable[str] | None = None) -> str | None:
        if self._auto(key, value):
            return None
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {value!r}")
        if choices is not None:
            options = list(choices)
            if value not in options:
                self.fail(key, f"must be one of {options}, got {value!r}")
        return value

    def read_table(self, key: str, value: Any) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"must be a table (JSON object), got {type(value).__name__} {value!r}")
        for name in value:
            if not isinstance(name, str):
                self.fail(key, f"keys must be strings, got {name!r}")
        return value

    def read_enabled(self, key: str, table: dict, default: bool = False) -> bool | None:
        """The ``enabled`` flag of a section (``None`` when it is ``"auto"``)."""
        if "enabled" not in table:
            return default
        return self.read_bool(join(key, "enabled"), table["enabled"])
