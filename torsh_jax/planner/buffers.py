"""What a candidate's gradient synchronisation holds: the runtime's buckets, from parameter shapes.

The bytes of a compressed reduction depend on how the gradients are laid out, not only on how
many there are: each parameter is padded to whole scale blocks, each bucket to whole blocks (top-k:
chunks) per device, and PowerSGD views each bucket as its own matrix. So the planner lays the
model's parameters (:attr:`ModelShape.leaves <torsh_jax.planner.shape.ModelShape.leaves>`) out as
the runtime does for the candidate's plan — the same functions (parameter specs, the stage split,
ZeRO's shard dims, the gradient sync and its buckets) on an abstract mesh of the candidate's sizes,
so no device is needed — and reads the buckets off. A shape without leaves (built by hand) has no
layout: the callers fall back to one unpadded buffer.

Example:
    >>> from torsh_jax.plan import AxisCompression, CompressorSpec, ParallelPlan
    >>> from torsh_jax.planner.shape import parse_model
    >>> shape = parse_model("demo:d_model=256,layers=4,vocab=256,seq_len=32")
    >>> topk = (AxisCompression(axis="data", gradients=CompressorSpec(method="topk")),)
    >>> sizes = {"data": 8, "fsdp": 1, "tensor": 1, "stage": 1}
    >>> compressed_buffers(shape, ParallelPlan(compression=topk), sizes)  # one bucket, 8 x 4096 chunks
    {'data': (3309568,)}
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from torsh_jax.plan import ParallelPlan, PipelineSpec, TensorSpec
from torsh_jax.plan.spec import AXES
from torsh_jax.planner.shape import ModelShape

__all__ = ["compressed_buffers", "tensor_replicated_elements", "tensor_split_elements", "TensorSplit"]


def compressed_buffers(
    shape: ModelShape, plan: ParallelPlan, sizes: dict[str, int]
) -> dict[str, tuple[int, ...]]:
    """Per compressed gradient axis: the padded length of each buffer (bucket) one device's gradient
    all-reduce over it compresses per synchronisation (``{}`` without leaves or compression)."""
    if not shape.leaves or not plan.compression:
        return {}
    return _buckets(shape, _key(plan), plan.compression, tuple(sizes[a] for a in AXES))


def tensor_replicated_elements(shape: ModelShape, plan: ParallelPlan, sizes: dict[str, int]) -> int:
    """Elements of the parameters the plan's rules do not split over any axis (norm weights,
    positions: with sequence parallelism their gradients are summed over ``tensor``); 0 without
    leaves."""
    if not shape.leaves:
        return 0
    params, _, _, split = _leaves(shape, _key(plan), tuple(sizes[a] for a in AXES))
    return sum(math.prod(dims) for dims, axes in zip(params, split, strict=True) if not axes)


class TensorSplit(NamedTuple):
    """What a plan splits over ``tensor`` of a model's parameters (:func:`tensor_split_elements`).

    Attributes:
        layer: elements of one layer split (whole counts, before the split).
        shared: elements of the embedding and head split.
        vocab: the share of the vocabulary projection's elements split (:func:`_vocab_share`): the
            logits are split as it is.
    """

    layer: int
    shared: int
    vocab: float


def tensor_split_elements(shape: ModelShape, plan: ParallelPlan, sizes: dict[str, int]) -> TensorSplit | None:
    """What the plan's rules split over ``tensor`` of the model's parameters, as the runtime lays
    them out; ``None`` without leaves or a ``tensor`` axis. A model whose names the rules do not
    know keeps those parameters whole on every tensor device.

    Example:
        >>> from torsh_jax.plan import ParallelPlan
        >>> from torsh_jax.planner.shape import parse_model
        >>> shape = parse_model("demo:d_model=256,layers=4,vocab=256,seq_len=32")
        >>> sizes = {"data": 4, "fsdp": 1, "tensor": 2, "stage": 1}
        >>> split = tensor_split_elements(shape, ParallelPlan(), sizes)
        >>> whole = shape.embed_params + shape.head_params - split.shared  # positions, the final norm
        >>> shape.layer_params - split.layer, whole, split.vocab  # the layer's norms stay whole
        (512, 8448, 1.0)
    """
    if not shape.leaves or sizes["tensor"] == 1:
        return None
    _, _, _, axes = _leaves(shape, _key(plan), tuple(sizes[a] for a in AXES))
    layer = shared = 0
    projections: list[tuple[bool, int, bool]] = []  # (under the head's keys, elements, split)
    for (path, dims), split in zip(shape.leaves, axes, strict=True):
        top, n, is_split = path.split("/")[0], math.prod(dims), "tensor" in split
        if top == shape.layers_key:
            layer += math.prod(dims[1:]) if is_split else 0
            continue
        shared += n if is_split else 0
        if len(dims) == 2 and shape.vocab in dims and shape.d_model in dims:
            projections.append((top in shape.head_keys, n, is_split))
    return TensorSplit(layer, shared, _vocab_share(projections))


def _vocab_share(projections: list[tuple[bool, int, bool]]) -> float:
    """The split share of the vocabulary projection: the head's ``[vocab, d]`` matrices, or where the
    head has none (a tied embedding) the embedding's; none found: 0, the logits counted whole."""
    head = [(n, split) for in_head, n, split in projections if in_head]
    found = head or [(n, split) for _, n, split in projections]
    total = sum(n for n, _ in found)
    return sum(n for n, split in found if split) / total if total else 0.0


def _key(plan: ParallelPlan) -> tuple:
    """What of ``plan`` the layout reads but its compression (hashable; the optimizer may hold a
    dict, and the mesh's split over slices, the schedule and sequence parallelism change no bucket)."""
    tensor = (plan.tensor.rules, plan.tensor.allow_replicated)
    pipeline = (plan.pipeline.virtual_stages, plan.pipeline.gather)
    return plan.zero, plan.precision, plan.communication, pipeline, tensor, plan.rules, plan.param_dims


def _plan(key: tuple, compression: tuple = ()) -> ParallelPlan:
    zero, precision, communication, (virtual, gather), (rules_kind, replicated), rules, param_dims = key
    return ParallelPlan(
        zero=zero,
        precision=precision,
        communication=communication,
        compression=compression,
        pipeline=PipelineSpec(virtual_stages=virtual, gather=gather),
        tensor=TensorSpec(rules=rules_kind, allow_replicated=replicated),
        rules=rules,
        param_dims=param_dims,
    )


@functools.lru_cache(maxsize=4096)
def _leaves(shape: ModelShape, key: tuple, axis_sizes: tuple[int, ...]):
    """``(global shapes, local shapes, shard dims, split axes)`` per parameter, as the runtime's
    layout makes them (:func:`torsh_jax.runtime.layout.layout_for`)."""
    import jax
    from jax.sharding import AbstractMesh, PartitionSpec

    from torsh_jax.plan.roles import compose
    from torsh_jax.runtime.fsdp import shard_dims, sharded_specs
    from torsh_jax.runtime.layered import LayeredModel
    from torsh_jax.runtime.layout import split_axes
    from torsh_jax.runtime.params import with_auto_tensor_names
    from torsh_jax.runtime.pipeline.stages import stage_specs
    from torsh_jax.runtime.specs import param_specs

    sizes, mesh = dict(zip(AXES, axis_sizes, strict=True)), AbstractMesh(axis_sizes, AXES)
    params = _params_like(shape, jax.ShapeDtypeStruct, "float32")
    layers = LayeredModel(None, None, None, layers_key=shape.layers_key)  # where the runtime reads it
    plan = with_auto_tensor_names(_plan(key), params, layers, mesh)  # ``tensor.rules = "auto"``: names
    roles = compose(plan, sizes)
    compute = stage_specs(param_specs(params, plan, mesh), params, plan, roles, shape.layers_key)
    dims = shard_dims(params, plan, mesh, roles=roles, specs=compute, stacked_key=shape.layers_key)
    update = sharded_specs(compute, dims) if roles.opt_state_sharded else compute
    held = update if roles.gather == "on_use" else compute  # ZeRO-3 synchronises its stored shards
    specs = jax.tree.leaves(held, is_leaf=lambda x: isinstance(x, PartitionSpec))
    shapes = [x.shape for x in jax.tree.leaves(params)]
    local = [jax.ShapeDtypeStruct(_local(x, s, sizes), "float32") for x, s in zip(shapes, specs, strict=True)]
    split = jax.tree.leaves(split_axes(compute), is_leaf=lambda x: isinstance(x, tuple))
    return shapes, local, jax.tree.leaves(dims, is_leaf=lambda x: x is None), split


@functools.lru_cache(maxsize=4096)
def _buckets(shape: ModelShape, key: tuple, compression: tuple, axis_sizes: tuple[int, ...]):
    from torsh_jax.plan.roles import compose
    from torsh_jax.runtime.data_parallel import gradient_sync
    from torsh_jax.runtime.sync import plan_buckets

    _, local, dims, split = _leaves(shape, key, axis_sizes)
    plan = _plan(key, compression)
    sync = gradient_sync(plan, compose(plan, dict(zip(AXES, axis_sizes, strict=True))), {})
    buffers: dict[str, list[int]] = {}
    for bucket in plan_buckets(local, dims, sync, split):
        for axis in sync.reduce_axes(bucket.scattered)[1]:
            buffers.setdefault(axis, []).append(bucket.padded_length)
    return {a: tuple(b) for a, b in buffers.items()}


def _local(shape: tuple[int, ...], spec, sizes: dict[str, int]) -> tuple[int, ...]:
    """One device's part of a parameter of ``shape`` laid out by ``spec``."""
    from torsh_jax.runtime.specs import entry_axes

    out = list(shape)
    for dim, entry in enumerate(spec):
        out[dim] //= math.prod(sizes[a] for a in entry_axes(entry))
    return tuple(out)


def _params_like(shape: ModelShape, make, dtype) -> dict:
    """The parameters' tree, rebuilt from their ``/``-joined paths."""
    tree: dict = {}
    for path, dims in shape.leaves:
        *parents, name = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[name] = make(dims, dtype)
    return tree
