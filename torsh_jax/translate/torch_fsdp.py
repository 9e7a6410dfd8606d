"""Translate PyTorch FSDP arguments (FSDP1 ``FullyShardedDataParallel`` or FSDP2 ``fully_shard``).

Input forms: a JSON object ``{"fsdp": {...kwargs...}}`` /
``{"fully_shard": {...}}``, or a Python excerpt with the call itself,
``FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.FULL_SHARD, ...)``.
Every argument (and every field of a nested policy) becomes a note.

Sources: torch/distributed/fsdp/fully_sharded_data_parallel.py (FSDP1
signature order), torch/distributed/fsdp/api.py (``ShardingStrategy``
values 1-5, ``MixedPrecision``: ``reduce_dtype`` defaults to
``param_dtype``; ``CPUOffload``; ``BackwardPrefetch``) and
torch/distributed/fsdp/_fully_shard/_fully_shard.py (``fully_shard``
keyword arguments, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``).

Mapping: FULL_SHARD -> ZeRO-3 over ``fsdp``; SHARD_GRAD_OP -> ZeRO-2;
NO_SHARD -> ``data`` only; HYBRID_SHARD -> ZeRO-3 with ``fsdp`` inside a node
and ``data`` across nodes (node size from ``devices_per_node``);
_HYBRID_SHARD_ZERO2 -> the same with ZeRO-2; mixed precision -> compute and
reduction dtypes (master weights stay float32); CPU offload -> parameter and
optimizer offload; ``reshard_after_forward`` -> ``zero.reshard_after_forward``.

Example:
    >>> r = translate_torch_fsdp({"fsdp": {"sharding_strategy": "SHARD_GRAD_OP",
    ...                                    "mixed_precision": {"param_dtype": "bfloat16"}}})
    >>> r.plan.zero.stage, r.plan.mesh.fsdp.ici, r.plan.precision.compute_dtype
    (2, -1, 'bfloat16')
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.plan.spec import AxisSize, MeshSpec, ParallelPlan, PrecisionSpec, ZeroSpec
from torsh_jax.translate.hvd_overrides import PLAN_SECTIONS, NoteBook, apply_plan_overrides, as_bool, as_int
from torsh_jax.translate.hvd_pyexpr import CallValue, PyScript, Symbol, Unknown
from torsh_jax.translate.result import TranslationResult

__all__ = ["translate_torch_fsdp", "looks_like_fsdp", "calls_from_dict", "calls_from_python", "FsdpCall"]

FSDP1_ORDER = (
    "module",
    "process_group",
    "sharding_strategy",
    "cpu_offload",
    "auto_wrap_policy",
    "backward_prefetch",
    "mixed_precision",
    "ignored_modules",
    "param_init_fn",
    "device_id",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "ignored_states",
    "device_mesh",
)
FSDP2_ORDER = ("module",)
_POLICY_ORDER = {
    "MixedPrecision": (
        "param_dtype",
        "reduce_dtype",
        "buffer_dtype",
        "keep_low_precision_grads",
        "cast_forward_inputs",
        "cast_root_forward_inputs",
        "_module_classes_to_ignore",
    ),
    "MixedPrecisionPolicy": ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"),
    "CPUOffload": ("offload_params",),
    "CPUOffloadPolicy": ("pin_memory",),
    "OffloadPolicy": (),
}
_CALL_NAMES = {"FullyShardedDataParallel": "fsdp", "FSDP": "fsdp", "fully_shard": "fully_shard"}
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


@dataclass
class FsdpCall:
    """One FSDP wrapping: which API, the note key prefix, and its arguments."""

    api: str
    prefix: str
    arguments: dict[str, Any] = field(default_factory=dict)


def dtype_name(value: Any, key: str) -> str | None:
    """``torch.bfloat16`` / ``"bf16"`` / None -> plan dtype name (None stays None).

    Raises:
        TranslationError: not a floating dtype the plan knows.
    """
    if value is None:
        return None
    text = value.rsplit(".", 1)[-1].lower() if isinstance(value, str) else None
    if text not in _DTYPES:
        raise TranslationError(
            f"unknown dtype {value!r}", key=key, fix="use torch.float32, torch.bfloat16 or torch.float16"
        )
    return _DTYPES[text]


def _to_plain(value: Any) -> Any:
    if isinstance(value, Symbol):
        return value.path
    if isinstance(value, CallValue):
        cls = value.func.rsplit(".", 1)[-1]
        order = _POLICY_ORDER.get(cls)
        if order is None:
            return Unknown(f"{value.func}(...)")
        out: dict[str, Any] = {"__class__": cls}
        for index, item in enumerate(value.args):
            out[order[index] if index < len(order) else f"arg{index}"] = _to_plain(item)
        out.update({k: _to_plain(v) for k, v in value.kwargs.items()})
        return out
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def calls_from_python(text: str) -> list[FsdpCall]:
    """Every ``FullyShardedDataParallel(...)`` / ``FSDP(...)`` / ``fully_shard(...)`` call in ``text``."""
    script = PyScript(text)
    sites = script.calls(tuple(_CALL_NAMES))
    calls = []
    for index, site in enumerate(sites):
        api = _CALL_NAMES[site.name]
        prefix = api if len(sites) == 1 else f"{api}[{index}]"
        order = FSDP1_ORDER if api == "fsdp" else FSDP2_ORDER
        arguments: dict[str, Any] = {}
        for position, node in enumerate(site.node.args):
            name = order[position] if position < len(order) else f"arg{position}"
            arguments[name] = _to_plain(script.evaluate(node, before=site.line).value)
        for keyword in site.node.keywords:
            name = keyword.arg or "**kwargs"
            arguments[name] = _to_plain(script.evaluate(keyword.value, before=site.line).value)
        calls.append(FsdpCall(api, prefix, arguments))
    return calls


def calls_from_dict(data: Any) -> list[FsdpCall]:
    """``{"fsdp": {...}}`` or ``{"fully_shard": {...}}`` -> one call.

    Raises:
        TranslationError: another top-level key, or a section that is not a table.
    """
    if not isinstance(data, dict):
        raise TranslationError(f"must be a JSON object, got {type(data).__name__}", key="<root>")
    calls = []
    for key, section in data.items():
        if key not in ("fsdp", "fully_shard"):
            raise TranslationError(
                f"unknown top-level key {key!r}",
                key=str(key),
                fix='use {"fsdp": {...}} or {"fully_shard": {...}}',
            )
        if not isinstance(section, dict):
            raise TranslationError(f"must be a table of keyword arguments, got {section!r}", key=key)
        calls.append(FsdpCall(key, key, dict(section)))
    if not calls:
        raise TranslationError(
            "no FSDP section", key="<root>", fix='write {"fsdp": {"sharding_strategy": ...}}'
        )
    return calls


def looks_like_fsdp(text: str) -> bool:
    """True when ``text`` calls FSDP1 or FSDP2."""
    return any(f"{name}(" in text for name in _CALL_NAMES)


_STRATEGIES = {
    1: "FULL_SHARD",
    2: "SHARD_GRAD_OP",
    3: "NO_SHARD",
    4: "HYBRID_SHARD",
    5: "_HYBRID_SHARD_ZERO2",
}
_STAGE = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2}
_IGNORED = {
    "module": "the wrapped model is defined by the training script",
    "param_init_fn": "initialisation belongs to the model code",
    "device_id": "device placement comes from the mesh",
    "sync_module_states": "one SPMD program starts every replica from the same state",
    "limit_all_gathers": "rate-limits the CUDA caching allocator; XLA plans memory ahead of time",
    "use_orig_params": "parameter views for torch optimizers; plans shard each parameter on its own",
    "cast_forward_inputs": "the model casts its inputs to the compute dtype",
    "cast_root_forward_inputs": "the model casts its inputs to the compute dtype",
    "_module_classes_to_ignore": "module classes kept in full precision (batch norm); models here have none",
    "buffer_dtype": "buffers (non-trained state) keep their own dtype; plans hold trained parameters only",
    "output_dtype": "the model casts its outputs",
    "pin_memory": "host memory pinning is a transfer detail",
}


_STRUCTURAL = (
    "ignored_modules",
    "ignored_states",
    "ignored_params",
    "process_group",
    "device_mesh",
    "mesh",
    "auto_wrap_policy",
    "shard_placement_fn",
)


@dataclass
class _Settings:
    """Plan fields collected from the calls; a second, different value is a conflict."""

    values: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def set(self, name: str, value: Any, key: str) -> None:
        if name in self.values and self.values[name][0] != value:
            first_value, first_key = self.values[name]
            raise TranslationError(
                f"conflicts with {first_key} = {first_value!r} (both set {name})",
                key=key,
                fix="use the same setting for every FSDP call",
            )
        self.values.setdefault(name, (value, key))

    def get(self, name: str, default: Any = None) -> Any:
        return self.values[name][0] if name in self.values else default


def _strategy_name(value: Any, key: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value in _STRATEGIES:
        return _STRATEGIES[value]
    name = value.rsplit(".", 1)[-1].upper() if isinstance(value, str) else None
    if name not in _STAGE:
        raise TranslationError(
            f"unknown sharding strategy {value!r}", key=key, fix=f"use one of {sorted(_STAGE)} (or 1-5)"
        )
    return name


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value is False


def _note_strategy(value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    name = _strategy_name(value, key)
    st.set("stage", _STAGE[name], key)
    st.set("strategy", name, key)
    if name == "SHARD_GRAD_OP":
        book.approximated(
            key,
            value,
            "zero.stage = 2 over fsdp: same math; FSDP also shards parameters between steps, "
            "ZeRO-2 keeps them whole (use zero.stage=3, zero.reshard_after_forward=false for that)",
        )
    elif name.startswith("_HYBRID") or name == "HYBRID_SHARD":
        book.mapped(key, value, f"zero.stage = {_STAGE[name]}, fsdp within a node x data across nodes")
    else:
        book.mapped(
            key, value, f"zero.stage = {_STAGE[name]}" + (", data-parallel only" if not _STAGE[name] else "")
        )


def _note_offload(value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    if isinstance(value, dict):
        cls = value.get("__class__", "CPUOffload")
        _note_fields(value, key, st, book, cls)
        if cls == "CPUOffloadPolicy":
            st.set("offload", True, key)
        return
    on = as_bool(value, key) if value is not None else False
    st.set("offload", on, key)
    book.mapped(key, value, "zero.offload_params = zero.offload_optimizer = " + str(on).lower())


def _note_fields(value: dict, key: str, st: _Settings, book: NoteBook, cls: str) -> None:
    if "__class__" in value:
        book.mapped(key, f"{cls}(...)", f"{cls}: its fields are noted one by one")
    for sub, item in value.items():
        if sub != "__class__":
            _note_policy_field(sub, item, f"{key}.{sub}", st, book, cls)


def _note_policy_field(name: str, value: Any, key: str, st: _Settings, book: NoteBook, cls: str) -> None:
    if isinstance(value, Unknown):
        book.approximated(key, value.source, "the excerpt does not show its value; FSDP's default assumed")
    elif name in _IGNORED:
        book.ignored(key, value, _IGNORED[name])
    elif name == "offload_params":
        on = as_bool(value, key)
        st.set("offload", on, key)
        book.mapped(key, value, f"zero.offload_params = zero.offload_optimizer = {str(on).lower()}")
    elif name in ("param_dtype", "reduce_dtype"):
        st.set(name, dtype_name(value, key), key)
        field_name = "compute_dtype" if name == "param_dtype" else "reduce_dtype"
        book.mapped(key, value, f"precision.{field_name} = {dtype_name(value, key) or 'float32'}")
    elif name == "keep_low_precision_grads":
        if as_bool(value, key):
            book.approximated(
                key, value, "gradients are reduced in reduce_dtype, then the update runs in float32"
            )
        else:
            book.mapped(key, value, "gradients are cast to float32 for the update (the default)")
    else:
        raise TranslationError(
            f"{cls} has no field {name!r}", key=key, fix=f"use {list(_POLICY_ORDER.get(cls, ()))}"
        )


def _note_precision(value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    if value is None:
        book.mapped(key, value, "full float32 precision (the default)")
        return
    if isinstance(value, str):
        dtype = dtype_name(value, key)
        st.set("param_dtype", dtype, key)
        st.set("reduce_dtype", dtype, key)
        book.mapped(key, value, f"precision.compute_dtype = precision.reduce_dtype = {dtype}")
        return
    if not isinstance(value, dict):
        raise TranslationError(f"must be a MixedPrecision table, got {value!r}", key=key)
    _note_fields(value, key, st, book, value.get("__class__", "MixedPrecision"))


def _note_prefetch(name: str, value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    if name == "forward_prefetch":
        if as_bool(value, key):
            st.set("prefetch", 1, key)
            book.approximated(key, value, "zero.prefetch_layers = 1: the next layer is gathered ahead")
        else:
            book.ignored(key, value, "off (the default)")
        return
    if value is None:
        st.set("prefetch", 0, key)
        book.mapped(key, value, "zero.prefetch_layers = 0")
        return
    mode = str(value).rsplit(".", 1)[-1].upper()
    if mode not in ("BACKWARD_PRE", "BACKWARD_POST"):
        raise TranslationError(
            f"unknown backward prefetch {value!r}", key=key, fix="use BACKWARD_PRE or BACKWARD_POST"
        )
    st.set("prefetch", 1, key)
    book.approximated(key, value, "zero.prefetch_layers = 1; XLA orders the gathers within the step")


def _note_argument(name: str, value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    if name in _IGNORED:
        book.ignored(key, value.source if isinstance(value, Unknown) else value, _IGNORED[name])
    elif name in _STRUCTURAL:
        _note_structural(name, value.source if isinstance(value, Unknown) else value, key, book)
    elif isinstance(value, Unknown):
        book.approximated(key, value.source, "the excerpt does not show its value; FSDP's default assumed")
    elif name == "sharding_strategy":
        _note_strategy(value, key, st, book)
    elif name in ("cpu_offload", "offload_policy"):
        _note_offload(value, key, st, book)
    elif name in ("mixed_precision", "mp_policy"):
        _note_precision(value, key, st, book)
    elif name in ("backward_prefetch", "forward_prefetch"):
        _note_prefetch(name, value, key, st, book)
    elif name == "reshard_after_forward":
        _note_reshard(value, key, st, book)
    elif name == "devices_per_node":
        st.set("devices_per_node", as_int(value, key, minimum=1), key)
        book.mapped(key, value, "node size for hybrid sharding: fsdp ici size")
    else:
        _note_structural(name, value, key, book)


def _note_reshard(value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    if isinstance(value, bool):
        st.set("reshard", value, key)
        book.mapped(key, value, f"zero.reshard_after_forward = {str(value).lower()}")
    else:
        as_int(value, key, minimum=1)
        st.set("reshard", True, key)
        book.approximated(
            key, value, "resharding to a smaller group is not modelled; reshard over all of fsdp"
        )


def _note_structural(name: str, value: Any, key: str, book: NoteBook) -> None:
    if name in ("ignored_modules", "ignored_states", "ignored_params"):
        if _is_empty(value):
            book.ignored(key, value, "nothing excluded")
        else:
            book.unsupported(key, value, "excluded parameters would stay unsharded and unreduced",
                             fix="shard every parameter")  # fmt: skip
    elif name in ("process_group", "device_mesh", "mesh"):
        if value is None:
            book.ignored(key, value, "the default group: every device")
        else:
            book.approximated(
                key, value, "process groups come from the plan's mesh axes (set mesh.* with --set)"
            )
    elif name in ("auto_wrap_policy", "shard_placement_fn"):
        what = "wrapping units" if name == "auto_wrap_policy" else "the sharded dim"
        book.approximated(
            key, value, f"{what}: stage 3 gathers one layer at a time, dims follow the logical rules"
        )
    else:
        raise TranslationError(f"not an FSDP argument: {name!r}", key=key, fix="check the spelling")


def _mesh(st: _Settings, world_size: int | None, book: NoteBook) -> MeshSpec:
    strategy = st.get("strategy", "FULL_SHARD")
    if strategy == "NO_SHARD":
        return MeshSpec()
    if strategy not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        return MeshSpec(data=AxisSize(), fsdp=AxisSize(ici=-1))
    node = st.get("devices_per_node")
    if node is None:
        book.approximated(
            "devices_per_node",
            None,
            "node size unknown: fsdp ici = -1 (a slice), data dcn = -1 (slices); "
            "pass --set fsdp.devices_per_node=N to pin it",
        )
        return MeshSpec(data=AxisSize(ici=1, dcn=-1), fsdp=AxisSize(ici=-1))
    nodes = -1
    if world_size:
        if world_size % node:
            raise TranslationError(
                f"world size {world_size} is not a multiple of {node}", key="devices_per_node"
            )
        nodes = world_size // node
    return MeshSpec(data=AxisSize(ici=1, dcn=nodes), fsdp=AxisSize(ici=node))


def _plan(st: _Settings, api: str, world_size: int | None, book: NoteBook, name: str) -> ParallelPlan:
    stage = st.get("stage", 3)
    compute = st.get("param_dtype") or "float32"
    reduce = st.get("reduce_dtype") or compute
    offload = bool(st.get("offload", False))
    zero = ZeroSpec(
        stage=stage,
        reshard_after_forward=st.get("reshard", True),
        offload_params=offload and stage == 3,
        offload_optimizer=offload,
        prefetch_layers=st.get("prefetch", 1),
    )
    return ParallelPlan(
        name=name,
        description=f"translated from PyTorch {'FSDP2 fully_shard' if api == 'fully_shard' else 'FSDP'}",
        mesh=_mesh(st, world_size, book),
        zero=zero,
        precision=PrecisionSpec(param_dtype="float32", compute_dtype=compute, reduce_dtype=reduce),
    )


def _load(source: str | Path | dict) -> tuple[list[FsdpCall], str]:
    if isinstance(source, dict):
        return calls_from_dict(source), "<dict>"
    if isinstance(source, Path):
        try:
            text = source.read_text(errors="replace")
        except OSError as err:
            raise TranslationError(f"cannot read file: {err.strerror}", key=str(source)) from None
        label = str(source)
    elif isinstance(source, str):
        text, label = source, "<text>"
    else:
        raise TranslationError(f"expected a dict, text or path, got {type(source).__name__}", key="source")
    if text.lstrip().startswith("{"):
        try:
            return calls_from_dict(json.loads(text)), label
        except (json.JSONDecodeError, RecursionError) as err:
            raise TranslationError(f"not valid JSON: {err}", key=label) from None
    calls = calls_from_python(text)
    if not calls:
        raise TranslationError("no FullyShardedDataParallel/FSDP/fully_shard call found", key=label)
    return calls, label


def _split_overrides(overrides: dict[str, Any], calls: list[FsdpCall]) -> dict[str, Any]:
    plan_overrides = {}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head in ("fsdp", "fully_shard") and rest:
            target = next((c for c in calls if c.api == head), calls[0])
            target.arguments[rest] = value
        elif head in PLAN_SECTIONS:
            plan_overrides[key] = value
        else:
            raise TranslationError(
                "unknown override", key=key, fix="use fsdp.ARG, fully_shard.ARG or a plan path"
            )
    return plan_overrides


def translate_torch_fsdp(
    source: str | Path | dict,
    /,
    *,
    world_size: int | None = None,
    overrides: dict[str, Any] | None = None,
    lenient: bool = False,
) -> TranslationResult:
    """Translate FSDP arguments into a plan.

    Args:
        source: ``{"fsdp": {...}}`` data, a path to a ``.json``/``.py`` file,
            or the text of one.
        world_size: number of devices (fixes the node count for hybrid sharding).
        overrides: ``fsdp.ARG`` / ``fully_shard.ARG`` (replace an argument,
            ``fsdp.devices_per_node`` included) or plan paths.
        lenient: note unsupported arguments instead of raising.

    Raises:
        TranslationError: an unknown or unsupported argument; the key names it.
    """
    calls, label = _load(source)
    plan_overrides = _split_overrides(dict(overrides or {}), calls)
    book, st = NoteBook(lenient=lenient), _Settings()
    for call in calls:
        for name, value in call.arguments.items():
            _note_argument(name, value, f"{call.prefix}.{name}", st, book)
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise TranslationError(f"must be an integer >= 1, got {world_size!r}", key="world_size")
    api = calls[0].api
    name = "torch_fsdp" if label.startswith("<") else Path(label).stem
    plan = apply_plan_overrides(_plan(st, api, world_size, book, name), plan_overrides)
    for key, value in plan_overrides.items():
        book.mapped(key, value, f"{key} set by --set")
    extras = {"world_size": world_size, "api": api, "devices_per_node": st.get("devices_per_node")}
    return TranslationResult(plan=plan, notes=book.notes(), source=label, kind="torch_fsdp", extras=extras)
