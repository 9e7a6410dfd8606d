"""The planner: which plan fits and runs fastest for a model on a machine, predicted and checked.

Candidates (:mod:`~torsh_jax.planner.space`) are whole plans for the devices and the global batch;
the cost model (:mod:`~torsh_jax.planner.cost`, its memory part :mod:`~torsh_jax.planner.memory`)
predicts each one's memory and step time from the plan theory's collectives and the machine's
figures (:mod:`~torsh_jax.planner.machine`); :func:`search` ranks them and :func:`verify` compiles
one to put the compiler's memory beside the prediction. Public names load on first use.

Example:
    >>> from torsh_jax.planner import Machine, ModelShape, search
    >>> best = search(ModelShape.demo("tiny"), Machine.from_target("v5e-8"), global_batch=64)[0]
    >>> best.fits
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Candidate": "torsh_jax.planner.space",
    "Space": "torsh_jax.planner.space",
    "candidates": "torsh_jax.planner.space",
    "Link": "torsh_jax.planner.machine",
    "Machine": "torsh_jax.planner.machine",
    "ModelShape": "torsh_jax.planner.shape",
    "parse_model": "torsh_jax.planner.shape",
    "Prediction": "torsh_jax.planner.cost",
    "predict": "torsh_jax.planner.cost",
    "search": "torsh_jax.planner.rank",
    "search_verified": "torsh_jax.planner.rank",
    "Verified": "torsh_jax.planner.rank",
    "verify": "torsh_jax.planner.rank",
    "model_step_builder": "torsh_jax.planner.steps",
    "ModelGradients": "torsh_jax.planner.gradients",
    "compiled_memory": "torsh_jax.planner.calibrate",
    "PlannedModel": "torsh_jax.planner.own_model",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.planner", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.planner.calibrate import compiled_memory
    from torsh_jax.planner.cost import Prediction, predict
    from torsh_jax.planner.gradients import ModelGradients
    from torsh_jax.planner.machine import Link, Machine
    from torsh_jax.planner.own_model import PlannedModel
    from torsh_jax.planner.rank import Verified, search, search_verified, verify
    from torsh_jax.planner.shape import ModelShape, parse_model
    from torsh_jax.planner.space import Candidate, Space, candidates
    from torsh_jax.planner.steps import model_step_builder
