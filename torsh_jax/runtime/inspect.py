"""Report a train step's collectives and memory from its compiled program.

Example:
    >>> import jax, optax
    >>> from torsh_jax.demo.model import LMConfig, init_params, loss_fn, synthetic_tokens
    >>> from torsh_jax.runtime.mesh import build_mesh
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.runtime.step import make_train_step
    >>> cfg, plan = LMConfig(layers=1), load_plan("ddp")
    >>> params = init_params(cfg, jax.random.key(0))
    >>> mesh = build_mesh(plan, jax.devices()[:1])
    >>> train = make_train_step(loss_fn(cfg), optax.adamw(1e-3), plan, mesh, params)
    >>> state = train.init(params)
    >>> report = inspect_step(train, state, synthetic_tokens(cfg, batch_size=8, seed=0))
    >>> report["theory"]["description"]
    'DDP over data=1'
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from torsh_jax.analysis import summarize
from torsh_jax.analysis.hlo import mesh_positions
from torsh_jax.analysis.memory import peak_of
from torsh_jax.analysis.overlap import collectives_once
from torsh_jax.analysis.report import sent_per_device, widening_note
from torsh_jax.analysis.theory import (
    Theory,
    megatron_blocks,
    pipeline_stages,
    pipelined_megatron_blocks,
    plan_theory,
)
from torsh_jax.runtime.layered import split_params
from torsh_jax.runtime.mesh import default_num_slices
from torsh_jax.runtime.pipeline import schedule_for
from torsh_jax.runtime.pipeline.measured import mixed_collectives, stage_collectives, stage_totals
from torsh_jax.runtime.specs import entry_axes, path_str
from torsh_jax.runtime.state import TrainState
from torsh_jax.runtime.step import TrainStep
from torsh_jax.tensor.axis import has_tensor_blocks

__all__ = ["inspect_step", "headline", "data_theory", "tensor_theory", "stage_theory", "tensor_split"]

_is_axes = lambda x: isinstance(x, tuple)


def _param_count(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def _shard_counts(train: TrainStep) -> dict:
    """Per parameter: its element count in one tensor shard (the whole leaf when not split)."""
    sizes = dict(train.mesh.shape)

    def one(leaf, split: tuple[str, ...]) -> int:
        return int(np.prod(leaf.shape)) // int(np.prod([sizes[a] for a in split]))

    layout = train.layout
    return jax.tree.map(one, layout.abstract.params, layout.split, is_leaf=lambda x: isinstance(x, tuple))


def _shard_param_count(train: TrainStep) -> int:
    """Parameters of one tensor shard: what the data-parallel axes synchronise per device group."""
    return int(sum(jax.tree.leaves(_shard_counts(train))))


def _layer_fraction(train: TrainStep) -> float:
    """Part of the parameters in stacked layers: a layered model's, none for a plain loss (nor under
    a pipeline, whose ZeRO-3 gathers a stage's parameters once per step)."""
    if not train.loss.stacked or train.layout.roles.stage_axis is not None:
        return 0.0
    counts = _shard_counts(train)
    return sum(jax.tree.leaves(counts[train.loss.layers_key])) / sum(jax.tree.leaves(counts))


def _head_fraction(train: TrainStep) -> float:
    """Part of the parameters in a layered model's head, a table the embedding reads too left out
    (none for a plain loss, nor under a pipeline)."""
    model = train.loss
    if not model.stacked or train.layout.roles.stage_axis is not None or model.head_keys is None:
        return 0.0
    counts = _shard_counts(train)
    own = [k for k in model.head_keys if k not in (model.embed_keys or ())]
    return sum(sum(jax.tree.leaves(counts[k])) for k in own) / sum(jax.tree.leaves(counts))


#: Why a pipelined step's tensor-axis theory and measurement are the first stage's.
PIPELINED_TENSOR_NOTE = (
    "tensor: the collectives run inside the pipeline's per-tick branches and a device runs one branch "
    "per tick, so theory.axes.tensor (theory and measured) is the first stage's, each branch's "
    "collectives counted once per slot that stage runs; totals count every branch as run"
)


#: Why a pipelined step's tensor axis has no theory (sequence parallelism or remat).
PIPELINED_TENSOR_UNMODELLED_NOTE = (
    "tensor: no theory of a pipeline's tensor collectives with sequence parallelism or remat; "
    "theory.other_axes_wire_bytes['tensor'] is the first stage's, each branch's collectives counted "
    "once per slot that stage runs"
)


def tensor_theory(train: TrainStep, batch: Any) -> Theory | None:
    """The tensor axis's theory for a layered model built from the tensor blocks (else ``None``);
    under a pipeline the first stage's (:data:`PIPELINED_TENSOR_NOTE`), without sequence
    parallelism or remat (else ``None``)."""
    roles, model, plan = train.layout.roles, train.loss, train.plan
    if not _megatron_tensor(train):
        return None
    if roles.stage_axis is not None:
        return _pipelined_tensor_theory(train, batch)
    compute = jnp.dtype(plan.precision.compute_dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute), train.layout.abstract.params)
    embed_params = split_params(model, params)[0]
    micro = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((plan.batch.micro_batch_size, *x.shape[1:]), x.dtype), batch
    )
    hidden = jax.eval_shape(model.embed, embed_params, micro)
    replicated = sum(
        x.size * compute.itemsize
        for x, split in zip(jax.tree.leaves(params), jax.tree.leaves(train.layout.split, is_leaf=_is_axes))
        if not split
    )
    zero3_regathers = roles.gather == "on_use" and plan.zero.reshard_after_forward
    return megatron_blocks(
        hidden.size * compute.itemsize,
        tensor_size=roles.size(roles.tensor_axis),
        layers=_layers(train),
        sequence_parallel=roles.sequence_parallel,
        token_bytes=math.prod(hidden.shape[:-1]) * 4,
        replicated_grad_bytes=replicated,
        recomputed=model.remat or zero3_regathers,
        micro_steps=plan.batch.accumulation_steps,
    )


def _pipelined_tensor_theory(train: TrainStep, batch: Any) -> Theory | None:
    """The first stage's tensor collectives (:func:`pipelined_megatron_blocks`); ``None`` with
    sequence parallelism or remat, which it does not count."""
    roles, plan = train.layout.roles, train.plan
    if roles.sequence_parallel or train.loss.remat:
        return None
    schedule = schedule_for(plan, roles)
    return pipelined_megatron_blocks(
        _pipeline_activation_bytes(train, batch),
        tensor_size=roles.size(roles.tensor_axis),
        layers=_layers(train) // schedule.stages,
        microbatches=schedule.microbatches,
        passes=plan.batch.accumulation_steps,
        virtual_stages=schedule.virtual_stages,
        splits_backward=schedule.splits_backward,
    )


def _stage_of(compiled, train: TrainStep) -> list[int]:
    """The pipeline stage of each logical device id of ``compiled`` (its position in the mesh)."""
    mesh = train.mesh
    positions = mesh_positions(compiled, mesh) or range(mesh.size)
    axis = mesh.axis_names.index(train.layout.roles.stage_axis)
    return np.unravel_index(np.asarray(positions), mesh.devices.shape)[axis].tolist()


def _pipelined_tensor_notes(tensor: Theory | None, found: list) -> list[str]:
    """What the report says of a pipeline's tensor axis: counted as its first stage runs it, with
    the collectives XLA combined across a branch's edge; or not modelled."""
    if tensor is None:
        return [PIPELINED_TENSOR_UNMODELLED_NOTE]
    mixed = [c for c in mixed_collectives(found) if c.axes == ("tensor",)]
    if not mixed:
        return [PIPELINED_TENSOR_NOTE]
    sent = sum(c.wire_bytes_per_step for c in mixed)
    combined = (
        f"; {len(mixed)} combine a branch's and other operations ({sent:.0f} wire bytes), counted as run"
    )
    return [PIPELINED_TENSOR_NOTE + combined]


def _megatron_tensor(train: TrainStep) -> bool:
    """Whether the step has a tensor axis over a layered model built from the tensor blocks."""
    model = train.loss
    return train.layout.roles.tensor_axis is not None and model.stacked and has_tensor_blocks(model)


def _pipeline_activation_bytes(train: TrainStep, batch: Any) -> int:
    """Bytes of one pipeline micro-batch's activation on one device (what crosses a stage boundary)."""
    plan, roles, model = train.plan, train.layout.roles, train.loss
    compute = jnp.dtype(plan.precision.compute_dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute), train.layout.abstract.params)
    rows = plan.batch.micro_batch_size // plan.pipeline.microbatches
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch)
    hidden = jax.eval_shape(model.embed, split_params(model, params)[0], micro)
    split = roles.size(roles.tensor_axis) if roles.sequence_parallel else 1
    return hidden.size * hidden.dtype.itemsize // split


def _shared_grad_bytes(train: TrainStep) -> int:
    """Per device: bytes of the embedding and head gradients summed over ``stage`` (plus the loss)."""
    layout, key = train.layout, train.loss.layers_key
    counts = _shard_counts(train)
    shared = sum(n for k, v in counts.items() if k != key for n in jax.tree.leaves(v))
    # reduce-scattered per micro-step: ZeRO-2, and ZeRO-3 under a pipeline (it gathers once per step)
    scattered = layout.roles.grads_sharded and layout.roles.reduce != "per_step"
    if scattered:
        fsdp = layout.roles.size(layout.roles.shard_axis)
        dims = {k: v for k, v in layout.dims.items() if k != key}
        sharded = {k: v for k, v in counts.items() if k != key}
        shared = sum(n // (fsdp if d is not None else 1) for n, d in zip(jax.tree.leaves(sharded),
                     jax.tree.leaves(dims, is_leaf=lambda x: x is None)))  # fmt: skip
    return shared * jnp.dtype(train.plan.precision.param_dtype).itemsize + 4


def stage_theory(train: TrainStep, batch: Any) -> Theory | None:
    """The ``stage`` axis's theory of a pipelined step (else ``None``)."""
    roles, plan = train.layout.roles, train.plan
    if roles.stage_axis is None:
        return None
    return pipeline_stages(
        _pipeline_activation_bytes(train, batch),
        stages=roles.size(roles.stage_axis),
        microbatches=plan.pipeline.microbatches,
        passes=plan.batch.accumulation_steps,
        shared_grad_bytes=_shared_grad_bytes(train),
        virtual_stages=plan.pipeline.virtual_stages,
    )


def data_theory(train: TrainStep) -> Theory:
    """The plan's data-parallel theory for this step's model: one tensor shard's parameters."""
    return plan_theory(
        train.plan,
        param_count=_shard_param_count(train),
        num_devices=train.mesh.size,
        num_slices=default_num_slices(train.plan),
        layer_fraction=_layer_fraction(train),
        layers=_layers(train),
        head_fraction=_head_fraction(train),
    )


def _layers(train: TrainStep) -> int | None:
    """Stacked layers of a layered model (``None`` for a plain loss)."""
    if not train.loss.stacked:
        return None
    logical = train.layout.logical_params(train.layout.abstract.params)
    return jax.tree.leaves(logical[train.loss.layers_key])[0].shape[0]


def inspect_step(train: TrainStep, state: TrainState, batch: Any, *, compiled: Any = None) -> dict:
    """Summary of the compiled step: collectives, totals, memory and theory. ``state`` may be
    :meth:`~torsh_jax.runtime.step.TrainStep.abstract_state` (nothing is allocated or run).

    See :func:`torsh_jax.analysis.summarize` for the keys; adds
    ``param_count``, ``shard_param_count`` (parameters of one tensor shard,
    which the theory of the data-parallel axes counts), ``plan``, ``roles`` (what each mesh axis does) and
    ``theory["axes"]["tensor"]`` (a model built from the tensor blocks: the
    Megatron theory of its tensor collectives against the measured ones, per
    kind), ``theory["axes"]["stage"]`` and ``pipeline`` (a pipelined step: the
    stage traffic against its theory, and the schedule table with its bubble
    and the activations each stage holds; ``stage_totals``: per stage, the bytes one of its
    devices sends, each branch counted as that stage runs it, where ``totals`` count every branch
    as run), ``tensor_split`` (a ``tensor`` axis: per parameter path, the dims split over it,
    :func:`tensor_split`), ``state_bytes_per_device`` (from the state layout: ``step``,
    ``params``, ``opt_state``, ``loss_scale``,
    ``feedback`` and ``total``) and ``notes``
    (what the step changed about the parameters, e.g. a dtype cast).
    """
    if compiled is None:  # given: compiled already (for an accelerator target, torsh_jax.targets)
        compiled = train.lower(state, batch).compile()
    theory, pipelined = data_theory(train), train.layout.roles.stage_axis is not None
    tensor = tensor_theory(train, batch)
    axis_theories = {"tensor": tensor, "stage": stage_theory(train, batch)}
    axis_theories = {axis: t for axis, t in axis_theories.items() if t is not None} or None
    schedule = schedule_for(train.plan, train.layout.roles) if pipelined else None
    first_stage = (lambda found: stage_collectives(found, schedule, 0)) if pipelined else None
    summary = summarize(compiled, train.mesh, theory=theory, axis_theories=axis_theories, as_run=first_stage)
    if pipelined:
        summary["pipeline"] = schedule.to_json()
        found = collectives_once(compiled, train.mesh)
        summary["stage_totals"] = stage_totals(found, schedule, _stage_of(compiled, train))
    summary["param_count"] = _param_count(state.params)
    summary["shard_param_count"] = _shard_param_count(train)
    summary["plan"] = train.plan.name
    summary["roles"] = train.layout.roles.describe()
    summary["state_bytes_per_device"] = _state_bytes(train)
    summary["notes"] = list(train.notes)
    if train.layout.roles.tensor_axis is not None:
        summary["tensor_split"] = tensor_split(train)
    if pipelined and _megatron_tensor(train):
        summary["notes"] += _pipelined_tensor_notes(tensor, found)
    widened = widening_note(summary["collectives"])
    summary["notes"] += [widened] if widened else []
    return summary


def tensor_split(train: TrainStep) -> dict[str, list[int]]:
    """Per parameter path: the dims the step's compute layout splits over ``tensor`` (``[]``:
    replicated over it)."""
    axis = train.layout.roles.tensor_axis
    flat = jax.tree_util.tree_leaves_with_path(train.layout.compute, is_leaf=lambda x: isinstance(x, P))
    return {path_str(path): [d for d, e in enumerate(spec) if axis in entry_axes(e)] for path, spec in flat}


def _state_bytes(train: TrainStep) -> dict[str, int]:
    """Bytes of each train-state field one device holds, from the state layout, and their total."""
    parts = train.layout.bytes_per_device()
    return {**parts, "total": sum(parts.values())}


def headline(summary: dict) -> dict:
    """The few numbers a training log shows: wire bytes (measured over every axis, and the theory of
    every axis it models), measured / theory per modelled axis, and memory.

    Under a pipeline a device sends what its stage runs (``stage_totals``), not every branch of the
    compiled step: ``wire_bytes_per_step`` and ``payload_bytes_per_step`` are the busiest stage's,
    ``wire_bytes_by_stage`` each stage's (``None`` without a pipeline).
    ``wire_ratio`` is the data-parallel axes' ratio; ``wire_ratio_by_axis`` adds ``tensor`` and
    ``stage`` where the plan has them and a theory models them; ``unmodelled_wire_bytes_by_axis``
    holds the measured bytes of the axes no theory models (``wire_bytes_per_step`` counts them).
    """
    theory = summary.get("theory") or {}
    memory = summary.get("memory") or {}
    modelled = _modelled_axes(theory)
    stages, sent = summary.get("stage_totals"), sent_per_device(summary)
    return {
        "wire_bytes_per_step": sent["wire_bytes"],
        "wire_bytes_by_stage": [s["wire_bytes"] for s in stages] if stages else None,
        "theoretical_wire_bytes_per_step": sum(s["wire_bytes"] for s in modelled.values())
        if theory
        else None,
        "wire_ratio": theory.get("wire_ratio"),
        "wire_ratio_by_axis": {name: section.get("wire_ratio") for name, section in modelled.items()},
        "unmodelled_wire_bytes_by_axis": {
            axes: n for axes, n in (theory.get("other_axes_wire_bytes") or {}).items() if axes not in modelled
        },
        "payload_bytes_per_step": sent["payload_bytes"],
        "memory_per_device_bytes": peak_of(memory),
    }


def _modelled_axes(theory: dict) -> dict[str, dict]:
    """The theory's sections by axis: ``data_parallel`` (the data axes), then ``tensor``, ``stage``."""
    if not theory:
        return {}
    sections = {"data_parallel": theory, **theory.get("axes", {})}
    return {name: section for name, section in sections.items() if section.get("wire_bytes") is not None}
