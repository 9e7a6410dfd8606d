"""The state layout of a plan: the one place where the train state's shardings are decided.

Each parameter has three layouts:

* **compute**: as the loss sees it (the plan's logical-axis rules only);
* **update**: as gradients, optimizer state and the optax update hold it
  (``fsdp`` added at the leaf's shard dim from ZeRO stage 1 on);
* **stored**: as the train state keeps it between steps (the update layout at
  stage 3, the compute layout below it).

:func:`state_layout` needs no loss function: checkpoints, ``inspect`` and
planners ask it for the shardings and per-device bytes of a plan's state.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> plan = load_plan("zero3")
    >>> mesh = build_mesh(plan, jax.devices()[:1])
    >>> layout = state_layout(plan, mesh, {"w": jnp.zeros((8, 4))}, optax.adam(1e-3))
    >>> layout.roles.kind, layout.state.params
    ('ddp', {'w': P(None, None)})
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.plan.roles import Roles
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.checks import check_param_axes
from torsh_jax.runtime.decide import StepPlan, decide
from torsh_jax.runtime.fsdp import shard_dims, sharded_specs
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.runtime.offload import offloaded_parts
from torsh_jax.runtime.pipeline import chunk_layers, stage_specs, unchunk_layers
from torsh_jax.runtime.specs import entry_axes, param_specs
from torsh_jax.runtime.state import TrainState
from torsh_jax.runtime.sync import SyncSpec, feedback_specs, sync_feedback
from torsh_jax.runtime.update import scaler_for
from torsh_jax.typing import PyTree

__all__ = ["StateLayout", "state_layout", "layout_for", "opt_state_specs"]

_is_spec = lambda x: isinstance(x, P)


@dataclass(frozen=True)
class StateLayout:
    """Every sharding decision of a plan's train state on one mesh.

    Attributes:
        decided: the step's decisions (:class:`~torsh_jax.runtime.decide.StepPlan`): roles, mesh,
            gradient synchronisation, layer chunks.
        compute: ``PartitionSpec`` per parameter as the loss sees it.
        dims: per parameter, the dim sharded over ``fsdp`` (``None``: replicated).
        update: ``PartitionSpec`` per parameter of gradients, optimizer state and the update.
        state: ``PartitionSpec`` pytree of the stored :class:`TrainState`.
        abstract: the stored state's shapes and dtypes (global).
        split: per parameter, the mesh axes its compute layout splits it over
            (``("tensor",)`` or ``()``); gradient buckets never mix them.

    The stacked layers are stored as ``[layer_chunks, layers / layer_chunks, ...]`` under an
    interleaved pipeline (else as given). Every field describes the stored form;
    :meth:`logical_params` and :meth:`stored_params` convert.
    """

    decided: StepPlan
    compute: PyTree
    dims: PyTree
    update: PyTree
    state: TrainState
    abstract: TrainState
    init_feedback: Callable[[], PyTree] | None = None
    offloaded: tuple[str, ...] = ()
    split: PyTree = None

    @property
    def roles(self) -> Roles:
        """What each mesh axis does."""
        return self.decided.roles

    @property
    def mesh(self) -> Mesh:
        return self.decided.mesh

    @property
    def sync(self) -> SyncSpec:
        """The gradient synchronisation the step runs after the backward pass."""
        return self.decided.sync

    @property
    def stacked_key(self) -> str:
        """Top-level key of the stacked layer parameters."""
        return self.decided.stacked_key

    @property
    def layer_chunks(self) -> int:
        """Chunks the stacked layers are stored in (1: as given)."""
        return self.decided.layer_chunks

    def stored_params(self, params: PyTree) -> PyTree:
        """Parameters as the model defines them -> as the train state stores them."""
        return chunk_layers(params, self.stacked_key, self.layer_chunks)

    def logical_params(self, params: PyTree) -> PyTree:
        """Stored parameters (``state.params``, gradients) -> as the model defines them."""
        return unchunk_layers(params, self.stacked_key, self.layer_chunks)

    def memory_kind(self, part: str) -> str:
        """``pinned_host`` for an offloaded state field, ``device`` otherwise."""
        return "pinned_host" if part in self.offloaded else "device"

    def shardings(self, *, stored: bool = True) -> TrainState:
        """``NamedSharding`` of every state leaf; ``stored``: offloaded fields in host memory."""
        out = {}
        for part, specs in self.state._asdict().items():
            kind = self.memory_kind(part) if stored else "device"
            out[part] = jax.tree.map(lambda s, k=kind: _sharding(self.mesh, s, k), specs, is_leaf=_is_spec)
        return TrainState(**out)

    def abstract_state(self) -> TrainState:
        """The stored state as ``jax.ShapeDtypeStruct`` s with their shardings: lower and compile
        the step, or restore into it, without creating a state."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.abstract, self.shardings()
        )

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of each state field one device holds (largest shard, as a device allocates it)."""
        out = {}
        for part, specs in self.state._asdict().items():
            leaves = jax.tree.leaves(getattr(self.abstract, part))
            spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
            out[part] = sum(_shard_bytes(x, s, self.mesh) for x, s in zip(leaves, spec_leaves))
        return out


def _sharding(mesh: Mesh, spec: P, kind: str) -> NamedSharding:
    sharding = NamedSharding(mesh, spec)
    return sharding if kind == "device" else sharding.with_memory_kind(kind)


def _shard_bytes(leaf: Any, spec: P, mesh: Mesh) -> int:
    shape = list(leaf.shape)
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        shape[dim] = -(-shape[dim] // int(np.prod([mesh.shape[a] for a in axes])))
    return int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize


def opt_state_specs(optimizer: optax.GradientTransformation, abstract_opt_state: PyTree, specs: PyTree):
    """Specs for optimizer state: parameter-shaped leaves follow their parameter."""
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        abstract_opt_state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=_is_spec,
    )


def _scale_specs(plan: ParallelPlan) -> PyTree:
    scaler = scaler_for(plan)
    return None if scaler is None else jax.tree.map(lambda _: P(), jax.eval_shape(scaler.init))


def _local_shapes(params_like: PyTree, specs: PyTree, mesh: Mesh) -> list[jax.ShapeDtypeStruct]:
    """Per-device shapes of ``params_like`` laid out by ``specs`` (flattened leaf order)."""
    leaves = jax.tree.leaves(params_like)
    spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    return [
        jax.ShapeDtypeStruct(_local_shape(x.shape, s, mesh), x.dtype) for x, s in zip(leaves, spec_leaves)
    ]


def _local_shape(shape, spec: P, mesh: Mesh) -> tuple[int, ...]:
    out = list(shape)
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        out[dim] //= int(np.prod([mesh.shape[a] for a in axes]))
    return tuple(out)


def split_axes(compute: PyTree) -> PyTree:
    """Per parameter: the mesh axes its compute spec splits it over, in spec order."""

    one = lambda spec: tuple(axis for entry in spec for axis in entry_axes(entry))
    return jax.tree.map(one, compute, is_leaf=_is_spec)


def _feedback(decided: StepPlan, params_like, compute, update, dims, split):
    """``(init, specs)`` of the error feedback of the step's sync (``(None, None)`` without compression)."""
    sync, mesh = decided.sync, decided.mesh
    if not sync.routes:
        return None, None
    # gathered on use, the deferred axes synchronise the stored shards
    sharded_sync = decided.roles.gather == "on_use"
    shapes = _local_shapes(params_like, update if sharded_sync else compute, mesh)
    leaf_dims = jax.tree.leaves(dims, is_leaf=lambda x: x is None)
    leaf_split = jax.tree.leaves(split, is_leaf=lambda x: isinstance(x, tuple))
    init = lambda: sync_feedback(shapes, leaf_dims, sync, axis_sizes=dict(mesh.shape), split_over=leaf_split)
    return init, feedback_specs(shapes, leaf_dims, sync, leaf_split)


def state_layout(
    plan: ParallelPlan,
    mesh: Mesh,
    params_like: PyTree,
    optimizer: optax.GradientTransformation,
    *,
    stacked_key: str = "layers",
) -> StateLayout:
    """The layout of the train state of ``plan`` on ``mesh``, without a model.

    Args:
        plan: the plan.
        mesh: from :func:`~torsh_jax.runtime.mesh.build_mesh`.
        params_like: parameters or their shapes, in the plan's parameter dtype.
        optimizer: the optax transformation (its state's structure).
        stacked_key: top-level key of stacked layer parameters (a
            :class:`~torsh_jax.runtime.layered.LayeredModel`'s ``layers_key``),
            whose leading (layer) dim is never sharded.

    Raises:
        ShardingError: a parameter dim does not divide its mesh axes (names the path).
    """
    return layout_for(decide(_shape_only(stacked_key), plan, mesh), params_like, optimizer)


def _shape_only(stacked_key: str) -> LayeredModel:
    """A model of which only the parameters' structure is known (the layout needs no more)."""
    return LayeredModel(embed=None, layer=None, head=None, layers_key=stacked_key, tensor_blocks=True)


def layout_for(
    decided: StepPlan, params_like: PyTree, optimizer: optax.GradientTransformation
) -> StateLayout:
    """The layout of the train state of the step ``decided`` for parameters like ``params_like``.

    Raises:
        ShardingError: a parameter dim does not divide its mesh axes (names the path).
    """
    plan, mesh, roles, key = decided.plan, decided.mesh, decided.roles, decided.stacked_key
    compute = stage_specs(param_specs(params_like, plan, mesh), params_like, plan, roles, key)
    check_param_axes(compute, roles)
    dims = shard_dims(params_like, plan, mesh, roles=roles, specs=compute, stacked_key=key)
    params_like, compute, dims = _chunked(params_like, compute, dims, key, decided.layer_chunks)
    update = sharded_specs(compute, dims) if roles.opt_state_sharded else compute
    stored = update if roles.params_sharded else compute
    split = split_axes(compute)
    init_feedback, fb_specs = _feedback(decided, params_like, compute, update, dims, split)
    abstract_opt = jax.eval_shape(optimizer.init, params_like)
    scaler = scaler_for(plan)
    specs = TrainState(
        step=P(),
        params=stored,
        opt_state=opt_state_specs(optimizer, abstract_opt, update),
        loss_scale=_scale_specs(plan),
        feedback=fb_specs,
    )
    abstract = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like),
        opt_state=abstract_opt,
        loss_scale=None if scaler is None else jax.eval_shape(scaler.init),
        feedback=None if init_feedback is None else jax.eval_shape(init_feedback),
    )
    return StateLayout(
        decided, compute, dims, update, specs, abstract, init_feedback, offloaded_parts(plan), split
    )


def _chunked(params_like: PyTree, compute: PyTree, dims: PyTree, key: str, chunks: int) -> tuple:
    """Shapes, compute specs and shard dims of the stored form (:func:`chunk_layers`): the chunk dim
    leads, replicated; the stage split moves to the layer dim within a chunk."""
    if chunks == 1:
        return params_like, compute, dims
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like)
    compute = {**compute, key: jax.tree.map(lambda s: P(None, *s), compute[key], is_leaf=_is_spec)}
    shifted = jax.tree.map(lambda d: None if d is None else d + 1, dims[key], is_leaf=lambda x: x is None)
    return chunk_layers(shapes, key, chunks), compute, {**dims, key: shifted}
