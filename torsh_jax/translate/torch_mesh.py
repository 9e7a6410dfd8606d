"""PyTorch device meshes next to FSDP: which dims FSDP shards over and which tensor parallelism splits.

A 2-D (or 3-D) job builds one ``DeviceMesh`` and hands slices of it to FSDP
and to ``parallelize_module``::

    mesh = init_device_mesh("cuda", (4, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])

The same as JSON: ``{"device_mesh": {"mesh_shape": [4, 2], "mesh_dim_names":
["dp", "tp"]}, "parallelize_module": {"device_mesh": "tp"}, "fully_shard":
{"mesh": "dp"}}`` (a mesh reference is a dim name or a list of them).

Sources: torch/distributed/device_mesh.py (``init_device_mesh(device_type,
mesh_shape, *, mesh_dim_names)``, slicing by dim names), torch/distributed/
tensor/parallel/api.py (``parallelize_module(module, device_mesh,
parallelize_plan)``), torch/distributed/fsdp/_fully_shard/_fully_shard.py (a
2-D mesh given to ``fully_shard`` is HSDP: replicate over dim 0, shard over dim 1).

Example:
    >>> found = meshes_from_python('m = init_device_mesh("cuda", (4, 2), mesh_dim_names=("dp", "tp"))\\n'
    ...                            'parallelize_module(model, m["tp"], {})')
    >>> found.mesh, found.tensor_dims
    (DeviceMesh(shape=(4, 2), names=('dp', 'tp')), ('tp',))
    >>> found.dims_of('m["dp"]')
    ('dp',)
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.translate.hvd_pyexpr import PyScript

__all__ = ["DeviceMesh", "MeshUse", "meshes_from_python", "mesh_from_dict"]


@dataclass(frozen=True)
class DeviceMesh:
    """A named device mesh: ``shape[i]`` devices along ``names[i]``."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def size(self, dims: tuple[str, ...]) -> int:
        return math.prod(self.shape[self.names.index(d)] for d in dims)


@dataclass
class MeshUse:
    """The job's mesh (``None``: not shown), the dims tensor parallelism uses, and named slices."""

    mesh: DeviceMesh | None = None
    tensor_dims: tuple[str, ...] = ()
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def dims_of(self, reference: Any) -> tuple[str, ...] | None:
        """Mesh dims a reference names (``mesh["dp"]``, an alias, a dim name or a list of them)."""
        if self.mesh is None or reference is None:
            return None
        if isinstance(reference, (list, tuple)) and all(isinstance(r, str) for r in reference):
            return self._known(tuple(reference), str(reference))
        if not isinstance(reference, str):
            return None
        if reference in self.mesh.names:
            return (reference,)
        if reference in self.aliases:
            return self.aliases[reference]
        try:
            node = ast.parse(reference.strip(), mode="eval").body
        except SyntaxError:
            return None
        return self._node_dims(node)

    def _node_dims(self, node: ast.expr) -> tuple[str, ...] | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            names = _string_items(node.slice)
            if names is not None and node.value.id in self.aliases:
                return self._known(names, ast.unparse(node))
        return None

    def _known(self, dims: tuple[str, ...], source: str) -> tuple[str, ...]:
        missing = [d for d in dims if d not in self.mesh.names]
        if missing:
            raise TranslationError(
                f"{source} names mesh dims {missing} that the mesh {self.mesh.names} does not have",
                key="device_mesh",
                fix=f"use dims of mesh_dim_names {list(self.mesh.names)}",
            )
        return dims


def _string_items(node: ast.expr) -> tuple[str, ...] | None:
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    if all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
        return tuple(i.value for i in items)
    return None


def _checked_mesh(shape: Any, names: Any, key: str) -> DeviceMesh:
    if not (isinstance(shape, (list, tuple)) and shape and all(_positive_int(s) for s in shape)):
        raise TranslationError(
            f"mesh_shape must be a list of positive integers, got {shape!r}",
            key=key,
            fix="give the mesh shape literally, e.g. (4, 2), or as a variable assigned a number",
        )
    if not (
        isinstance(names, (list, tuple))
        and len(names) == len(shape)
        and all(isinstance(n, str) for n in names)
    ):
        raise TranslationError(
            f"mesh_dim_names must name each of the {len(shape)} dims, got {names!r}",
            key=key,
            fix='pass mesh_dim_names=("dp", "tp") with one name per dim',
        )
    return DeviceMesh(tuple(int(s) for s in shape), tuple(names))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _mesh_call(script: PyScript, site) -> DeviceMesh:
    node = site.node
    shape_node = node.args[1] if len(node.args) > 1 else None
    names_node = node.args[2] if len(node.args) > 2 else None
    for keyword in node.keywords:
        if keyword.arg == "mesh_shape":
            shape_node = keyword.value
        elif keyword.arg == "mesh_dim_names":
            names_node = keyword.value
    value = lambda n: None if n is None else script.evaluate(n, before=site.line).value
    return _checked_mesh(value(shape_node), value(names_node), "init_device_mesh")


def _mesh_names(script: PyScript, site_line: int) -> list[str]:
    return [name for name, found in script.assignments.items() for line, _, _ in found if line == site_line]


def meshes_from_python(text: str) -> MeshUse:
    """The ``init_device_mesh`` of an excerpt, its named slices and the dims ``parallelize_module`` uses."""
    script = PyScript(text)
    sites = script.calls(("init_device_mesh",))
    if not sites:
        return MeshUse()
    if len(sites) > 1:
        raise TranslationError(
            f"{len(sites)} init_device_mesh calls; one job mesh is expected",
            key="init_device_mesh",
            fix="keep the one init_device_mesh call that builds the training mesh",
        )
    mesh = _mesh_call(script, sites[0])
    use = MeshUse(mesh=mesh, aliases=dict.fromkeys(_mesh_names(script, sites[0].line), mesh.names))
    for name, found in script.assignments.items():
        for _, expr, _ in found:
            dims = use._node_dims(expr) if isinstance(expr, ast.Subscript) else None
            if dims is not None:
                use.aliases[name] = dims
    use.tensor_dims = _tensor_dims(use, script)
    return use


def _tensor_dims(use: MeshUse, script: PyScript) -> tuple[str, ...]:
    dims: tuple[str, ...] = ()
    for site in script.calls(("parallelize_module",)):
        node = site.node
        ref = node.args[1] if len(node.args) > 1 else None
        ref = next((k.value for k in node.keywords if k.arg == "device_mesh"), ref)
        found = None if ref is None else use.dims_of(ast.unparse(ref))
        if found is None:
            raise TranslationError(
                "cannot tell which mesh dims parallelize_module uses",
                key="parallelize_module.device_mesh",
                fix='pass a slice of the init_device_mesh mesh, e.g. mesh["tp"]',
            )
        dims = tuple(dict.fromkeys(dims + found))
    return dims


def mesh_from_dict(data: dict) -> MeshUse:
    """``device_mesh`` and ``parallelize_module`` sections of a JSON input (both optional)."""
    section = data.get("device_mesh")
    if section is None:
        return MeshUse()
    if not isinstance(section, dict):
        raise TranslationError(
            f"must be a table, got {section!r}",
            key="device_mesh",
            fix='write {"mesh_shape": [4, 2], "mesh_dim_names": ["dp", "tp"]}',
        )
    mesh = _checked_mesh(section.get("mesh_shape"), section.get("mesh_dim_names"), "device_mesh")
    use = MeshUse(mesh=mesh)
    tp = data.get("parallelize_module")
    if tp is not None:
        ref = tp.get("device_mesh") if isinstance(tp, dict) else None
        dims = use.dims_of(ref)
        if dims is None:
            raise TranslationError(
                f"must name mesh dims, got {ref!r}",
                key="parallelize_module.device_mesh",
                fix=f"use a dim name (or a list of them) of {list(mesh.names)}",
            )
        use.tensor_dims = dims
    return use
