"""Bottlenecks of a run, computed from its log and its compiled step: ``findings(run)``.

Five checks, each a :class:`Finding` (with a severity, the figures it rests on and where they come
from, and changes to the plan with their computed effect) or nothing:

* **communication**: time in collectives over the step time. Measured on the profile when the run
  has one (the trace's collective ops of the step's program on this process's devices, waiting for
  peers included, over the profiled steps that did not compile), else modelled from the ``inspect``
  wire bytes over the machine's links (``RunLog(machine=...)``; ``dcn`` for an axis that crosses
  slices, as the planner chooses).
  Reported from 25 % (high from 50 %).
* **memory**: the compiled step's peak against one device's capacity, from 80 % (high from 90 %).
* **pipeline bubble**: the schedule table's idle share, from 15 % (high from 30 %).
* **recompilation**: backend compiles during any step after the first.
* **jitter**: the 90th percentile of the steady steps (after the first, not profiled, not compiling)
  over their median, from 1.25 (medium from 1.5); at least 5 steady steps.

Example:
    >>> from pathlib import Path
    >>> steps = [{"step": 1, "step_time_s": 0.5, "compiles": 1}, {"step": 2, "compiles": 2}]
    >>> [(f.kind, f.title) for f in findings(Run(Path("runs/a"), {"devices": 1}, steps=steps))]
    [('recompilation', '2 compiles after the first step (steps 2)')]
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from torsh_jax.analysis.memory import peak_of
from torsh_jax.analysis.report import sent_per_device
from torsh_jax.plan.factor import link_kind
from torsh_jax.runlog.profile import collective_seconds
from torsh_jax.runlog.read import Run
from torsh_jax.runlog.suggest import percent, pipeline_options, zero_options
from torsh_jax.units import format_bytes

__all__ = ["Finding", "findings", "communication_share", "steady_steps"]

_SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}


@dataclass(frozen=True)
class Finding:
    """One bottleneck: ``kind``, ``severity`` (high, medium, low), a one-line ``title`` with its
    figure, ``source`` (where the figures come from), ``suggestions`` and the ``figures``."""

    kind: str
    severity: str
    title: str
    source: str
    suggestions: tuple[str, ...] = ()
    figures: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**asdict(self), "suggestions": list(self.suggestions)}


def steady_steps(run: Run) -> list[dict]:
    """Steps after the first that neither compiled nor ran under the profiler."""
    return [s for s in run.steps[1:] if not s.get("compiles") and not s.get("profiled")]


def _median_step_s(run: Run) -> float | None:
    times = [s["step_time_s"] for s in (steady_steps(run) or run.steps) if s.get("step_time_s")]
    return statistics.median(times) if times else None


def _measured_share(run: Run) -> dict | None:
    traces = [t for t in run.traces if t.name == "perfetto_trace.json.gz"]
    # this run's profile: a resumed run's log keeps the earlier run's steps, whose traces were moved
    resumed = run.header.get("resumed_from_step") or 0
    profiled = [s for s in run.steps if s.get("profiled") and s.get("step_time_s") and s["step"] > resumed]
    timed = [s for s in profiled if not s.get("compiles")]  # a compile is not the step's time
    if not traces or not timed or run.inspect is None:
        return None
    seconds = collective_seconds(traces[0], run.inspect["collectives"], module=run.header.get("hlo_module"))
    local = run.header.get("local_devices") or run.header["devices"]  # the devices the trace holds
    per_step = {axes: s / (local * len(profiled)) for axes, s in seconds.items()}
    step_s = statistics.mean(s["step_time_s"] for s in timed)
    first, last = profiled[0]["step"], profiled[-1]["step"]
    source = f"measured: collective ops in the profile of steps {first}-{last} (waiting for peers included)"
    if len(timed) < len(profiled):
        left_out = ", ".join(str(s["step"]) for s in profiled if s.get("compiles"))
        source += f"; step time of the steps without compiles (step {left_out} compiled)"
    return _share(per_step, step_s, source)


def _dcn_sizes(run: Run) -> dict[str, int]:
    """Each plan axis's cross-slice size (``-1``: the run's slices)."""
    plan = run.plan()
    if plan is None:
        return {}
    sizes = {a: getattr(plan.mesh, a) for a in ("data", "fsdp", "tensor", "stage")}
    slices = run.header.get("slices") or 1
    return {a: (slices if size.dcn == -1 else size.dcn) for a, size in sizes.items() if size is not None}


def _modelled_share(run: Run) -> dict | None:
    links, step_s = run.header.get("links"), _median_step_s(run)
    if not links or run.inspect is None or not step_s:
        return None
    dcn, per_step, kinds = _dcn_sizes(run), {}, set()
    for axes, entry in sent_per_device(run.inspect)["by_axis"].items():  # a pipeline: its busiest stage
        if axes == "-":
            continue
        kind = link_kind(axes.split("+"), dcn)
        link = links.get(kind) or links["ici"]  # as Machine.link: one slice has no dcn link
        kinds.add(kind)
        per_step[axes] = entry["count"] * link["alpha_s"] + entry["wire_bytes"] / link["bytes_per_s"]
    over = " and ".join(sorted(f"{k} ({'across slices' if k == 'dcn' else 'in-slice'})" for k in kinds))
    links_source = run.header.get("links_source")
    return _share(
        per_step, step_s, f"modelled: inspect's wire bytes per axis over the {over} link ({links_source})"
    )


def _share(per_step: dict[str, float], step_s: float, source: str) -> dict:
    return {
        "share": sum(per_step.values()) / step_s,
        "seconds_by_axis": per_step,
        "step_s": step_s,
        "source": source,
    }


def communication_share(run: Run) -> dict | None:
    """``share`` of the step in collectives, ``seconds_by_axis`` per step and device, ``step_s`` and
    ``source``: measured on the profile, else modelled, else ``None``."""
    return _measured_share(run) or _modelled_share(run)


def _communication(run: Run) -> Finding | None:
    comm = communication_share(run)
    if comm is None or comm["share"] < 0.25:
        return None
    axes = ", ".join(f"{a} {percent(s, comm['step_s'])}" for a, s in sorted(comm["seconds_by_axis"].items()))
    capacity = run.header.get("memory_capacity_bytes")
    fewer = [o for o in zero_options(run, stages=(0, 1, 2, 3)) if o.wire_bytes < o.current_wire_bytes]
    best = max(fewer, key=lambda o: (-o.wire_bytes, o.stage), default=None)  # fewest bytes, least memory
    suggestions = []
    if best is not None:
        instead = f"{best.label} instead of ZeRO-{run.plan().zero.stage}"
        suggestions.append(f"{instead}: {best.bytes_phrase()}, {best.memory_phrase(capacity)}")
    title = f"communication takes {percent(comm['share'], 1)} of the step ({axes})"
    if comm["share"] > 1:
        title += _over_step(comm["source"])
    else:
        suggestions += _accumulation_suggestion(run, comm)
    return Finding(
        "communication",
        "high" if comm["share"] >= 0.5 else "medium",
        title,
        comm["source"],
        tuple(suggestions),
        comm,
    )


def _over_step(source: str) -> str:
    """Why a share above 100 % cannot be the step's communication, by where it comes from."""
    if source.startswith("measured"):
        return (
            ": more than the measured step, so the profile's collective ops overlap each other "
            "(several streams or asynchronous ops) and their sum is not time the step waited"
        )
    return ": more than the measured step, so the machine's link figures do not describe this run"


def _accumulation_suggestion(run: Run, comm: dict) -> list[str]:
    """Twice the accumulation steps: one gradient reduction per step (ZeRO <= 1), twice the compute."""
    plan = run.plan()
    if plan is None or plan.zero.stage > 1:
        return []
    c = comm["share"] * comm["step_s"]
    new = c / (c + 2 * (comm["step_s"] - c))
    a = plan.batch.accumulation_steps
    return [
        f"batch.accumulation_steps {a} -> {2 * a} (twice the global batch): communication "
        f"{percent(comm['share'], 1)} -> {percent(new, 1)} of the step (one reduction per step)"
    ]


def _memory(run: Run) -> Finding | None:
    peak = peak_of((run.inspect or {}).get("memory") or {})
    capacity = run.header.get("memory_capacity_bytes")
    if not peak or not capacity or peak < 0.8 * capacity:
        return None
    plan = run.plan()
    stage = plan.zero.stage if plan else None
    worthwhile = 0.01 * capacity  # a change that saves less is not shown
    suggestions = [
        f"{o.label} instead of ZeRO-{stage}: {o.memory_phrase(capacity)}, {o.bytes_phrase()}"
        for o in zero_options(run, stages=(1, 2, 3))
        if o.peak_bytes is not None and o.peak_bytes < peak - worthwhile
    ]
    optimizer = (run.inspect.get("state_bytes_per_device") or {}).get("opt_state", 0)
    if plan is not None and optimizer >= worthwhile and not plan.zero.offload_optimizer:
        rest = peak - optimizer
        suggestions.append(
            f"zero.offload_optimizer = true: peak ≈ {format_bytes(rest)} "
            f"({percent(rest, capacity)} of {format_bytes(capacity)}), the "
            f"{format_bytes(optimizer)} of optimizer state per device in host memory"
        )
    source = f"compiled step's memory_analysis peak; capacity: {run.header.get('memory_capacity_source')}"
    return Finding(
        "memory",
        "high" if peak >= 0.9 * capacity else "medium",
        f"peak memory {format_bytes(peak)} is {percent(peak, capacity)} of the device's "
        f"{format_bytes(capacity)}",
        source,
        tuple(suggestions or _activation_hint(run, peak)),
        {"peak_bytes": peak, "capacity_bytes": capacity},
    )


def _activation_hint(run: Run, peak: int) -> tuple[str, ...]:
    """When no change of the state helps: how much of the peak the state is, and what the rest is."""
    state = (run.inspect.get("state_bytes_per_device") or {}).get("total")
    temp = (run.inspect.get("memory") or {}).get("temp_bytes")
    if state is None or temp is None:
        return ()
    return (
        f"the training state is {format_bytes(state)} of the {format_bytes(peak)} peak and the "
        f"temporaries {format_bytes(temp)} (activations, gradients): they scale with "
        f"batch.micro_batch_size (fewer rows per micro-step, more accumulation steps)",
    )


def _bubble(run: Run) -> Finding | None:
    pipe = (run.inspect or {}).get("pipeline")
    if not pipe or pipe["bubble"] < 0.15:
        return None
    plan, step_s = run.plan(), _median_step_s(run)
    options = pipeline_options(
        pipe,
        micro_batch_size=plan.batch.micro_batch_size if plan else None,
        layers=(run.header.get("model") or {}).get("layers"),
    )
    suggestions = []
    for change, bubble, examples in options:
        if bubble >= pipe["bubble"]:
            continue
        text = f"{change}: bubble {percent(pipe['bubble'], 1)} -> {percent(bubble, 1)}"
        if step_s:  # the busy time per example kept, the idle share changed
            new_ms = step_s * (1 - pipe["bubble"]) * examples / (1 - bubble) * 1e3
            more = "" if examples == 1 else f" for {examples:g}× the examples"
            text += f", step ≈ {new_ms:.1f} ms{more} (now {step_s * 1e3:.1f})"
        suggestions.append(text)
    title = (
        f"pipeline bubble: {percent(pipe['bubble'], 1)} of the {pipe['schedule']} schedule's slots idle "
        f"({pipe['stages']} stages, {pipe['microbatches']} micro-batches)"
    )
    return Finding(
        "bubble",
        "high" if pipe["bubble"] >= 0.3 else "medium",
        title,
        _bubble_source(run),
        tuple(suggestions),
        {"bubble": pipe["bubble"]},
    )


def _bubble_source(run: Run) -> str:
    source = "the schedule table of the compiled step; step times assume an idle slot costs its time"
    if run.header.get("platform") == "cpu":
        source += " (simulated CPU devices share the host's cores: an idle stage lends its core, so less)"
    return source


def _recompilation(run: Run) -> Finding | None:
    again = [s for s in run.steps[1:] if s.get("compiles")]
    if not again:
        return None
    seconds = sum(s.get("compile_s") or 0.0 for s in again)
    total = sum(s.get("step_time_s") or 0.0 for s in run.steps) or 1.0
    compiles = sum(s["compiles"] for s in again)
    steps = ", ".join(str(s["step"]) for s in again[:8]) + (" ..." if len(again) > 8 else "")
    suggestions = (
        f"keep the shapes and dtypes of the step's inputs fixed (pad the last batch): "
        f"{seconds:.2f} s of compiling, {percent(seconds, total)} of the steps' time",
        "check for it in tests: TrainStep.traces (or chex.assert_max_traces) must stay 1",
    )
    severity = "high" if len(again) >= 2 or seconds >= 0.1 * total else "medium"
    return Finding(
        "recompilation",
        severity,
        f"{compiles} compiles after the first step (steps {steps})",
        "jax.monitoring backend-compile events counted per step",
        suggestions,
        {"steps": [s["step"] for s in again], "compiles": compiles, "compile_s": seconds},
    )


def _jitter(run: Run) -> Finding | None:
    steady = steady_steps(run)
    if len(steady) < 5:
        return None
    times = sorted(s["step_time_s"] for s in steady)
    median, p90 = statistics.median(times), times[min(len(times) - 1, round(0.9 * (len(times) - 1)))]
    if p90 < 1.25 * median:
        return None
    slow = [s for s in steady if s["step_time_s"] > 1.5 * median]
    worst = max(steady, key=lambda s: s["step_time_s"])
    suggestions = [
        f"trace the slowest steady step, {worst['step']} ({worst['step_time_s'] * 1e3:.1f} ms): "
        f"--profile {worst['step']}:{worst['step']}"
    ]
    if slow:
        lost = sum(s["step_time_s"] - median for s in slow)
        spent = f"{lost:.3f} s more than median steps ({percent(lost, sum(times))} of the steady steps' time)"
        suggestions.insert(0, f"{len(slow)} steps over 1.5× the median cost {spent}")
    title = (
        f"step time jitter: p90 {p90 * 1e3:.1f} ms is {p90 / median:.2f}× the median {median * 1e3:.1f} ms"
    )
    return Finding(
        "jitter",
        "medium" if p90 >= 1.5 * median else "low",
        title,
        f"step_time_s of {len(steady)} steady steps",
        tuple(suggestions),
        {"median_s": median, "p90_s": p90},
    )


def findings(run: Run) -> list[Finding]:
    """The run's bottlenecks, most severe first (empty for a healthy run)."""
    checks = (_communication, _memory, _bubble, _recompilation, _jitter)
    found = [f for f in (check(run) for check in checks) if f is not None]
    return sorted(found, key=lambda f: _SEVERITY_ORDER[f.severity])
