"""How often each computation of an HLO module runs: the call graph and loop trip counts.

Example:
    >>> from torsh_jax.analysis._hlo_text import parse_module
    >>> text = '''HloModule m
    ... %body (t: s32[]) -> s32[] {
    ...   ROOT %t = s32[] parameter(0)
    ... }
    ... %cond (c: s32[]) -> pred[] {
    ...   %c = s32[] parameter(0)
    ...   %n = s32[] constant(5)
    ...   ROOT %lt = pred[] compare(%c, %n), direction=LT
    ... }
    ... ENTRY %main (p: s32[]) -> s32[] {
    ...   %p = s32[] parameter(0)
    ...   ROOT %w = s32[] while(%p), condition=%cond, body=%body
    ... }'''
    >>> computation_executions(parse_module(text))["body"]
    Executions(count=5, in_loop=True, trip_count=5)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from torsh_jax.analysis._hlo_text import ArrayShape, HloModuleText, Instruction

__all__ = ["Executions", "trip_count", "computation_executions"]

#: Opcodes whose called computations may hold collectives.
_CALLING_OPCODES = frozenset({"while", "call", "conditional", "fusion", "async-start", "custom-call"})


def trip_count(module: HloModuleText, loop: Instruction) -> int | None:
    """Trip count of a ``while`` instruction, or ``None`` when unknown.

    Uses ``backend_config`` ``known_trip_count`` (set by XLA's loop analysis);
    otherwise the single integer constant of the condition computation with
    ``known_init_step`` (default init 0, step 1), as jax's ``scan``/``fori_loop``
    lower to ``i < n``.
    """
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
    if known:
        return int(known.group(1))
    condition = loop.attr("condition")
    bound = _condition_constant(module, condition.lstrip("%")) if condition else None
    if bound is None:
        return None
    init_step = re.search(r'"known_init_step":\{"init":"(-?\d+)","step":"(\d+)"\}', loop.attrs)
    init, step = (int(init_step.group(1)), int(init_step.group(2))) if init_step else (0, 1)
    return max(0, math.ceil((bound - init) / step))


def _condition_constant(module: HloModuleText, condition: str) -> int | None:
    values = set()
    for ins in module.computations.get(condition, []):
        if ins.opcode != "constant" or not isinstance(ins.shape, ArrayShape) or ins.shape.dims:
            continue
        if ins.shape.dtype[0] not in "su":
            continue
        values.add(int(ins.operands[0]) if ins.operands and ins.operands[0].lstrip("-").isdigit() else None)
    values.discard(None)
    return values.pop() if len(values) == 1 else None


@dataclass(frozen=True)
class Executions:
    """How often a computation runs per call of the entry computation.

    Attributes:
        count: product of enclosing loop trip counts (unknown trip counts count 1).
        in_loop: the computation is (inside) a while body.
        trip_count: trip count of the innermost enclosing loop, ``None`` when
            not in a loop or unknown.
    """

    count: int
    in_loop: bool
    trip_count: int | None


def _call_edges(module: HloModuleText, name: str) -> list[tuple[str, int, bool, int | None]]:
    """(callee, multiplier, is a loop body, trip count) for each call made by ``name``."""
    edges = []
    for ins in module.computations.get(name, []):
        if ins.opcode not in _CALLING_OPCODES:
            continue  # async-done/-update: the matching async-start already calls the computation
        trips = trip_count(module, ins) if ins.opcode == "while" else None
        for key, callee in ins.callees():
            if key == "to_apply" and ins.opcode != "call":
                continue  # reducers of all-reduce, reduce, sort, ...: no collectives inside
            if key == "body":
                edges.append((callee, trips or 1, True, trips))
            else:
                edges.append((callee, 1, False, None))
    return edges


def _callers_first(module: HloModuleText, edges: dict[str, list]) -> list[str]:
    """Computations reachable from ENTRY, every caller before its callees."""
    order: list[str] = []
    state: dict[str, bool] = {}
    stack = [(module.entry, False)]
    while stack:
        name, done = stack.pop()
        if done:
            order.append(name)
            continue
        if name in state:
            continue
        state[name] = True
        edges[name] = _call_edges(module, name)
        stack.append((name, True))
        stack.extend((callee, False) for callee, *_ in edges[name] if callee not in state)
    return order[::-1]


def computation_executions(module: HloModuleText) -> dict[str, Executions]:
    """Executions of every computation reachable from ENTRY.

    A computation called from several places adds up its callers' counts;
    conditional branches count as if taken (an upper bound). Each
    computation is read once, so this is linear in the module size.
    """
    edges: dict[str, list] = {}
    order = _callers_first(module, edges)
    count = dict.fromkeys(order, 0)
    in_loop = dict.fromkeys(order, False)
    trips: dict[str, int | None] = dict.fromkeys(order)
    count[module.entry] = 1
    for name in order:
        for callee, multiplier, is_body, loop_trips in edges[name]:
            count[callee] += count[name] * multiplier
            in_loop[callee] = in_loop[callee] or is_body or in_loop[name]
            trips[callee] = loop_trips if is_body else trips[name]
    return {name: Executions(count[name], in_loop[name], trips[name]) for name in order}
