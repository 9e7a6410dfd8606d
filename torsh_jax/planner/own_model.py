"""Your model as the planner reads it: ``torsh-jax plan --model MODULE:NAME``.

``NAME`` in the importable ``MODULE`` (the working directory is searched first) is a
:class:`PlannedModel`, or a function of no arguments that returns one: a
:class:`~torsh_jax.runtime.layered.LayeredModel` (a flax model's, ``from_linen(...).model``), its
parameters (arrays or their shapes), an example batch and the widths the activation formulas
need. ``plan`` then ranks that model's plans, compiles its own train step for ``--verify``, and
on a calibrated machine of this host's kind reads the compiled memory from its own gradient
(:class:`~torsh_jax.planner.gradients.ModelGradients`).

Example (``my_model.py`` beside you; ``torsh-jax plan --model my_model:planned --target v5e-8
--global-batch 64``; here the demo model as if it were yours):
    >>> import jax
    >>> from torsh_jax.demo.model import LMConfig, init_params, layered_model, synthetic_tokens
    >>> cfg = LMConfig(layers=2)
    >>> params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    >>> planned = PlannedModel.of(layered_model(cfg), params, synthetic_tokens(cfg, batch_size=1, seed=0),
    ...                           name="mine", d_model=64, seq_len=32, vocab=256, heads=4, mlp=256)
    >>> planned.shape.name, planned.shape.layers, planned.shape.tensor_blocks
    ('mine', 2, True)
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from torsh_jax.errors import PlanError
from torsh_jax.typing import PyTree

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.planner.gradients import ModelGradients
    from torsh_jax.planner.shape import ModelShape
    from torsh_jax.planner.steps import StepBuilder
    from torsh_jax.runtime.layered import LayeredModel

__all__ = ["PlannedModel", "load_planned_model", "names_own_model"]

#: What ``--model`` takes for your model.
FORM = "MODULE:NAME (NAME a PlannedModel, or a function returning one)"


class PlannedModel(NamedTuple):
    """A model of your own, planned: the model, its parameters (arrays or shapes), an example
    batch (any leading dim, ``shape.seq_len`` tokens per example) and its
    :class:`~torsh_jax.planner.shape.ModelShape`."""

    model: LayeredModel
    params: PyTree
    example: PyTree
    shape: ModelShape

    @classmethod
    def of(cls, model: LayeredModel, params: PyTree, example: PyTree, /, *, name: str = "model", **widths):
        """The shape read from the model (:meth:`ModelShape.from_model`) with ``widths``
        (``d_model``, ``seq_len``, ``vocab``, ``heads``, ``mlp``)."""
        from torsh_jax.planner.shape import ModelShape

        shape = replace(ModelShape.from_model(model, params, **widths), name=name)
        return cls(model, params, example, shape)

    def step_builder(self) -> StepBuilder:
        """The train step ``verify`` compiles: this model's (:func:`model_step_builder`)."""
        from torsh_jax.planner.steps import model_step_builder

        return model_step_builder(self.model, self.params, self.example)

    def with_tensor_counts(self, found, devices) -> PlannedModel:
        """This model with its collectives over ``tensor`` read from its compiled step, for every
        candidate in ``found`` that ``devices`` hold the ``tensor`` axis of
        (:func:`~torsh_jax.planner.tensor_counts.with_tensor_counts`; a model written with the
        tensor blocks keeps Megatron's count)."""
        from torsh_jax.planner.gradients import stack_at_depth
        from torsh_jax.planner.steps import model_step_builder
        from torsh_jax.planner.tensor_counts import with_tensor_counts

        key = self.model.layers_key
        build = lambda layers: model_step_builder(
            self.model, stack_at_depth(self.params, key, layers), self.example
        )
        return self._replace(shape=with_tensor_counts(self.shape, found, build, devices))

    def gradients(self) -> ModelGradients:
        """The gradient programs its compiled memory is read from."""
        from torsh_jax.planner.gradients import ModelGradients

        return ModelGradients(self.model, self.params, self.example)


def names_own_model(spec: str, /) -> bool:
    """Whether ``--model`` names a model of your own (``MODULE:NAME``), not the demo model.

    Example:
        >>> names_own_model("my_model:planned"), names_own_model("demo:150m")
        (True, False)
    """
    module, colon, name = spec.strip().partition(":")
    return bool(colon) and module != "demo" and name.isidentifier()


def load_planned_model(spec: str, /) -> PlannedModel:
    """The :class:`PlannedModel` ``spec`` (``MODULE:NAME``) names, imported from the working
    directory or the installed packages.

    Raises:
        PlanError: the module does not import, has no such name, or it is not a PlannedModel.
    """
    module_name, _, name = spec.strip().partition(":")
    searched = [os.getcwd(), *sys.path]
    sys.path, given = searched, sys.path  # the working directory, while the model is made too
    try:
        found = getattr(_imported(module_name, spec), name, None)
        if found is None:
            raise PlanError(
                f"{module_name} has no {name}", key="--model", fix=f"define {name} in {module_name}"
            )
        planned = found if isinstance(found, PlannedModel) else found() if callable(found) else found
    finally:
        sys.path = given
    if not isinstance(planned, PlannedModel):
        raise PlanError(
            f"{spec} is a {type(planned).__name__}, not a PlannedModel",
            key="--model",
            fix="make it PlannedModel.of(model, params, example, d_model=.., seq_len=.., vocab=.., "
            "heads=.., mlp=..)",
        )
    return planned


def _imported(module_name: str, spec: str):
    """``module_name`` imported (the caller puts the working directory first on the path)."""
    try:
        return importlib.import_module(module_name)
    except (ImportError, ValueError, TypeError) as error:  # also an empty or relative name
        raise PlanError(
            f"cannot import {module_name!r} for {spec}: {error}",
            key="--model",
            fix=f"run from the directory holding it and name a module, not a file (my_model:planned for "
            f"my_model.py); the form is {FORM}",
        ) from None
