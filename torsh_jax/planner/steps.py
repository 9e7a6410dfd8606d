"""The train step :func:`~torsh_jax.planner.rank.verify` compiles for a candidate: the demo model of
the planned shape, or your own :class:`~torsh_jax.runtime.layered.LayeredModel`.

A step builder is ``build(plan, devices, remat) -> (train step, batch shapes)``: the train step of
``plan`` over ``devices`` (a target's compile-only devices too), its layers recomputed in the
backward pass where ``remat``, built from parameter shapes (nothing is allocated), and a global
batch of shapes. The optimizer is the one the plan names (``plan.optimizer``), whose state the
cost model counts.

Example (a model that is not the demo model, planned from its parameters and compiled as itself;
tests/test_planner.py runs it):
    >>> import jax, jax.numpy as jnp
    >>> from torsh_jax.runtime.layered import LayeredModel
    >>> model = LayeredModel(embed=lambda p, b: p["embed"][b["tokens"]],
    ...                      layer=lambda w, h: jnp.tanh(h @ w["w"]),
    ...                      head=lambda p, h, b: jnp.mean((h @ p["head"]) ** 2))
    >>> params = {"embed": jnp.zeros((64, 16)), "layers": {"w": jnp.zeros((4, 16, 16))},
    ...           "head": jnp.zeros((16, 64))}
    >>> build = model_step_builder(model, params, {"tokens": jnp.zeros((1, 8), jnp.int32)})
    >>> from torsh_jax import load_plan
    >>> train, batch = build(load_plan("ddp"), jax.devices()[:1], remat=True)
    >>> batch["tokens"].shape, train.lower(train.abstract_state(), batch) is not None
    ((8, 8), True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torsh_jax.typing import PyTree

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.plan import ParallelPlan
    from torsh_jax.planner.shape import ModelShape
    from torsh_jax.runtime.layered import LayeredModel

__all__ = ["StepBuilder", "demo_step_builder", "model_step_builder"]

#: ``(plan, devices, remat) -> (train step, batch shapes)``
StepBuilder = Callable[..., tuple[Any, PyTree]]


def demo_step_builder(shape: ModelShape, /) -> StepBuilder:
    """The demo model of ``shape`` (:func:`~torsh_jax.demo.run.abstract_train_step`)."""

    def build(plan: ParallelPlan, devices: Sequence, /, *, remat: bool):
        from torsh_jax.demo.run import abstract_train_step

        return abstract_train_step(plan, shape.demo_config(), devices, remat=remat)

    return build


def model_step_builder(model: LayeredModel, params: PyTree, example: PyTree, /) -> StepBuilder:
    """``model`` with ``params`` (arrays or their shapes) on batches shaped like ``example`` (any
    leading dim): :func:`~torsh_jax.runtime.step.abstract_step`; ``remat`` recomputes each layer
    (``model.remat``)."""

    def build(plan: ParallelPlan, devices: Sequence, /, *, remat: bool):
        import jax

        from torsh_jax.runtime.step import abstract_step

        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        return abstract_step(model._replace(remat=model.remat or remat), shapes, example, plan, devices)

    return build
