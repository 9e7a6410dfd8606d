"""A small reader for the text of an optimized HLO module (``compiled.as_text()``).

It knows just enough HLO to find collectives: array and tuple shapes,
one instruction per line (``%name = SHAPE opcode(operands), attr=value, ...``),
computations, the module header (``num_partitions``, ``replica_count``) and
(how often each computation runs is in :mod:`torsh_jax.analysis._calls`).

Example:
    >>> text = '''HloModule m, num_partitions=2
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %r = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add
    ... }'''
    >>> module = parse_module(text)
    >>> module.entry, module.num_partitions
    ('main', 2)
    >>> ins = module.computations['main'][1]
    >>> ins.opcode, ins.operands, shape_bytes(ins.shape)
    ('all-reduce', ('p',), 16)
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

from torsh_jax.errors import NotSupportedYetError

__all__ = [
    "ArrayShape",
    "Shape",
    "Instruction",
    "HloModuleText",
    "parse_shape",
    "element_bits",
    "flat_arrays",
    "shape_bytes",
    "parse_module",
    "cached_module",
]

#: Bits per element of HLO primitive types.
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
    "token": 0,
}  # fmt: skip

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_INSTRUCTION_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
_IOTA_LIST_RE = re.compile(r"\[[\d,]*\]<=\[[\d,]*\](?:T\([\d,]*\))?")
_QUOTED_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_CALLEE_ATTRS = ("calls", "to_apply", "body", "condition", "branch_computations",
                 "true_computation", "false_computation")  # fmt: skip


@dataclass(frozen=True)
class ArrayShape:
    """One array type: ``dtype`` (HLO name such as ``f32``) and ``dims``."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        bits = _BITS.get(self.dtype)
        if bits is None:
            raise NotSupportedYetError(
                f"unknown HLO element type {self.dtype!r}",
                key="hlo.shape",
                fix="add its bit width to torsh_jax.analysis._hlo_text._BITS",
            )
        return math.ceil(math.prod(self.dims) * bits / 8)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


#: An array shape or a (possibly nested) tuple of shapes.
Shape = ArrayShape | tuple


_BRACKETS_RE = re.compile(r"[(){}\[\]]")
_SPLIT_RE = re.compile(r"[(){}\[\],]")
_CLOSERS = {"(": ")", "{": "}", "[": "]"}
_PAIR_RES = {opener: re.compile(f"[{re.escape(opener + closer)}]") for opener, closer in _CLOSERS.items()}


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside any (), {}, [] nesting; parts stripped, empty parts dropped."""
    if _BRACKETS_RE.search(text) is None:
        parts = text.split(",")
    else:
        parts, depth, start = [], 0, 0
        for match in _SPLIT_RE.finditer(text):
            ch = match.group()
            if ch in "({[":
                depth += 1
            elif ch in ")}]":
                depth -= 1
            elif depth == 0:
                parts.append(text[start : match.start()])
                start = match.end()
        parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _matching_close(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]`` (other bracket kinds are not counted)."""
    opener = text[start]
    close = text.find(_CLOSERS[opener], start + 1)
    if close >= 0 and text.find(opener, start + 1, close) < 0:
        return close
    depth = 0
    for match in _PAIR_RES[opener].finditer(text, start):
        depth += 1 if match.group() == opener else -1
        if depth == 0:
            return match.start()
    raise NotSupportedYetError(
        f"unbalanced {opener!r} in HLO text: {text[:120]!r}",
        key="hlo",
        fix="pass the text of a whole HLO module (compiled.as_text())",
    )


def parse_shape(text: str) -> Shape:
    """Parse an HLO type such as ``f32[16,4]{1,0}`` or ``(f32[4], s32[])``.

    Example:
        >>> parse_shape("(bf16[2,3]{1,0}, /*index=1*/s8[])")
        (ArrayShape(dtype='bf16', dims=(2, 3)), ArrayShape(dtype='s8', dims=()))
    """
    return _cached_shape(text)


@functools.lru_cache(maxsize=4096)
def _cached_shape(text: str) -> Shape:
    """:func:`parse_shape`, once per distinct text (a program repeats few types; shapes are immutable)."""
    text = _COMMENT_RE.sub("", text).strip() if "/*" in text else text.strip()
    if text.startswith("("):
        inner = text[1 : _matching_close(text, 0)]
        return tuple(_cached_shape(part) for part in _split_top_level(inner))
    match = _ARRAY_RE.match(text)
    if match is None:
        raise NotSupportedYetError(
            f"cannot read HLO type {text[:80]!r}",
            key="hlo.shape",
            fix="pass the text of a whole HLO module (compiled.as_text())",
        )
    dims = tuple(int(d.replace("<=", "")) for d in match.group(2).split(",") if d.strip())
    return ArrayShape(match.group(1), dims)


def element_bits(dtype: str) -> int | None:
    """Bits per element of an HLO element type (``None`` when unknown)."""
    return _BITS.get(dtype)


def flat_arrays(shape: Shape) -> list[ArrayShape]:
    """The array shapes of ``shape`` in order, tuples flattened."""
    if isinstance(shape, ArrayShape):
        return [shape]
    return [a for element in shape for a in flat_arrays(element)]


def shape_bytes(shape: Shape) -> int:
    """Bytes of all arrays in ``shape`` (tuple index tables not counted)."""
    return sum(a.nbytes for a in flat_arrays(shape))


@functools.lru_cache(maxsize=64)
def _attr_key_re(key: str) -> re.Pattern:
    return re.compile(rf"(?:^|[\s,]){re.escape(key)}=")


def _blank_strings(text: str) -> str:
    """``text`` with the inside of "quoted strings" blanked (same length), so keys in them do not match."""
    return _QUOTED_RE.sub(lambda m: '"' + "_" * (len(m.group(0)) - 2) + '"', text)


#: ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``: groups named by mesh axes.
_MESH_GROUPS_RE = re.compile(r"mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^}]*\}")
_TOKEN_END_RE = re.compile(r"[,\s]|$")
_CALLEE_NAME_RE = re.compile(r"%?([\w.\-]+)")


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction line.

    Attributes:
        name: instruction name without ``%``.
        shape: result type.
        opcode: e.g. ``all-reduce``, ``while``, ``fusion``.
        operands: operand names (without ``%``).
        operand_shapes: types written inline before operand names (older
            printers do this), else ``None`` for each operand.
        attrs: the text after the operand list (``channel_id=1, ...``).
        is_root: the instruction is its computation's ``ROOT``.
    """

    name: str
    shape: Shape
    opcode: str
    operands: tuple[str, ...]
    operand_shapes: tuple[Shape | None, ...]
    attrs: str
    is_root: bool = False

    @functools.cached_property
    def _searchable_attrs(self) -> str:
        return _blank_strings(self.attrs)

    def attr(self, key: str) -> str | None:
        """The raw value of attribute ``key`` (a balanced {...} block or a token)."""
        if f"{key}=" not in self.attrs:
            return None
        match = _attr_key_re(key).search(self._searchable_attrs)
        if match is None:
            return None
        start = match.end()
        iota = _IOTA_LIST_RE.match(self.attrs, start)
        if iota:
            return iota.group(0)
        mesh = _MESH_GROUPS_RE.match(self.attrs, start)
        if mesh:
            return mesh.group(0)
        if start < len(self.attrs) and self.attrs[start] in "{[(":
            return self.attrs[start : _matching_close(self.attrs, start) + 1]
        return self.attrs[start : _TOKEN_END_RE.search(self.attrs, start).start()]

    def callees(self) -> list[tuple[str, str]]:
        """(attribute, computation name) for every computation this instruction calls."""
        return list(self._callees)

    @functools.cached_property
    def _callees(self) -> tuple[tuple[str, str], ...]:
        if "=" not in self.attrs:
            return ()
        found = []
        for key in _CALLEE_ATTRS:
            value = self.attr(key)
            if value is not None:
                found.extend((key, name) for name in _CALLEE_NAME_RE.findall(value.strip("{}")))
        return tuple(found)


@dataclass
class HloModuleText:
    """A parsed module: computations by name (in text order) and header facts."""

    name: str
    entry: str
    computations: dict[str, list[Instruction]] = field(default_factory=dict)
    num_partitions: int = 1
    replica_count: int = 1
    _by_name: dict[str, dict[str, Instruction]] = field(default_factory=dict, repr=False)

    def instruction(self, computation: str, name: str) -> Instruction | None:
        """The instruction ``name`` of ``computation``, if any."""
        if computation not in self._by_name:
            self._by_name[computation] = {i.name: i for i in self.computations.get(computation, [])}
        return self._by_name[computation].get(name)

    def root(self, computation: str) -> Instruction | None:
        """The ``ROOT`` instruction of ``computation`` (the last one when none is marked)."""
        instructions = self.computations.get(computation, [])
        return next((i for i in instructions if i.is_root), instructions[-1] if instructions else None)


_LITERAL_RE = re.compile(r"^[-+]?(\d|\.\d|inf|nan|true|false|\{)", re.IGNORECASE)


_OPERAND_NAME_RE = re.compile(r"%?([\w.\-]+)$")
_OPCODE_RE = re.compile(r"\s*([\w\-]+)\(")
#: ``%name, %name, ...``: operands as the current printer writes them.
_NAMES_ONLY_RE = re.compile(r"%[\w.\-]+(?:, %[\w.\-]+)*")
#: One number such as ``parameter(0)``'s or ``constant(-3.4e+38)``'s.
_LONE_NUMBER_RE = re.compile(r"[-+]?\.?\d[\w.+\-]*")
#: The common line: an array type (no spaces), one space, ``opcode(`` and operands without parentheses.
_SIMPLE_LINE_RE = re.compile(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*([^\s(][^ ]*) ([\w\-]+)\(([^()]*)\)(.*)")


def _parse_operand(part: str) -> tuple[str, Shape | None] | None:
    """(name, inline type or ``None``) of one operand; a literal is kept as written, untyped."""
    if "/*" in part:
        part = _COMMENT_RE.sub("", part).strip()
    if _LITERAL_RE.match(part):
        return part, None  # a literal such as ``constant(-3.4e+38)``
    match = _OPERAND_NAME_RE.search(part)
    if match is None:
        return None
    typed = part[: match.start()].strip()
    return match.group(1), (_cached_shape(typed) if typed else None)


def _parse_operands(text: str) -> tuple[tuple[str, ...], tuple[Shape | None, ...]]:
    if _NAMES_ONLY_RE.fullmatch(text):
        names = tuple(text[1:].split(", %"))
        return names, (None,) * len(names)
    if _LONE_NUMBER_RE.fullmatch(text):
        return (text,), (None,)
    if not text:
        return (), ()
    parsed = [op for op in map(_parse_operand, _split_top_level(text)) if op is not None]
    return tuple(name for name, _ in parsed), tuple(shape for _, shape in parsed)


def _parse_instruction(line: str) -> Instruction | None:
    simple = _SIMPLE_LINE_RE.match(line)
    if simple is None:
        return _parse_any_instruction(line)
    root, name, shape, opcode, operands, attrs = simple.groups()
    names, shapes = _parse_operands(operands)
    attrs = attrs.rstrip().lstrip(", ")
    return Instruction(name, _cached_shape(shape), opcode, names, shapes, attrs, bool(root))


def _parse_any_instruction(line: str) -> Instruction | None:
    """:func:`_parse_instruction` for any line: tuple types, parentheses among the operands."""
    match = _INSTRUCTION_RE.match(line)
    if match is None:
        return None
    name, rest = match.group(2), match.group(3).strip()
    if rest.startswith("("):
        type_end = _matching_close(rest, 0) + 1
    else:
        type_end = rest.find(" ")
        if type_end < 0:
            return None
    shape = _cached_shape(rest[:type_end])
    op_match = _OPCODE_RE.match(rest, type_end)
    if op_match is None:
        return None
    open_at = op_match.end() - 1
    close_at = _matching_close(rest, open_at)
    operands, operand_shapes = _parse_operands(rest[open_at + 1 : close_at])
    attrs = rest[close_at + 1 :].lstrip(", ")
    return Instruction(name, shape, op_match.group(1), operands, operand_shapes, attrs, bool(match.group(1)))


def _header_int(header: str, key: str, default: int) -> int:
    match = re.search(rf"\b{key}=(\d+)", header)
    return int(match.group(1)) if match else default


def parse_module(text: str) -> HloModuleText:
    """Parse the text of one HLO module (the first one, if several are given).

    Raises:
        NotSupportedYetError: the text has no ``HloModule`` header or no
            ``ENTRY`` computation.
    """
    lines = text.splitlines()
    header = next((ln for ln in lines if ln.startswith("HloModule")), None)
    if header is None:
        raise NotSupportedYetError("text has no 'HloModule' header", key="hlo", fix="pass compiled.as_text()")
    module = HloModuleText(name=header.split()[1].rstrip(","), entry="")
    module.num_partitions = _header_int(header, "num_partitions", 1)
    module.replica_count = _header_int(header, "replica_count", 1)
    current: list[Instruction] | None = None
    for line in lines[lines.index(header) + 1 :]:
        if line.startswith("HloModule"):
            break
        header_match = _HEADER_RE.match(line) if " = " not in line else None
        if header_match:
            current = module.computations.setdefault(header_match.group(2), [])
            if header_match.group(1):
                module.entry = header_match.group(2)
        elif line.strip() == "}":
            current = None
        elif current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                current.append(instruction)
    if not module.entry:
        raise NotSupportedYetError(
            "HLO module has no ENTRY computation",
            key=f"hlo.{module.name}",
            fix="pass the text of a whole HLO module (compiled.as_text())",
        )
    return module


@functools.lru_cache(maxsize=2)
def cached_module(text: str) -> HloModuleText:
    """:func:`parse_module`, once for the analyses that read the same program one after another.

    Every call with the same text returns the same object: read it, do not change it.
    """
    return parse_module(text)
