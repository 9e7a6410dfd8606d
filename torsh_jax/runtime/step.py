"""``make_train_step``: a plan, a loss and an optimizer become a jitted ``(init, step)`` pair.

The step is one ``shard_map`` program over the whole mesh in which we place
every collective; it is jitted once with donated state.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from torsh_jax.plan import ParallelPlan, BatchSpec
    >>> from torsh_jax.runtime.mesh import build_mesh
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

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.errors import ShardingError, TorshError
from torsh_jax.plan.roles import compose
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.call_checks import check_state, require_train_state, scalar_loss
from torsh_jax.runtime.checks import check_mesh, check_supported, check_tensor_split
from torsh_jax.runtime.fit import batch_key, check_compiled_fits, check_step_fits
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.runtime.layout import StateLayout
from torsh_jax.runtime.mesh import mesh_shape_str
from torsh_jax.runtime.offload import check_offload, to_device_memory
from torsh_jax.runtime.params import take_params
from torsh_jax.runtime.pipeline import layer_chunks, require_layered, unchunk_layers
from torsh_jax.runtime.precision import cast_tree
from torsh_jax.runtime.program import build_program
from torsh_jax.runtime.specs import path_str
from torsh_jax.runtime.state import TrainState
from torsh_jax.runtime.update import scaler_for
from torsh_jax.tensor.axis import has_tensor_blocks
from torsh_jax.typing import PyTree

__all__ = ["TrainStep", "make_train_step"]


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
        step: ``(state, global_batch) -> (state, metrics)``; donates ``state``. Raises
            :class:`~torsh_jax.errors.ArgumentError` for a state another plan, optimizer or model
            made, or a loss that returns no scalar (checked when traced, not per step).
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

    @property
    def notes(self) -> tuple[str, ...]:
        """What the step changes about the parameters it was given (dtype casts), one line each."""
        return self._built.get("notes", ())

    @property
    def prepared(self) -> bool:
        """Whether the state layout exists (``init`` or :meth:`prepare` has run)."""
        return "layout" in self._built

    @property
    def layout(self) -> StateLayout:
        """The state layout (after ``init`` was called, or with ``example_params``)."""
        return self._built["layout"]

    def logical_params(self, params: PyTree) -> PyTree:
        """``state.params`` (or gradients) as the model defines them: identical except under an
        interleaved pipeline, which stores the stacked layers as ``[chunks, layers / chunks, ...]``."""
        return self.layout.logical_params(params)

    def prepare(self, params_like: PyTree) -> None:
        """Derive the state layout from parameters or their shapes, as ``init`` would, without
        creating a state (to restore one into it, e.g. :func:`torsh_jax.checkpoint.restore`)."""
        self._built["ensure_built"](params_like)

    def abstract_state(self) -> TrainState:
        """The state's shapes, dtypes and shardings (``jax.ShapeDtypeStruct`` s; after ``init`` or
        :meth:`prepare`): what :meth:`lower` needs, with no state created."""
        return self.layout.abstract_state()

    def lower(self, state: TrainState, batch: PyTree) -> jax.stages.Lowered:
        """Lower the step for ``state`` and a global ``batch`` (for inspection); both may be
        ``jax.ShapeDtypeStruct`` s (:meth:`abstract_state`)."""
        return self._built["jitted"].lower(state, self.shard_batch(batch))

    def shard_batch(self, batch: PyTree) -> PyTree:
        """Validate a global batch and place it on the mesh (shapes: their sharding set)."""
        _validate_batch(batch, global_batch=self.global_batch_size, plan=self.plan, mesh=self.mesh)
        return jax.tree.map(
            lambda x: _place(x, NamedSharding(self.mesh, _leaf_batch_spec(self.batch_spec, x))), batch
        )


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Put a global batch leaf on the mesh; host data works in multi-process runs too
    (every process passes the same global array and keeps only its shards)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
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
            :class:`~torsh_jax.runtime.layered.LayeredModel` (lets ZeRO-3
            gather one layer at a time).
        optimizer: optax transformation.
        plan: the parallel plan.
        mesh: from :func:`torsh_jax.runtime.mesh.build_mesh`.
        example_params: parameters (or ``jax.ShapeDtypeStruct`` s) to derive
            shardings from before ``init`` is called; default: from ``init``'s argument.

    Returns:
        A :class:`TrainStep`; unpack as ``init, step``.

    Raises:
        NotSupportedYetError: the plan needs a strategy not built yet.
        ShardingError: a parameter or batch does not divide the mesh.
        DeviceMemoryError: from ``init`` or a call of ``step`` with a new batch shape: the state or
            the step cannot fit in a device's memory (:mod:`torsh_jax.runtime.fit`), before compiling
            (a lower bound) or before running (the compiled program's figure).
        MeshError: ``mesh`` is not one ``plan`` builds (names and sizes of its axes).
    """
    check_mesh(plan, mesh)
    roles = compose(plan, mesh.shape)
    check_supported(plan, roles)
    require_layered(loss_fn, roles)
    check_offload(plan, mesh)
    global_batch = plan.batch.global_batch_size(roles.batch_size)
    built: dict[str, Any] = {"traces": 0}

    def build(params_like: PyTree, layout_plan: ParallelPlan) -> None:
        program = build_program(scalar_loss(loss_fn), optimizer, layout_plan, mesh, params_like)
        layout = program.layout
        check_tensor_split(layout.compute, roles, plan, tensor_blocks=has_tensor_blocks(loss_fn))
        device_shardings = layout.shardings(stored=False)
        shardings = layout.shardings()

        def traced(state, batch):
            check_state(state, layout.abstract, shardings=False)  # once per trace: no per-step cost
            built["traces"] += 1
            return program.run(to_device_memory(state, device_shardings, plan), batch)

        built.update(layout=layout, shardings=shardings)
        built["jitted"] = jax.jit(
            traced, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0
        )
        init_state = _init_state(optimizer, plan, layout.init_feedback, to_stored=layout.stored_params)
        built["init"] = jax.jit(init_state, out_shardings=shardings)

    def ensure_built(params_like: PyTree) -> PyTree:
        """Plain parameters of ``params_like``; builds the step the first time."""
        intake = take_params(params_like, plan, warn="jitted" not in built)
        if "jitted" not in built:
            built["notes"] = intake.notes
            like = jax.eval_shape(lambda p: cast_tree(p, plan.precision.param_dtype), intake.params)
            build(like, intake.plan)
        return intake.params

    built["ensure_built"] = ensure_built
    if example_params is not None:
        ensure_built(example_params)

    def init(params: PyTree) -> TrainState:
        plain = ensure_built(params)
        check_step_fits(train_step)  # the state alone, before it is made
        return built["init"](plain)

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        require_train_state(state)
        if "jitted" not in built:  # a state stored by an equal step: its layers may be in chunks
            stacked = loss_fn.layers_key if isinstance(loss_fn, LayeredModel) else None
            ensure_built(unchunk_layers(state.params, stacked, layer_chunks(plan, roles)))
        shape_key = batch_key(batch)
        unchecked = shape_key not in built.setdefault("fitted", set())
        if unchecked:  # a new batch shape: refuse what cannot fit before placing and compiling
            check_step_fits(train_step, batch)
        batch = train_step.shard_batch(batch)
        try:
            if unchecked:  # compile now and refuse before running when XLA's figure exceeds the limit
                check_compiled_fits(train_step, built["jitted"].lower(state, batch).compile())
                built["fitted"].add(shape_key)
            return built["jitted"](state, batch)
        except TorshError:
            raise
        except (TypeError, ValueError):  # jit refused the state before tracing: say which leaf and why
            check_state(state, train_step.abstract_state())
            raise

    train_step = TrainStep(
        init=init,
        step=step,
        plan=plan,
        mesh=mesh,
        batch_spec=P(roles.batch_axes),
        global_batch_size=global_batch,
        loss=loss_fn,
        _built=built,
    )
    return train_step


def _init_state(
    optimizer: optax.GradientTransformation,
    plan: ParallelPlan,
    init_feedback: Callable | None = None,
    to_stored: Callable = lambda params: params,
) -> Callable:
    scaler = scaler_for(plan)

    def init(params: PyTree) -> TrainState:
        params = to_stored(cast_tree(params, plan.precision.param_dtype))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=None if scaler is None else scaler.init(),
            feedback=None if init_feedback is None else init_feedback(),
        )

    return init
