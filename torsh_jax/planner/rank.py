"""Rank the candidate plans by predicted step time, and check the best against the compiler.

:func:`search` predicts every candidate (:mod:`~torsh_jax.planner.space`,
:mod:`~torsh_jax.planner.cost`), keeps per family (everything but the accumulation steps) the
fewest accumulation steps that fit, and ranks the plans that fit by predicted step time.
:func:`verify` compiles one for the machine's devices (simulated CPU devices, or a target's
compile-only devices) and puts the compiler's memory next to the prediction.

Example:
    >>> from torsh_jax.planner.machine import Machine
    >>> from torsh_jax.planner.shape import ModelShape
    >>> ranked = search(ModelShape.demo("tiny"), Machine.from_target("v5e-8"), global_batch=64)
    >>> ranked[0].fits, ranked[0].step_s <= ranked[-1].step_s
    (True, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from torsh_jax.plan import ParallelPlan
from torsh_jax.planner.cost import Prediction, optimizer_state_factor, predict, scheduled_step
from torsh_jax.planner.machine import Machine
from torsh_jax.planner.shape import ModelShape
from torsh_jax.planner.space import Space, candidates
from torsh_jax.planner.steps import StepBuilder, demo_step_builder

__all__ = ["search", "search_verified", "Verified", "verify", "rules_of_thumb"]

#: The seeds' guides: the strategy by model size and devices, and compression by link bandwidth.
RULES = (
    ("ddp", "DDP under 1 B parameters"),
    ("fsdp", "FSDP (ZeRO-3) under 10 B parameters on up to 32 devices"),
    ("3d", "3-D parallelism (data x tensor x stage) above"),
)
#: Gradient compression by the bandwidth across slices: (below bits/s, method).
COMPRESSION_RULES = ((10e9, "topk"), (25e9, "int8"))


def search(
    shape: ModelShape,
    machine: Machine,
    /,
    *,
    global_batch: int,
    base: ParallelPlan | None = None,
    space: Space | None = None,
    by_floor: bool = False,
    refused: frozenset[str] | set[str] = frozenset(),
) -> list[Prediction]:
    """Predictions ranked: plans that fit by step time, then those that do not by memory. With
    ``by_floor`` (compiles will decide), a plan whose :attr:`~Prediction.memory_floor` fits ranks
    with those that fit, unless its label is among those the compiler ``refused``."""
    base = base or ParallelPlan()
    found = candidates(
        shape,
        devices=machine.devices,
        global_batch=global_batch,
        slices=machine.slices,
        base=base,
        space=space,
    )
    factor = optimizer_state_factor(base)
    best: dict[str, Prediction] = {}
    admits = lambda p: _admitted(p, by_floor, refused)
    for candidate in found:  # accumulation steps ascend within a family
        kept = best.get(candidate.family)
        if kept is not None and admits(kept):  # the fewest steps that fit are found
            continue
        p = predict(candidate, shape, machine, opt_factor=factor)
        if kept is None or (not admits(kept) and p.memory["total"] < kept.memory["total"]):
            best[candidate.family] = p
    fitting = sorted((p for p in best.values() if admits(p)), key=lambda p: p.step_s)
    over = sorted((p for p in best.values() if not admits(p)), key=lambda p: p.memory["total"])
    return fitting + over


def _admitted(p: Prediction, by_floor: bool, refused: frozenset[str] | set[str]) -> bool:
    """Whether ``p`` ranks with the plans that fit: the compiler has not ``refused`` it, and it
    fits, or (``by_floor``) its floor does."""
    return p.candidate.label not in refused and (p.fits or (by_floor and p.may_fit))


class Verified(NamedTuple):
    """What :func:`search_verified` found.

    Attributes:
        ranked: the final ranking (compiled figures, with the compile's ``seconds``, in
            ``Prediction.compiled``).
        pick: the first plan the compiler found to fit; without compiling, the first predicted to
            fit; ``None`` when nothing does.
        machine: the machine with the activation scale learned from the plans that did not fit.
        stopped: why compiling stopped before a plan fit with compiles left, else ``None``.
    """

    ranked: list[Prediction]
    pick: Prediction | None
    machine: Machine
    stopped: str | None = None


def search_verified(
    shape: ModelShape,
    machine: Machine,
    /,
    *,
    global_batch: int,
    budget: int,
    check: Callable[[Prediction], dict],
    base: ParallelPlan | None = None,
    space: Space | None = None,
    seconds: float | None = None,
) -> Verified:
    """:func:`search`, then compile down the ranking (``check``: :func:`verify` for the machine's
    devices; at most ``budget`` compiles) until a plan fits: the pick. A plan the compiler finds
    too large teaches the activation scale (its compiled bytes over the predicted activations),
    and the rest is ranked again with it; a plan compiled because only its
    :attr:`~Prediction.memory_floor` fit and found too large teaches nothing (the compiler held
    its parts together, as the prediction's total says). A refused plan is passed over: its
    family moves on to more accumulation steps. ``seconds``: no
    compile is started that would end past this much compiling, the last compile's time taken
    for the next one's (the first always runs).
    A compile that reads the schedule's overlap (a target's) adds the plan's ``exposed_s`` and
    ``step_s`` with it (:func:`~torsh_jax.planner.cost.scheduled_step`) to its compiled figures;
    the ranking stays the prediction's.
    """
    compiled: dict[str, dict] = {}
    tried: dict[str, Prediction] = {}
    refused: set[str] = set()  # compiled and found too large
    ranking = dict(global_batch=global_batch, base=base, space=space, by_floor=budget > 0)
    pick_label, stopped, spent, last = None, None, 0.0, 0.0
    for _ in range(budget):
        ranked = search(shape, machine, **ranking, refused=refused)
        left = (p for p in ranked if p.candidate.label not in compiled)
        todo = next((p for p in left if _admitted(p, ranking["by_floor"], refused)), None)
        if todo is None:
            break
        if seconds is not None and compiled and spent + last > seconds:
            n = len(compiled)
            stopped = f"{n} compile{'s' * (n > 1)} took {spent:.0f} s; another would pass {seconds:g} s"
            break
        start = time.perf_counter()
        result = check(todo)
        last = time.perf_counter() - start
        spent += last
        scheduled = scheduled_step(todo, machine, result["overlap"]) if result.get("overlap") else {}
        compiled[todo.candidate.label] = {**result, "seconds": last, **scheduled}
        tried[todo.candidate.label] = todo
        if result["fits"]:
            pick_label = todo.candidate.label
            break
        refused.add(todo.candidate.label)
        if not todo.fits:  # compiled for its floor: the compiler held the parts together
            continue
        scale = machine.activation_scale * _activation_ratio(todo, result)
        machine = replace(machine, activation_scale=scale)
    ranked = search(shape, machine, **ranking, refused=refused)
    ranked += _dropped(tried, ranked, shape, machine, base)
    ranked = [replace(p, compiled=compiled.get(p.candidate.label, {})) for p in ranked]
    if budget == 0:
        return Verified(ranked, next((p for p in ranked if p.fits), None), machine)
    pick = next((p for p in ranked if p.candidate.label == pick_label), None)
    return Verified(ranked, pick, machine, stopped)


def _dropped(tried: dict[str, Prediction], ranked: list[Prediction], shape: ModelShape, machine: Machine,
             base: ParallelPlan | None) -> list[Prediction]:  # fmt: skip
    """The compiled plans the last ranking left out, predicted again on ``machine``, by memory: a
    family keeps its fewest accumulation steps predicted to fit, and after a refusal that can be
    more steps than the plan compiled."""
    listed = {p.candidate.label for p in ranked}
    factor = optimizer_state_factor(base or ParallelPlan())
    again = [
        predict(p.candidate, shape, machine, opt_factor=factor) for k, p in tried.items() if k not in listed
    ]
    return sorted(again, key=lambda p: p.memory["total"])


def _activation_ratio(p: Prediction, compiled: dict) -> float:
    """Compiled activation bytes over predicted, from a plan that did not fit: the compiler's peak
    (refused: the peak its message states) less the predicted non-activation parts; at least 1.1,
    so that the next prediction asks for more."""
    needed = (compiled.get("peak") or 0) - p.memory["state"] - p.memory["gradients"] - p.memory["gathered"]
    predicted = p.memory["activations"] + p.memory["logits"]
    return max(needed / predicted if predicted else 1.1, 1.1)


def verify(
    prediction: Prediction, shape: ModelShape, devices, /, *, target=None, build: StepBuilder | None = None
) -> dict:
    """Compile the predicted plan over ``devices`` (a target's, with ``target``), recomputing each
    layer where the candidate has remat, and return the compiler's memory: ``peak``, ``temp``,
    ``fits`` and ``memory_error`` (predicted / compiled peak - 1); for a target also ``overlap``, the
    overlapped fraction of each axis set's collective bytes in the compiled schedule (``None`` on
    CPU devices, whose collectives are synchronous). The step is ``build``'s
    (:func:`~torsh_jax.planner.steps.model_step_builder`: your model), else the demo model of
    ``shape``'s."""
    candidate = prediction.candidate
    build = build or demo_step_builder(shape)
    # the candidate's DCN sizes are its slices (TPU) or nodes (GPU: the devices' processes)
    train, batch = build(candidate.plan, devices, remat=candidate.remat)
    if target is not None:
        from torsh_jax.targets import compile_for_target

        report = compile_for_target(train, batch, target=target)
        peak, temp = report.memory["peak"], report.memory.get("temp")
        fits = report.fits and peak <= prediction.memory_limit  # a limit below the chip's, too
        overlap = _overlap_by_axes(report.overlap)
    else:
        from torsh_jax.analysis.memory import memory_report, peak_bytes

        memory = memory_report(train.lower(train.abstract_state(), batch).compile())
        peak, temp = peak_bytes(memory, devices[0].platform), memory.temp_bytes  # libtpu's on a TPU
        fits, overlap = peak <= prediction.memory_limit, None
    error = prediction.memory["total"] / peak - 1 if peak else None
    return {"peak": peak, "temp": temp, "fits": fits, "memory_error": error, "overlap": overlap}


def _overlap_by_axes(report: dict | None) -> dict[str, float] | None:
    """The overlapped fraction of each mesh-axis set's collective bytes in a target's compiled
    schedule (axes the analysis could not name left out)."""
    if not report:
        return None
    found = {axes: row["fraction"] for axes, row in report.get("by_axes", {}).items()}
    return {axes: f for axes, f in found.items() if f is not None and axes not in ("?", "-")} or None


def _rule(shape: ModelShape, machine: Machine) -> tuple[str, str]:
    if shape.param_count < 1e9:
        return RULES[0]
    return RULES[1] if shape.param_count < 10e9 and machine.devices <= 32 else RULES[2]


def _of_kind(p: Prediction, kind: str) -> bool:
    sizes = p.candidate.sizes
    plain = sizes["tensor"] == 1 and sizes["stage"] == 1
    if kind == "ddp":
        return plain and sizes["fsdp"] == 1
    if kind == "fsdp":
        return plain and p.candidate.plan.zero.stage == 3
    return sizes["tensor"] > 1 and sizes["stage"] > 1 and sizes["data"] * sizes["fsdp"] > 1


def rules_of_thumb(
    ranked: list[Prediction], shape: ModelShape, machine: Machine, pick: Prediction | None = None
) -> list[dict]:
    """The seeds' rules against the planner's ``pick`` (the first ranked where not given), with
    the reason in figures where they differ.

    One row for the strategy rule; one for compression when the machine has slices (its DCN
    bandwidth against the rule's thresholds)."""
    from torsh_jax.units import format_bytes

    kind, rule = _rule(shape, machine)
    pick = pick or ranked[0]
    follows = next((p for p in ranked if _of_kind(p, kind)), None)
    row = {
        "rule": rule,
        "rule_plan": follows.candidate.label if follows else None,
        "pick": pick.candidate.label,
    }
    if follows is None:
        row["reason"] = f"no {kind} plan exists for {machine.devices} devices and this model"
    elif not follows.fits_as_compiled:
        need, have = format_bytes(follows.memory["total"]), format_bytes(follows.memory_limit)
        if follows.memory_floor is not None and not follows.compiled:  # the compiler's schedule decides
            need = f"{format_bytes(follows.memory_floor)} to {need}"
        row["reason"] = f"{follows.candidate.label} needs {need} per device, {have} available"
    elif follows is pick:
        row["reason"] = "agrees"
    else:
        row["reason"] = (f"{pick.candidate.label} is predicted {follows.step_s / pick.step_s:.2f}x faster "
                         f"({pick.step_s * 1e3:.1f} ms against {follows.step_s * 1e3:.1f} ms)")  # fmt: skip
    rows = [row]
    if machine.slices > 1:
        rows.append(_compression_rule(ranked, machine))
    return rows


def _method(p: Prediction) -> str:
    """The gradient compression method of a plan (``none`` without)."""
    return next((a.gradients.method for a in p.candidate.plan.compression if a.gradients), "none")


def _compression_rule(ranked: list[Prediction], machine: Machine) -> dict:
    bits = machine.link("dcn").bytes_per_s * 8
    method = next((m for limit, m in COMPRESSION_RULES if bits < limit), "none")
    compressed = [p for p in ranked if p.candidate.plan.compression]
    pick = ranked[0]
    ruled = [p for p in compressed if _method(p) == method] or compressed
    even = next((p for p in ruled if p.break_even_bytes_per_s), None)
    picked = _method(pick)
    pays = even.break_even_bytes_per_s * 8 / 1e9 if even else None
    reason = "agrees" if picked == method else (
        f"across slices {bits / 1e9:.1f} Gb/s; {_method(even)} pays below {pays:.1f} Gb/s (its encode and "
        f"decode against the bytes it saves)" if even else "no compressed plan considered")  # fmt: skip
    return {"rule": f"gradient compression by DCN bandwidth: {method} at {bits / 1e9:.1f} Gb/s",
            "rule_plan": method, "pick": picked, "reason": reason}  # fmt: skip
