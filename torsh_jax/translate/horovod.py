"""Translate Horovod launch lines, ``HOROVOD_*`` variables and ``DistributedOptimizer`` calls.

Input is text: shell lines (``horovodrun -np 16 -H a:4,b:4,c:4,d:4 python
train.py``, ``mpirun -np 8 -x HOROVOD_FUSION_THRESHOLD=16777216 ...``) and/or
Python excerpts of the training script. Every flag, variable, script option,
``DistributedOptimizer`` argument and ``hvd.*`` use becomes a note.

Mapping (sources: horovod/runner/launch.py, docs/tensor-fusion.rst,
horovod/torch/optimizer.py):

- ``-np`` / ``-H host:slots`` -> world size and process layout (``extras``);
  the mesh is pure data parallelism.
- ``--fusion-threshold-mb`` (MiB) / ``HOROVOD_FUSION_THRESHOLD`` (bytes) ->
  ``communication.bucket_mb`` (1e6 bytes); Horovod's default is 128 MiB.
- hierarchical allreduce -> approximated: with a known uniform host layout the
  data axis is split into in-host (ICI) x across-host (DCN) parts.
- ``compression=fp16`` -> fp16 gradient compression over ``data``;
  ``op`` Average/Sum -> ``communication.reduce_op``; Adasum is unsupported.
- ``backward_passes_per_step`` -> ``batch.accumulation_steps`` with
  ``accumulation_reduce="sum"`` (Horovod sums; DeepSpeed averages).
- learning rate scaled by ``hvd.size()`` -> a note and ``extras["lr_scaling"]``.

Example:
    >>> r = translate_horovod("horovodrun -np 8 --fusion-threshold-mb 32 python train.py")
    >>> r.extras["world_size"], round(r.plan.communication.bucket_mb, 3)
    (8, 33.554)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.plan.spec import (
    AxisCompression,
    BatchSpec,
    CommunicationSpec,
    CompressorSpec,
    ParallelPlan,
)
from torsh_jax.translate.hvd_launch import ENV_ASSIGN, LaunchCommand, LaunchFlag, find_launches, logical_lines
from torsh_jax.translate.hvd_layout import Layout, apply_env, apply_flag, layout_mesh
from torsh_jax.translate.hvd_optimizer import find_lr_scaling, note_api_uses, read_optimizer_calls
from torsh_jax.translate.hvd_pyexpr import PyScript, strip_comment_lines
from torsh_jax.translate.hvd_tables import (
    HOROVOD_DEFAULT_FUSION_BYTES,
    HOROVODRUN_FLAGS,
    MPIRUN_FLAGS,
    lookup_flag,
)
from torsh_jax.translate.messages import short_errors
from torsh_jax.translate.overrides import PLAN_SECTIONS, NoteBook, apply_plan_overrides, plain
from torsh_jax.translate.result import TranslationResult
from torsh_jax.translate.world_size import check_world_size

__all__ = ["translate_horovod", "looks_like_horovod"]

_SHELL_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=[^,()]*$")
_MARKERS = ("horovodrun", "hvd.", "HOROVOD_", "import horovod", "horovod.")


def looks_like_horovod(text: str) -> bool:
    """True when ``text`` mentions a Horovod launcher, variable or API."""
    return any(marker in text for marker in _MARKERS) or "mpirun" in text


def _read(source: str | Path) -> tuple[str, str]:
    if isinstance(source, Path):
        try:
            return source.read_text(errors="replace"), str(source)
        except OSError as err:
            raise TranslationError(
                f"cannot read file: {err.strerror}", key=str(source), fix="pass the path of a readable file"
            ) from None
    if not isinstance(source, str):
        raise TranslationError(
            f"expected text or a path, got {type(source).__name__}",
            key="source",
            fix="pass the script or launch line as text, or a path",
        )
    return source, "<text>"


def _split_overrides(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {
        "args": {},
        "env": {},
        "opt": {},
        "flags": {},
        "plan": {},
        "launch": {},
    }
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if key == "launch":
            groups["launch"][key] = value
        elif head in ("args", "env") and rest:
            groups[head][rest] = value
        elif head == "DistributedOptimizer" and rest:
            groups["opt"][rest] = value
        elif head in ("horovodrun", "mpirun") and rest.startswith("-"):
            groups["flags"][rest] = value
        elif head in PLAN_SECTIONS:
            groups["plan"][key] = value
        else:
            raise TranslationError(
                "unknown override",
                key=key,
                fix="use args.NAME, env.NAME, DistributedOptimizer.ARG, horovodrun.-FLAG, launch "
                "or a plan path",
            )
    return groups


def _select_launch(commands: list[LaunchCommand], chosen: dict[str, Any]) -> int:
    if "launch" not in chosen:
        return 0
    index = chosen["launch"]
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < max(1, len(commands)):
        raise TranslationError(
            f"no launch command {index!r}; the file has {len(commands)}",
            key="launch",
            fix=f"use an index in 0..{max(0, len(commands) - 1)}",
        )
    return index


def _note_command(command: LaunchCommand, prefix: str, env_prefix: str, selected: bool, layout, book) -> None:
    if selected:
        layout.launcher = command.launcher
    for name, value in command.env:
        key = f"{env_prefix}{name}"
        if selected:
            apply_env(name, value, key, layout, book)
        else:
            book.ignored(key, value, "belongs to another launch command; select it with --set launch=N")
    for flag in command.flags:
        key = f"{prefix}.{flag.written}"
        if flag.role == "mca":
            key = f"{prefix}.{flag.written}.{flag.values[0]}"
        values = flag.values[0] if len(flag.values) == 1 else list(flag.values) or True
        if selected:
            apply_flag(flag, key, values, layout, book)
        else:
            book.ignored(key, values, "belongs to another launch command; select it with --set launch=N")
    _note_script(command, prefix, book)


def _note_script(command: LaunchCommand, prefix: str, book: NoteBook) -> None:
    if command.program and command.script != command.program:
        book.ignored(f"{prefix}.program", command.program, "the interpreter started on every worker")
    if command.script:
        book.ignored(
            f"{prefix}.script", command.script, "the training script itself; run its JAX version instead"
        )
    for option, value in command.script_args:
        detail = "option of the training script, passed through unchanged; not a parallel setting"
        book.ignored(f"{prefix}.script.{option}", value if value is not None else True, detail)


def _note_launches(text: str, flag_overrides: dict, chosen: dict, layout: Layout, book: NoteBook) -> None:
    commands = find_launches(text)
    selected = _select_launch(commands, chosen)
    if chosen:
        book.mapped("launch", chosen["launch"], f"launch command {selected} sets the plan")
    for index, command in enumerate(commands):
        many = len(commands) > 1
        prefix = f"{command.launcher}[{index}]" if many else command.launcher
        env_prefix = f"{prefix}.env." if many else "env."
        _note_command(command, prefix, env_prefix, index == selected, layout, book)
    _note_flag_overrides(
        commands[selected].launcher if commands else "horovodrun", flag_overrides, layout, book
    )


def _note_flag_overrides(launcher: str, flag_overrides: dict, layout: Layout, book: NoteBook) -> None:
    table = HOROVODRUN_FLAGS if launcher == "horovodrun" else MPIRUN_FLAGS
    for written, value in flag_overrides.items():
        key = f"{launcher}.{written}"
        found = lookup_flag(table, written)
        if found is None:
            raise TranslationError(
                f"unknown {launcher} option {written!r}", key=key, fix="check the spelling"
            )
        flag, nargs, role = found
        if nargs == 0 and value is False:
            book.ignored(key, value, "flag switched off by --set")
            continue
        values = tuple(str(v) for v in value) if isinstance(value, list) else (str(value),)
        if len(values) < nargs or role == "env":
            raise TranslationError(
                f"option {written} needs {nargs} value(s), got {value!r}",
                key=key,
                fix="give the value(s); set variables with env.NAME",
            )
        apply_flag(LaunchFlag(written, flag, role, values[:nargs] if nargs else ()), key, value, layout, book)


def _note_standalone_env(text: str, layout: Layout, book: NoteBook) -> None:
    """``export HOROVOD_X=1`` / ``HOROVOD_X=1`` lines and ``os.environ["X"] = ...``."""
    environ = re.compile(r"os\.environ\[\s*['\"](\w+)['\"]\s*\]\s*=\s*['\"]?([^'\"\s]*)")
    for _, line in logical_lines(text):
        tokens = line.split()
        if tokens and tokens[0] == "export":
            tokens = tokens[1:]
        if tokens and all(_SHELL_ASSIGN.match(t) for t in tokens):
            for token in tokens:
                name, value = ENV_ASSIGN.match(token).groups()
                apply_env(name, value.strip("'\""), f"env.{name}", layout, book)
        for name, value in environ.findall(line):
            apply_env(name, value, f"env.{name}", layout, book)


def _note_argparse(script: PyScript, book: NoteBook) -> None:
    for dest, info in script.argparse.items():
        default = plain(info["default"])
        book.ignored(
            f"argparse.{info['flag']}",
            default,
            f"option of the training script (default {default!r}); resolves args.{dest} in the excerpt",
        )


def _build_plan(layout: Layout, settings, name: str) -> ParallelPlan:
    compression = ()
    if settings.compression == "fp16":
        fp16 = CompressorSpec(method="fp16", error_feedback=False)
        compression = (AxisCompression(axis="data", gradients=fp16),)
    bucket_bytes = layout.fusion_bytes if layout.fusion_bytes is not None else HOROVOD_DEFAULT_FUSION_BYTES
    return ParallelPlan(
        name=name,
        description="translated from Horovod settings",
        mesh=layout_mesh(layout),
        batch=BatchSpec(
            accumulation_steps=settings.accumulation_steps, accumulation_reduce=settings.accumulation_reduce
        ),
        communication=CommunicationSpec(
            bucket_mb=bucket_bytes / 1e6,
            reduce_op=settings.reduce_op,
            gradient_predivide_factor=settings.gradient_predivide_factor,
        ),
        compression=compression,
        optimizer=settings.optimizer,
    )


@short_errors
def translate_horovod(
    source: str | Path,
    /,
    *,
    world_size: int | None = None,
    overrides: dict[str, Any] | None = None,
    lenient: bool = False,
) -> TranslationResult:
    """Translate Horovod settings (launch lines, variables, script excerpts) into a plan.

    Args:
        source: a file path, or the text itself.
        world_size: number of processes (``--world-size``), for a launch line
            without ``-np`` or with ``-np $NP``; it must agree with a
            literal ``-np``.
        overrides: ``args.NAME`` (script option values), ``env.NAME``,
            ``DistributedOptimizer.ARG``, ``horovodrun.-FLAG``, ``launch``
            (which launch command of several) or plan paths
            (``batch.micro_batch_size``).
        lenient: note unsupported settings instead of raising.

    Returns:
        A :class:`TranslationResult` of kind ``horovod``.

    Raises:
        TranslationError: an unsupported or malformed setting, or a
            ``world_size`` that differs from ``-np``; the key names it.

    Example:
        >>> r = translate_horovod("opt = hvd.DistributedOptimizer(o, backward_passes_per_step=2)")
        >>> r.plan.batch.accumulation_steps, r.plan.batch.accumulation_reduce
        (2, 'sum')
    """
    text, label = _read(source)
    groups = _split_overrides(dict(overrides or {}))
    book = NoteBook(lenient=lenient)
    layout = Layout()
    code = strip_comment_lines(text)
    _note_launches(code, groups["flags"], groups["launch"], layout, book)
    _note_standalone_env(code, layout, book)
    for name, value in groups["env"].items():
        apply_env(name, None if value is None else str(value), f"env.{name}", layout, book)
    known_world = world_size or layout.world_size or layout.total_slots()
    sizes = {"hvd.size": known_world, "hvd.local_size": layout.uniform_slots()}
    script = PyScript(code, arg_values=groups["args"], known_calls={k: v for k, v in sizes.items() if v})
    base = PyScript(code, arg_values=groups["args"], known_calls={"hvd.size": 1, "hvd.local_size": 1})
    _note_argparse(script, book)
    settings = read_optimizer_calls(script, book, overrides=groups["opt"], base=base)
    note_api_uses(script, book, has_optimizer_call=settings.found)
    extras = _extras(script, layout, world_size, book)
    if not book.notes():
        raise TranslationError(
            "no Horovod launch line (horovodrun / mpirun) or Horovod API use (hvd.init, "
            "hvd.DistributedOptimizer, HOROVOD_* variables) found",
            key=label,
            fix="pass a launch command such as 'horovodrun -np 4 python train.py' or the training "
            "script that calls hvd.*",
        )
    for key, value in groups["args"].items():
        book.mapped(f"args.{key}", value, "resolves the script option in the excerpt")
    layout.world_size = extras["world_size"]
    name = Path(label).stem if label != "<text>" else "horovod"
    plan = apply_plan_overrides(_build_plan(layout, settings, name), groups["plan"])
    for key, value in groups["plan"].items():
        book.mapped(key, value, f"{key} set by --set")
    layout.finish(book)
    return TranslationResult(plan=plan, notes=book.notes(), source=label, kind="horovod", extras=extras)


def _check_world_size(world_size: int | None, layout: Layout) -> None:
    """``world_size`` (``--world-size``) is a positive integer that agrees with the launch's ``-np``."""
    check_world_size(world_size)
    launched = layout.world_size
    if world_size is not None and launched is not None and world_size != launched:
        flag = layout.world_size_key.partition(".")[2]
        raise TranslationError(
            f"the launch line starts {launched} processes ({flag} {launched}), "
            f"--world-size says {world_size}",
            key=layout.world_size_key,
            fix=f"drop --world-size (the launch line sets it), or make {flag} and --world-size agree",
        )


def _check_slots(world_size: int | None, layout: Layout) -> None:
    """The processes fit the hosts' slots (``-H host:slots``): horovodrun refuses more processes than
    slots ("Requested more processes than there are available slots", horovod's host assignment),
    and mpirun without ``-np`` starts one process per slot, which ``--world-size`` must agree with."""
    slots, launched = layout.total_slots(), layout.world_size
    if slots is None:
        return
    if layout.launcher == "horovodrun" and launched is not None and launched > slots:
        flag = layout.world_size_key.partition(".")[2]
        raise TranslationError(
            f"the launch line starts {launched} processes on {slots} slots (-H); horovodrun refuses more "
            "processes than slots",
            key=layout.world_size_key,
            fix=f"give the hosts {launched} slots (-H host:slots), or lower {flag}",
        )
    if layout.launcher == "mpirun" and launched is None and world_size is not None and world_size != slots:
        raise TranslationError(
            f"mpirun without -np starts one process per slot, {slots} (-H), --world-size says {world_size}",
            key="mpirun.-H",
            fix="drop --world-size, or make the slots and --world-size agree",
        )


def _extras(script: PyScript, layout: Layout, world_size: int | None, book: NoteBook) -> dict[str, Any]:
    _check_world_size(world_size, layout)
    _check_slots(world_size, layout)
    extras: dict[str, Any] = {"world_size": world_size or layout.world_size or layout.total_slots()}
    extras.update(layout.extras())
    lr_lines = find_lr_scaling(script)
    if lr_lines:
        book.ignored(
            "lr_scaling",
            lr_lines,
            "the training script multiplies its learning rate by the world size; keep that in the JAX script "
            "or put the scaled value in optimizer.learning_rate",
        )
        by = "local_size" if all("local_size" in line for line in lr_lines) else "world_size"
        extras["lr_scaling"] = {"by": by, "lines": lr_lines, "world_size": extras["world_size"]}
    return extras
