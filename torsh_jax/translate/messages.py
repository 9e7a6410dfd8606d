"""Error texts that stay one readable line: long keys and values are clipped in the middle.

A translation error names the key and often echoes the value; a 100 KB key or
a huge list in the input must not turn the one-line error into 100 KB.
:func:`short_errors` wraps the public translators so that every
:class:`~torsh_jax.errors.TorshError` they raise is clipped in one place (the
path of the input file, which the user typed, is kept whole).

Example:
    >>> clip("k" * 100, 20)
    'kkkkkkkkk...kkkkkkkk'
    >>> short = clip_words("unknown key " + "x" * 200 + " here")
    >>> len(short), short.startswith("unknown key xxx"), "x..." in short, short.endswith("xxx here")
    (97, True, True, True)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import ParamSpec, TypeVar

from torsh_jax.errors import TorshError

__all__ = ["WORD_LIMIT", "MESSAGE_LIMIT", "clip", "clip_words", "shortened", "short_errors"]

#: Most characters of one key, value or other word shown in an error.
WORD_LIMIT = 80
#: Most characters of an error's message or fix (a long list value has spaces).
MESSAGE_LIMIT = 500

_ELLIPSIS = "..."
_LONG_WORD = re.compile(rf"\S{{{WORD_LIMIT + 1},}}")

P = ParamSpec("P")
R = TypeVar("R")


def clip(text: str, limit: int = WORD_LIMIT) -> str:
    """``text`` when it has at most ``limit`` characters, else its start and end around ``...``."""
    if len(text) <= limit:
        return text
    kept = max(limit - len(_ELLIPSIS), 2)
    head = (kept + 1) // 2
    return text[:head] + _ELLIPSIS + text[len(text) - (kept - head) :]


def clip_words(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` with each word longer than :data:`WORD_LIMIT` clipped, then clipped to ``limit``."""
    return clip(_LONG_WORD.sub(lambda match: clip(match.group()), text), limit)


def shortened(err: TorshError, *, keep: Collection[str] = ()) -> TorshError:
    """``err`` itself, its key, message and fix clipped (:func:`clip`, :func:`clip_words`); a key in
    ``keep`` (the input file's own path) stays whole."""
    key = err.key if not err.key or err.key in keep else clip(err.key)
    message = clip_words(err.message)
    fix = clip_words(err.fix) if err.fix else err.fix
    if (key, message, fix) != (err.key, err.message, err.fix):
        err.reword(message=message, key=key, fix=fix)
    return err


def _source_names(args: tuple) -> tuple[str, ...]:
    """How errors may name the input a translator was given as a path (its first argument)."""
    source = args[0] if args else None
    return (str(source), str(Path(source))) if isinstance(source, (str, Path)) else ()


def short_errors(func: Callable[P, R]) -> Callable[P, R]:
    """``func``, raising its :class:`TorshError` s :func:`shortened` (same error, same traceback);
    the path it was given keeps its full length."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except TorshError as err:
            shortened(err, keep=_source_names(args))
            raise

    return wrapper
