"""One stage's share of a compiled pipelined step's collectives.

The compiled step holds every branch of every tick (:mod:`~torsh_jax.runtime.pipeline.executor`),
and a device runs one branch per tick, so counting every branch as run overstates what any device
sends. A kind's chunk code runs in the kind's name scope (``F``, ``B``, ``B_last``, ``W``), and a
branch's own part (the embedding of ``F_first`` and ``B_first``, the head of ``F_last``) in the
branch's inside it
(:func:`~torsh_jax.pipeline.slots.slot_scope`), so the program's collectives say which scope they
belong to. A scope's traced copies (one per tick the executor traces, run once in line or once per
repeat when scanned) run as often as the ticks they stand for; a stage runs the scope as often as
its row of the table says. So a collective of scope ``X`` runs on stage ``s`` its executions times
``X``'s slots on ``s`` over the executions of ``X``'s traced copies. Collectives outside every
slot keep their executions, and so do those XLA combined from operations of a slot and others
(:func:`mixed_collectives`), whose share of each is not known.

Example:
    >>> from torsh_jax.pipeline.schedule import build_pipeline_schedule
    >>> sites = branch_sites(build_pipeline_schedule("1f1b", stages=2, microbatches=2))
    >>> sites["F_first"], sites["F"], sites["B_last"]
    (2, 4, 2)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from torsh_jax.analysis.hlo import Collective
from torsh_jax.analysis.report import collective_totals
from torsh_jax.pipeline.schedule import Schedule
from torsh_jax.pipeline.slots import (
    BRANCHES,
    MIXED,
    executor_segments,
    kind_of,
    scoped_branch,
    segment_ticks,
    slot_plan,
)

__all__ = ["branch_sites", "stage_collectives", "stage_totals", "mixed_collectives"]


def branch_sites(schedule: Schedule) -> Counter:
    """Per branch and per kind of branch (the scopes of a branch's own part and of its kind's chunk
    code): how often the executor's traced copies of it run (every tick it stands for whose block
    has some stage running the branch, or a branch of the kind)."""
    plan = slot_plan(schedule)
    sites: Counter = Counter()
    for segment in executor_segments(plan, schedule):
        for ticks in segment_ticks(segment):
            present = {BRANCHES[b] for b in plan.branch[ticks].ravel().tolist()}
            for scope in _scopes(present):
                sites[scope] += len(ticks)
    return sites


def _scopes(branches) -> set[str]:
    """The scopes ``branches`` run in: their own and their kinds'."""
    return {*branches, *map(kind_of, branches)}


def stage_collectives(found: list[Collective], schedule: Schedule, stage: int) -> list[Collective]:
    """``found`` (the step's collectives, every branch counted as run) with the executions stage
    ``stage`` runs: a branch's collectives scaled by its slots on that stage over its sites."""
    plan = slot_plan(schedule)
    runs = Counter(scope for b in plan.branch[:, stage].tolist() for scope in _scopes({BRANCHES[b]}))
    sites = branch_sites(schedule)

    def on_stage(c: Collective) -> Collective:
        branch = scoped_branch(c.op_name)
        if branch is None or branch == MIXED:
            return c
        return dataclasses.replace(c, executions=c.executions * runs[branch] / sites[branch])

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
