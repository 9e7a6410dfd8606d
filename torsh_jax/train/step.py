"""``make_train_step``: a plan, a loss and an optimizer become a jitted ``(init, step)`` pair.

The step is one ``shard_map`` program over the whole mesh in which we place
every collective; it is jitted once with donated state.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from torsh_jax.plan import ParallelPlan, BatchSpec
    >>> from torsh_jax.parallel.mesh import build_mesh
    >>> plan = ParallelPlan(batch=BatchSpec(micro_batch_size=2))
    >>> mesh = build_mesh(plan, jax.devices()[:1])
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> init, step = make_train_step(loss, optax.sgd(0.1), plan, mesh)
    >>> state = init({"w": jnp.zeros((3, 1))})
    >>> state, metrics = step(state, {"x": jnp.ones((2, 3)), "y": jnp.ones((2, 1))})
    >>> float(metrics["loss"])
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.errors import NotSupportedYetError, ShardingError
from torsh_jax.parallel.layered import LayeredModel
from torsh_jax.parallel.mesh import data_axes, mesh_shape_str
from torsh_jax.parallel.sharding import named_shardings, path_str
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.train.compression_check import check_compression
from torsh_jax.train.offload import check_offload, host_shardings, to_device_memory
from torsh_jax.train.precision import cast_tree
from torsh_jax.train.programs import build_program
from torsh_jax.train.state import TrainState
from torsh_jax.train.update import scaler_for

__all__ = ["TrainStep", "make_train_step", "check_supported"]

PyTree = Any


def check_supported(plan: ParallelPlan, mesh: Mesh) -> None:
    """Raise :class:`NotSupportedYetError` for plan features this version cannot run."""
    for axis in ("tensor", "stage"):
        if mesh.shape[axis] > 1:
            raise NotSupportedYetError(
                f"the {axis} axis has size {mesh.shape[axis]} (mesh {mesh_shape_str(mesh)}); "
                f"{'tensor' if axis == 'tensor' else 'pipeline'}-parallel train steps are not supported yet",
                key=f"mesh.{axis}",
                fix=f"set mesh.{axis} = 1 and use data/fsdp axes",
            )
    check_compression(plan, mesh)
    check_offload(plan, mesh)


def _validate_batch(batch: PyTree, *, global_batch: int, plan: ParallelPlan, mesh: Mesh) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ShardingError("the batch has no arrays", key="batch", fix="pass a pytree of arrays")
    for path, leaf in leaves:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != global_batch:
            b = plan.batch
            dp = global_batch // (b.micro_batch_size * b.accumulation_steps)
            raise ShardingError(
                f"leading dim of shape {shape} must be the global batch {global_batch} = micro batch "
                f"{b.micro_batch_size} x accumulation {b.accumulation_steps} x data-parallel "
                f"{dp} (mesh {mesh_shape_str(mesh)})",
                key=f"batch/{path_str(path)}" if path else "batch",
                fix=f"feed batches of {global_batch} examples, or change batch.micro_batch_size",
            )


@dataclass
class TrainStep:
    """A compiled-once ``(init, step)`` pair plus what was derived from the plan.

    Unpacks as ``init, step = make_train_step(...)``.

    Attributes:
        init: ``params -> TrainState`` placed on the mesh.
        step: ``(state, global_batch) -> (state, metrics)``; donates ``state``.
        plan, mesh: what it was built for.
        batch_spec: ``PartitionSpec`` of every batch leaf's leading dim.
        global_batch_size: examples per optimizer step.
        loss: the loss function or layered model the step was built from.
    """

    init: Callable[[PyTree], TrainState]
    step: Callable[[TrainState, PyTree], tuple[TrainState, dict]]
    plan: ParallelPlan
    mesh: Mesh
    batch_spec: P
    global_batch_size: int
    loss: Any = None
    _built: dict = field(repr=False, default_factory=dict)

    def __iter__(self) -> Iterator[Callable]:
        return iter((self.init, self.step))

    @property
    def traces(self) -> int:
        """Times the step was traced: 1 after any number of same-shaped calls."""
        return self._built.get("traces", 0)

    @property
    def state_shardings(self) -> PyTree:
        """``NamedSharding`` pytree of the state (after ``init`` was called)."""
        return self._built["shardings"]

    def lower(self, state: TrainState, batch: PyTree) -> jax.stages.Lowered:
        """Lower the step for ``state`` and a global ``batch`` (for inspection)."""
        return self._built["jitted"].lower(state, self.shard_batch(batch))

    def shard_batch(self, batch: PyTree) -> PyTree:
        """Validate a global batch and place it on the mesh."""
        _validate_batch(batch, global_batch=self.global_batch_size, plan=self.plan, mesh=self.mesh)
        return jax.tree.map(
            lambda x: _place(x, NamedSharding(self.mesh, _leaf_batch_spec(self.batch_spec, x))), batch
        )


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Put a global batch leaf on the mesh; host data works in multi-process runs too
    (every process passes the same global array and keeps only its shards)."""
    if isinstance(x, jax.Array):
        return x if x.sharding.is_equivalent_to(sharding, x.ndim) else jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _leaf_batch_spec(spec: P, leaf: Any) -> P:
    return P(spec[0], *([None] * (len(leaf.shape) - 1)))


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], jax.Array] | LayeredModel,
    optimizer: optax.GradientTransformation,
    plan: ParallelPlan,
    mesh: Mesh,
    *,
    example_params: PyTree | None = None,
) -> TrainStep:
    """Build the jitted train step for ``plan`` on ``mesh``.

    Args:
        loss_fn: ``(params, batch) -> scalar mean loss`` over a batch, or a
            :class:`~torsh_jax.parallel.layered.LayeredModel` (lets ZeRO-3
            gather one layer at a time).
        optimizer: optax transformation.
        plan: the parallel plan.
        mesh: from :func:`torsh_jax.parallel.mesh.build_mesh`.
        example_params: parameters (or ``jax.ShapeDtypeStruct`` s) to derive
            shardings from before ``init`` is called; default: from ``init``'s argument.

    Returns:
        A :class:`TrainStep`; unpack as ``init, step``.

    Raises:
        NotSupportedYetError: the plan needs a strategy not built yet.
        ShardingError: a parameter or batch does not divide the mesh.
    """
    check_supported(plan, mesh)
    axes = data_axes(mesh)
    dp_size = math.prod(mesh.shape[a] for a in axes)
    global_batch = plan.batch.global_batch_size(dp_size)
    batch_p = P(axes)
    built: dict[str, Any] = {"traces": 0}

    def build(params_like: PyTree) -> None:
        program = build_program(loss_fn, optimizer, plan, mesh, params_like)

        device_shardings = named_shardings(program.state_specs, mesh)
        shardings = host_shardings(device_shardings, plan)

        def traced(state, batch):
            built["traces"] += 1
            return program.run(to_device_memory(state, device_shardings, plan), batch)

        built["shardings"] = shardings
        built["jitted"] = jax.jit(
            traced, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0
        )
        built["init"] = jax.jit(_init_state(optimizer, plan, program.init_feedback), out_shardings=shardings)

    def ensure_built(params_like: PyTree) -> None:
        if "jitted" not in built:
            build(jax.eval_shape(lambda p: cast_tree(p, plan.precision.param_dtype), params_like))

    if example_params is not None:
        ensure_built(example_params)

    def init(params: PyTree) -> TrainState:
        ensure_built(params)
        return built["init"](params)

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        ensure_built(state.params)
        return built["jitted"](state, train_step.shard_batch(batch))

    train_step = TrainStep(
        init=init,
        step=step,
        plan=plan,
        mesh=mesh,
        batch_spec=batch_p,
        global_batch_size=global_batch,
        loss=loss_fn,
        _built=built,
    )
    return train_step


def _init_state(
    optimizer: optax.GradientTransformation, plan: ParallelPlan, init_feedback: Callable | None = None
) -> Callable:
    scaler = scaler_for(plan)

    def init(params: PyTree) -> TrainState:
        params = cast_tree(params, plan.precision.param_dtype)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=None if scaler is None else scaler.init(),
            feedback=None if init_feedback is None else init_feedback(),
        )

    return init
