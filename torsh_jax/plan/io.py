"""Plans to and from plain dicts, TOML and JSON; presets by name or path.

The dict form is strict: unknown keys are errors naming their key path and
the keys that are allowed. An axis size may be written as a number (the
in-slice size) or as a table ``{ici = 4, dcn = 2}``. A compressor may be
written as a preset name from ``compression/`` (``gradients = "int8"``), and
``param_dims`` as a preset name from ``meshes/param_dims/`` (``param_dims = "hf_llama"``) or a
list mixing such names with ``[regex, [logical names]]`` entries.

Example:
    >>> from torsh_jax.plan.io import plan_from_dict, plan_to_dict
    >>> plan = plan_from_dict({"mesh": {"data": -1}, "zero": {"stage": 1}})
    >>> plan.zero.stage, plan.mesh.data.ici
    (1, -1)
    >>> plan_from_dict(plan_to_dict(plan)) == plan
    True
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w

from torsh_jax.errors import PlanError, PresetNotFoundError, TorshError
from torsh_jax.plan import presets
from torsh_jax.plan.spec import AxisSize, CompressorSpec, MeshSpec, ParallelPlan

__all__ = [
    "plan_from_dict",
    "plan_to_dict",
    "plan_from_toml",
    "plan_to_toml",
    "plan_from_json",
    "plan_to_json",
    "load_plan",
    "save_plan",
    "plan_text",
    "load_compressor",
    "load_param_dims",
]

#: The preset kind (folder) of ``param_dims`` presets.
PARAM_DIMS_PRESETS = "meshes/param_dims"


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Convert plain data ``value`` to type ``tp``, naming ``path`` on error."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        if value is None:
            return None
        errors = []
        for option in options:
            try:
                return _convert(option, value, path)
            except PlanError as err:
                errors.append(err)
        raise errors[-1]
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise PlanError(
                f"must be one of {list(typing.get_args(tp))}, got {value!r}",
                key=path,
                fix=f"use one of {list(typing.get_args(tp))}",
            )
        return value
    if origin is tuple:
        return _convert_tuple(tp, value, path)
    if origin is dict:
        return _convert_mapping(value, path)
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path)
    return _convert_scalar(tp, value, path)


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise PlanError(
            f"must be a number, got {value!r}", key=path, fix="write a number without quotes, not true/false"
        )
    if not isinstance(value, tp):
        raise PlanError(
            f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}",
            key=path,
            fix=f"write {_type_name(tp)}",
        )
    return value


def _convert_tuple(tp: Any, value: Any, path: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise PlanError(
            f"must be a list, got {type(value).__name__}", key=path, fix="write a list, e.g. [1, 2]"
        )
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(args[0], v, _join(path, i)) for i, v in enumerate(value))
    if len(args) != len(value):
        raise PlanError(
            f"must have {len(args)} items, got {len(value)}", key=path, fix=f"write exactly {len(args)} items"
        )
    return tuple(_convert(t, v, _join(path, i)) for i, (t, v) in enumerate(zip(args, value)))


def _convert_mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise PlanError(
            f"must be a table, got {type(value).__name__}", key=path, fix="write a table of key = value pairs"
        )
    for key, item in value.items():
        if not isinstance(item, (int, float, str, bool)):
            raise PlanError(
                f"must be a number, string or boolean, got {item!r}",
                key=_join(path, key),
                fix="write a number, quoted string or true/false",
            )
    return dict(value)


def _convert_dataclass(cls: Any, value: Any, path: str) -> Any:
    if cls is AxisSize:
        value = _axis_table(value, path)
    if cls is CompressorSpec and isinstance(value, str):
        return _compressor_preset(value, path)
    if not isinstance(value, dict):
        raise PlanError(
            f"must be a table, got {type(value).__name__} {value!r}",
            key=path or "plan",
            fix="write a table of key = value pairs",
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in value if k not in names]
    if unknown:
        raise PlanError(
            f"unknown key {unknown[0]!r}",
            key=_join(path, unknown[0]),
            fix=f"use one of {names}",
        )
    no_default = dataclasses.MISSING
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is no_default and f.default_factory is no_default and f.name not in value
    ]
    if required:
        raise PlanError(f"missing required key {required[0]!r}", key=_join(path, required[0]), fix="add it")
    kwargs = {k: _convert(hints[k], v, _join(path, k)) for k, v in value.items()}
    try:
        return cls(**kwargs)
    except PlanError as err:
        if path and err.key and not err.key.startswith(path.split(".")[0]):
            raise PlanError(err.message, key=_join(path, err.key), fix=err.fix) from None
        raise


def _axis_table(value: Any, path: str) -> dict:
    """An axis size as a table: ``8`` is ``{ici = 8}``; anything but an integer or a table is refused."""
    if isinstance(value, dict):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return {"ici": value}
    example = value.strip() if isinstance(value, str) and value.strip().lstrip("-").isdigit() else "8"
    raise PlanError(
        f"must be an integer or a table {{ici = N, dcn = M}}, got {type(value).__name__} {value!r}",
        key=path,
        fix=f"write {path.rsplit('.', 1)[-1]} = {example} (no quotes), or {{ici = {example}, dcn = 1}}",
    )


def _compressor_preset(name: str, path: str) -> CompressorSpec:
    try:
        return load_compressor(name)
    except PresetNotFoundError as err:
        raise PresetNotFoundError(err.message, key=path, fix=err.fix) from None


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_strip_none(v) for v in value]
    return value


def _expand_param_dims(value: Any) -> Any:
    """``param_dims`` with each preset name replaced by the preset's entries, in place."""
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list):
        return value
    out: list = []
    for i, entry in enumerate(entries):
        named = isinstance(entry, str)
        key = "param_dims" if isinstance(value, str) else f"param_dims[{i}]"
        out += [list(e) for e in load_param_dims(entry, key=key)] if named else [entry]
    return out


def plan_from_dict(data: dict, *, name: str | None = None) -> ParallelPlan:
    """Build a validated plan from plain data (parsed TOML or JSON)."""
    if "param_dims" in data:
        data = {**data, "param_dims": _expand_param_dims(data["param_dims"])}
    plan = _convert_dataclass(ParallelPlan, data, "")
    return plan.replace(name=name) if name and "name" not in data else plan


def _non_default(obj: Any, reference: Any) -> dict:
    """Fields of dataclass ``obj`` that differ from ``reference`` (same type), recursively."""
    out = {}
    for f in dataclasses.fields(obj):
        value, default = getattr(obj, f.name), getattr(reference, f.name)
        if value == default:
            continue
        if dataclasses.is_dataclass(value):
            # Loading fills missing fields from the class defaults, so diff against those;
            # a value equal to them is written in full rather than as an empty table.
            out[f.name] = _non_default(value, _blank(value)) or _strip_none(dataclasses.asdict(value))
        else:
            out[f.name] = _strip_none(_as_plain(value))
    return out


def _blank(value: Any) -> Any:
    """A default instance of ``value``'s type to diff against (itself if it has required fields)."""
    if isinstance(value, MeshSpec):  # data's default depends on the other axes
        return MeshSpec(data=dataclasses.replace(value, data=None).data)
    try:
        return type(value)()
    except TypeError:
        return dataclasses.replace(value, **{f.name: None for f in dataclasses.fields(value)})


def _as_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return [_as_plain(v) for v in value]
    return value


def plan_to_dict(plan: ParallelPlan, *, full: bool = False) -> dict:
    """Plain data for ``plan``: only fields that differ from the defaults
    (all fields with ``full=True``); no ``None`` values, tuples as lists."""
    if full:
        return _strip_none(dataclasses.asdict(plan))
    return _non_default(plan, ParallelPlan())


def _parse(text: str, *, fmt: str, source: str) -> dict:
    """Plain data from TOML or JSON text; :class:`PlanError` naming ``source`` when malformed."""
    loads, error = (
        (tomllib.loads, tomllib.TOMLDecodeError) if fmt == "toml" else (json.loads, json.JSONDecodeError)
    )
    try:
        return loads(text)
    except error as err:
        raise PlanError(
            f"not valid {fmt.upper()}: {err}",
            key=source,
            fix="correct the syntax at the line and column given",
        ) from None


def plan_from_toml(text: str, *, name: str | None = None, source: str = "<toml>") -> ParallelPlan:
    return plan_from_dict(_parse(text, fmt="toml", source=source), name=name)


def plan_to_toml(plan: ParallelPlan) -> str:
    return tomli_w.dumps(plan_to_dict(plan))


def plan_from_json(text: str, *, name: str | None = None, source: str = "<json>") -> ParallelPlan:
    return plan_from_dict(_parse(text, fmt="json", source=source), name=name)


def plan_to_json(plan: ParallelPlan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2)


def load_plan(name_or_path: str | Path, *, key: str = "plan") -> ParallelPlan:
    """Load a plan preset by name (``ddp``) or from a ``.toml``/``.json`` path.

    ``key`` names where the name came from in errors (``--plan`` on the
    command line).

    Raises:
        PresetNotFoundError: no such preset or file; the message lists presets.
        PlanError: the file is empty or not a valid plan; the message names
            the file and the key.
    """
    path = presets.find("meshes", str(name_or_path), key=key)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise PlanError(f"not UTF-8 text: {err}", key=str(path), fix="save the plan as UTF-8") from None
    if not text.strip():
        raise PlanError("the plan file is empty", key=str(path), fix="write a plan (see meshes/*.toml)")
    try:
        if path.suffix == ".json":
            return plan_from_json(text, name=path.stem, source=str(path))
        return plan_from_toml(text, name=path.stem, source=str(path))
    except TorshError as err:
        if err.key != str(path):  # field errors: say which file
            err.args = (f"{path}: {err}",)
        raise


def save_plan(plan: ParallelPlan, path: str | Path) -> Path:
    """Write ``plan`` as TOML (or JSON for a ``.json`` suffix)."""
    path = Path(path)
    path.write_text(plan_text(plan, path))
    return path


def plan_text(plan: ParallelPlan, path: str | Path) -> str:
    """``plan`` as the file ``path`` holds it: JSON for a ``.json`` suffix, TOML otherwise.

    Example:
        >>> plan = ParallelPlan(name="p")
        >>> plan_text(plan, "p.json").startswith("{"), plan_text(plan, "p.toml").splitlines()[0]
        (True, 'name = "p"')
    """
    return plan_to_json(plan) if Path(path).suffix == ".json" else plan_to_toml(plan)


def load_compressor(name_or_path: str | Path) -> CompressorSpec:
    """Load a compressor preset from ``compression/`` by name or path."""
    path = presets.find("compression", str(name_or_path))
    data = _parse(path.read_text(), fmt="toml", source=str(path))
    data.pop("description", None)
    return _convert_dataclass(CompressorSpec, data, path.stem)


def load_param_dims(name_or_path: str | Path, *, key: str = "param_dims") -> tuple:
    """The entries ``((regex, logical names), ...)`` of a ``param_dims`` preset
    (``meshes/param_dims/<name>.toml``) or file.

    Example:
        >>> entries = load_param_dims("hf_llama")
        >>> dict(entries)[r"(^|/)self_attn/(q_proj|k_proj|v_proj)/kernel$"]
        ('...', 'embed', 'heads')
    """
    path = presets.find(PARAM_DIMS_PRESETS, str(name_or_path), key=key)
    fmt = "json" if path.suffix == ".json" else "toml"
    data = _parse(path.read_text(encoding="utf-8"), fmt=fmt, source=str(path))
    entries = data.get("param_dims")
    if not isinstance(entries, list) or not entries:
        raise PlanError(
            "a param_dims preset holds a non-empty list param_dims = [[regex, [logical names]], ...]",
            key=str(path),
            fix="write the entries under param_dims",
        )
    return _convert(typing.get_type_hints(ParallelPlan)["param_dims"], entries, f"{path.stem}.param_dims")
