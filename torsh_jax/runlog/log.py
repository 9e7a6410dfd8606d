"""``RunLog``: write a run directory while a training loop runs (see :mod:`torsh_jax.runlog.files`).

Each step's record is one JSON line, written and flushed when the step ends, so a reader (the
dashboard, ``tail -f``) follows the run. Its keys: ``step``, ``time`` (Unix seconds),
``loss``, ``step_time_s``, ``tokens_per_s``, ``grad_norm``, ``loss_scale`` (a plan with loss
scaling), ``mfu`` with ``flops_per_step``, ``flops_source``, ``peak_flops_per_device``,
``peak_flops_source``, ``compiles`` and ``compile_s`` (backend compiles during the step and their
seconds, counted from ``jax.monitoring``), and ``profiled`` (the step ran under the profiler).

Example:
    >>> import tempfile
    >>> log = RunLog(tempfile.mkdtemp(), tokens_per_step=100)
    >>> log.begin(1)
    >>> log.end(1, {"loss": 2.5}, step_time_s=0.5)["tokens_per_s"]
    200.0
    >>> log.close()

    A train step's log (its plan, ``inspect`` summary, FLOPs and peak):

    >>> log = RunLog.for_step("runs/a", train, state, batch, tokens_per_step=2048)  # doctest: +SKIP
    >>> for i in range(10):  # doctest: +SKIP
    ...     log.begin(i + 1)
    ...     state, metrics = train.step(state, batch)
    ...     log.end(i + 1, metrics)
    >>> log.close()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torsh_jax.errors import RunLogError
from torsh_jax.runlog import files
from torsh_jax.runlog.flops import PeakFlops, StepFlops, mfu
from torsh_jax.runlog.profile import ProfileWindow

__all__ = ["RunLog", "MachineLinks", "machine_file", "describe_devices"]

#: The event jax records once per backend compilation.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

#: The step metrics a record keeps.
_METRICS = ("loss", "grad_norm", "loss_scale")


class _CompileCounter:
    """Counts backend compiles (and their seconds) while registered with ``jax.monitoring``."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def __call__(self, event: str, duration: float, **_: Any) -> None:
        if event == _COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def register(self) -> None:
        import jax

        jax.monitoring.register_event_duration_secs_listener(self)

    def unregister(self) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self)


class RunLog:
    """Writes ``run.json``, the plan, the ``inspect`` summary and one JSON line per step.

    Args:
        directory: the run directory (created; an existing ``steps.jsonl`` is replaced, but for
            the steps ``continues`` keeps).
        header: what the run is (``plan``, ``mesh``, ``devices``, ``platform``, ...), kept in ``run.json``.
        flops: the step's FLOPs and their source (:func:`~torsh_jax.runlog.flops.step_flops`).
        peak: one device's peak FLOP/s and its source (:func:`~torsh_jax.runlog.flops.peak_flops`).
        devices: devices the step runs on.
        tokens_per_step: tokens one step trains on (``tokens_per_s`` is ``None`` without it).
        plan: the :class:`~torsh_jax.plan.ParallelPlan`, written as ``plan.toml`` and ``plan.json``.
        inspect: the ``inspect`` summary of the compiled step (:func:`~torsh_jax.runtime.inspect_step`);
            its headline (:func:`~torsh_jax.runtime.inspect.headline`) goes into ``run.json``.
        profile: steps to trace with ``jax.profiler`` (``"3:5"`` or a :class:`ProfileWindow`).
        tensorboard: also write TensorBoard scalars (needs ``tensorboardX``; skipped, and said so in
            ``run.json``, without it).
        machine: a :class:`~torsh_jax.planner.Machine` (``torsh-jax calibrate``, or a target's) or
            :func:`machine_file`: its links' α-β figures model the communication time when no
            profile measures it.
        continues: the step a run resumed at from its checkpoint: the earlier run's lines in
            ``steps.jsonl`` up to that step are kept, this run's follow (``resumed_from_step`` in
            ``run.json``).

    Only process 0 (``jax.process_index() == 0``) writes; on other processes the log computes and
    returns the records but writes nothing and traces nothing. A ``profile/`` left by an earlier run
    in the same directory is renamed ``profile.1`` (then ``profile.2``, ...), so the report pairs
    only this run's traces with its steps.

    Raises:
        RunLogError: the directory cannot be written, or ``profile`` is malformed.
    """

    def __init__(
        self,
        directory: str | Path,
        /,
        *,
        header: dict | None = None,
        flops: StepFlops | None = None,
        peak: PeakFlops | None = None,
        devices: int = 1,
        tokens_per_step: int | None = None,
        plan: Any = None,
        inspect: dict | None = None,
        profile: str | ProfileWindow | None = None,
        tensorboard: bool = False,
        machine: Any = None,
        continues: int | None = None,
    ):
        self.window = ProfileWindow.parse(profile) if isinstance(profile, str) else profile
        self.path, self.writes = Path(directory), _is_process_0()
        if not self.writes:  # another process of a multi-process run: process 0 writes the log
            self.window, tensorboard = None, False
        else:
            files.make_run_dir(directory)
            files.rotate_profile(self.path)
        self.flops = flops or StepFlops(None, "unknown", None, 0)
        self.peak = peak or PeakFlops(None, "unknown")
        self.devices, self.tokens_per_step = devices, tokens_per_step
        self._header = {
            **(header or {}),
            "devices": devices,
            "tokens_per_step": tokens_per_step,
            **self.flops.to_dict(),
            **self.peak.to_dict(),
            "profile": self.window.to_dict() if self.window else None,
            "resumed_from_step": continues,
        }
        if machine is not None:
            self._header["links"] = {
                kind: dict(vars(link)) if not isinstance(link, dict) else link
                for kind, link in machine.links.items()
            }
            self._header["links_source"] = f"{machine.name}: {machine.source}"
        self._writer = _tensorboard_writer(self.path) if tensorboard else None
        self._header["tensorboard"] = _tensorboard_state(tensorboard, self._writer)
        self._steps = None
        if self.writes:
            self._write_static(plan, inspect)
            kept = files.steps_up_to(self.path, continues) if continues else []
            self._steps = (self.path / files.STEPS_FILE).open("w", encoding="utf-8")
            self._steps.writelines(f"{line}\n" for line in kept)
            self._steps.flush()
        self._compiles = _CompileCounter()
        self._compiles.register()
        self._seen, self._started, self._tracing, self._traced = (0, 0.0), None, False, False
        self._closed = False

    @classmethod
    def for_step(cls, directory: str | Path, train, state, batch, /, **options: Any) -> RunLog:
        """A log of ``train`` (a :class:`~torsh_jax.runtime.step.TrainStep`): compiles the step on
        ``state`` and ``batch`` (abstract ones do), writes its ``inspect`` summary, takes its FLOPs
        from the compiled program and the peak from the devices. ``options`` as for the constructor,
        and ``model_flops_per_step``, ``peak_flops``."""
        from torsh_jax.runlog.flops import peak_flops, step_flops
        from torsh_jax.runlog.profile import hlo_module_name
        from torsh_jax.runtime.inspect import inspect_step

        compiled = train.lower(state, batch).compile()
        devices = list(train.mesh.devices.flat)
        flops = step_flops(
            compiled, devices=len(devices), model_flops_per_step=options.pop("model_flops_per_step", None)
        )
        peak = peak_flops(devices, given=options.pop("peak_flops", None))
        summary = inspect_step(train, state, batch, compiled=compiled)
        header = describe_devices(devices, train.mesh) | {"hlo_module": hlo_module_name(compiled)}
        header |= options.pop("header", {})
        return cls(
            directory,
            header=header,
            flops=flops,
            peak=peak,
            devices=len(devices),
            plan=train.plan,
            inspect=summary,
            **options,
        )

    def _write_static(self, plan: Any, inspect: dict | None) -> None:
        from torsh_jax.plan.io import plan_to_json, plan_to_toml

        if plan is not None:
            (self.path / files.PLAN_TOML).write_text(plan_to_toml(plan))
            (self.path / files.PLAN_JSON).write_text(plan_to_json(plan))
            self._header.setdefault("plan", plan.name)
        if inspect is not None:
            from torsh_jax.runtime.inspect import headline

            files.write_json(self.path / files.INSPECT_FILE, inspect)
            self._header["inspect_headline"] = headline(inspect)  # what the demo prints per step
        self._header.update(started=time.time(), finished=None)
        files.write_json(self.path / files.RUN_FILE, self._header)

    def begin(self, step: int) -> None:
        """Call before running ``step``: starts the profiler at the window's first step (or the first
        step in the window, for a resumed run), and the clock."""
        if self.window is not None and step in self.window and not self._traced:
            import jax

            jax.profiler.start_trace(str(self.path / files.PROFILE_DIR), create_perfetto_trace=True)
            self._tracing = self._traced = True
        self._seen = (self._compiles.count, self._compiles.seconds)
        self._started = time.perf_counter()

    def end(self, step: int, metrics: dict, /, *, step_time_s: float | None = None) -> dict:
        """Call after ``step``: reads ``metrics`` (``loss``, ``grad_norm``, ``loss_scale``), writes
        and returns its record. ``step_time_s`` defaults to the time since :meth:`begin`; compiles are
        counted since :meth:`begin`.

        Raises:
            RunLogError: no :meth:`begin` before it, or ``step_time_s`` is not above 0.
        """
        if self._started is None:
            raise RunLogError(
                f"end({step}) without begin({step})",
                key="RunLog.end",
                fix=f"call log.begin({step}) before the step",
            )
        values = {key: _scalar(metrics[key]) for key in _METRICS if key in metrics}  # waits for the step
        if step_time_s is None:
            step_time_s = time.perf_counter() - self._started
        if not step_time_s > 0:
            raise RunLogError(
                f"step {step} took step_time_s={step_time_s}",
                key="step_time_s",
                fix="pass the step's seconds, above 0",
            )
        self._started = None
        if self._tracing and step >= self.window.last:
            self._stop_trace()
        record = self._record(step, values, step_time_s)
        if self._steps is not None:
            self._steps.write(files.flat_json_line(record) + "\n")
            self._steps.flush()
        if self._writer is not None:
            _tensorboard_scalars(self._writer, record)
        return record

    def _record(self, step: int, values: dict, step_time_s: float) -> dict:
        compiles, seconds = self._compiles.count - self._seen[0], self._compiles.seconds - self._seen[1]
        record = {
            "step": step,
            "time": time.time(),
            "loss": values.get("loss"),
            "step_time_s": step_time_s,
            "tokens_per_s": self.tokens_per_step / step_time_s if self.tokens_per_step else None,
            "grad_norm": values.get("grad_norm"),
        }
        if "loss_scale" in values:
            record["loss_scale"] = values["loss_scale"]
        record["mfu"] = mfu(
            flops_per_step=self.flops.flops_per_step,
            step_time_s=step_time_s,
            peak_flops_per_device=self.peak.peak_flops_per_device,
            devices=self.devices,
        )
        record.update(
            flops_per_step=self.flops.flops_per_step,
            flops_source=self.flops.flops_source,
            peak_flops_per_device=self.peak.peak_flops_per_device,
            peak_flops_source=self.peak.peak_flops_source,
        )
        record.update(
            compiles=compiles, compile_s=seconds, profiled=self.window is not None and step in self.window
        )
        return record

    def _stop_trace(self) -> None:
        import jax

        jax.profiler.stop_trace()
        self._tracing = False

    def close(self, **summary: Any) -> None:
        """Stop a trace still running, close the files and mark ``run.json`` finished (with ``summary``);
        a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._tracing:
            self._stop_trace()
        self._compiles.unregister()
        if self._writer is not None:
            self._writer.close()
        if self._steps is not None:
            self._steps.close()
            self._header.update(summary, finished=time.time())
            files.write_json(self.path / files.RUN_FILE, self._header)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class MachineLinks:
    """The links of a machine file (``torsh-jax calibrate -o``) as :class:`RunLog` reads them."""

    name: str
    source: str
    links: dict


def machine_file(path: str | Path, /, *, key: str = "machine") -> MachineLinks:
    """The name, source and links (``{"ici": {"alpha_s", "bytes_per_s"}, ...}``) of a machine file.

    Raises:
        RunLogError: the file is missing or is not a machine file.
    """
    try:
        data = json.loads(Path(path).read_text())
        links = {
            kind: {"alpha_s": float(v["alpha_s"]), "bytes_per_s": float(v["bytes_per_s"])}
            for kind, v in data["links"].items()
        }
        return MachineLinks(str(data["name"]), str(data.get("source", "")), links)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        reason = f"it has no {err.args[0]!r} field" if isinstance(err, KeyError) else err
        raise RunLogError(
            f"cannot read machine file {path}: {reason}",
            key=key,
            fix="write it with torsh-jax calibrate -o machine.json",
        ) from None


def describe_devices(devices: list, mesh: Any = None) -> dict:
    """``platform``, ``device_kind``, ``mesh``, ``local_devices`` (this process's, the ones its profile
    traces), ``slices`` and the memory capacity of one device with its source."""
    import jax

    from torsh_jax.runtime.fit import device_memory_limit

    limit = device_memory_limit(mesh) if mesh is not None else None
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "mesh": {name: int(size) for name, size in mesh.shape.items()} if mesh is not None else None,
        "local_devices": sum(d.process_index == jax.process_index() for d in devices),
        "slices": len({getattr(d, "slice_index", 0) for d in devices}),
        "memory_capacity_bytes": limit.bytes if limit else None,
        "memory_capacity_source": limit.source if limit else "unknown",
    }


def _is_process_0() -> bool:
    import jax

    return jax.process_index() == 0


def _scalar(value: Any) -> float | None:
    return None if value is None else float(value)


def _tensorboard_writer(path: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path / files.TENSORBOARD_DIR))


def _tensorboard_state(asked: bool, writer: Any) -> str:
    if not asked:
        return "off"
    return (
        "written"
        if writer is not None
        else 'skipped: tensorboardX is not installed (pip install "torsh-jax[report]")'
    )


def _tensorboard_scalars(writer: Any, record: dict) -> None:
    for key in ("loss", "step_time_s", "tokens_per_s", "grad_norm", "loss_scale", "mfu"):
        if record.get(key) is not None:
            writer.add_scalar(key, record[key], record["step"])
