"""Pipeline parallelism inside the train step, by job:

* :mod:`~torsh_jax.runtime.pipeline.stages`: a plan's schedule table, the stacked layers split
  over ``stage``, and what a model must be for a pipeline;
* :mod:`~torsh_jax.runtime.pipeline.chunks`: layer-chunk storage under an interleaved schedule;
* :mod:`~torsh_jax.runtime.pipeline.branches`: the forward, backward and idle slots of one stage;
* :mod:`~torsh_jax.runtime.pipeline.executor`: one executor for every table (ticks, ``ppermute``);
* :mod:`~torsh_jax.runtime.pipeline.ends`: the embedding's and head's gradient sums, sharing buffers;
* :mod:`~torsh_jax.runtime.pipeline.varying`: the varying-axis types the branches must agree on.

Example:
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.plan.roles import compose
    >>> plan = load_plan("pp_interleaved")
    >>> layer_chunks(plan, compose(plan, {"data": 2, "stage": 4, "fsdp": 1, "tensor": 1}))
    2
"""

from __future__ import annotations

from torsh_jax.runtime.pipeline.chunks import chunk_layers, layer_chunks, unchunk_layers
from torsh_jax.runtime.pipeline.executor import pipeline_gradients, reduce_over_stage
from torsh_jax.runtime.pipeline.stages import require_layered, schedule_for, stage_specs

__all__ = [
    "pipeline_gradients",
    "reduce_over_stage",
    "schedule_for",
    "stage_specs",
    "require_layered",
    "layer_chunks",
    "chunk_layers",
    "unchunk_layers",
]
