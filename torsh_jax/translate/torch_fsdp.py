"""Translate PyTorch FSDP arguments (FSDP1 ``FullyShardedDataParallel`` or FSDP2 ``fully_shard``).

Input forms: a JSON object ``{"fsdp": {...kwargs...}}`` /
``{"fully_shard": {...}}``, or a Python excerpt with the call itself,
``FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.FULL_SHARD, ...)``.
Every argument (and every field of a nested policy) becomes a note. The arguments are
read by :mod:`torsh_jax.translate.fsdp_args`.

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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.plan.spec import AxisSize, MeshSpec, ParallelPlan, PrecisionSpec, ZeroSpec
from torsh_jax.translate.fsdp_args import (
    POLICY_ORDER,
    STAGE,
    FsdpCall,
    calls_from_dict,
    calls_from_python,
    dtype_name,
    load_calls,
    looks_like_fsdp,
    strategy_name,
)
from torsh_jax.translate.hvd_pyexpr import Unknown
from torsh_jax.translate.messages import short_errors
from torsh_jax.translate.overrides import (
    MAX_PROCESSES,
    PLAN_SECTIONS,
    NoteBook,
    apply_plan_overrides,
    as_bool,
    as_int,
)
from torsh_jax.translate.result import TranslationResult
from torsh_jax.translate.torch_mesh import MeshUse
from torsh_jax.translate.world_size import check_world_size

__all__ = ["translate_torch_fsdp", "looks_like_fsdp", "calls_from_dict", "calls_from_python", "FsdpCall"]

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
    mesh_use: MeshUse = field(default_factory=MeshUse)

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


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value is False


def _note_strategy(value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    name = strategy_name(value, key)
    st.set("stage", STAGE[name], key)
    st.set("strategy", name, key)
    if name == "SHARD_GRAD_OP":
        book.approximated(
            key,
            value,
            "zero.stage = 2 over fsdp: same math; FSDP also shards parameters between steps, "
            "ZeRO-2 keeps them whole (use zero.stage=3, zero.reshard_after_forward=false for that)",
        )
    elif name.startswith("_HYBRID") or name == "HYBRID_SHARD":
        book.mapped(key, value, f"zero.stage = {STAGE[name]}, fsdp within a node x data across nodes")
    else:
        book.mapped(
            key, value, f"zero.stage = {STAGE[name]}" + (", data-parallel only" if not STAGE[name] else "")
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
            f"{cls} has no field {name!r}", key=key, fix=f"use {list(POLICY_ORDER.get(cls, ()))}"
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
        raise TranslationError(
            f"must be a MixedPrecision table, got {value!r}",
            key=key,
            fix="pass MixedPrecision(param_dtype=..., reduce_dtype=...) or a table of its fields",
        )
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
    book.approximated(key, value, "zero.prefetch_layers = 1: the next layer is gathered ahead (backward too)")


def _note_argument(name: str, value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    if name in _IGNORED:
        book.ignored(key, value.source if isinstance(value, Unknown) else value, _IGNORED[name])
    elif name in ("device_mesh", "mesh") and st.mesh_use.mesh is not None:
        _note_fsdp_mesh(value.source if isinstance(value, Unknown) else value, key, st, book)
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
        st.set("devices_per_node", as_int(value, key, minimum=1, maximum=MAX_PROCESSES), key)
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


def _note_fsdp_mesh(value: Any, key: str, st: _Settings, book: NoteBook) -> None:
    dims = st.mesh_use.dims_of(value)
    if dims is None:
        raise TranslationError(
            f"cannot tell which dims of the device mesh {st.mesh_use.mesh.names} {value!r} names",
            key=key,
            fix='pass a slice of the init_device_mesh mesh, e.g. mesh["dp"]',
        )
    if len(dims) > 2:
        raise TranslationError(
            f"FSDP over {len(dims)} mesh dims {list(dims)}: FSDP takes a 1-D mesh, or 2-D for HSDP",
            key=key,
            fix="flatten the data-parallel dims into one, or pass (replicate, shard) dims",
        )
    st.set("fsdp_dims", dims, key)
    book.mapped(key, value, f"FSDP over mesh dims {list(dims)}" + (" (HSDP)" if len(dims) == 2 else ""))


def _device_mesh(st: _Settings, book: NoteBook) -> MeshSpec:
    """Plan axes from a PyTorch device mesh: FSDP's dims -> data/fsdp, ``parallelize_module``'s -> tensor."""
    use = st.mesh_use
    mesh, tensor_dims = use.mesh, use.tensor_dims
    fsdp_dims = st.get("fsdp_dims")
    if fsdp_dims is None:
        fsdp_dims = tuple(d for d in mesh.names if d not in tensor_dims)
        book.approximated(
            "device_mesh", list(mesh.names), f"FSDP is given no mesh: it spans {list(fsdp_dims)}"
        )
    shared = [d for d in fsdp_dims if d in tensor_dims]
    if shared:
        raise TranslationError(
            f"mesh dims {shared} are used by both FSDP and parallelize_module",
            key="device_mesh",
            fix="give FSDP and tensor parallelism different dims of the mesh",
        )
    for dim in mesh.names:
        if dim not in fsdp_dims and dim not in tensor_dims:
            book.unsupported(
                f"device_mesh.{dim}",
                mesh.size((dim,)),
                "a mesh dim used by neither FSDP nor parallelize_module (pipeline or context "
                "parallelism) is not translated",
                fix=f"drop the {dim!r} dim from the mesh, or give it to FSDP",
            )
    tensor = mesh.size(tensor_dims) if tensor_dims else 1
    if st.get("strategy") == "NO_SHARD":
        data, fsdp = mesh.size(fsdp_dims), 1
    elif len(fsdp_dims) == 2:
        data, fsdp = mesh.size(fsdp_dims[:1]), mesh.size(fsdp_dims[1:])
    else:
        data, fsdp = 1, mesh.size(fsdp_dims)
    book.mapped(
        "device_mesh",
        {"mesh_shape": list(mesh.shape), "mesh_dim_names": list(mesh.names)},
        f"mesh.data = {data}, mesh.fsdp = {fsdp}, mesh.tensor = {tensor}",
    )
    if tensor_dims:
        book.mapped(
            "parallelize_module.device_mesh",
            list(tensor_dims),
            f"mesh.tensor = {tensor}; the plan's logical rules (heads, mlp, vocab) say what is split, "
            "in place of the parallelize_plan",
        )
    return MeshSpec(data=AxisSize(ici=data), fsdp=AxisSize(ici=fsdp), tensor=AxisSize(ici=tensor))


def _mesh(st: _Settings, world_size: int | None, book: NoteBook) -> MeshSpec:
    if st.mesh_use.mesh is not None:
        return _device_mesh(st, book)
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
                f"world size {world_size} is not a multiple of {node}",
                key="devices_per_node",
                fix=f"use a world size that is a multiple of {node} devices per node",
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


def _check_world_size(world_size: int | None, mesh_use: MeshUse) -> None:
    """``world_size`` (``--world-size``) is a positive integer that agrees with the device mesh's size."""
    check_world_size(world_size)
    mesh = mesh_use.mesh
    devices = mesh.size(mesh.names) if mesh is not None else None
    if world_size is not None and devices is not None and world_size != devices:
        raise TranslationError(
            f"the device mesh {mesh.shape} has {devices} devices, --world-size says {world_size}",
            key="device_mesh",
            fix="drop --world-size (the mesh sets it), or make the mesh shape and --world-size agree",
        )


@short_errors
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
        world_size: number of devices (fixes the node count for hybrid sharding);
            it must agree with a device mesh the input shows.
        overrides: ``fsdp.ARG`` / ``fully_shard.ARG`` (replace an argument,
            ``fsdp.devices_per_node`` included) or plan paths.
        lenient: note unsupported arguments instead of raising.

    Raises:
        TranslationError: an unknown or unsupported argument; the key names it.
    """
    calls, label, mesh_use = load_calls(source)
    plan_overrides = _split_overrides(dict(overrides or {}), calls)
    book, st = NoteBook(lenient=lenient), _Settings(mesh_use=mesh_use)
    for call in calls:
        for name, value in call.arguments.items():
            _note_argument(name, value, f"{call.prefix}.{name}", st, book)
    _check_world_size(world_size, mesh_use)
    api = calls[0].api
    name = "torch_fsdp" if label.startswith("<") else Path(label).stem
    plan = apply_plan_overrides(_plan(st, api, world_size, book, name), plan_overrides)
    for key, value in plan_overrides.items():
        book.mapped(key, value, f"{key} set by --set")
    extras = {"world_size": world_size, "api": api, "devices_per_node": st.get("devices_per_node")}
    return TranslationResult(plan=plan, notes=book.notes(), source=label, kind="torch_fsdp", extras=extras)
