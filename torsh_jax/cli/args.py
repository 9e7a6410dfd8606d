"""The argument parser and argument types of the commands: every error is one line with a ``Fix:``.

:class:`OneLineParser` prints argparse's own errors (unknown option, missing
argument, bad choice) as one line ending in ``Fix: ...``; the usage block is
shown by ``--help`` only.

Example:
    >>> steps = count_type(0, 1_000_000, fix="pass --steps 20")
    >>> steps("20")
    20
    >>> steps("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a whole number in 0..1,000,000, got '-1'. Fix: pass --steps 20
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from torsh_jax.errors import TorshError

__all__ = [
    "OneLineParser",
    "count_type",
    "flag_error",
    "output_file_type",
    "output_problem",
    "MAX_STEPS",
    "MAX_DEVICES",
]

#: Most optimizer steps the demo runs in one call (hours of CPU time at the default size).
MAX_STEPS = 1_000_000

#: Most devices a command addresses; more than any pod has. Simulated CPU devices are
#: bounded further by host memory (``torsh_jax.demo.host``).
MAX_DEVICES = 65_536


def flag_error(err: TorshError, parser: argparse.ArgumentParser) -> TorshError:
    """``err`` keyed by the flag that set the value it names (``--grace-period``), where the library
    named its parameter (``grace_period``: the flag's ``dest`` in ``parser``) as the key or as the
    key's first word (``target 'v9x-3'``); else ``err``.

    Example:
        >>> from torsh_jax.errors import DistributedError
        >>> parser = argparse.ArgumentParser()
        >>> _ = parser.add_argument("--grace-period", type=float)
        >>> err = DistributedError("must be >= 0 seconds", key="grace_period")
        >>> str(flag_error(err, parser))
        '--grace-period: must be >= 0 seconds'
        >>> str(flag_error(DistributedError("unknown", key="grace_period 'x'"), parser))
        "--grace-period 'x': unknown"
    """
    import copy

    name, space, rest = (err.key or "").partition(" ")
    for action in parser._actions:
        if action.dest == name and action.option_strings:
            flagged = copy.copy(err)
            flagged.reword(key=max(action.option_strings, key=len) + space + rest)
            return flagged
    return err


def count_type(low: int, high: int, *, fix: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting whole numbers in ``low..high`` (decimal digits only)."""

    def parse(text: str) -> int:
        stripped = text.strip()
        digits = stripped.removeprefix("-")
        value = int(stripped) if digits.isdigit() and len(digits) <= 30 else None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a whole number in {low:,}..{high:,}, got {text!r}. Fix: {fix}"
            )
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def names_type(allowed: tuple[str, ...], *, none: str = "none") -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type`` accepting a comma list of ``allowed`` names (``()`` for ``none``).

    Example:
        >>> names_type(("int8", "topk"))("topk,int8"), names_type(("int8",))("none")
        (('topk', 'int8'), ())
    """

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",")))
        if names == (none,):
            return ()
        unknown = [n for n in names if n not in allowed]
        if unknown:
            what = f"{none!r} goes alone" if none in unknown else f"{unknown[0]!r} is not one of them"
            raise argparse.ArgumentTypeError(
                f"{what} ({', '.join(allowed)}; or {none}). Fix: pass a comma list of them, e.g. "
                f"{','.join(allowed)}, or {none}"
            )
        return names

    parse.__name__ = "names"  # argparse names the type in its messages
    return parse


def bytes_type(*, fix: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting a positive byte count (:func:`~torsh_jax.units.parse_bytes`:
    ``14GiB``, ``16e9``)."""

    def parse(text: str) -> int:
        from torsh_jax.units import parse_bytes

        try:
            return parse_bytes(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}. Fix: {fix}") from None

    parse.__name__ = "size"  # argparse names the type in its messages
    return parse


def output_file_type(*suffixes: str) -> Callable[[str], Path]:
    """An argparse ``type`` for a file the command writes when its work is done (``-o``), checked
    when it starts (:func:`output_problem`), so that no work is lost to a path it cannot write.

    Example:
        >>> output_file_type(".toml", ".json")("/no/such/dir/plan.toml")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: directory '/no/such/dir' does not exist. Fix: create it ...
    """

    def parse(text: str) -> Path:
        path = Path(text)
        problem = output_problem(path, suffixes)
        if problem is not None:
            what, fix = problem
            raise argparse.ArgumentTypeError(f"{what}. Fix: {fix}")
        return path

    parse.__name__ = "path"  # argparse names the type in its messages
    return parse


def output_problem(path: Path, suffixes: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """``(what, fix)`` if ``path`` cannot be written as an output file: it is a directory, its
    suffix is not one of ``suffixes`` (any, when empty), its directory does not exist or this
    process may not write it; ``None`` when it can.

    Example:
        >>> output_problem(Path("/"), (".toml",))
        ("'/' is a directory", 'name a file in it, e.g. /out.toml')
    """
    parent, name = path.parent, "out" + (suffixes[0] if suffixes else "")
    if path.is_dir():
        return f"{str(path)!r} is a directory", f"name a file in it, e.g. {path / name}"
    if suffixes and path.suffix not in suffixes:
        what = f"{str(path)!r} must end in {' or '.join(suffixes)}"
        if str(path) == "-" or (path.exists() and not path.is_file()):  # stdout, a device: no such file
            return what, f"write to a {' or '.join(suffixes)} file, e.g. {name}"
        return what, f"use {path.with_suffix(suffixes[0])}"
    if not parent.is_dir():
        return (
            f"directory {str(parent)!r} does not exist",
            f"create it (mkdir -p {parent}) or write elsewhere",
        )
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"cannot write {str(path)!r}: permission denied", "choose a path you can write"
    return None


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: WHAT. Fix: HOW``, exit code 2.

    Example:
        >>> parser = OneLineParser(prog="torsh-jax demo")
        >>> _ = parser.add_argument("--steps", type=int)
        >>> parser.fix_for("unrecognized arguments: --step 3")
        'did you mean --steps?'
    """

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        if "Fix:" not in text:
            text = f"{text}. Fix: {self.fix_for(text)}"
        self.exit(2, f"{self.prog}: error: {text}\n")

    def fix_for(self, message: str) -> str:
        """What to do about one of argparse's own error messages."""
        helps = f"`{self.prog} --help` shows the usage"
        if message.startswith("unrecognized arguments:"):
            words = message.split(":", 1)[1].split()
            options = [o for o in self._option_string_actions if o.startswith("--")]
            close = difflib.get_close_matches(words[0].split("=")[0], options, n=1, cutoff=0.6)
            return f"did you mean {close[0]}?" if close else f"remove {' '.join(words)}; {helps}"
        if "invalid choice:" in message:
            found = re.findall(r"'([^']*)'", message)
            close = difflib.get_close_matches(found[0], found[1:], n=1, cutoff=0.6) if found else []
            return f"did you mean {close[0]!r}?" if close else "use one of the choices listed"
        if message.startswith("the following arguments are required:"):
            missing = message.split(":", 1)[1].strip()
            commands = self._subcommands()
            if commands is not None and missing == (commands.metavar or commands.dest):
                return f"name one of {', '.join(commands.choices)}"
            return f"pass {missing}; {helps}"
        kind = re.search(r"invalid (\w+) value", message)
        if kind:
            return f"write a {'number' if kind.group(1) == 'float' else f'valid {kind.group(1)}'}; {helps}"
        if "expected" in message and "argument" in message:
            return f"give the option a value; {helps}"
        if "not allowed with" in message:
            return "pass only one of the two"
        return helps

    def _subcommands(self) -> argparse._SubParsersAction | None:
        return next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
