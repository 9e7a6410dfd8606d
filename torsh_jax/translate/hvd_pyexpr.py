"""Read settings out of Python source excerpts without running them.

Training scripts hold their parallel settings in calls such as
``hvd.DistributedOptimizer(opt, op=hvd.Average)`` or
``FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD)``. This module
finds such calls, parses them with :mod:`ast` and evaluates their arguments
symbolically: constants stay constants, ``a.b.c`` becomes a :class:`Symbol`,
``args.x`` resolves through argparse defaults, local names resolve through
earlier assignments, and anything else becomes :class:`Unknown`.

Example:
    >>> src = "c = hvd.Compression.fp16\\nopt = hvd.DistributedOptimizer(o, compression=c)"
    >>> script = PyScript(src)
    >>> call = script.calls(("DistributedOptimizer",))[0]
    >>> script.evaluate(call.node.keywords[0].value, before=call.line).value
    Symbol(path='hvd.Compression.fp16')
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from torsh_jax.errors import TranslationError

__all__ = [
    "Symbol",
    "Unknown",
    "CallValue",
    "Evaluated",
    "CallSite",
    "PyScript",
    "shown",
    "strip_comment_lines",
]

_MAX_DEPTH = 12
_MAX_CALL_CHARS = 20_000


@dataclass(frozen=True)
class Symbol:
    """A dotted name such as ``hvd.Compression.fp16`` or ``torch.bfloat16``."""

    path: str

    @property
    def last(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Unknown:
    """A value that depends on something the excerpt does not show."""

    source: str


@dataclass(frozen=True)
class CallValue:
    """A call expression with evaluated arguments, e.g. ``MixedPrecision(param_dtype=...)``."""

    func: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Evaluated:
    """A value plus the assumptions made to get it (for notes)."""

    value: Any
    assumptions: tuple[str, ...] = ()


@dataclass(frozen=True)
class CallSite:
    """One call found in the text: callee name, 1-based line and parsed node."""

    name: str
    line: int
    node: ast.Call
    source: str


def shown(value: Any) -> Any:
    """``value`` as a note shows it: a symbol's path, an unknown's source, ``func(...)`` for a call.

    Example:
        >>> shown(Symbol("hvd.Average")), shown(CallValue("torch.optim.SGD", (), {})), shown(0.1)
        ('hvd.Average', 'torch.optim.SGD(...)', 0.1)
    """
    if isinstance(value, Symbol):
        return value.path
    if isinstance(value, Unknown):
        return value.source
    if isinstance(value, CallValue):
        return f"{value.func}(...)"
    return value


def strip_comment_lines(text: str) -> str:
    """``text`` with whole-line ``#`` comments blanked (line numbers kept)."""
    return "\n".join("" if line.lstrip().startswith("#") else line for line in text.splitlines())


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _closing_paren(text: str, start: int) -> int | None:
    """Index of the ``)`` matching the ``(`` at ``start`` (quotes respected)."""
    depth, quote, i = 0, "", start
    end = min(len(text), start + _MAX_CALL_CHARS)
    while i < end:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _parse_expr(source: str, key: str) -> ast.expr:
    try:
        return ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise TranslationError(
            f"cannot parse Python expression {source[:80]!r}: {type(err).__name__}",
            key=key,
            fix="give the complete call with balanced parentheses",
        ) from None


@dataclass
class PyScript:
    """A Python excerpt: assignments, argparse defaults and calls.

    Args:
        text: the source text (fragments and odd indentation are fine).
        arg_values: known ``args.<dest>`` values, overriding argparse defaults.
        known_calls: values of argument-free calls by dotted name
            (``{"hvd.size": 8}``).
    """

    text: str
    arg_values: dict[str, Any] = field(default_factory=dict)
    known_calls: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.text = strip_comment_lines(self.text)
        self._lines = self.text.splitlines()
        self._offsets = [0]
        for line in self._lines:
            self._offsets.append(self._offsets[-1] + len(line) + 1)
        self.assignments = self._find_assignments()
        self.argparse = self._find_argparse()
        self.arg_defaults = {dest: info["default"] for dest, info in self.argparse.items()}

    def _line_of(self, offset: int) -> int:
        lo, hi = 0, len(self._offsets) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._offsets[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    def calls(self, names: tuple[str, ...]) -> list[CallSite]:
        """Calls of any of ``names`` (optionally qualified: ``hvd.X(``), in order."""
        pattern = re.compile(
            r"(?<![\w.])((?:[A-Za-z_]\w*\.)*(" + "|".join(map(re.escape, names)) + r"))\s*\("
        )
        sites = []
        for match in pattern.finditer(self.text):
            before = self.text[max(0, match.start() - 4) : match.start()]
            if before.endswith("def ") or before.endswith("ass "):
                continue
            open_at = match.end() - 1
            close_at = _closing_paren(self.text, open_at)
            key = match.group(2)
            if close_at is None:
                raise TranslationError(
                    f"call {match.group(1)}( is not closed", key=key, fix="include the whole call"
                )
            source = match.group(1) + self.text[open_at : close_at + 1]
            node = _parse_expr(source.replace("\n", " "), key)
            if isinstance(node, ast.Call):
                sites.append(CallSite(match.group(2), self._line_of(match.start()), node, source))
        return sites

    def _find_assignments(self) -> dict[str, list[tuple[int, ast.expr, ast.expr | None]]]:
        """``name -> [(line, value, guard)]``; ``guard`` is the test of an enclosing ``if``."""
        found: dict[str, list[tuple[int, ast.expr, ast.expr | None]]] = {}
        target = re.compile(r"^\s*([A-Za-z_]\w*)\s*=(?!=)\s*(\S.*)$")
        for index, line in enumerate(self._lines):
            match = target.match(line)
            if not match:
                continue
            expr = self._grow_expression(index, match.group(2))
            if expr is not None:
                found.setdefault(match.group(1), []).append((index + 1, expr, self._guard(index)))
        return found

    def _guard(self, index: int) -> ast.expr | None:
        """The test of the ``if`` block holding line ``index``, if the nearest outer line is one."""
        indent = len(self._lines[index]) - len(self._lines[index].lstrip())
        for prev in range(index - 1, max(-1, index - 40), -1):
            line = self._lines[prev]
            if not line.strip():
                continue
            if len(line) - len(line.lstrip()) < indent:
                match = re.match(r"^\s*if\s+(.+):\s*$", line)
                if match is None:
                    return None
                try:
                    return ast.parse(match.group(1), mode="eval").body
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    return None
        return None

    def _grow_expression(self, index: int, first: str) -> ast.expr | None:
        source = first
        for extra in range(8):
            try:
                return ast.parse(source.strip(), mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                if index + extra + 1 >= len(self._lines):
                    return None
                source += "\n" + self._lines[index + extra + 1]
        return None

    def _find_argparse(self) -> dict[str, dict[str, Any]]:
        options: dict[str, dict[str, Any]] = {}
        for site in self.calls(("add_argument",)):
            flags = [
                a.value for a in site.node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
            kwargs = {k.arg: k.value for k in site.node.keywords if k.arg}
            long = next((f for f in flags if f.startswith("--")), flags[0] if flags else None)
            if long is None:
                continue
            dest = kwargs.get("dest")
            name = dest.value if isinstance(dest, ast.Constant) else long.lstrip("-").replace("-", "_")
            options[str(name)] = {"flag": long, "default": self._argparse_default(kwargs), "line": site.line}
        return options

    @staticmethod
    def _argparse_default(kwargs: dict[str, ast.expr]) -> Any:
        if "default" in kwargs:
            node = kwargs["default"]
            return node.value if isinstance(node, ast.Constant) else Unknown(ast.unparse(node))
        action = kwargs.get("action")
        action = action.value if isinstance(action, ast.Constant) else None
        return {"store_true": False, "store_false": True}.get(action)

    def lookup_arg(self, dest: str) -> Any:
        """The value of ``args.<dest>``: an override, else the argparse default, else Unknown."""
        if dest in self.arg_values:
            return self.arg_values[dest]
        if dest in self.arg_defaults:
            return self.arg_defaults[dest]
        return Unknown(f"args.{dest}")

    def evaluate(self, node: ast.expr, *, before: int) -> Evaluated:
        """Evaluate ``node`` using assignments on lines before ``before``."""
        assumptions: list[str] = []
        try:
            value = self._eval(node, before, assumptions, 0)
        except (RecursionError, MemoryError, ArithmeticError, ValueError):
            value = Unknown(_unparse(node))
        return Evaluated(value, tuple(assumptions))

    def _eval(self, node: ast.expr, before: int, notes: list[str], depth: int) -> Any:
        if depth > _MAX_DEPTH:
            return Unknown(_unparse(node))
        step = depth + 1
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self._eval_name(node.id, before, notes, step)
        if isinstance(node, ast.Attribute):
            path = _dotted(node)
            if path is None:
                return Unknown(_unparse(node))
            if path.startswith("args.") and path.count(".") == 1:
                return self.lookup_arg(path[5:])
            return Symbol(path)
        if isinstance(node, ast.IfExp):
            return self._eval_ifexp(node, before, notes, step)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            inner = self._eval(node.operand, before, notes, step)
            return Unknown(_unparse(node)) if isinstance(inner, Unknown) else not inner
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = self._eval(node.operand, before, notes, step)
            return -inner if _is_number(inner) else Unknown(_unparse(node))
        if isinstance(node, ast.BoolOp):
            return self._eval_boolop(node, before, notes, step)
        if isinstance(node, ast.BinOp):
            return self._eval_binop(node, before, notes, step)
        if isinstance(node, ast.Call):
            return self._eval_call(node, before, notes, step)
        if isinstance(node, (ast.List, ast.Tuple)):
            return tuple(self._eval(e, before, notes, step) for e in node.elts)
        return Unknown(_unparse(node))

    def _eval_name(self, name: str, before: int, notes: list[str], depth: int) -> Any:
        earlier = [item for item in self.assignments.get(name, ()) if item[0] < before]
        for line, expr, guard in reversed(earlier):
            if guard is not None:
                test = self._eval(guard, line, notes, depth)
                if isinstance(test, Unknown):
                    notes.append(f"assumed `{_unparse(guard)}` is false (its value is not in the file)")
                    continue
                if not test:
                    continue
            return self._eval(expr, line, notes, depth)
        return Unknown(name)

    def _eval_boolop(self, node: ast.BoolOp, before: int, notes: list[str], depth: int) -> Any:
        values = [self._eval(v, before, notes, depth) for v in node.values]
        decisive = (lambda v: not v) if isinstance(node.op, ast.And) else bool
        for value in values:
            if isinstance(value, Unknown):
                continue
            if decisive(value):
                return value
        if any(isinstance(v, Unknown) for v in values):
            return Unknown(_unparse(node))
        return values[-1]

    def _eval_ifexp(self, node: ast.IfExp, before: int, notes: list[str], depth: int) -> Any:
        test = self._eval(node.test, before, notes, depth)
        if isinstance(test, Unknown):
            notes.append(f"assumed `{_unparse(node.test)}` is false (its value is not in the file)")
            return self._eval(node.orelse, before, notes, depth)
        if isinstance(test, (Symbol, CallValue)):
            return self._eval(node.body, before, notes, depth)
        branch = node.body if test else node.orelse
        return self._eval(branch, before, notes, depth)

    def _eval_binop(self, node: ast.BinOp, before: int, notes: list[str], depth: int) -> Any:
        left = self._eval(node.left, before, notes, depth)
        right = self._eval(node.right, before, notes, depth)
        if not (_is_number(left) and _is_number(right)):
            return Unknown(_unparse(node))
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
        ops[ast.Div] = lambda a, b: a / b
        op = ops.get(type(node.op))
        if op is None or max(abs(left), abs(right)) > 1e300:
            return Unknown(_unparse(node))
        return op(left, right)

    def _eval_call(self, node: ast.Call, before: int, notes: list[str], depth: int) -> Any:
        func = _dotted(node.func) or _unparse(node.func)
        if func in self.known_calls and not node.args and not node.keywords:
            return self.known_calls[func]
        args = tuple(self._eval(a, before, notes, depth) for a in node.args)
        kwargs = {k.arg: self._eval(k.value, before, notes, depth) for k in node.keywords if k.arg}
        return CallValue(func, args, kwargs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _unparse(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except (ValueError, RecursionError, AttributeError):
        return "<expression>"
