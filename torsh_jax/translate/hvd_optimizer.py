"""Horovod ``DistributedOptimizer`` arguments and ``hvd.*`` API uses -> plan settings.

Sources: horovod/torch/optimizer.py (``DistributedOptimizer(optimizer,
named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
sparse_as_dense=False, process_set=global_process_set)``: accumulated
gradients are *summed* over the backward passes) and
horovod/tensorflow/__init__.py (``average_aggregated_gradients`` divides them
by ``backward_passes_per_step``).

Example:
    >>> from torsh_jax.translate.hvd_pyexpr import PyScript
    >>> from torsh_jax.translate.overrides import NoteBook
    >>> script = PyScript("opt = hvd.DistributedOptimizer(o, op=hvd.Sum, backward_passes_per_step=4)")
    >>> settings = read_optimizer_calls(script, NoteBook(), overrides={})
    >>> settings.reduce_op, settings.accumulation_steps, settings.accumulation_reduce
    ('sum', 4, 'sum')
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.plan.spec import OptimizerSpec
from torsh_jax.translate.hvd_pyexpr import Evaluated, PyScript, Symbol, Unknown, shown
from torsh_jax.translate.hvd_wrapped import wrapped_optimizer
from torsh_jax.translate.overrides import NoteBook, as_bool, as_float, as_int

__all__ = ["OptimizerSettings", "read_optimizer_calls", "note_api_uses", "find_lr_scaling"]

_TORCH_ORDER = (
    "optimizer",
    "named_parameters",
    "compression",
    "backward_passes_per_step",
    "op",
    "gradient_predivide_factor",
    "num_groups",
    "groups",
    "sparse_as_dense",
    "process_set",
)
_DEFAULTS: dict[str, Any] = {
    "compression": "none",
    "op": "Average",
    "backward_passes_per_step": 1,
    "gradient_predivide_factor": 1.0,
    "average_aggregated_gradients": False,
}
_IGNORED = {
    "named_parameters": "names the reductions; parameters are named by their pytree paths here",
    "num_groups": "groups reductions for fusion; communication.bucket_mb sets the fusion size",
    "groups": "groups reductions for fusion; communication.bucket_mb sets the fusion size",
    "sparse_as_dense": "JAX gradients are dense already",
    "device_dense": "device placement comes from the mesh",
    "device_sparse": "device placement comes from the mesh",
    "use_locking": "TensorFlow variable locking; JAX updates are functional",
    "name": "TensorFlow op name prefix",
    "scale_local_gradients": "applies to local (non-reduced) variables only, which plans do not have",
}


@dataclass
class OptimizerSettings:
    """What the ``DistributedOptimizer`` call asks for (Horovod defaults otherwise)."""

    found: bool = False
    compression: str = "none"
    reduce_op: str = "mean"
    accumulation_steps: int = 1
    accumulation_reduce: str = "sum"
    gradient_predivide_factor: float = 1.0
    optimizer: OptimizerSpec | None = None


def _name_of(value: Any) -> str | None:
    if isinstance(value, Symbol):
        return value.last
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1]
    if value is None:
        return "none"
    return None


def _arguments(call, script: PyScript) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for index, node in enumerate(call.node.args):
        name = _TORCH_ORDER[index] if index < len(_TORCH_ORDER) else f"arg{index}"
        values[name] = script.evaluate(node, before=call.line)
    for keyword in call.node.keywords:
        name = keyword.arg or "**kwargs"
        values[name] = script.evaluate(keyword.value, before=call.line)
    return values


def read_optimizer_calls(
    script: PyScript, book: NoteBook, *, overrides: dict[str, Any], base: PyScript | None = None
) -> OptimizerSettings:
    """Note every argument of every ``DistributedOptimizer(...)`` call; the first call sets the plan.

    ``base`` is the same text evaluated with ``hvd.size()`` = 1, for base learning rates.
    """
    settings = OptimizerSettings()
    calls = script.calls(("DistributedOptimizer",))
    for index, call in enumerate(calls):
        prefix = "DistributedOptimizer" if len(calls) == 1 else f"DistributedOptimizer[{index}]"
        arguments = _arguments(call, script)
        for name, value in overrides.items():
            arguments[name] = value
        if index:
            for name, evaluated in arguments.items():
                book.ignored(
                    f"{prefix}.{name}", _shown(evaluated), "only the first DistributedOptimizer call is used"
                )
            continue
        settings.found = True
        base_arguments = _arguments(call, base) if base is not None else {}
        _apply_arguments(arguments, prefix, settings, book, base_arguments)
    if not calls and overrides:
        settings.found = True
        _apply_arguments(dict(overrides), "DistributedOptimizer", settings, book, {})
    return settings


def _shown(evaluated: Any) -> Any:
    return shown(getattr(evaluated, "value", evaluated))


def _apply_arguments(
    arguments: dict[str, Any],
    prefix: str,
    settings: OptimizerSettings,
    book: NoteBook,
    base_arguments: dict[str, Any],
) -> None:
    order = ["op", *[k for k in arguments if k != "op"]] if "op" in arguments else list(arguments)
    for name in order:
        evaluated = arguments[name]
        key = f"{prefix}.{name}"
        value = getattr(evaluated, "value", evaluated)
        assumptions = getattr(evaluated, "assumptions", ())
        if name in _IGNORED:
            book.ignored(key, _shown(evaluated), _IGNORED[name])
            continue
        if name == "optimizer":
            actual = evaluated if isinstance(evaluated, Evaluated) else Evaluated(evaluated)
            settings.optimizer = wrapped_optimizer(actual, base_arguments.get(name), key, book)
            continue
        if name not in _DEFAULTS and name != "process_set":
            raise TranslationError(
                f"DistributedOptimizer has no argument {name!r}",
                key=key,
                fix=f"use one of {sorted([*_DEFAULTS, 'optimizer', 'process_set', *_IGNORED])}",
            )
        if isinstance(value, Unknown):
            default = _DEFAULTS.get(name, "global_process_set")
            why = f"depends on `{value.source}`, which the file does not set; "
            why += f"assumed Horovod's default {default!r}"
            book.approximated(key, value.source, f"{why}. Fix: pass --set {_fix_key(value.source, key)}=...")
            value, assumptions = default, ()
        _apply_one(name, key, value, assumptions, settings, book)


def _fix_key(source: str, key: str) -> str:
    return source if re.fullmatch(r"args\.\w+", source) else key


def _record(book: NoteBook, key: str, value: Any, detail: str, assumptions: tuple[str, ...]) -> None:
    if key in book and not assumptions:
        return
    if assumptions:
        book.approximated(key, value, f"{detail}; {'; '.join(assumptions)}")
    else:
        book.mapped(key, value, detail)


def _apply_one(
    name: str, key: str, value: Any, assumptions, settings: OptimizerSettings, book: NoteBook
) -> None:
    shown = _shown(value)
    if name == "compression":
        method = (_name_of(value) or "").lower()
        if method not in ("none", "fp16"):
            book.unsupported(
                key, shown, "only Compression.none and Compression.fp16 translate", fix="use one of them"
            )
            return
        settings.compression = method
        detail = (
            "compression[data].gradients = fp16 (no error feedback)" if method == "fp16" else "no compression"
        )
        _record(book, key, shown, detail, assumptions)
    elif name == "op":
        _apply_op(key, value, shown, assumptions, settings, book)
    elif name == "backward_passes_per_step":
        settings.accumulation_steps = as_int(value, key, minimum=1)
        detail = f"batch.accumulation_steps = {settings.accumulation_steps}, gradients summed over the passes"
        _record(book, key, shown, detail, assumptions)
    elif name == "average_aggregated_gradients":
        settings.accumulation_reduce = "mean" if as_bool(value, key) else "sum"
        _record(
            book, key, shown, f"batch.accumulation_reduce = {settings.accumulation_reduce!r}", assumptions
        )
    elif name == "gradient_predivide_factor":
        _apply_predivide(key, value, shown, assumptions, settings, book)
    else:
        _apply_process_set(key, value, shown, book)


def _apply_op(key, value, shown, assumptions, settings: OptimizerSettings, book: NoteBook) -> None:
    op = (_name_of(value) or "").lower()
    if op == "adasum":
        book.unsupported(
            key,
            shown,
            "Adasum combines gradients adaptively; plans reduce by mean or sum",
            fix="use op=hvd.Average",
        )
        return
    if op not in ("average", "sum"):
        book.unsupported(key, shown, "only op=Average or op=Sum translate", fix="use op=hvd.Average")
        return
    settings.reduce_op = "mean" if op == "average" else "sum"
    _record(book, key, shown, f"communication.reduce_op = {settings.reduce_op!r}", assumptions)


def _apply_predivide(key, value, shown, assumptions, settings: OptimizerSettings, book: NoteBook) -> None:
    factor = as_float(value, key)
    if factor <= 0:
        raise TranslationError(
            f"must be > 0, got {factor}", key=key, fix="use a positive gradient_predivide_factor, e.g. 1.0"
        )
    if factor != 1.0 and settings.reduce_op != "mean":
        raise TranslationError(
            "gradient_predivide_factor needs op=Average (Horovod rejects it otherwise)",
            key=key,
            fix="use op=hvd.Average or drop the factor",
        )
    settings.gradient_predivide_factor = factor
    _record(book, key, shown, f"communication.gradient_predivide_factor = {factor}", assumptions)


def _apply_process_set(key: str, value: Any, shown: Any, book: NoteBook) -> None:
    if _name_of(value) == "global_process_set":
        book.mapped(key, shown, "all processes, as the plan's data axes")
        return
    book.unsupported(
        key,
        shown,
        "a process subset reduces over part of the world; plans reduce over all data axes",
        fix="drop process_set",
    )


_SUBSETS = "process sets run collectives over subsets of the world; plans reduce over all data axes"
_API_UNSUPPORTED = {"ProcessSet": _SUBSETS, "add_process_set": _SUBSETS, "remove_process_set": _SUBSETS}
_API_IGNORED = [
    (r"^(init|shutdown)$", "process start-up; JAX's distributed initialisation plays this role"),
    (
        r"^(size|local_size|cross_size|rank|local_rank|cross_rank|is_initialized|\w+_built|mpi_threads_supported)$",
        "query of the process layout; jax.process_count()/process_index() answer it in JAX",
    ),
    (
        r"^broadcast_\w+$|\.Broadcast\w+$|^Broadcast\w+$",
        "one SPMD program starts every replica from the same state",
    ),
    (
        r"^(allreduce|allgather|broadcast|alltoall|reducescatter|grouped_\w+)(_async_?)?_?$",
        "a collective written in the training script (metrics, custom logic); "
        "the plan covers gradient reduction",
    ),
    (r"^elastic\.", "elastic membership is not modelled; the plan fixes the world size"),
    (r"^callbacks\.", "a Keras callback of the training script (learning-rate warm-up, metric averaging)"),
    (r"^global_process_set$", "the default process set: every process"),
]
_OPTIMIZER_PARTS = re.compile(r"^(DistributedOptimizer|Compression\.\w+|Compression|Adasum|Average|Sum)$")
_API_REF = re.compile(r"(?<![\w.])hvd\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def note_api_uses(script: PyScript, book: NoteBook, *, has_optimizer_call: bool) -> None:
    """Note each ``hvd.<name>`` the text uses (``hvd.init(process_sets=...)`` included)."""
    for name in dict.fromkeys(_API_REF.findall(script.text)):
        key = f"hvd.{name}"
        if name in _API_UNSUPPORTED:
            book.unsupported(key, name, _API_UNSUPPORTED[name], fix="use the global process set")
        elif _OPTIMIZER_PARTS.match(name):
            if has_optimizer_call:
                book.mapped(
                    key, name, "part of the DistributedOptimizer call; see the DistributedOptimizer.* notes"
                )
            else:
                book.ignored(key, name, "not passed to a DistributedOptimizer call in this file")
        else:
            reason = next((why for pattern, why in _API_IGNORED if re.search(pattern, name)), None)
            book.ignored(key, name, reason or "Horovod API used by the training script; no plan setting")
    for call in script.calls(("init",)):
        for keyword in call.node.keywords:
            if keyword.arg == "process_sets":
                book.unsupported(
                    "hvd.init.process_sets",
                    keyword.arg,
                    _API_UNSUPPORTED["ProcessSet"],
                    fix="drop process_sets",
                )


_LR_WORDS = re.compile(r"\b\w*lr\w*\b|learning_rate", re.IGNORECASE)


def find_lr_scaling(script: PyScript) -> list[str]:
    """Source lines that scale a learning rate by ``hvd.size()`` or ``hvd.local_size()``."""
    lines = []
    for line in script.text.splitlines():
        if re.search(r"hvd\.(local_)?size\(\)", line) and _LR_WORDS.search(line):
            lines.append(line.strip())
    return lines
