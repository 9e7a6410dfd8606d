"""What every stage does at every tick, as small integer tables the executor indexes by stage.

From a :class:`~torsh_jax.pipeline.schedule.Schedule` this derives, per tick:
the branch each stage runs (``F`` / ``B`` of the first, a middle or the last
virtual stage, ``W``, or idle), its micro-batch and chunk, the stash slot its
input activation is read from, the slot of the incoming gradient, the slot a
split backward leaves for its ``W`` (each layer's input and output gradient),
which stages send forward or backward, and the slot a received tensor is
written to. Stash slots are assigned by interval colouring: an activation
lives from its arrival to its backward, a gradient from its arrival to its
use, a ``W`` stash from its ``B`` to its ``W``, so the stash holds what the
schedule keeps in flight and no more.

The executor runs every tick in one ``lax.scan`` and reads all of this from
the tables at the scanned tick. The ``ppermute`` pairs must be static, so the
ticks' sender rows are told apart (:func:`send_patterns`): one ``ppermute`` per
distinct row, picked by the tick.

Example:
    >>> from torsh_jax.pipeline.schedule import build_pipeline_schedule
    >>> plan = slot_plan(build_pipeline_schedule("1f1b", stages=2, microbatches=4))
    >>> plan.activation_slots, plan.gradient_slots
    (2, 1)
    >>> len(send_patterns(plan.sends_forward).patterns), plan.branch.shape  # [ticks, stages]
    (2, (10, 2))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from torsh_jax.pipeline.schedule import BACKWARD, FORWARD, IDLE, WEIGHT, Schedule

__all__ = [
    "SlotPlan",
    "slot_plan",
    "BRANCHES",
    "KINDS",
    "kind_of",
    "SendPatterns",
    "send_patterns",
    "send_scope",
    "scoped_send",
    "slot_scope",
    "scoped_branch",
    "MIXED",
]

#: Branch names; ``F_first`` embeds, ``F_last`` / ``B_last`` run the head and the loss, ``W`` makes a
#: chunk's weight gradients when the schedule splits backwards.
BRANCHES = ("idle", "F_first", "F_mid", "F_last", "B_first", "B_mid", "B_last", "W")

#: The kinds of branch whose stages share one copy of the chunk's code at a tick (``F_first``,
#: ``F_mid`` and ``F_last`` are ``F``). ``B_last`` is a kind of its own: its head reads the chunk's
#: recomputed output, which the other backwards leave unread (XLA drops a one-layer chunk's last
#: tensor sum there), so the collectives of every copy of a kind are the same.
KINDS = ("F", "B", "B_last", "W")


def kind_of(branch: str) -> str:
    """The kind (:data:`KINDS`) of ``branch``, or ``idle``.

    Example:
        >>> kind_of("F_last"), kind_of("B_first"), kind_of("B_last"), kind_of("W")
        ('F', 'B', 'B_last', 'W')
    """
    return branch if branch in KINDS or branch == "idle" else branch.split("_")[0]


@dataclass(frozen=True)
class SlotPlan:
    """Per tick ``[ticks, stages]`` int tables (``-1``: none) and the stash sizes."""

    branch: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    activation_in: np.ndarray
    gradient_in: np.ndarray
    weight_stash: np.ndarray
    receive_activation: np.ndarray
    receive_gradient: np.ndarray
    sends_forward: np.ndarray
    sends_backward: np.ndarray
    activation_slots: int
    gradient_slots: int
    weight_slots: int


def _branch(kind: int, virtual: int, last: int) -> int:
    if kind == IDLE:
        return 0
    if kind == WEIGHT:
        return BRANCHES.index("W")
    offset = 1 if kind == FORWARD else 4
    return offset + (0 if virtual == 0 else 2 if virtual == last else 1)


class _Colouring:
    """Slots per stage for intervals ``[start, end]``: a slot freed at tick t is reusable at t."""

    def __init__(self, stages: int):
        self.free_at: list[list[int]] = [[] for _ in range(stages)]

    def assign(self, stage: int, start: int, end: int) -> int:
        slots = self.free_at[stage]
        for slot, free in enumerate(slots):
            if free <= start:
                slots[slot] = end
                return slot
        slots.append(end)
        return len(slots) - 1

    @property
    def size(self) -> int:
        return max(len(s) for s in self.free_at)


def slot_plan(schedule: Schedule) -> SlotPlan:
    """The executor's tables for ``schedule``."""
    p, ticks, last = schedule.stages, schedule.ticks, schedule.stages * schedule.virtual_stages - 1
    when = {}
    for tick, stage in np.ndindex(ticks, p):
        kind, micro, virtual = (int(x) for x in schedule.table[tick, stage])
        if kind != IDLE:
            when[(kind, micro, virtual)] = tick
    shape = (ticks, p)
    names = ("activation_in", "gradient_in", "weight_stash", "receive_activation", "receive_gradient")
    tables = {name: np.full(shape, -1, np.int32) for name in names}
    branch = np.zeros(shape, np.int32)
    micro_t, chunk_t = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    sends_f, sends_b = np.zeros(shape, bool), np.zeros(shape, bool)
    acts, grads, weights = _Colouring(p), _Colouring(p), _Colouring(p)
    for (kind, micro, virtual), tick in sorted(when.items(), key=lambda kv: kv[1]):
        stage = virtual % p
        branch[tick, stage] = _branch(kind, virtual, last)
        micro_t[tick, stage], chunk_t[tick, stage] = micro, virtual // p
        if kind == FORWARD and virtual > 0:  # input arrives at the end of the previous stage's forward
            arrive, used = when[(FORWARD, micro, virtual - 1)], when[(BACKWARD, micro, virtual)]
            slot = acts.assign(stage, arrive, used)
            tables["activation_in"][tick, stage] = tables["activation_in"][used, stage] = slot
            tables["receive_activation"][arrive, stage] = slot
            sends_f[arrive, (virtual - 1) % p] = True
        if kind == BACKWARD and virtual < last:  # gradient arrives at the end of the next stage's backward
            arrive = when[(BACKWARD, micro, virtual + 1)]
            slot = grads.assign(stage, arrive, tick)
            tables["gradient_in"][tick, stage] = slot
            tables["receive_gradient"][arrive, stage] = slot
            sends_b[arrive, (virtual + 1) % p] = True
        if kind == WEIGHT:  # the B of the same micro-batch and chunk left this slot
            made = when[(BACKWARD, micro, virtual)]
            slot = weights.assign(stage, made, tick)
            tables["weight_stash"][tick, stage] = tables["weight_stash"][made, stage] = slot
    return SlotPlan(branch, micro_t, chunk_t, **tables, sends_forward=sends_f, sends_backward=sends_b,
                    activation_slots=max(acts.size, 1), gradient_slots=max(grads.size, 1),
                    weight_slots=weights.size)  # fmt: skip


class SendPatterns(NamedTuple):
    """The distinct rows of a sends table (the stages that send at a tick), and each tick's index
    into them: the executor's ``lax.switch`` over ``ppermute`` pairs, which must be static."""

    patterns: tuple[tuple[bool, ...], ...]
    at: np.ndarray  # [ticks] int32


def send_patterns(sends: np.ndarray) -> SendPatterns:
    """The sender patterns of ``sends`` (``[ticks, stages]``, a plan's ``sends_forward`` or
    ``sends_backward``), in a fixed order.

    Example:
        >>> from torsh_jax.pipeline.schedule import build_pipeline_schedule
        >>> plan = slot_plan(build_pipeline_schedule("1f1b", stages=2, microbatches=16))
        >>> found = send_patterns(plan.sends_forward)
        >>> found.patterns, found.at[:6].tolist()
        (((False, False), (True, False)), [1, 1, 0, 0, 1, 0])
    """
    rows = [tuple(row) for row in sends.tolist()]
    patterns = tuple(sorted(set(rows)))
    return SendPatterns(patterns, np.asarray([patterns.index(row) for row in rows], np.int32))


def send_scope(direction: str, pattern: tuple[bool, ...]) -> str:
    """The name scope of the ``ppermute`` sending ``direction`` (``F``: activations, ``B``: their
    gradients) from the stages set in ``pattern``.

    Example:
        >>> send_scope("B", (False, True, True))
        'pipeline_send_B_011'
    """
    return f"pipeline_send_{direction}_" + "".join("1" if sends else "0" for sends in pattern)


_SEND = re.compile(r"(?:^|/)pipeline_send_([FB])_([01]+)(?=/|$)")


def scoped_send(op_name: str) -> tuple[str, tuple[bool, ...]] | None:
    """``(direction, pattern)`` of the send scope (:func:`send_scope`) ``op_name`` is in, else ``None``.

    Example:
        >>> scoped_send("jit(step)/while/body/switch/pipeline_send_F_10/ppermute")
        ('F', (True, False))
    """
    found = _SEND.findall(op_name)
    if not found:
        return None
    direction, bits = found[-1]
    return direction, tuple(bit == "1" for bit in bits)


def slot_scope(branch: str) -> str:
    """The name scope of ``branch``'s operations: the compiled program's ``op_name`` names the slot.

    Example:
        >>> scoped_branch("jit(step)/shard_map/cond/branch_1_fun/" + slot_scope("B_first") + "/psum")
        'B_first'
    """
    return f"pipeline_slot_{branch}"


_SCOPED = re.compile(r"(?:^|/)pipeline_slot_(" + "|".join((*BRANCHES, *KINDS)) + r")(?=/|$)")


#: What :func:`scoped_branch` says of a collective XLA combined from operations of different
#: branches, or of a branch and operations outside every branch.
MIXED = "mixed"


def scoped_branch(op_name: str) -> str | None:
    """The branch or kind whose scope (:func:`slot_scope`) ``op_name`` is innermost in (a kind's
    chunk code runs in the kind's scope, a branch's own part, its embedding or head, in the
    branch's inside it), ``None`` outside every slot, or :data:`MIXED` for a combined collective
    whose parts disagree.

    Example:
        >>> scoped_branch("jit(f)/pipeline_slot_B/cond/branch_1_fun/pipeline_slot_B_last/psum")
        'B_last'
        >>> scoped_branch("jit(f)/(reduce_sum:shard_map/pipeline_slot_W/psum)")
        'mixed'
    """
    found = {_innermost(part) for part in _parts(op_name)}
    return found.pop() if len(found) == 1 else MIXED


def _innermost(op_name: str) -> str | None:
    scopes = _SCOPED.findall(op_name)
    return scopes[-1] if scopes else None


def _parts(op_name: str) -> list[str]:
    """The names a combined collective's ``op_name`` joins (``prefix/(a:b:...)``), else itself."""
    start = op_name.find("/(")
    if start < 0 or not op_name.endswith(")"):
        return [op_name]
    parts, depth, current = [], 0, ""
    for char in op_name[start + 2 : -1]:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ":" and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]
