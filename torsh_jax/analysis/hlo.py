"""Every collective of a compiled program, with its mesh axes and bytes per device.

Reads the optimized HLO text of a compiled executable
(``jax.jit(f).lower(...).compile().as_text()``; the same text as
``compiled.runtime_executable().hlo_modules()[0].to_string()``), so the
numbers are what the program really does after XLA's passes: combined,
widened or hoisted collectives included.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...                   in_specs=P("data"), out_specs=P(), check_vma=False)
    >>> compiled = jax.jit(f).lower(jnp.ones((mesh.size, 256))).compile()
    >>> [(c.kind, c.dtype, c.payload_bytes) for c in collectives(compiled, mesh)]
    [('all-reduce', 'f32', 1024)]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torsh_jax.analysis import _groups
from torsh_jax.analysis._calls import computation_executions
from torsh_jax.analysis._hlo_text import (
    ArrayShape,
    HloModuleText,
    Instruction,
    Shape,
    cached_module,
    element_bits,
    flat_arrays,
    shape_bytes,
)
from torsh_jax.analysis.theory import ring_wire_bytes
from torsh_jax.errors import MeshError

__all__ = ["Collective", "KINDS", "check_devices", "collectives", "collectives_from_text", "mesh_positions"]

#: Collective kinds reported (async ``-start`` forms map to these; ``-done`` is skipped).
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_ASYNC_STARTS = {f"{kind}-start": kind for kind in KINDS}


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program, per device.

    Attributes:
        kind: one of :data:`KINDS`; an async pair (``all-gather-start`` /
            ``all-gather-done``) is one collective of kind ``all-gather``.
        opcode: the HLO opcode as written (``all-gather-start`` for async).
        name: the HLO instruction name.
        dtype: element type(s) on the wire, HLO spelling (``f32``, ``bf16``,
            ``s8``); a combined collective of mixed types lists them joined
            by ``,`` in operand order (``f32,s8``).
        operand_shapes: operand types, e.g. ``("f32[16,4]",)``.
        result_shapes: result types (for async starts: the data result).
        operand_bytes: bytes of all operands on one device.
        result_bytes: bytes of all results on one device.
        replica_groups: groups of device ids as the HLO names them (for
            collective-permute: the connected components of its pairs); for
            jax programs the ids are positions in the mesh's device order.
        source_target_pairs: collective-permute pairs, else ``()``.
        group_size: devices per group (largest group).
        axes: mesh axes the groups run over, ``()`` for groups of one
            device, ``None`` when the groups match no set of mesh axes.
        computation: name of the HLO computation holding the instruction.
        in_loop: the instruction sits inside a while loop body (on at least
            one call path).
        trip_count: trip count of the innermost enclosing loop when known.
        executions: times it runs per program call (product of enclosing
            known trip counts; 1 outside loops or when unknown).
        op_name: jax's ``op_name`` metadata (e.g. ``jit(f)/shard_map/psum``).
        widened_from: the narrower float type the operands were converted
            from just before the collective (``bf16`` when the CPU backend
            runs a bf16 collective in f32; in a combined collective, the
            operands that were widened), else ``None``.
        unwidened_bytes: payload bytes with each widened operand counted in
            its own type (``None``: no operand was widened).
    """

    kind: str
    opcode: str
    name: str
    dtype: str
    operand_shapes: tuple[str, ...]
    result_shapes: tuple[str, ...]
    operand_bytes: int
    result_bytes: int
    replica_groups: tuple[tuple[int, ...], ...]
    source_target_pairs: tuple[tuple[int, int], ...]
    group_size: int
    axes: tuple[str, ...] | None
    computation: str
    in_loop: bool
    trip_count: int | None
    executions: int
    op_name: str = ""
    widened_from: str | None = None
    unwidened_bytes: int | None = None

    @property
    def unwidened_payload_bytes(self) -> int:
        """:attr:`payload_bytes` in :attr:`widened_from`'s width (the data's own size).

        Equal to :attr:`payload_bytes` unless the backend widened the data
        for the collective (the CPU backend runs bf16 collectives in f32).
        """
        if self.unwidened_bytes is not None:
            return self.unwidened_bytes
        if self.widened_from is None:
            return self.payload_bytes
        ratio = element_bits(self.widened_from) / element_bits(self.dtype)
        return int(self.payload_bytes * ratio)

    @property
    def payload_bytes(self) -> int:
        """Logical data size: operand bytes, except all-gather (result bytes)."""
        return self.result_bytes if self.kind == "all-gather" else self.operand_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution under ring-algorithm conventions.

        With ``n`` = group size: all-reduce ``2·S·(n−1)/n`` (S = operand
        bytes; a reduce-scatter then an all-gather), reduce-scatter
        ``S_in·(n−1)/n``, all-gather ``S_out·(n−1)/n``, all-to-all
        ``S·(n−1)/n`` (the block kept locally is not sent),
        collective-permute ``S`` (operand bytes).
        """
        return ring_wire_bytes(self.kind, self.payload_bytes, self.group_size)

    @property
    def payload_bytes_per_step(self) -> int:
        """:attr:`payload_bytes` times :attr:`executions`."""
        return self.payload_bytes * self.executions

    @property
    def wire_bytes_per_step(self) -> float:
        """:attr:`wire_bytes` times :attr:`executions`."""
        return self.wire_bytes * self.executions


def _kind(opcode: str) -> str | None:
    if opcode in KINDS:
        return opcode
    return _ASYNC_STARTS.get(opcode)


def _operand_shapes(module: HloModuleText, computation: str, ins: Instruction) -> list[Shape]:
    shapes = []
    for name, inline in zip(ins.operands, ins.operand_shapes, strict=True):
        producer = module.instruction(computation, name)
        shape = inline if inline is not None else (producer.shape if producer else None)
        if shape is not None:
            shapes.append(shape)
    return shapes


def _result_shape(kind: str, ins: Instruction) -> Shape:
    """The data result of ``ins`` (async starts of all-gather / permute return tuples)."""
    if ins.opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
        return ins.shape[1]
    return ins.shape


def _mode(kind: str, ins: Instruction) -> str:
    has_channel = ins.attr("channel_id") is not None
    if kind in ("all-to-all", "collective-permute"):
        return "cross_partition" if has_channel else "cross_replica"
    if ins.attr("use_global_device_ids") == "true":
        return "flattened_id"
    return "cross_replica_and_partition" if has_channel else "cross_replica"


def _groups_of(module: HloModuleText, kind: str, ins: Instruction):
    """(HLO replica groups, source-target pairs, flattened device groups)."""
    pairs: tuple[tuple[int, int], ...] = ()
    if kind == "collective-permute":
        pairs = _groups.parse_pairs(ins.attr("source_target_pairs"))
        groups = _groups.pair_components(pairs)
        if not groups:
            return (), pairs, ()
    else:
        groups = _groups.parse_replica_groups(ins.attr("replica_groups"))
    flat = _groups.device_groups(
        groups,
        mode=_mode(kind, ins),
        replica_count=module.replica_count,
        num_partitions=module.num_partitions,
    )
    return groups or flat, pairs, flat


#: Ops whose result elements are elements of their first operand: a widening convert behind them
#: still means the data is narrow (the bucket's transpose, reshape and concatenation into rows).
_VALUE_PRESERVING = ("bitcast", "copy", "transpose", "reshape", "slice", "dynamic-slice")
#: Instructions followed back from a collective's operand before giving up.
_MAX_HOPS = 16


def _narrow_source(module: HloModuleText, computation: str, name: str, callers: tuple = ()) -> str | None:
    """Float type the value ``name`` was widened from (a ``convert`` to more bits), looking
    through fusions, their parameters and value-preserving ops; ``None`` if not widened."""
    ins = module.instruction(computation, name)
    for _ in range(_MAX_HOPS):
        if ins is None:
            return None
        if ins.opcode == "fusion":
            callers, computation = (*callers, (computation, ins)), (ins.attr("calls") or "").lstrip("%")
            ins = module.root(computation)
        elif ins.opcode == "parameter" and callers and ins.operands and ins.operands[0].isdigit():
            (computation, fusion), callers = callers[-1], callers[:-1]
            operands = fusion.operands[int(ins.operands[0]) :][:1]
            ins = module.instruction(computation, operands[0]) if operands else None
        elif ins.opcode == "concatenate":
            sources = {_narrow_source(module, computation, op, callers) for op in ins.operands}
            return sources.pop() if len(sources) == 1 else None
        elif ins.opcode in _VALUE_PRESERVING and ins.operands:
            ins = module.instruction(computation, ins.operands[0])
        else:
            break
    return _widening(module, computation, ins)


def _widening(module: HloModuleText, computation: str, ins: Instruction | None) -> str | None:
    if ins is None or ins.opcode != "convert" or not isinstance(ins.shape, ArrayShape):
        return None
    source = _operand_shapes(module, computation, ins)
    if len(source) != 1 or not isinstance(source[0], ArrayShape):
        return None
    narrow, wide = element_bits(source[0].dtype), element_bits(ins.shape.dtype)
    is_float = source[0].dtype.startswith(("bf", "f"))
    return source[0].dtype if is_float and narrow and wide and narrow < wide else None


def _widened(module: HloModuleText, computation: str, ins: Instruction) -> tuple[str | None, ...]:
    """Per operand: the float type it was widened from just before the collective, or ``None``."""
    return tuple(_narrow_source(module, computation, name) for name in ins.operands)


def _unwidened_bytes(kind: str, operands: list[Shape], result: Shape, widened: tuple) -> int | None:
    """Payload bytes with each widened operand counted in its own (narrow) type; ``None``: none widened."""
    if not any(widened):
        return None
    payload = [result] if kind == "all-gather" else operands
    parts = [a for s in payload for a in flat_arrays(s)]
    if len(parts) != len(widened):
        return None
    return sum(
        shape_bytes(a) * element_bits(n) // element_bits(a.dtype) if n else shape_bytes(a)
        for a, n in zip(parts, widened, strict=True)
    )


def _op_name(ins: Instruction) -> str:
    match = re.search(r'op_name="([^"]*)"', ins.attrs)
    return match.group(1) if match else ""


def _dtype(shapes: list[Shape]) -> str:
    names: list[str] = []
    for array in (a for s in shapes for a in flat_arrays(s)):
        if array.dtype not in names:
            names.append(array.dtype)
    return ",".join(names)


def collectives_from_text(
    hlo_text: str,
    *,
    axis_sizes: dict[str, int] | None = None,
    positions: list[int] | None = None,
) -> list[Collective]:
    """Collectives of an HLO module given as text.

    Args:
        hlo_text: the text of one optimized HLO module.
        axis_sizes: mesh axis name -> size, in mesh order; ``None`` leaves
            :attr:`Collective.axes` as ``None``.
        positions: ``positions[device_id]`` = position in the flattened mesh,
            when the program's device order differs from the mesh's.

    Returns:
        Collectives in text order (computations as printed), async pairs once.

    Example:
        >>> text = '''HloModule m, num_partitions=4
        ... ENTRY %main (p: bf16[8]) -> bf16[32] {
        ...   %p = bf16[8]{0} parameter(0)
        ...   %s = (bf16[8]{0}, bf16[32]{0}) all-gather-start(%p), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
        ...   ROOT %d = bf16[32]{0} all-gather-done(%s)
        ... }'''
        >>> [c] = collectives_from_text(text, axis_sizes={"fsdp": 4})
        >>> c.kind, c.axes, c.payload_bytes, c.wire_bytes
        ('all-gather', ('fsdp',), 64, 48.0)
    """  # noqa: E501
    return _collect(cached_module(hlo_text), axis_sizes, positions)


def _collect(module: HloModuleText, axis_sizes, positions) -> list[Collective]:
    executions = computation_executions(module)
    found = []
    for computation, instructions in module.computations.items():
        run = executions.get(computation)
        if run is None:
            continue
        for ins in instructions:
            kind = _kind(ins.opcode)
            if kind is None:
                continue
            found.append(_collective(module, computation, ins, kind, run, axis_sizes, positions))
    return found


def _collective(module, computation, ins, kind, run, axis_sizes, positions) -> Collective:
    operands = _operand_shapes(module, computation, ins)
    result = _result_shape(kind, ins)
    widened = _widened(module, computation, ins)
    narrow = {n for n in widened if n}
    groups, pairs, flat = _groups_of(module, kind, ins)
    axes = None
    if axis_sizes is not None:
        mapped = [[positions[d] if positions else d for d in g] for g in flat]
        axes = _groups.axes_for_groups(mapped, axis_sizes)
    return Collective(
        kind=kind,
        opcode=ins.opcode,
        name=ins.name,
        dtype=_dtype(operands or [result]),
        operand_shapes=tuple(str(a) for s in operands for a in flat_arrays(s)),
        result_shapes=tuple(str(a) for a in flat_arrays(result)),
        operand_bytes=sum(shape_bytes(s) for s in operands),
        result_bytes=shape_bytes(result),
        replica_groups=groups,
        source_target_pairs=pairs,
        group_size=max((len(g) for g in flat), default=1),
        axes=axes,
        computation=computation,
        in_loop=run.in_loop,
        trip_count=run.trip_count,
        executions=run.count,
        op_name=_op_name(ins),
        widened_from=narrow.pop() if len(narrow) == 1 else None,
        unwidened_bytes=_unwidened_bytes(kind, operands, result, widened),
    )


def mesh_positions(compiled, mesh) -> list[int] | None:
    """``positions[logical id]`` when the executable lists its devices, else ``None``."""
    try:
        devices = list(compiled.runtime_executable().local_devices())
    except (AttributeError, RuntimeError, TypeError):
        return None
    try:
        mesh_devices = mesh.devices
    except ValueError:  # an AbstractMesh has no devices
        return None
    index = {device.id: i for i, device in enumerate(mesh_devices.flat)}
    if len(devices) != mesh.size or any(d.id not in index for d in devices):
        return None
    return [index[d.id] for d in devices]


def collectives(compiled, mesh) -> list[Collective]:
    """Every collective of a compiled jax program, with the mesh axes it runs over.

    Args:
        compiled: ``jax.jit(f).lower(*args).compile()``.
        mesh: the :class:`jax.sharding.Mesh` the program was built for (an
            ``AbstractMesh`` works too; device ids are then taken to be
            positions in mesh order).

    Returns:
        One :class:`Collective` per collective instruction (async pairs once).

    Raises:
        MeshError: the program runs on a different number of devices than
            ``mesh`` has.
    """
    return program_collectives(cached_module(compiled.as_text()), compiled, mesh)


def program_collectives(module: HloModuleText, compiled, mesh) -> list[Collective]:
    """:func:`collectives` of ``compiled``, whose text is already parsed as ``module``."""
    check_devices(module, mesh)
    axis_sizes = {name: int(size) for name, size in mesh.shape.items()}
    return _collect(module, axis_sizes, mesh_positions(compiled, mesh))


def check_devices(module: HloModuleText, mesh) -> None:
    """Raise :class:`MeshError` when ``module`` runs on another number of devices than ``mesh`` has."""
    devices = module.num_partitions * module.replica_count
    if devices != mesh.size:
        raise MeshError(
            f"the compiled program runs on {devices} devices but the mesh has {mesh.size}",
            key=f"mesh{dict(mesh.shape)}",
            fix="pass the mesh the program was compiled with",
        )
