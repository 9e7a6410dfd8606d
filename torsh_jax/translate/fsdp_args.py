"""Reading PyTorch FSDP arguments: JSON sections or ``FullyShardedDataParallel``/``fully_shard`` calls.

Positional arguments get their names from the signatures in
torch/distributed/fsdp/fully_sharded_data_parallel.py (FSDP1) and
torch/distributed/fsdp/_fully_shard/_fully_shard.py (FSDP2); policy objects
(``MixedPrecision(...)``, ``CPUOffload(...)``) become tables with a
``__class__`` entry. ``ShardingStrategy`` values 1-5 and dtype spellings are
normalised here too (torch/distributed/fsdp/api.py).

Example:
    >>> [call] = calls_from_python("FSDP(model, sharding_strategy=ShardingStrategy.NO_SHARD)")
    >>> call.api, call.prefix, call.arguments["sharding_strategy"]
    ('fsdp', 'fsdp', 'ShardingStrategy.NO_SHARD')
    >>> strategy_name(2, "fsdp.sharding_strategy"), dtype_name("torch.bfloat16", "k")
    ('SHARD_GRAD_OP', 'bfloat16')
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.translate.hvd_pyexpr import CallValue, PyScript, Symbol, Unknown
from torsh_jax.translate.torch_mesh import MeshUse, mesh_from_dict, meshes_from_python

__all__ = [
    "FSDP1_ORDER",
    "FSDP2_ORDER",
    "POLICY_ORDER",
    "STAGE",
    "MESH_KEYS",
    "CALL_SECTIONS",
    "JSON_SECTIONS",
    "FsdpCall",
    "dtype_name",
    "strategy_name",
    "calls_from_python",
    "calls_from_dict",
    "looks_like_fsdp",
    "load_calls",
]

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
POLICY_ORDER = {
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
#: Top-level JSON keys of the job's device mesh (read by :mod:`torsh_jax.translate.torch_mesh`).
MESH_KEYS = ("device_mesh", "parallelize_module")
#: Top-level JSON keys holding an FSDP call's keyword arguments (FSDP1, FSDP2).
CALL_SECTIONS = ("fsdp", "fully_shard")
#: Every top-level key of FSDP JSON input.
JSON_SECTIONS = CALL_SECTIONS + MESH_KEYS
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
        order = POLICY_ORDER.get(cls)
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
        raise TranslationError(
            f"must be a JSON object, got {type(data).__name__}",
            key="<root>",
            fix='write {"fsdp": {...keyword arguments...}}',
        )
    calls = []
    for key, section in data.items():
        if key in MESH_KEYS:
            continue
        if key not in CALL_SECTIONS:
            raise TranslationError(
                f"unknown top-level key {key!r}",
                key=str(key),
                fix='use {"fsdp": {...}} or {"fully_shard": {...}}, with optional "device_mesh" and '
                '"parallelize_module" tables',
            )
        if not isinstance(section, dict):
            raise TranslationError(
                f"must be a table of keyword arguments, got {section!r}",
                key=key,
                fix="write the keyword arguments as a table",
            )
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
STAGE = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2}


def strategy_name(value: Any, key: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value in _STRATEGIES:
        return _STRATEGIES[value]
    name = value.rsplit(".", 1)[-1].upper() if isinstance(value, str) else None
    if name not in STAGE:
        raise TranslationError(
            f"unknown sharding strategy {value!r}", key=key, fix=f"use one of {sorted(STAGE)} (or 1-5)"
        )
    return name


def load_calls(source: str | Path | dict) -> tuple[list[FsdpCall], str, MeshUse]:
    """The FSDP calls of ``source``, its label and the device mesh it shows."""
    if isinstance(source, dict):
        return calls_from_dict(source), "<dict>", mesh_from_dict(source)
    if isinstance(source, Path):
        try:
            text = source.read_text(errors="replace")
        except OSError as err:
            raise TranslationError(
                f"cannot read file: {err.strerror}", key=str(source), fix="pass the path of a readable file"
            ) from None
        label = str(source)
    elif isinstance(source, str):
        text, label = source, "<text>"
    else:
        raise TranslationError(
            f"expected a dict, text or path, got {type(source).__name__}",
            key="source",
            fix="pass a dict, the source text, or a path",
        )
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
            return calls_from_dict(data), label, mesh_from_dict(data)
        except (json.JSONDecodeError, RecursionError) as err:
            raise TranslationError(
                f"not valid JSON: {err}",
                key=label,
                fix="correct the JSON syntax at the line and column given",
            ) from None
    calls = calls_from_python(text)
    if not calls:
        raise TranslationError(
            "no FullyShardedDataParallel/FSDP/fully_shard call found",
            key=label,
            fix='pass a Python file that calls FSDP(...) or fully_shard(...), or JSON {"fsdp": {...}}',
        )
    return calls, label, meshes_from_python(text)
