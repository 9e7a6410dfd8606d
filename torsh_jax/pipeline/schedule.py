"""Pipeline schedules as data: a static tick x stage table of forward, backward or idle slots.

Every schedule is built by one simulation: at each tick every stage takes the
next forward or backward of its own order whose inputs are ready (a forward
needs the previous virtual stage's forward from an earlier tick, a backward
its own forward and the next virtual stage's backward), under a cap on the
activations it holds (forwards done whose backward is not). The schedules
differ only in that order, the cap and which of the two a stage prefers:

* ``gpipe``: all forwards, then all backwards (cap ``m``);
* ``1f1b``: backward first when ready, at most ``p - s`` forwards in flight on
  stage ``s``, which keeps the activations held flat in ``m``;
* ``interleaved``: ``v`` chunks per stage (virtual stage ``c * p + s``), in
  Megatron-LM's order (groups of ``p`` micro-batches, chunk by chunk), at most
  ``2 (p - s - 1) + (v - 1) p + 1`` in flight, forward first when allowed.

``zb_h1`` (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)
splits each backward into ``B`` (the input gradient, which the previous stage
waits for) and ``W`` (the weight gradient, which nobody waits for). Stage ``s``
runs a fixed order: ``p - s`` forwards, ``s`` rounds of ``B, F``, then rounds
of ``B, W, F`` and the ``W`` s left; each slot waits for its inputs. Every stage
holds at most ``p`` activations (1F1B's first stage) and, with ``m >= p``, the
table idles ``(p - 1) / (3 m + p - 1)`` of its slots against 1F1B's
``3 (p - 1) / (3 m + 3 (p - 1))`` counted in the same units (a 1F1B backward is
a ``B`` and a ``W``).

A slot is one chunk's forward or backward; with equal slot times the idle
fraction is ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B and
``(p - 1) / (v m + p - 1)`` for interleaved when ``m`` is a multiple of ``p``.

Example:
    >>> table = build_pipeline_schedule("1f1b", stages=2, microbatches=2)
    >>> print(table.render())
    stage 0 | F0 F1 .  B0 .  B1
    stage 1 | .  F0 B0 F1 B1 .
    >>> table.bubble
    0.3333333333333333
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import numpy as np

from torsh_jax.errors import PlanError

__all__ = [
    "PIPELINE_SCHEDULES",
    "ScheduleKind",
    "Schedule",
    "build_pipeline_schedule",
    "render_grid",
    "IDLE",
    "FORWARD",
    "BACKWARD",
    "WEIGHT",
]

#: Slot kinds in :attr:`Schedule.table` ``[..., 0]``. ``BACKWARD`` makes the input and, unless the
#: schedule has ``WEIGHT`` slots, the weight gradients.
IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
_LETTERS = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}
_NOT_YET = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Schedule:
    """A validated schedule.

    Attributes:
        name: a key of :data:`PIPELINE_SCHEDULES` (``gpipe``, ``1f1b``, ``interleaved``, ``zb_h1``).
        stages: pipeline stages ``p``.
        microbatches: micro-batches ``m`` per pipeline pass.
        virtual_stages: chunks ``v`` per stage.
        table: ``int32 [ticks, stages, 3]``: slot kind (:data:`IDLE`,
            :data:`FORWARD`, :data:`BACKWARD`, :data:`WEIGHT`), micro-batch,
            virtual stage (``-1`` when idle).
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    table: np.ndarray

    @property
    def ticks(self) -> int:
        return int(self.table.shape[0])

    @property
    def bubble(self) -> float:
        """Idle fraction of the table's slots."""
        return float(np.mean(self.table[..., 0] == IDLE))

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into ``B`` (input gradient) and ``W`` (weight gradient) slots."""
        return bool(np.any(self.table[..., 0] == WEIGHT))

    @property
    def theory_bubble(self) -> float:
        """``(p - 1) / (v m + p - 1)``; ``(p - 1) / (3 m + p - 1)`` with ``W`` slots."""
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        return (p - 1) / ((3 if self.splits_backward else v) * m + p - 1)

    def slots(self, kind: int) -> np.ndarray:
        """``[stages]``: how many slots of ``kind`` each stage runs."""
        return np.sum(self.table[..., 0] == kind, axis=0)

    @cached_property
    def in_flight(self) -> np.ndarray:
        """``[stages]``: the most activations a stage holds at once (forwards whose backward, or
        weight gradient when split, is pending)."""
        kinds = self.table[..., 0]
        done = WEIGHT if self.splits_backward else BACKWARD
        held = np.cumsum((kinds == FORWARD).astype(int) - (kinds == done).astype(int), axis=0)
        return held.max(axis=0)

    def render(self) -> str:
        """Rows stages, columns ticks; ``F3`` / ``B2`` / ``W2`` (``F3.1``: chunk 1 if interleaved) / ``.``."""
        return render_grid([[self._cell(t, s) for t in range(self.ticks)] for s in range(self.stages)])

    def _cell(self, tick: int, stage: int) -> str:
        kind, micro, virtual = (int(x) for x in self.table[tick, stage])
        if kind == IDLE:
            return "."
        chunk = f".{virtual // self.stages}" if self.virtual_stages > 1 else ""
        return f"{_LETTERS[kind]}{micro}{chunk}"

    def to_json(self) -> dict:
        """The table and its numbers as JSON-able values."""
        return {
            "schedule": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "ticks": self.ticks,
            "bubble": self.bubble,
            "theory_bubble": self.theory_bubble,
            "in_flight": self.in_flight.tolist(),
            "grid": [[self._cell(t, s) for t in range(self.ticks)] for s in range(self.stages)],
        }


def render_grid(cells: list[list[str]]) -> str:
    """A table's cells (rows stages, columns ticks; :meth:`Schedule.to_json`'s ``grid``) as text."""
    width = max(len(c) for row in cells for c in row)
    return "\n".join(
        f"stage {s} | " + " ".join(c.ljust(width) for c in row).rstrip() for s, row in enumerate(cells)
    )


@dataclass(frozen=True)
class ScheduleKind:
    """How one named schedule builds its table.

    Attributes:
        table: ``(stages, microbatches, virtual_stages) -> int32 [ticks, stages, 3]``.
        virtual_stages: whether it runs more than one chunk per stage.
        microbatch_per_stage: whether it needs at least as many micro-batches as stages.
    """

    table: Callable[[int, int, int], np.ndarray]
    virtual_stages: bool = False
    microbatch_per_stage: bool = True


def build_pipeline_schedule(
    name: str, *, stages: int, microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """The table of pipeline schedule ``name`` (a key of :data:`PIPELINE_SCHEDULES`), validated.

    Raises:
        PlanError: an unknown schedule, ``virtual_stages`` > 1 with a schedule
            that has one chunk per stage, or fewer micro-batches than stages
            for a schedule that needs one per stage (all but ``gpipe``).
    """
    kind = _check(name, stages, microbatches, virtual_stages)
    schedule = Schedule(
        name, stages, microbatches, virtual_stages, kind.table(stages, microbatches, virtual_stages)
    )
    validate(schedule)
    return schedule


def _check(name: str, p: int, m: int, v: int) -> ScheduleKind:
    kind = PIPELINE_SCHEDULES.get(name)
    if kind is None:
        raise PlanError(
            f"unknown schedule {name!r}",
            key="pipeline.schedule",
            fix=f"use one of {tuple(PIPELINE_SCHEDULES)}",
        )
    if v > 1 and not kind.virtual_stages:
        raise PlanError(
            f"virtual_stages = {v} needs the interleaved schedule, not {name!r}",
            key="pipeline.virtual_stages",
            fix='set pipeline.schedule = "interleaved", or virtual_stages = 1',
        )
    if kind.microbatch_per_stage and m < p:
        raise PlanError(
            f"{name} needs at least as many micro-batches as stages: {m} < {p}",
            key="pipeline.microbatches",
            fix=f"set pipeline.microbatches >= {p} (2 x stages or more keeps the bubble small)",
        )
    return kind


def _zb_h1_table(p: int, m: int, v: int) -> np.ndarray:
    return _run_orders([_zb_h1_order(p, m, s) for s in range(p)])


def _zb_h1_order(p: int, m: int, stage: int) -> list[tuple[int, int]]:
    """Stage ``stage``'s ``(kind, micro-batch)`` slots in ZB-H1's order."""
    order: list[tuple[int, int]] = []
    done = {FORWARD: 0, BACKWARD: 0, WEIGHT: 0}

    def add(kind: int) -> None:
        limit = done[BACKWARD] if kind == WEIGHT else m
        if done[kind] < limit:
            order.append((kind, done[kind]))
            done[kind] += 1

    for _ in range(p - stage):
        add(FORWARD)
    rounds = [(BACKWARD, FORWARD)] * stage + [(BACKWARD, WEIGHT, FORWARD)] * m
    for kind in (kind for round_ in rounds for kind in round_):
        add(kind)
    while done[WEIGHT] < m:
        add(WEIGHT)
    return order


def _run_orders(orders: list[list[tuple[int, int]]]) -> np.ndarray:
    """Each stage (virtual stage = stage) runs its slots in order, each at the first tick its inputs
    are ready; a stage waiting for an input idles."""
    p, last = len(orders), len(orders) - 1
    done_at: dict[tuple[int, int, int], int] = {}
    position, rows = [0] * p, []
    while any(position[s] < len(order) for s, order in enumerate(orders)):
        tick, row = len(rows), []
        for s, order in enumerate(orders):
            kind, micro = order[position[s]] if position[s] < len(order) else (IDLE, -1)
            needs = {FORWARD: [(FORWARD, micro, s - 1)] if s > 0 else [],
                     BACKWARD: [(FORWARD, micro, s)] + ([(BACKWARD, micro, s + 1)] if s < last else []),
                     WEIGHT: [(BACKWARD, micro, s)], IDLE: []}[kind]  # fmt: skip
            ready = kind != IDLE and all(done_at.get(n, _NOT_YET) < tick for n in needs)
            row.append((kind, micro, s) if ready else (IDLE, -1, -1))
        for s, (kind, micro, virtual) in enumerate(row):
            if kind != IDLE:
                done_at[(kind, micro, virtual)] = tick
                position[s] += 1
        rows.append(row)
    return np.asarray(rows, dtype=np.int32)


def _in_order(p: int, m: int, v: int, stage: int) -> tuple[list, list]:
    """Forwards and backwards of ``stage`` in micro-batch order (one chunk per stage)."""
    return [(i, stage) for i in range(m)], [(i, stage) for i in range(m)]


def _megatron_order(p: int, m: int, v: int, stage: int) -> tuple[list, list]:
    """Megatron-LM's interleaved order: groups of ``p`` micro-batches, chunk by chunk."""
    forward, backward = [], []
    for first in range(0, m, p):
        group = range(first, min(first + p, m))
        forward += [(i, c * p + stage) for c in range(v) for i in group]
        backward += [(i, c * p + stage) for c in reversed(range(v)) for i in group]
    return forward, backward


def _all_forwards_first(pending: bool, f_ready: bool, b_ready: bool) -> int:
    """GPipe: no backward while a forward is pending."""
    if pending:
        return FORWARD if f_ready else IDLE
    return BACKWARD if b_ready else IDLE


def _backward_first(pending: bool, f_ready: bool, b_ready: bool) -> int:
    return BACKWARD if b_ready else FORWARD if f_ready else IDLE


def _forward_first(pending: bool, f_ready: bool, b_ready: bool) -> int:
    return FORWARD if f_ready else BACKWARD if b_ready else IDLE


def _simulate(p: int, m: int, v: int, *, order, cap, pick) -> np.ndarray:
    """Each stage runs the forwards and backwards of ``order(p, m, v, stage)``, at most
    ``cap(p, m, v, stage)`` forwards ahead of its backwards, ``pick``-ing between a ready forward
    and a ready backward."""
    last = p * v - 1
    forward_at: dict[tuple[int, int], int] = {}
    backward_at: dict[tuple[int, int], int] = {}
    orders = [order(p, m, v, s) for s in range(p)]
    caps = [cap(p, m, v, s) for s in range(p)]
    done_f, done_b = [0] * p, [0] * p
    rows = []
    while any(done_b[s] < m * v for s in range(p)):
        tick = len(rows)
        row = []
        for s, (forwards, backwards) in enumerate(orders):
            f = forwards[done_f[s]] if done_f[s] < m * v else None
            b = backwards[done_b[s]] if done_b[s] < m * v else None
            f_ready = f is not None and (f[1] == 0 or forward_at.get((f[0], f[1] - 1), _NOT_YET) < tick)
            f_ready = f_ready and done_f[s] - done_b[s] < caps[s]
            b_ready = b is not None and forward_at.get(b, _NOT_YET) < tick
            b_ready = b_ready and (b[1] == last or backward_at.get((b[0], b[1] + 1), _NOT_YET) < tick)
            kind = pick(f is not None, f_ready, b_ready)
            row.append((kind, *(f if kind == FORWARD else b)) if kind != IDLE else (IDLE, -1, -1))
        for s, (kind, micro, virtual) in enumerate(row):
            if kind == FORWARD:
                forward_at[(micro, virtual)] = tick
                done_f[s] += 1
            elif kind == BACKWARD:
                backward_at[(micro, virtual)] = tick
                done_b[s] += 1
        rows.append(row)
        if tick > 4 * (m * v + p) + 8:
            raise AssertionError(f"schedule p={p} m={m} v={v} does not finish")  # a bug, not input
    return np.asarray(rows, dtype=np.int32)


#: Pipeline schedule name -> how it builds its table. A new schedule is one entry here.
PIPELINE_SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(
        partial(_simulate, order=_in_order, cap=lambda p, m, v, s: m, pick=_all_forwards_first),
        microbatch_per_stage=False,
    ),
    "1f1b": ScheduleKind(
        partial(_simulate, order=_in_order, cap=lambda p, m, v, s: p - s, pick=_backward_first)
    ),
    "interleaved": ScheduleKind(
        partial(
            _simulate,
            order=_megatron_order,
            cap=lambda p, m, v, s: min(2 * (p - s - 1) + (v - 1) * p + 1, m * v),
            pick=_forward_first,
        ),
        virtual_stages=True,
    ),
    "zb_h1": ScheduleKind(_zb_h1_table),
}


def validate(schedule: Schedule) -> None:
    """Check the table: every (micro-batch, virtual stage) runs forward then backward exactly once, on
    its stage, after its inputs. Raises ``ValueError`` naming the first broken slot."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    seen: dict[tuple[int, int, int], int] = {}
    for tick, stage in np.ndindex(schedule.ticks, p):
        kind, micro, virtual = (int(x) for x in schedule.table[tick, stage])
        if kind == IDLE:
            continue
        where = f"{schedule.name} tick {tick} stage {stage}"
        if virtual % p != stage or (kind, micro, virtual) in seen:
            raise ValueError(f"{where}: slot {kind, micro, virtual} on the wrong stage or repeated")
        needs = [(kind, micro, virtual - 1)] if kind == FORWARD and virtual > 0 else []
        if kind == BACKWARD:
            later = [(BACKWARD, micro, virtual + 1)] if virtual < p * v - 1 else []
            needs = [(FORWARD, micro, virtual), *later]
        if kind == WEIGHT:
            needs = [(BACKWARD, micro, virtual)]
        if any(seen.get(need, tick) >= tick for need in needs):
            raise ValueError(f"{where}: runs before its inputs {needs}")
        seen[(kind, micro, virtual)] = tick
    kinds = 3 if schedule.splits_backward else 2
    if len(seen) != kinds * m * p * v:
        raise ValueError(f"{schedule.name}: {len(seen)} slots, expected {kinds * m * p * v}")
