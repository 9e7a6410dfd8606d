"""Every decision of a train step, made once, before any parameter is seen: one frozen :class:`StepPlan`.

:func:`decide` checks the plan against the mesh and the model (typed errors, before compiling) and
records what the step runs: the model in its one shape (a plain loss is a
:class:`~torsh_jax.runtime.layered.LayeredModel` without stacked layers), the axis roles (which axes
split the batch and shard the state, how parameters are gathered and when gradients are reduced,
:class:`~torsh_jax.plan.roles.Roles`), the gradient synchronisations, the axes the local
parameters vary over, the compression kernels each axis runs, and the pipeline's schedule and layer
chunks. The state layout (:mod:`torsh_jax.runtime.layout`) and the step's program
(:mod:`torsh_jax.runtime.program`) read this record and decide nothing again.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> plan = load_plan("zero3")
    >>> decided = decide(lambda p, b: jnp.sum(p["w"] * b), plan, build_mesh(plan, jax.devices()[:1]))
    >>> decided.roles.gather, decided.model.stacked, decided.schedule
    ('stored', False, None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from torsh_jax.compress.factory import kernel_platform
from torsh_jax.pipeline.schedule import Schedule
from torsh_jax.plan.roles import Roles, compose
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.call_checks import scalar_loss
from torsh_jax.runtime.checks import check_mesh, check_sequence_parallel, check_supported
from torsh_jax.runtime.compiler_axes import compiler_axes
from torsh_jax.runtime.data_parallel import backward_sync, gradient_sync
from torsh_jax.runtime.layered import LayeredModel, as_model
from torsh_jax.runtime.offload import check_offload
from torsh_jax.runtime.pipeline import layer_chunks, require_layered, schedule_for
from torsh_jax.runtime.sync import SyncSpec
from torsh_jax.typing import PyTree

__all__ = ["StepPlan", "decide", "kernel_choice"]

#: Top-level key whose leading dim is never sharded, for a model without stacked layers.
DEFAULT_STACKED_KEY = "layers"


@dataclass(frozen=True)
class StepPlan:
    """What a train step runs, decided once.

    Attributes:
        plan: the plan (with the parameters' flax axis names folded into its ``param_dims``).
        mesh: the mesh.
        roles: what each mesh axis does, how parameters are gathered (``roles.gather``) and when
            gradients are reduced (``roles.reduce``).
        model: the model in its one shape (a plain loss has no embedding and no stacked layers).
        compiler_axes: mesh axes the compiler partitions (``tensor`` for a model without tensor
            blocks); the step's ``shard_map`` is manual over the others.
        sync: the gradient synchronisation after the backward pass.
        backward: ZeRO-3's per-parameter synchronisation inside the gather's backward pass
            (``None`` unless ``roles.gather == "on_use"``).
        vary: the axes the local parameters are marked as varying over before differentiating.
        kernels: per compressed axis, ``pallas`` or ``reference`` (``compression.implementation``
            with ``auto`` resolved for the mesh's devices).
        schedule: the pipeline's schedule table (``None`` without a ``stage`` axis).
        layer_chunks: the stacked layers are stored in this many chunks (interleaved pipeline).
        stacked_key: top-level key of the stacked layers (never sharded on its leading dim).
    """

    plan: ParallelPlan
    mesh: Mesh
    roles: Roles
    model: LayeredModel
    compiler_axes: tuple[str, ...]
    sync: SyncSpec
    backward: SyncSpec | None
    vary: tuple[str, ...]
    kernels: Mapping[str, str]
    schedule: Schedule | None
    layer_chunks: int
    stacked_key: str

    @property
    def batch_spec(self) -> P:
        """``PartitionSpec`` of every batch leaf's leading dim."""
        return P(self.roles.batch_axes)

    @property
    def global_batch_size(self) -> int:
        """Examples per optimizer step."""
        return self.plan.batch.global_batch_size(self.roles.batch_size)


def kernel_choice(implementation: str, platform: str) -> str:
    """``pallas`` or ``reference``: what ``compression.implementation`` runs on ``platform`` devices.

    Example:
        >>> kernel_choice("auto", "cpu"), kernel_choice("auto", "tpu"), kernel_choice("pallas", "cpu")
        ('reference', 'pallas', 'pallas')
    """
    if implementation in ("pallas", "pallas_interpret"):
        return implementation
    return "reference" if kernel_platform(implementation, platform) is None else "pallas"


def _kernels(plan: ParallelPlan, roles: Roles, mesh: Mesh) -> dict[str, str]:
    platform = mesh.devices.flat[0].platform
    axes = dict.fromkeys((*roles.gradient_compression, *roles.weight_compression))
    return {axis: kernel_choice(plan.compression_for(axis).implementation, platform) for axis in axes}


def decide(
    loss: Callable[[PyTree, PyTree], jax.Array] | LayeredModel,
    plan: ParallelPlan,
    mesh: Mesh,
) -> StepPlan:
    """Check ``plan`` on ``mesh`` for ``loss`` and record every decision of its train step.

    Raises:
        MeshError: ``mesh`` is not one ``plan`` builds.
        NotSupportedYetError: the composition needs what is not built yet.
        PlanError: a pipeline without a layered model, or micro-batches that do not split.
    """
    check_mesh(plan, mesh)
    roles = compose(plan, mesh.shape)
    check_supported(plan, roles)
    check_offload(plan, mesh)
    model = scalar_loss(as_model(loss))
    check_sequence_parallel(model, roles)
    require_layered(model, roles)
    kernels = _kernels(plan, roles, mesh)
    sync = gradient_sync(plan, roles, kernels)
    on_use = roles.gather == "on_use"
    return StepPlan(
        plan=plan,
        mesh=mesh,
        roles=roles,
        model=model,
        compiler_axes=compiler_axes(model, roles),
        sync=sync,
        backward=backward_sync(plan, roles, kernels) if on_use else None,
        # on use, the gathers' backward passes reduce over the other batch axes
        vary=sync.axes if on_use else roles.batch_axes,
        kernels=kernels,
        schedule=None if roles.stage_axis is None else schedule_for(plan, roles),
        layer_chunks=layer_chunks(plan, roles),
        stacked_key=model.layers_key if model.stacked else DEFAULT_STACKED_KEY,
    )
