"""The shard role: ZeRO shards the state over ``fsdp`` and gathers parameters on use.

Stage 1: ``opt[D/fsdp]``; stage 2: also ``dW[D/fsdp]``; stage 3: also
``W[D/fsdp]``, all-gathered on use (per layer of a :class:`LayeredModel`) with
the gradient reduce-scattered in the gather's backward pass.

A parameter is sharded along its largest dim that divides the ``fsdp`` size
and is neither the stacked layer dim nor already split by another mesh axis;
a parameter with no such dim, or with fewer elements than
``zero.persistence_threshold``, stays replicated (its gradient is
all-reduced instead of reduce-scattered).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from torsh_jax.plan import plan_from_dict
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> plan = plan_from_dict({"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": 3}})
    >>> mesh = build_mesh(plan, jax.devices()[:8])
    >>> shard_dims({"layers": {"wq": jnp.zeros((2, 64, 4, 16)), "b": jnp.zeros((2, 3))}}, plan, mesh)
    {'layers': {'b': None, 'wq': 1}}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torsh_jax.compress import compressed_all_gather
from torsh_jax.compress.factory import length_unit
from torsh_jax.plan.roles import SHARD_AXIS, Roles, compose
from torsh_jax.plan.spec import CompressorSpec, ParallelPlan
from torsh_jax.runtime.compiler_axes import manual_over
from torsh_jax.runtime.layered import LayeredModel, scan_layers, split_params
from torsh_jax.runtime.prefetch import prefetched_scan
from torsh_jax.runtime.specs import logical_dims, param_specs, path_str
from torsh_jax.runtime.sync import SyncSpec, sync_leaf
from torsh_jax.tensor.axis import vary_over, varying_axes
from torsh_jax.typing import PyTree

if TYPE_CHECKING:
    from torsh_jax.runtime.decide import StepPlan

__all__ = ["shard_dims", "sharded_specs", "all_gather_params", "gathered_loss", "GATHERED"]

FSDP = SHARD_AXIS
#: Name given to gathered parameters, for remat policies.
GATHERED = "torsh_gathered_param"


def _pick_dim(shape, names, spec: P, size: int, stacked: bool) -> int | None:
    best = None
    for dim, length in enumerate(shape):
        taken = dim < len(spec) and spec[dim] is not None
        if (stacked and dim == 0) or names[dim] == "layers" or taken or length % size:
            continue
        if best is None or length > shape[best]:
            best = dim
    return best


def shard_dims(
    params: PyTree,
    plan: ParallelPlan,
    mesh: Mesh,
    *,
    roles: Roles | None = None,
    specs: PyTree = None,
    stacked_key: str = "layers",
) -> PyTree:
    """Per parameter leaf: the dim sharded over ``fsdp``, or ``None`` (replicated).

    Leaves under the top-level ``stacked_key`` (a :class:`LayeredModel`'s
    stacked layers) are never split along dim 0, the layer dim.
    """
    roles = roles or compose(plan, mesh.shape)
    specs = param_specs(params, plan, mesh) if specs is None else specs
    size = mesh.shape[FSDP]
    threshold = max(plan.zero.persistence_threshold, 1)

    def one(path, leaf, spec):
        shape = tuple(leaf.shape)
        if roles.shard_axis is None or int(np.prod(shape)) < threshold:
            return None
        stacked = bool(path) and path_str(path[:1]) == stacked_key
        return _pick_dim(shape, logical_dims(path_str(path), leaf, plan), spec, size, stacked)

    return jax.tree_util.tree_map_with_path(one, params, specs, is_leaf=lambda x: isinstance(x, P))


def sharded_specs(base_specs: PyTree, dims: PyTree) -> PyTree:
    """``base_specs`` with ``fsdp`` added at each leaf's shard dim."""

    def one(spec: P, dim: int | None) -> P:
        entries = list(spec)
        if dim is not None:
            entries[dim] = FSDP
        return P(*entries)

    return jax.tree.map(one, base_specs, dims, is_leaf=lambda x: isinstance(x, P))


def all_gather_params(shards: PyTree, dims: PyTree) -> PyTree:
    """All-gather every sharded leaf over ``fsdp`` along its shard dim (inside ``shard_map``)."""

    def one(shard, dim):
        return shard if dim is None else jax.lax.all_gather(shard, FSDP, axis=dim, tiled=True)

    return jax.tree.map(one, shards, dims, is_leaf=lambda x: x is None)


def _compressed_gather(shard: jax.Array, dim: int, spec: CompressorSpec, implementation: str) -> jax.Array:
    """All-gather ``shard`` along ``dim`` over ``fsdp`` with a compressed payload."""
    size = jax.lax.axis_size(FSDP)
    row = jnp.moveaxis(shard, dim, 0).reshape(-1).astype(jnp.float32)
    m, unit = row.shape[0], length_unit(spec)
    padded = jnp.pad(row, (0, -(-m // unit) * unit - m))
    gathered = compressed_all_gather(
        padded, spec=spec, axis_name=FSDP, axis_size=size, implementation=implementation
    )
    rows = gathered.reshape(size, -1)
    full = rows[:, :m].reshape(size * shard.shape[dim], *jnp.moveaxis(shard, dim, 0).shape[1:])
    return jnp.moveaxis(full, 0, dim)


def gather_and_reduce(
    dim: int | None,
    plan: ParallelPlan,
    backward: SyncSpec,
    weights: CompressorSpec | None,
    *,
    compiler: tuple[str, ...] = (),
    spec: P | None = None,
    implementation: str = "reference",
) -> tuple[Callable, Callable]:
    """The two collectives of a parameter sharded along ``dim`` (``None``: replicated).

    ``gather``: ``W_shard -> W`` in the compute dtype (compressed when ``weights``).
    ``reduce``: ``dW`` in the reduction dtype through :func:`~torsh_jax.runtime.sync.sync_leaf`
    (reduce-scatter over ``fsdp``, sum over the other non-deferred axes), returned in the parameter
    dtype. Both run per shard of the ``compiler`` axes the parameter is split over by ``spec``
    (see :mod:`~torsh_jax.runtime.compiler_axes`). ``implementation``: the compressed gather's
    kernels (``pallas`` or ``reference``).
    """
    precision = plan.precision
    sync = backward if dim is not None else backward._replace(scatter_axis=None)
    replicas = tuple(a for a in backward.axes if a != FSDP)

    def gather(shard: jax.Array) -> jax.Array:
        full = shard.astype(precision.compute_dtype)
        if dim is None:
            return vary_over(full, backward.axes)
        if weights is not None:  # the compressed gather is typed as replicated over fsdp
            return vary_over(
                _compressed_gather(shard, dim, weights, implementation).astype(precision.compute_dtype),
                (*replicas, FSDP),
            )
        return vary_over(jax.lax.all_gather(full, FSDP, axis=dim, tiled=True), replicas)

    def reduce(g: jax.Array) -> jax.Array:
        return sync_leaf(g.astype(precision.reduce_dtype), dim, sync).astype(precision.param_dtype)

    spec = P() if spec is None else spec
    return manual_over(gather, compiler, (spec,), spec), manual_over(reduce, compiler, (spec,), spec)


def make_gather(dim: int | None, plan: ParallelPlan, backward: SyncSpec, weights, **options) -> Callable:
    """Gather-on-use of a parameter sharded along ``dim``: the gather of :func:`gather_and_reduce`
    whose transpose is its reduction (same arguments)."""
    forward, grad = gather_and_reduce(dim, plan, backward, weights, **options)

    @jax.custom_vjp
    def gather(shard):
        return forward(shard)

    gather.defvjp(lambda shard: (forward(shard), None), lambda _, g: (grad(g),))
    return gather


def _weights(plan: ParallelPlan) -> CompressorSpec | None:
    section = plan.compression_for(FSDP)
    spec = None if section is None else section.weights
    return spec if spec is not None and spec.method != "none" else None


def _gather_tree(
    shards: PyTree, dims: PyTree, specs: PyTree, decided: StepPlan, compiler: tuple[str, ...]
) -> PyTree:
    plan = decided.plan
    weights = _weights(plan)
    options = {"compiler": compiler, "implementation": decided.kernels.get(FSDP, "reference")}

    def one(shard, dim, spec):
        backward = _summed_by_gather(decided.backward, shard, dim)
        gather = make_gather(dim, plan, backward, weights, spec=spec, **options)
        return checkpoint_name(gather(shard), GATHERED)

    return jax.tree.map(one, shards, dims, specs, is_leaf=lambda x: x is None)


def _summed_by_gather(backward: SyncSpec, shard: jax.Array, dim: int | None) -> SyncSpec:
    """``backward`` less the axes ``shard`` is typed as varying over (but the one it is scattered
    over): the sum over such an axis is the transpose of that typing (:func:`_head_first`),
    not the gather's."""
    typed = varying_axes(shard) - ({backward.scatter_axis} if dim is not None else set())
    kept = tuple(a for a in backward.axes if a not in typed)
    if kept == backward.axes:
        return backward
    return backward._replace(axes=kept, routes={a: r for a, r in backward.routes.items() if a in kept})


def _tree_collectives(dims: PyTree, specs: PyTree, decided: StepPlan, compiler: tuple[str, ...]):
    """``(gather, reduce)`` over a tree of shards (see :func:`gather_and_reduce`)."""
    plan = decided.plan
    options = {"compiler": compiler, "implementation": decided.kernels.get(FSDP, "reference")}
    dim_leaves, treedef = jax.tree.flatten(dims, is_leaf=lambda x: x is None)
    spec_leaves = treedef.flatten_up_to(specs)
    pairs = [
        gather_and_reduce(dim, plan, decided.backward, _weights(plan), spec=spec, **options)
        for dim, spec in zip(dim_leaves, spec_leaves, strict=True)
    ]

    def over_tree(k: int) -> Callable:
        return lambda tree: treedef.unflatten(
            [pair[k](leaf) for pair, leaf in zip(pairs, treedef.flatten_up_to(tree), strict=True)]
        )

    return over_tree(0), over_tree(1)


def _layer_scan(decided: StepPlan, one_layer: tuple[PyTree, PyTree], gather: Callable, batch) -> Callable:
    """``scan(stacked_shards, hidden)`` of the step's layers on ``batch``, gathering each on use; with
    ``roles.prefetch_layers`` the next layer is gathered while one computes
    (:func:`~torsh_jax.runtime.prefetch.prefetched_scan`)."""
    model = decided.model.on(batch)
    if decided.roles.prefetch_layers:
        gather_layer, reduce_layer = _tree_collectives(*one_layer, decided, decided.compiler_axes)
        return prefetched_scan(model.layer, gather=gather_layer, reduce=reduce_layer)
    layer = _remat(lambda s, h: model.layer(gather(s, *one_layer), h), decided.plan)
    return lambda stacked, hidden: scan_layers(layer, stacked, hidden)


def _remat(fn: Callable, plan: ParallelPlan) -> Callable:
    """Re-gather in the backward pass (``reshard_after_forward``): recompute from the shards."""
    if not plan.zero.reshard_after_forward:
        return fn
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


def _layer_dims(dims: PyTree, leading: int = 1) -> PyTree:
    """Shard dims of one layer's slice of stacked parameters (the ``leading`` layer dims are gone)."""
    return jax.tree.map(lambda d: None if d is None else d - leading, dims, is_leaf=lambda x: x is None)


def _layer_specs(specs: PyTree, leading: int = 1) -> PyTree:
    """Specs of one layer's slice of stacked parameters (the ``leading`` layer dims are gone)."""
    return jax.tree.map(lambda s: P(*s[leading:]), specs, is_leaf=lambda x: isinstance(x, P))


def gathering_model(decided: StepPlan, dims: PyTree, *, specs: PyTree) -> LayeredModel:
    """The step's model whose functions take parameter shards and gather them on use (one layer at a
    time; gradients reduce-scattered in the backward pass): a pipeline slot's ZeRO-3 per micro-batch."""
    model, plan = decided.model, decided.plan
    leading = 1 + (decided.layer_chunks > 1)  # stored in chunks: two leading layer dims
    gather = lambda shards, d, s: _gather_tree(shards, d, s, decided, ())
    embed_d, stacked_d, head_d = split_params(model, dims)
    embed_p, stacked_p, head_p = split_params(model, specs)
    one_layer = _layer_dims(stacked_d, leading), _layer_specs(stacked_p, leading)
    return model._replace(
        embed=lambda s, batch: model.embed(gather(s, embed_d, embed_p), batch),
        layer=_remat(lambda s, h, *batch: model.layer(gather(s, *one_layer), h, *batch), plan),
        head=lambda s, hidden, batch: model.head(gather(s, head_d, head_p), hidden, batch),
    )


def gathered_loss(decided: StepPlan, dims: PyTree, *, specs: PyTree) -> Callable:
    """ZeRO-3: ``loss(shards, batch)`` of the step's model that gathers parameters on use.

    Stacked layers are gathered one layer at a time inside the layer scan (embed and head stay
    gathered through the backward pass, like FSDP's root module; a key both read, a tied embedding,
    is gathered once). A plain loss (no stacked layers) gathers every leaf once, before use, and
    keeps it through the backward pass (every leaf is alive at once anyway, so gathering again would
    only add bytes). ``specs``: per parameter, its split over the step's compiler axes.
    """
    model, compiler = decided.model, decided.compiler_axes
    gather = lambda shards, d, s: _gather_tree(shards, d, s, decided, compiler)

    def loss(shards, batch):
        embed_s, stacked_s, head_s = split_params(model, shards)
        embed_d, stacked_d, head_d = split_params(model, dims)
        embed_p, stacked_p, head_p = split_params(model, specs)
        embed = gather(embed_s, embed_d, embed_p)
        hidden = model.embed(embed, batch)
        if not model.stacked:
            return model.head(_head_params(model, embed, head_s, head_d, head_p, gather), hidden, batch)
        one_layer = _layer_dims(stacked_d), _layer_specs(stacked_p)
        hidden = _layer_scan(decided, one_layer, gather, batch)(stacked_s, hidden)
        embed, head_s, hidden = _head_first(model, embed, head_s, hidden, decided.backward.axes)
        return model.head(_head_params(model, embed, head_s, head_d, head_p, gather), hidden, batch)

    return loss


def _head_first(
    model: LayeredModel, embed: dict, head_shards: PyTree, hidden: jax.Array, summed: tuple[str, ...]
) -> tuple:
    """``(embed, head_shards, hidden)`` with the head's parameter shards (and a tied table) and the
    hidden state through one optimization barrier, whose transpose makes the layers' backward wait
    for the head's gradients reduced: the step never holds the head's whole gradient, nor the
    logits' gradient, through the layers' backward. libtpu 0.0.42.1 did, computing the head's
    weight gradient after them (the 150 M demo model's ``zero3 fsdp=16`` on v5e-16: 2,916 MiB,
    1,892 MiB with the barrier; docs/planner.md).

    A barrier's operands vary over the same mesh axes: the hidden state is typed as varying over
    every axis the head's weights do (vocabulary-split ones: ``tensor``), and a shard over the
    gradient axes it lacks (``summed``: ``data`` under HSDP), as their use in the head would type
    them; the transpose of that typing is the same sum, run at the barrier (the shard's gather then
    leaves it out: :func:`_summed_by_gather`). A shard lacking another axis (a weight replicated
    over ``tensor``) and a tied table lacking any stay out of it."""
    tied = {k: embed[k] for k in model.head_keys or () if k in embed}
    leaves, rebuild = jax.tree.flatten((tied, head_shards))
    axes = varying_axes(hidden).union(*map(varying_axes, leaves))
    tables = len(jax.tree.leaves(tied))  # gathered already: their gathers sum every axis
    may_add = lambda i: set(summed) if i >= tables else set()
    joined = [i for i, x in enumerate(leaves) if axes - varying_axes(x) <= may_add(i)]
    order = tuple(sorted(axes))
    typed = [vary_over(leaves[i], order) for i in joined]
    kept, hidden = jax.lax.optimization_barrier((typed, vary_over(hidden, order)))
    for i, leaf in zip(joined, kept, strict=True):
        leaves[i] = leaf
    tied, head_shards = jax.tree.unflatten(rebuild, leaves)
    return {**embed, **tied}, head_shards, hidden


def _head_params(model: LayeredModel, embed: dict, shards, dims, specs, gather: Callable) -> PyTree:
    """The head's parameters, gathered; a key the embedding read too (a tied table) is used as
    gathered there: one gather and one reduce-scatter of its summed gradient."""
    if model.head_keys is None:
        return gather(shards, dims, specs)
    own = [k for k in model.head_keys if k not in embed]
    fresh = gather(*({k: tree[k] for k in own} for tree in (shards, dims, specs)))
    return {k: embed[k] if k in embed else fresh[k] for k in model.head_keys}
