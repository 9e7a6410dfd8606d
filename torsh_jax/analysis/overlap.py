"""How much of each collective can hide behind compute, read from a compiled program's schedule.

The model is a **static schedule measure**, not a timing: a compiled GPU/TPU program is a
sequence of instructions per computation (``compiled.as_text()`` prints it in schedule order).
An asynchronous collective is a start and a done; whatever the schedule places between them runs
while the collective is in flight. A collective is **overlapped** when at least one compute op
(a fusion, a dot or convolution, a custom call, a loop, or any op on a non-scalar array) sits
between its start and its done, and **exposed** when nothing or only other collectives do, or
when it is synchronous (no start/done). For each collective the ops in between are counted with
their FLOPs (dots and convolutions, from their shapes) and output bytes, so a caller can compare
them with the collective's bytes under a roofline; whether the compute is *long enough* to hide
the transfer is not decided here.

Forms read: ``all-gather-start`` / ``-done`` (and the other collectives' ``-start``/``-done``),
``async-start`` / ``async-done`` wrapping a collective, and TPU's fusions whose root is a
``AsyncCollectiveStart`` / ``AsyncCollectiveDone`` custom call, with the compute fusions that
carry the collective's progress in between. A done is paired with its start by data flow; a start
whose done lies in the next loop iteration (collective pipelining) is measured around the loop.
Bytes, kinds and mesh axes come from :mod:`torsh_jax.analysis.hlo`; loop bodies count their trip
counts (``executions``).

Example:
    >>> text = '''HloModule m, is_scheduled=true, num_partitions=4
    ... %fused (a: f32[8,16], b: f32[16,32]) -> f32[8,32] {
    ...   %a = f32[8,16]{1,0} parameter(0)
    ...   %b = f32[16,32]{1,0} parameter(1)
    ...   ROOT %d = f32[8,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }
    ... ENTRY %main (p: f32[4,32], x: f32[8,16], w: f32[16,32]) -> (f32[16,32], f32[8,32]) {
    ...   %p = f32[4,32]{1,0} parameter(0)
    ...   %x = f32[8,16]{1,0} parameter(1)
    ...   %w = f32[16,32]{1,0} parameter(2)
    ...   %s = (f32[4,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
    ...   %f = f32[8,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused
    ...   %g = f32[16,32]{1,0} all-gather-done(%s)
    ...   ROOT %t = (f32[16,32]{1,0}, f32[8,32]{1,0}) tuple(%g, %f)
    ... }'''
    >>> report = collective_overlap(text, axis_sizes={"fsdp": 4})
    >>> [(o.collective.kind, o.status, o.compute_ops, o.compute_flops) for o in report.collectives]
    [('all-gather', 'overlapped', 1, 8192)]
    >>> report.fraction()
    1.0
"""  # noqa: E501

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from torsh_jax.analysis._calls import Executions, computation_executions, trip_count
from torsh_jax.analysis._hlo_text import ArrayShape, HloModuleText, Instruction, cached_module, flat_arrays
from torsh_jax.analysis.hlo import (
    KINDS,
    Collective,
    _collect,
    check_devices,
    mesh_positions,
    program_collectives,
)

__all__ = ["CollectiveOverlap", "OverlapReport", "collective_overlap", "collectives_once"]

_STARTS = {f"{kind}-start" for kind in KINDS} | {"async-start"}
_DONES = {f"{kind}-done" for kind in KINDS} | {"async-done"}
#: TPU: a fusion whose root custom call has this target starts / finishes a collective.
_TPU_START, _TPU_DONE = "AsyncCollectiveStart", "AsyncCollectiveDone"
#: Ops that do no work of their own (bookkeeping, aliasing, index scalars, host copies).
_NO_WORK = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done",
    "partition-id", "replica-id", "after-all", "add-dependency", "opt-barrier", "async-update",
    "send", "send-done", "recv", "recv-done", "infeed", "outfeed", "domain",
})  # fmt: skip
#: Ops passed through when following a done back to its start.
_PASS_THROUGH = frozenset({"get-tuple-element", "tuple", "bitcast", "async-update", "copy"})
#: Custom calls that only manage buffers.
_BOOKKEEPING_TARGETS = frozenset({"AllocateBuffer", _TPU_START, _TPU_DONE})
#: Attributes naming computations that run as their own schedule (not fused into one op).
_SCHEDULED_CALLEES = ("body", "condition", "branch_computations", "true_computation", "false_computation")

EXPOSED, OVERLAPPED = "exposed", "overlapped"


@dataclass(frozen=True)
class CollectiveOverlap:
    """One collective and what the schedule runs while it is in flight.

    Attributes:
        collective: the collective (kind, bytes, mesh axes, executions per step).
        start: name of the start instruction (of the instruction itself when synchronous).
        done: name of the done instruction, ``None`` when synchronous or unpaired.
        is_async: it has a start and a done.
        compute_ops: compute ops scheduled between start and done.
        compute_flops: their FLOPs (dots and convolutions, loops times their trip counts).
        compute_bytes: their output bytes (a fusion's outputs, collective buffers passed
            through it not counted).
        other_collectives: collective starts, dones and synchronous collectives in between.
        wraps_loop: the done is in the next iteration of the enclosing loop.
        in_loop: the collective is scheduled inside a loop body (a layer scan's iteration).
    """

    collective: Collective
    start: str
    done: str | None
    is_async: bool
    compute_ops: int = 0
    compute_flops: int = 0
    compute_bytes: int = 0
    other_collectives: int = 0
    wraps_loop: bool = False
    in_loop: bool = False

    @property
    def status(self) -> str:
        """``"overlapped"`` (compute between start and done) or ``"exposed"``."""
        return OVERLAPPED if self.is_async and self.compute_ops > 0 else EXPOSED

    @property
    def bytes_per_step(self) -> int:
        """Payload bytes per step (:attr:`Collective.payload_bytes_per_step`)."""
        return self.collective.payload_bytes_per_step


def _group_summary(items: list[CollectiveOverlap]) -> dict:
    total = sum(o.bytes_per_step for o in items)
    hidden = sum(o.bytes_per_step for o in items if o.status == OVERLAPPED)
    wire = sum(o.collective.wire_bytes_per_step for o in items)
    wire_hidden = sum(o.collective.wire_bytes_per_step for o in items if o.status == OVERLAPPED)
    return {
        "count": len(items),
        "async": sum(o.is_async for o in items),
        "overlapped": sum(o.status == OVERLAPPED for o in items),
        "bytes": total,
        "overlapped_bytes": hidden,
        "fraction": hidden / total if total else None,
        "wire_fraction": wire_hidden / wire if wire else None,
    }


@dataclass(frozen=True)
class OverlapReport:
    """Every collective of a program with its overlap (see the module docstring for the model).

    Attributes:
        collectives: one entry per collective instruction, async pairs once, in schedule order.
        scheduled: the HLO says ``is_scheduled=true`` (text order is the schedule).
    """

    collectives: tuple[CollectiveOverlap, ...]
    scheduled: bool

    def fraction(self, *, kind: str | None = None) -> float | None:
        """Fraction of collective payload bytes per step that are overlapped (``None``: no bytes)."""
        items = [o for o in self.collectives if kind is None or o.collective.kind == kind]
        return _group_summary(items)["fraction"]

    def by_kind(self) -> dict[str, dict]:
        """Summary per collective kind: count, async, overlapped, bytes, fractions."""
        return {
            k: _group_summary(v) for k, v in _grouped(self.collectives, lambda o: o.collective.kind).items()
        }

    def by_axes(self) -> dict[str, dict]:
        """Summary per mesh-axis set (``"fsdp"``, ``"data+fsdp"``; ``"?"``: axes unknown)."""
        return {k: _group_summary(v) for k, v in _grouped(self.collectives, _axes_label).items()}

    def by_place(self) -> dict[str, dict]:
        """Summary for collectives inside loop bodies (``"in_loops"``: a layer scan's gathers and
        reductions) and outside them (``"outside_loops"``: the step's own, e.g. embedding's)."""
        return {k: _group_summary(v) for k, v in _grouped(self.collectives, _place_label).items()}

    def to_dict(self) -> dict:
        """A JSON-ready summary: totals, per kind, per axes and per place (in or outside loops)."""
        return {
            "model": "static schedule: compute ops between each async start and done",
            "scheduled": self.scheduled,
            **_group_summary(list(self.collectives)),
            "by_kind": self.by_kind(),
            "by_axes": self.by_axes(),
            "by_place": self.by_place(),
        }


def _place_label(o: CollectiveOverlap) -> str:
    return "in_loops" if o.in_loop else "outside_loops"


def _axes_label(o: CollectiveOverlap) -> str:
    axes = o.collective.axes
    return "?" if axes is None else ("+".join(axes) or "-")


def _grouped(items: Iterable[CollectiveOverlap], key) -> dict[str, list[CollectiveOverlap]]:
    groups: dict[str, list[CollectiveOverlap]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def collective_overlap(
    compiled_or_text, mesh=None, *, axis_sizes: dict[str, int] | None = None
) -> OverlapReport:
    """Which collectives of a compiled program overlap compute in its schedule.

    Args:
        compiled_or_text: a compiled program (``jax.jit(f).lower(...).compile()``) or the text
            of its optimized, scheduled HLO module (``compiled.as_text()``).
        mesh: the mesh it was compiled for, to name each collective's mesh axes.
        axis_sizes: mesh axis name -> size in mesh order, instead of ``mesh`` (for text).

    Returns:
        An :class:`OverlapReport`; ``report.fraction()`` is the overlapped share of bytes.

    Raises:
        MeshError: the program runs on a different number of devices than ``mesh`` has.
        NotSupportedYetError: the text is not an HLO module.
    """
    is_text = isinstance(compiled_or_text, str)
    text = compiled_or_text if is_text else compiled_or_text.as_text()
    return _overlap_report(text, None if is_text else compiled_or_text, mesh, axis_sizes)


def _overlap_report(text: str, compiled, mesh, axis_sizes: dict[str, int] | None) -> OverlapReport:
    """:func:`collective_overlap` of the program ``text``; ``compiled`` (or ``None``) places its devices."""
    module = cached_module(text)
    positions = None
    if mesh is not None:
        check_devices(module, mesh)
        axis_sizes = {name: int(size) for name, size in mesh.shape.items()}
        if compiled is not None:
            positions = mesh_positions(compiled, mesh)
    records = {(c.computation, c.name): c for c in _collect(module, axis_sizes, positions)}
    flops: dict[str, int] = {}  # computation -> FLOPs, filled on use
    scheduled = bool(re.search(r"\bis_scheduled=true\b", text.split("\n", 1)[0]))
    found, executions = [], computation_executions(module)
    for computation in _scheduled_computations(module, executions):
        in_loop = executions[computation].in_loop
        found.extend(_Schedule(module, computation, records, flops, in_loop).overlaps())
    return OverlapReport(tuple(found), scheduled)


def collectives_once(compiled, mesh) -> list[Collective]:
    """:func:`~torsh_jax.analysis.hlo.collectives` with each collective once.

    TPU programs split an asynchronous collective over its start fusion and the compute fusions
    that carry its progress, each holding a copy of the instruction (with the same channel id);
    the copies in carrying fusions are dropped. Elsewhere (CPU, GPU) nothing is dropped.
    """
    text = compiled.as_text()
    module = cached_module(text)
    found = program_collectives(module, compiled, mesh)
    scheduled = set(_scheduled_computations(module, computation_executions(module)))
    if all(c.computation in scheduled for c in found):
        return found
    overlaps = _overlap_report(text, compiled, mesh, None).collectives
    counted = {(o.collective.computation, o.collective.name) for o in overlaps}
    return [c for c in found if c.computation in scheduled or (c.computation, c.name) in counted]


def _scheduled_computations(module: HloModuleText, reachable: dict[str, Executions]) -> list[str]:
    """ENTRY and every computation run as its own instruction sequence (loop bodies, branches, calls);
    ``reachable``: :func:`~torsh_jax.analysis._calls.computation_executions` of ``module``."""
    order, todo = [], [module.entry]
    while todo:
        name = todo.pop(0)
        if name in order or name not in reachable:
            continue
        order.append(name)
        for ins in module.computations.get(name, []):
            for key, callee in ins.callees():
                if key in _SCHEDULED_CALLEES or (ins.opcode == "call" and key in ("to_apply", "calls")):
                    todo.append(callee)
    return order


def _custom_target(ins: Instruction | None) -> str | None:
    if ins is None or ins.opcode != "custom-call":
        return None
    match = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    return match.group(1) if match else None


def _called(ins: Instruction) -> str | None:
    callee = ins.attr("calls")
    return callee.lstrip("%") if callee else None


def _dims(text: str | None) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text or "")]


class _Schedule:
    """One computation's instruction sequence: its collectives, paired, and the ops between them."""

    def __init__(
        self, module: HloModuleText, computation: str, records: dict, flops: dict[str, int], in_loop: bool
    ):
        self.module, self.computation, self.records, self.flops = module, computation, records, flops
        self.in_loop = in_loop
        self.instructions = module.computations[computation]
        self.index = {ins.name: i for i, ins in enumerate(self.instructions)}
        self.chained: set[str] = set()  # carriers on the way from a done to its start

    # -- classification -------------------------------------------------------------------
    def _inner_collective(self, ins: Instruction) -> tuple[str, Instruction] | None:
        """(computation, instruction) of the collective ``ins`` is or carries, if any."""
        if ins.opcode in KINDS or ins.opcode in _STARTS - {"async-start"}:
            return self.computation, ins
        callee = _called(ins) if ins.opcode in ("fusion", "async-start") else None
        for inner in self.module.computations.get(callee or "", []):
            if inner.opcode in KINDS or inner.opcode in _STARTS - {"async-start"}:
                return callee, inner
        return None

    def _role(self, ins: Instruction) -> str | None:
        """``start``, ``done``, ``sync`` (a synchronous collective), ``carrier`` (a fusion that
        computes and carries a collective's progress) or ``None``."""
        if ins.opcode in _STARTS:
            return "start" if self._inner_collective(ins) else None
        if ins.opcode in _DONES:
            return "done"
        if ins.opcode in KINDS:
            return "sync"
        if ins.opcode == "fusion" and self._inner_collective(ins):
            target = _custom_target(self.module.root(_called(ins)))
            return {_TPU_START: "start", _TPU_DONE: "done"}.get(target, "carrier")
        return None

    def _record(self, ins: Instruction) -> Collective | None:
        inner = self._inner_collective(ins)
        return self.records.get((inner[0], inner[1].name)) if inner else None

    # -- pairing ---------------------------------------------------------------------------
    def _start_of(self, done: Instruction, roles: dict) -> str | None:
        """The start a done finishes, found by following its operands back (through tuples and
        the fusions that carry collectives); ``"<loop>"`` when only the loop's parameter is
        reached (the start was in the previous iteration). Of several starts reached, the one
        whose collective has the done's channel and kind wins."""
        seen, todo, starts, reached_parameter = set(), list(done.operands), [], False
        while todo:
            name = todo.pop(0)
            ins = self.module.instruction(self.computation, name) if name not in seen else None
            seen.add(name)
            if ins is None:
                continue
            role = roles.get(name)
            if role == "start" and self.index[name] < self.index[done.name]:
                starts.append(name)
            elif ins.opcode == "parameter":
                reached_parameter = True
            elif role == "carrier" or ins.opcode in _PASS_THROUGH:
                self.chained.add(name)
                todo.extend(ins.operands)
        same = [s for s in starts if self._signature(s) == self._signature(done.name)]
        if same or starts:
            return (same or starts)[0]
        return "<loop>" if reached_parameter else None

    def _signature(self, name: str) -> tuple | None:
        """(kind, channel id) of the collective an instruction is, carries or finishes."""
        ins = self.module.instruction(self.computation, name)
        inner = self._inner_collective(ins) if ins is not None else None
        if inner is None and ins is not None and ins.operands:  # X-done / async-done: its start's
            producer = self.module.instruction(self.computation, ins.operands[0])
            inner = self._inner_collective(producer) if producer is not None else None
        if inner is None:
            return None
        return inner[1].opcode.removesuffix("-start"), inner[1].attr("channel_id")

    def _pairs(self, roles: dict) -> tuple[dict[str, str], set[str]]:
        """start name -> done name, and the starts whose done is in the next iteration."""
        pairs, wrapped_dones = {}, []
        for ins in self.instructions:
            if roles.get(ins.name) != "done":
                continue
            start = self._start_of(ins, roles)
            if start == "<loop>":
                wrapped_dones.append(ins)
            elif start is not None and start not in pairs:
                pairs[start] = ins.name
        unpaired = [i for i in self.instructions if roles.get(i.name) == "start" and i.name not in pairs]
        wraps = set()
        for done in wrapped_dones:
            match = next((s for s in unpaired if self.index[s.name] > self.index[done.name]), None)
            if match is not None:
                unpaired.remove(match)
                pairs[match.name] = done.name
                wraps.add(match.name)
        return pairs, wraps

    # -- measuring -------------------------------------------------------------------------
    def _between(self, start: str, done: str | None, wraps: bool) -> list[Instruction]:
        i = self.index[start]
        if done is None:
            return self.instructions[i + 1 :]
        j = self.index[done]
        return self.instructions[i + 1 :] + self.instructions[:j] if wraps else self.instructions[i + 1 : j]

    def overlaps(self) -> list[CollectiveOverlap]:
        roles = {ins.name: role for ins in self.instructions if (role := self._role(ins))}
        pairs, wraps = self._pairs(roles)
        for name in [n for n, role in roles.items() if role == "carrier" and n not in self.chained]:
            roles[name] = "sync"  # a collective fused with compute, on no start's way to its done
        found = []
        for ins in self.instructions:
            role = roles.get(ins.name)
            record = self._record(ins) if role in ("start", "sync") else None
            if record is None:
                continue
            if role == "sync":
                found.append(CollectiveOverlap(record, ins.name, None, is_async=False, in_loop=self.in_loop))
                continue
            done = pairs.get(ins.name)
            between = self._between(ins.name, done, ins.name in wraps)
            work = [w for b in between if roles.get(b.name) in (None, "carrier") and (w := self._work(b))]
            found.append(
                CollectiveOverlap(
                    record,
                    ins.name,
                    done,
                    is_async=True,
                    compute_ops=len(work),
                    compute_flops=sum(flops for flops, _ in work),
                    compute_bytes=sum(nbytes for _, nbytes in work),
                    other_collectives=sum(roles.get(b.name) in ("start", "done", "sync") for b in between),
                    wraps_loop=ins.name in wraps,
                    in_loop=self.in_loop,
                )
            )
        return found

    def _work(self, ins: Instruction) -> tuple[int, int] | None:
        """(FLOPs, output bytes) of a compute op, ``None`` for ops that do no work."""
        return _op_work(self.module, self.computation, ins, self.flops)


def _op_work(
    module: HloModuleText, computation: str, ins: Instruction, flops: dict
) -> tuple[int, int] | None:
    if ins.opcode in _NO_WORK or _custom_target(ins) in _BOOKKEEPING_TARGETS:
        return None
    if ins.opcode == "fusion":
        callee = _called(ins) or ""
        if all(i.opcode in _NO_WORK or i.opcode == "reshape" for i in module.computations.get(callee, [])):
            return None
        return _computation_flops(module, callee, flops), _fusion_output_bytes(module, callee)
    if ins.opcode in ("while", "call", "conditional"):
        trips = (trip_count(module, ins) or 1) if ins.opcode == "while" else 1
        callees = [c for key, c in ins.callees() if key != "condition"]
        return sum(_computation_flops(module, c, flops) for c in callees) * trips, _array_bytes(ins.shape)
    flops = _instruction_flops(module, computation, ins)
    if flops == 0 and ins.opcode not in ("custom-call", "copy") and _elements(ins.shape) <= 1:
        return None  # scalar arithmetic (loop counters, indices)
    return flops, _array_bytes(ins.shape)


def _elements(shape) -> int:
    return sum(math.prod(a.dims) for a in flat_arrays(shape))


def _array_bytes(shape) -> int:
    return sum(a.nbytes for a in flat_arrays(shape))


def _fusion_output_bytes(module: HloModuleText, callee: str) -> int:
    """Bytes a fusion writes: its root's elements, without parameters and collectives it only
    passes through (TPU fusions that carry a collective return its buffers too)."""
    root = module.root(callee)
    if root is None:
        return 0
    if root.opcode != "tuple":
        return _array_bytes(root.shape)
    written = 0
    for name in root.operands:
        element = module.instruction(callee, name)
        if element is not None and element.opcode != "parameter" and element.opcode not in KINDS:
            written += _array_bytes(element.shape)
    return written


def _computation_flops(module: HloModuleText, computation: str, cache: dict[str, int]) -> int:
    """FLOPs of the dots and convolutions of ``computation`` and what it calls."""
    if computation not in cache:
        total = 0
        for ins in module.computations.get(computation, []):
            if ins.opcode in ("fusion", "while", "call", "conditional"):
                total += (_op_work(module, computation, ins, cache) or (0, 0))[0]
            else:
                total += _instruction_flops(module, computation, ins)
        cache[computation] = total
    return cache[computation]


def _operand_dims(
    module: HloModuleText, computation: str, ins: Instruction, k: int
) -> tuple[int, ...] | None:
    inline = ins.operand_shapes[k] if k < len(ins.operand_shapes) else None
    producer = module.instruction(computation, ins.operands[k]) if k < len(ins.operands) else None
    shape = inline if inline is not None else (producer.shape if producer else None)
    return shape.dims if isinstance(shape, ArrayShape) else None


def _instruction_flops(module: HloModuleText, computation: str, ins: Instruction) -> int:
    if ins.opcode == "dot":
        lhs = _operand_dims(module, computation, ins, 0)
        if lhs is None:
            return 0
        contracted = math.prod(lhs[d] for d in _dims(ins.attr("lhs_contracting_dims")))
        return 2 * _elements(ins.shape) * contracted
    if ins.opcode == "convolution":
        return _convolution_flops(module, computation, ins)
    return 0


def _convolution_flops(module: HloModuleText, computation: str, ins: Instruction) -> int:
    """2 x (output batch x features) x input features per group x valid (output, tap) pairs per
    spatial dim: taps that fall in the padding (XLA writes some batched matmuls as padded
    convolutions) do no work."""
    lhs, rhs = (_operand_dims(module, computation, ins, k) for k in (0, 1))
    labels = re.match(r"(\w+)_(\w+)->(\w+)", ins.attr("dim_labels") or "")
    if lhs is None or rhs is None or labels is None or not isinstance(ins.shape, ArrayShape):
        return 0
    lhs_l, rhs_l, out_l = labels.groups()
    out = ins.shape.dims
    window = _window(ins.attr("window"))
    flops = 2 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
    for n in range(len(lhs_l) - 2):
        spatial = str(n)
        size, pad_lo, stride, dilation = window[n] if n < len(window) else (1, 0, 1, 1)
        flops *= _valid_pairs(
            lhs[lhs_l.index(spatial)], out[out_l.index(spatial)], size, pad_lo, stride, dilation
        )
    return flops


def _window(text: str | None) -> list[tuple[int, int, int, int]]:
    """Per spatial dim: (size, low padding, stride, rhs dilation) from ``window={size=1x4 pad=0_0x3_3}``."""
    fields = dict(re.findall(r"(\w+)=([\dx_\-]+)", (text or "").strip("{}")))
    sizes = [int(v) for v in fields.get("size", "").split("x") if v]
    pads = [int(p.split("_")[0]) for p in fields.get("pad", "").split("x") if p]
    strides = [int(v) for v in fields.get("stride", "").split("x") if v]
    dilations = [int(v) for v in fields.get("rhs_dilate", "").split("x") if v]
    pick = lambda values, n, default: values[n] if n < len(values) else default
    return [(s, pick(pads, n, 0), pick(strides, n, 1), pick(dilations, n, 1)) for n, s in enumerate(sizes)]


def _valid_pairs(in_size: int, out_size: int, taps: int, pad_lo: int, stride: int, dilation: int) -> int:
    """Number of (output position, tap) pairs that read an input element (not padding)."""
    total = 0
    for k in range(taps):
        offset = k * dilation - pad_lo  # input index = o * stride + offset
        first = max(0, -(offset // stride) if offset < 0 else 0)
        first = max(0, math.ceil(-offset / stride))
        last = min(out_size - 1, (in_size - 1 - offset) // stride)
        total += max(0, last - first + 1)
    return total
