"""One stage's share of a compiled pipelined step's collectives.

The compiled step holds every branch (:mod:`~torsh_jax.runtime.pipeline.executor`) in one scanned
tick, and a device runs one branch per tick, so counting every branch as run overstates what any
device sends. A kind's chunk code runs in the kind's name scope (``F``, ``B``, ``B_last``, ``W``),
and a branch's own part (the embedding of ``F_first`` and ``B_first``, the head of ``F_last``) in
the branch's inside it (:func:`~torsh_jax.pipeline.slots.slot_scope`), so the program's
collectives say which scope they belong to. Each runs once per tick of the scan; a stage runs the
scope as often as its row of the table says. So a collective of scope ``X`` runs on stage ``s``
its executions times ``X``'s slots on ``s`` over the ticks. Likewise a send's ``ppermute`` (in
its sender pattern's scope, :func:`~torsh_jax.pipeline.slots.send_scope`) runs at the ticks with
that pattern. Collectives outside every scope keep their executions, and so do those XLA combined
from operations of a slot and others (:func:`mixed_collectives`), whose share of each is not known.

Example:
    >>> from torsh_jax.pipeline.schedule import build_pipeline_schedule
    >>> from torsh_jax.analysis.hlo import Collective
    >>> schedule = build_pipeline_schedule("1f1b", stages=2, microbatches=2)  # 6 ticks
    >>> psum = Collective("all-reduce", "all-reduce", "ar", "f32", ("f32[8]",), ("f32[8]",), 32, 32,
    ...                   ((0, 1),), (), 2, ("tensor",), "body", True, 6, 6, "jit(f)/pipeline_slot_F/psum")
    >>> [c.executions for s in (0, 1) for c in stage_collectives([psum], schedule, s)]  # 2 F each
    [2.0, 2.0]
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from torsh_jax.analysis.hlo import Collective
from torsh_jax.analysis.report import collective_totals
from torsh_jax.pipeline.schedule import Schedule
from torsh_jax.pipeline.slots import BRANCHES, MIXED, kind_of, scoped_branch, scoped_send, slot_plan

__all__ = ["stage_collectives", "stage_totals", "mixed_collectives"]


def _scopes(branches) -> set[str]:
    """The scopes ``branches`` run in: their own and their kinds'."""
    return {*branches, *map(kind_of, branches)}


def stage_collectives(found: list[Collective], schedule: Schedule, stage: int) -> list[Collective]:
    """``found`` (the step's collectives, every branch and send counted as run at every tick) with
    the executions stage ``stage`` runs: a scope's collectives scaled by the ticks it runs at
    (its branch's or kind's slots on that stage; a send pattern's ticks) over all ticks."""
    plan = slot_plan(schedule)
    ticks = plan.branch.shape[0]
    runs = Counter(scope for b in plan.branch[:, stage].tolist() for scope in _scopes({BRANCHES[b]}))
    # the ticks each sender pattern sends at, by direction
    sends = {
        d: Counter(map(tuple, t.tolist())) for d, t in (("F", plan.sends_forward), ("B", plan.sends_backward))
    }

    def at_ticks(c: Collective) -> int | None:
        """The ticks at which ``stage`` runs ``c``; ``None`` outside every scope (or mixed)."""
        sent = scoped_send(c.op_name)
        if sent is not None:
            direction, pattern = sent
            return sends[direction][pattern]
        branch = scoped_branch(c.op_name)
        return None if branch is None or branch == MIXED else runs[branch]

    def on_stage(c: Collective) -> Collective:
        run = at_ticks(c)
        return c if run is None else dataclasses.replace(c, executions=c.executions * run / ticks)

    return [on_stage(c) for c in found]


def stage_totals(found: list[Collective], schedule: Schedule, stage_of: Sequence[int]) -> list[dict]:
    """Per stage, what one of its devices sends per step: its branches' collectives as the stage
    runs them (:func:`stage_collectives`), and of each permute the pairs whose source is on the
    stage (``stage_of[i]``: the stage of the device with logical id ``i``). Rows of ``stage``,
    ``wire_bytes``, ``payload_bytes`` and ``by_axis`` (as the report's ``totals``)."""
    per_stage = len(stage_of) / schedule.stages
    rows = []
    for stage in range(schedule.stages):
        mine = [_sent_from(c, stage, stage_of, per_stage) for c in stage_collectives(found, schedule, stage)]
        totals = collective_totals(mine)
        rows.append({"stage": stage, **{k: totals[k] for k in ("wire_bytes", "payload_bytes", "by_axis")}})
    return rows


def _sent_from(c: Collective, stage: int, stage_of: Sequence[int], per_stage: float) -> Collective:
    """``c`` as a device of ``stage`` sends it: a permute only from the devices its pairs send from."""
    if c.kind != "collective-permute" or not c.source_target_pairs:
        return c
    senders = sum(stage_of[source] == stage for source, _ in c.source_target_pairs)
    return dataclasses.replace(c, executions=c.executions * senders / per_stage)


def mixed_collectives(found: list[Collective]) -> list[Collective]:
    """The collectives of ``found`` XLA combined from a branch's operations and others: counted as
    run by every stage, each stage's true share unknown."""
    return [c for c in found if scoped_branch(c.op_name) == MIXED]
