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
    >>> params = {"w": jnp.zeros((3, 1))}
    >>> init, step = make_train_step(loss, optax.sgd(0.1), plan, mesh, params)
    >>> state = init(params)
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
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.call_checks import check_params, check_state, require_train_state
from torsh_jax.runtime.checks import check_tensor_split
from torsh_jax.runtime.decide import StepPlan, decide
from torsh_jax.runtime.fit import batch_key, check_compiled_fits, check_step_fits
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.runtime.layout import StateLayout, layout_for
from torsh_jax.runtime.mesh import mesh_shape_str
from torsh_jax.runtime.offload import to_device_memory
from torsh_jax.runtime.params import take_params, with_auto_tensor_names
from torsh_jax.runtime.precision import state_params
from torsh_jax.runtime.program import build_program
from torsh_jax.runtime.specs import path_str
from torsh_jax.runtime.state import TrainState
from torsh_jax.runtime.update import scaler_for
from torsh_jax.tensor.axis import has_tensor_blocks
from torsh_jax.typing import PyTree

__all__ = ["TrainStep", "abstract_step", "make_train_step"]


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


class _Traces:
    """How many times the step was traced (a retrace is a new compile)."""

    def __init__(self) -> None:
        self.count = 0


@dataclass(frozen=True)
class TrainStep:
    """A compiled-once ``(init, step)`` pair and every decision it was made from.

    Unpacks as ``init, step = make_train_step(...)``.

    Attributes:
        init: ``params -> TrainState`` placed on the mesh (the parameters the step was made for).
        step: ``(state, global_batch) -> (state, metrics)``; donates ``state``. Raises
            :class:`~torsh_jax.errors.ArgumentError` for a state another plan, optimizer or model
            made, or a loss that returns no scalar (checked when traced, not per step).
        decided: the step's decisions (:class:`~torsh_jax.runtime.decide.StepPlan`).
        layout: the state layout (:class:`~torsh_jax.runtime.layout.StateLayout`).
        jitted: the jitted ``(state, placed batch) -> (state, metrics)``.
        notes: what the step changes about the parameters it was given (dtype casts), one line each.
    """

    init: Callable[[PyTree], TrainState]
    step: Callable[[TrainState, PyTree], tuple[TrainState, dict]]
    decided: StepPlan
    layout: StateLayout
    jitted: Any = field(repr=False)
    notes: tuple[str, ...] = ()
    _traces: _Traces = field(repr=False, default_factory=_Traces)

    def __iter__(self) -> Iterator[Callable]:
        return iter((self.init, self.step))

    @property
    def plan(self) -> ParallelPlan:
        """The plan (with the parameters' flax axis names in its ``param_dims``)."""
        return self.decided.plan

    @property
    def mesh(self) -> Mesh:
        return self.decided.mesh

    @property
    def loss(self) -> LayeredModel:
        """The model the step differentiates (a plain loss as a model without stacked layers)."""
        return self.decided.model

    @property
    def batch_spec(self) -> P:
        """``PartitionSpec`` of every batch leaf's leading dim."""
        return self.decided.batch_spec

    @property
    def global_batch_size(self) -> int:
        """Examples per optimizer step."""
        return self.decided.global_batch_size

    @property
    def traces(self) -> int:
        """Times the step was traced: 1 after any number of same-shaped calls."""
        return self._traces.count

    @property
    def state_shardings(self) -> TrainState:
        """``NamedSharding`` pytree of the stored state."""
        return self.layout.shardings()

    def logical_params(self, params: PyTree) -> PyTree:
        """``state.params`` (or gradients) as the model defines them: identical except under an
        interleaved pipeline, which stores the stacked layers as ``[chunks, layers / chunks, ...]``."""
        return self.layout.logical_params(params)

    def abstract_state(self) -> TrainState:
        """The state's shapes, dtypes and shardings (``jax.ShapeDtypeStruct`` s): what :meth:`lower`
        and checkpoint restore need, with no state created."""
        return self.layout.abstract_state()

    def lower(self, state: TrainState, batch: PyTree) -> jax.stages.Lowered:
        """Lower the step for ``state`` and a global ``batch`` (for inspection); both may be
        ``jax.ShapeDtypeStruct`` s (:meth:`abstract_state`)."""
        return self.jitted.lower(state, self.shard_batch(batch))

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
    params: PyTree,
) -> TrainStep:
    """Build the jitted train step for ``plan`` on ``mesh``.

    Args:
        loss_fn: ``(params, batch) -> scalar mean loss`` over a batch, or a
            :class:`~torsh_jax.runtime.layered.LayeredModel` (lets ZeRO-3
            gather one layer at a time, and a pipeline split the layers).
        optimizer: optax transformation.
        plan: the parallel plan.
        mesh: from :func:`torsh_jax.runtime.mesh.build_mesh`.
        params: the parameters, or their shapes (``jax.eval_shape(init_fn, ...)``): every sharding
            is decided from them, before ``init`` is called (flax boxes and ``nnx.State`` are
            unboxed, :mod:`~torsh_jax.runtime.params`).

    Returns:
        A frozen :class:`TrainStep`; unpack as ``init, step``.

    Raises:
        NotSupportedYetError: the plan needs a strategy not built yet.
        ShardingError: a parameter or batch does not divide the mesh.
        ParameterError: a parameter cannot be trained (an integer leaf).
        DeviceMemoryError: from ``init`` or a call of ``step`` with a new batch shape: the state or
            the step cannot fit in a device's memory (:mod:`torsh_jax.runtime.fit`), before compiling
            (a lower bound) or before running (the compiled program's figure).
        MeshError: ``mesh`` is not one ``plan`` builds (names and sizes of its axes).
    """
    intake = take_params(params, plan, warn=True)
    decided = decide(loss_fn, with_auto_tensor_names(intake.plan, intake.params, loss_fn, mesh), mesh)
    like = jax.eval_shape(lambda p: state_params(p, plan.precision.param_dtype), intake.params)
    layout = layout_for(decided, like, optimizer)
    check_tensor_split(
        layout.compute, decided.roles, decided.plan, tensor_blocks=has_tensor_blocks(decided.model)
    )
    run = build_program(decided, optimizer, layout)
    traces = _Traces()
    device_shardings, shardings = layout.shardings(stored=False), layout.shardings()
    logical = layout.logical_params(layout.abstract.params)

    def traced(state, batch):
        check_state(state, layout.abstract, shardings=False)  # once per trace: no per-step cost
        traces.count += 1
        return run(to_device_memory(state, device_shardings, decided.plan), batch)

    jitted = jax.jit(
        traced, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0
    )
    init_state = _init_state(optimizer, decided.plan, layout.init_feedback, to_stored=layout.stored_params)
    jitted_init = jax.jit(init_state, out_shardings=shardings)
    fitted: set = set()

    def init(params: PyTree) -> TrainState:
        plain = take_params(params, plan).params
        check_params(jax.eval_shape(lambda p: p, plain), logical)
        check_step_fits(train_step)  # the state alone, before it is made
        return jitted_init(plain)

    def step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict]:
        require_train_state(state)
        shape_key = batch_key(batch)
        unchecked = shape_key not in fitted
        if unchecked:  # a new batch shape: refuse what cannot fit before placing and compiling
            check_step_fits(train_step, batch)
        batch = train_step.shard_batch(batch)
        try:
            if unchecked:  # compile now and refuse before running when XLA's figure exceeds the limit
                check_compiled_fits(train_step, jitted.lower(state, batch).compile())
                fitted.add(shape_key)
            return jitted(state, batch)
        except TorshError:
            raise
        except (TypeError, ValueError):  # jit refused the state before tracing: say which leaf and why
            check_state(state, train_step.abstract_state())
            raise

    train_step = TrainStep(init, step, decided, layout, jitted, intake.notes, traces)
    return train_step


def _init_state(
    optimizer: optax.GradientTransformation,
    plan: ParallelPlan,
    init_feedback: Callable | None = None,
    to_stored: Callable = lambda params: params,
) -> Callable:
    scaler = scaler_for(plan)

    def init(params: PyTree) -> TrainState:
        params = to_stored(state_params(params, plan.precision.param_dtype))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            loss_scale=None if scaler is None else scaler.init(),
            feedback=None if init_feedback is None else init_feedback(),
        )

    return init


def abstract_step(
    model: LayeredModel, shapes: PyTree, example: PyTree, plan: ParallelPlan, devices, /, *,
    num_slices: int | None = None,
) -> tuple[TrainStep, PyTree]:  # fmt: skip
    """``model``'s train step under ``plan`` over ``devices`` (a target's compile-only devices too),
    built from parameter ``shapes`` with the optimizer the plan names (nothing is allocated), and a
    global batch of shapes like ``example`` (any leading dim): what a compile-only check compiles.

    Example:
        >>> import jax.numpy as jnp
        >>> from torsh_jax import load_plan
        >>> model = LayeredModel(embed=lambda p, b: p["embed"][b["tokens"]],
        ...                      layer=lambda w, h: jnp.tanh(h @ w["w"]),
        ...                      head=lambda p, h, b: jnp.mean(h @ p["head"]))
        >>> shapes = jax.eval_shape(lambda: {"embed": jnp.zeros((64, 16)), "head": jnp.zeros((16, 4)),
        ...                                  "layers": {"w": jnp.zeros((2, 16, 16))}})
        >>> example = {"tokens": jnp.zeros((1, 8), jnp.int32)}
        >>> train, batch = abstract_step(model, shapes, example, load_plan("ddp"), jax.devices()[:1])
        >>> batch["tokens"].shape
        (8, 8)
    """
    from torsh_jax.optim import build_optimizer
    from torsh_jax.runtime.fit import batch_like
    from torsh_jax.runtime.mesh import build_mesh

    mesh = build_mesh(plan, devices, num_slices=num_slices)
    train = make_train_step(model, build_optimizer(plan.optimizer), plan, mesh, shapes)
    return train, batch_like(example, train.global_batch_size)
