"""Find and split ``horovodrun`` / ``mpirun`` command lines in a text.

A launch line may carry ``NAME=value`` environment assignments before the
launcher, launcher flags (see :mod:`~torsh_jax.translate.hvd_tables`), then
the training command (``python train.py --lr 0.1``) whose options belong to
the user's script.

Example:
    >>> cmd = find_launches("$ horovodrun -np 4 -H localhost:4 python train.py --lr 0.1")[0]
    >>> cmd.launcher, [f.written for f in cmd.flags], cmd.script, cmd.script_args
    ('horovodrun', ['-np', '-H'], 'train.py', [('--lr', '0.1')])
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from torsh_jax.errors import TranslationError
from torsh_jax.translate.hvd_tables import HOROVODRUN_FLAGS, MPIRUN_FLAGS, lookup_flag

__all__ = ["LaunchFlag", "LaunchCommand", "find_launches", "logical_lines", "ENV_ASSIGN"]

_LAUNCHERS = ("horovodrun", "mpirun", "mpiexec")
_LAUNCH_LINE = re.compile(r"(^|[\s/])(horovodrun|mpirun|mpiexec)(\s|$)")
_PREFIX_WORDS = ("$", ">", "sudo", "time", "exec", "nohup", "env", "srun")
#: ``NAME=value`` as a shell token.
ENV_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


@dataclass(frozen=True)
class LaunchFlag:
    """One launcher flag: as written, canonical spelling, role and values."""

    written: str
    flag: str
    role: str
    values: tuple[str, ...]


@dataclass
class LaunchCommand:
    """One launch command line.

    Args:
        launcher: ``horovodrun`` or ``mpirun``.
        env: ``NAME=value`` prefixes (value None when passed through by ``-x NAME``).
        flags: launcher flags in order.
        program: the program started on every worker (``python``).
        script: the training script (``train.py``), or None.
        script_args: the script's own options, ``(option, value or None)``.
        line: 1-based line where the command starts.
    """

    launcher: str
    env: list[tuple[str, str | None]] = field(default_factory=list)
    flags: list[LaunchFlag] = field(default_factory=list)
    program: str | None = None
    script: str | None = None
    script_args: list[tuple[str, str | None]] = field(default_factory=list)
    line: int = 1


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, as ``(first line number, text)``."""
    out: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not buffer:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        out.append((start, buffer + line))
        buffer = ""
    if buffer:
        out.append((start, buffer))
    return out


def find_launches(text: str) -> list[LaunchCommand]:
    """Every launch command in ``text``.

    Raises:
        TranslationError: a launch line cannot be split (unbalanced quotes)
            or has an unknown launcher flag.
    """
    commands = []
    for number, line in logical_lines(text):
        if line.lstrip().startswith("#") or not _LAUNCH_LINE.search(line):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as err:
            raise TranslationError(
                f"cannot split launch line {number}: {err}", key=f"line {number}", fix="balance the quotes"
            ) from None
        command = _parse_tokens(tokens, number)
        if command is not None:
            commands.append(command)
    return commands


def _launcher_index(tokens: list[str]) -> int | None:
    """Where the launcher is, if only a prompt, env assignments or wrappers precede it."""
    for i, token in enumerate(tokens):
        if token.rsplit("/", 1)[-1] in _LAUNCHERS:
            return i
        if token not in _PREFIX_WORDS and not ENV_ASSIGN.match(token):
            return None
    return None


def _parse_tokens(tokens: list[str], line: int) -> LaunchCommand | None:
    at = _launcher_index(tokens)
    if at is None:
        return None
    launcher = tokens[at].rsplit("/", 1)[-1]
    launcher = "mpirun" if launcher == "mpiexec" else launcher
    command = LaunchCommand(launcher=launcher, line=line)
    for token in tokens[:at]:
        match = ENV_ASSIGN.match(token)
        if match:
            command.env.append((match.group(1), match.group(2)))
    rest = _parse_flags(command, tokens[at + 1 :])
    _parse_program(command, rest)
    return command


def _parse_flags(command: LaunchCommand, tokens: list[str]) -> list[str]:
    table = HOROVODRUN_FLAGS if command.launcher == "horovodrun" else MPIRUN_FLAGS
    key_prefix = command.launcher
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("-") or token in ("-", "--"):
            return tokens[i + (token == "--") :]
        written, _, inline = token.partition("=")
        found = lookup_flag(table, written)
        if found is None:
            raise TranslationError(
                f"unknown {command.launcher} option {written!r}",
                key=f"{key_prefix}.{written}",
                fix=f"check the spelling; known options include {sorted(table)[:12]}...",
            )
        flag, nargs, role = found
        values = [inline] if "=" in token and nargs else []
        needed = nargs - len(values)
        values += tokens[i + 1 : i + 1 + needed]
        if len(values) < nargs:
            raise TranslationError(
                f"option {written} needs {nargs} value(s), got {len(values)}",
                key=f"{key_prefix}.{written}",
                fix=f"write {written} VALUE",
            )
        _add_flag(command, LaunchFlag(written, flag, role, tuple(values)))
        i += 1 + needed
    return []


def _add_flag(command: LaunchCommand, flag: LaunchFlag) -> None:
    if flag.role == "env":
        name, sep, value = flag.values[0].partition("=")
        command.env.append((name, value if sep else None))
    else:
        command.flags.append(flag)


def _parse_program(command: LaunchCommand, tokens: list[str]) -> None:
    if not tokens:
        return
    command.program = tokens[0]
    rest = tokens[1:]
    if command.program.rsplit("/", 1)[-1].startswith("python"):
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]
        if rest and rest[0] == "-m":
            rest = rest[1:]
        command.script = rest[0] if rest else None
        rest = rest[1:]
    else:
        command.script = command.program
    command.script_args = _split_script_args(rest)


def _split_script_args(tokens: list[str]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("-") and "=" in token:
            name, _, value = token.partition("=")
            out.append((name, value))
        elif token.startswith("-"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            takes_value = nxt is not None and not nxt.startswith("-")
            out.append((token, nxt if takes_value else None))
            i += takes_value
        else:
            out.append((token, None))
        i += 1
    return out
