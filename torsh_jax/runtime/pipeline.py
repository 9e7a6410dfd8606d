"""One executor for every schedule table, run per device inside the step's ``shard_map``.

The table is static, so the executor unrolls it tick by tick. At each tick
every stage runs one branch (``lax.switch`` on its row of the table): the
forward or backward of one chunk for one micro-batch, or nothing. Then the
stages that produced an activation (a gradient) send it to the next (previous)
stage with one ``ppermute`` whose pairs are exactly the sending stages, so the
bytes over ``stage`` are the activations and their gradients per micro-batch
per boundary and nothing else. A backward recomputes its chunk's forward from
the stashed input (``jax.vjp``), so a stage holds the inputs of the
micro-batches in flight, which is what the schedule decides.

A schedule with ``W`` slots (``zb_h1``) splits each chunk's backward: ``B``
recomputes the chunk from its stashed input and runs one ``vjp`` with respect
to that input only (no weight-gradient matmuls); zeros added to every layer's
output make their gradients the layers' output gradients. It sends the chunk's
input gradient on and leaves each layer's input and output gradient in a
``W`` stash slot. ``W`` later makes the weight gradients from that slot, one
layer at a time (recomputing that layer's forward), with nothing waiting on
it. The embedding and head weight gradients are made in ``B`` of the first and
last stage.

Embedding and head parameters are replicated over ``stage``; their gradients,
made on the first and last stage, are summed over ``stage`` once per pass. A
key both read (a tied embedding) gets the sum of its embedding and head
gradients (:func:`~torsh_jax.runtime.layered.join_params`) before that sum.

Inside ``shard_map`` over a mesh with a ``stage`` axis the step calls
``grads, loss, slots = pipeline_gradients(model, schedule)(params, batch, scale)``.

Example (the table and the layout a plan gets):
    >>> import jax.numpy as jnp
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.plan.roles import compose
    >>> plan = load_plan("pp_1f1b")
    >>> roles = compose(plan, {"data": 2, "stage": 4, "fsdp": 1, "tensor": 1})
    >>> schedule_for(plan, roles).ticks
    22
    >>> params = {"layers": {"w": jnp.zeros((8, 3))}}
    >>> stage_specs({"layers": {"w": P(None, None)}}, params, plan, roles, "layers")
    {'layers': {'w': P('stage', None)}}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from torsh_jax.errors import NotSupportedYetError, PlanError
from torsh_jax.pipeline.schedule import Schedule, build_schedule
from torsh_jax.pipeline.slots import BRANCHES, Segment, SlotPlan, slot_plan, tick_segments
from torsh_jax.plan.roles import STAGE_AXIS, Roles
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.accumulate import split_micro_batches
from torsh_jax.runtime.layered import LayeredModel, join_params, scan_layers, shared_keys, split_params
from torsh_jax.runtime.specs import path_str
from torsh_jax.tensor.axis import has_tensor_blocks, vary_over, varying_axes

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

PyTree = Any


class _Carry(NamedTuple):
    """What the ticks thread through: the stashes, gradients, loss and slot counts of one stage."""

    acts: jax.Array  # [activation slots, *hidden]: inputs received, until their backward
    cots: jax.Array  # [gradient slots, *hidden]: gradients received, until their backward
    wstash: jax.Array  # [weight slots, 2, layers per chunk, *hidden]: (inputs, output grads) for W
    grads: tuple  # (embed, chunks, head) accumulated in accum_dtype
    loss_sum: jax.Array
    counts: jax.Array  # [3]: forward, backward, weight slots run


def schedule_for(plan: ParallelPlan, roles: Roles) -> Schedule:
    """The schedule table of ``plan`` on the stages of ``roles``."""
    pipe = plan.pipeline
    return build_schedule(pipe.schedule, stages=roles.size(STAGE_AXIS), microbatches=pipe.microbatches,
                          virtual_stages=pipe.virtual_stages)  # fmt: skip


def layer_chunks(plan: ParallelPlan, roles: Roles) -> int:
    """Chunks the stored stacked layers are split into: ``virtual_stages`` under an interleaved
    pipeline, else 1.

    Interleaving puts layer chunk ``c * p + s`` on stage ``s``: a strided split of
    the layer dim that no ``PartitionSpec`` of ``[layers, ...]`` expresses. Stored
    as ``[v, layers / v, ...]`` (a reshape: the values keep their order) and
    split ``P(None, 'stage')``, stage ``s`` holds exactly its ``v`` chunks, so no
    parameter moves between stages in a step.
    """
    pipe = plan.pipeline
    interleaved = roles.stage_axis is not None and pipe.schedule == "interleaved"
    return pipe.virtual_stages if interleaved else 1


def chunk_layers(params: dict, key: str, chunks: int) -> dict:
    """``params`` with the stacked layers ``[layers, ...]`` under ``key`` stored as ``[chunks,
    layers / chunks, ...]`` (arrays or ``ShapeDtypeStruct`` s; ``chunks == 1``: unchanged)."""
    return _reshape_layers(params, key, chunks, lambda s: (chunks, s[0] // chunks, *s[1:]))


def unchunk_layers(params: dict, key: str, chunks: int) -> dict:
    """Inverse of :func:`chunk_layers`: the stacked layers back as ``[layers, ...]``."""
    return _reshape_layers(params, key, chunks, lambda s: (s[0] * s[1], *s[2:]))


def _reshape_layers(params: dict, key: str, chunks: int, new_shape: Callable) -> dict:
    if chunks == 1:
        return params

    def one(x):
        shape = new_shape(x.shape)
        return (
            jax.ShapeDtypeStruct(shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.reshape(shape)
        )

    return {**params, key: jax.tree.map(one, params[key])}


def require_layered(loss: Any, roles: Roles) -> None:
    """A pipeline needs the model's layer boundaries (and, with ``tensor``, tensor blocks)."""
    if roles.stage_axis is None:
        return
    if not isinstance(loss, LayeredModel):
        raise PlanError(
            f"a pipeline over stage={roles.size(STAGE_AXIS)} needs a LayeredModel (embed, stacked layers, "
            "head), not a plain loss function",
            key="loss_fn",
            fix="pass torsh_jax.LayeredModel(embed=..., layer=..., head=...), or set mesh.stage = 1",
        )
    _require_whole_stage_keys(loss, roles)
    if roles.tensor_axis is not None and not has_tensor_blocks(loss):
        raise NotSupportedYetError(
            "a pipeline with a compiler-partitioned tensor axis (a model without torsh_jax.tensor blocks) "
            "is not built yet",
            key="mesh.tensor",
            fix="build the layers from torsh_jax.tensor blocks (LayeredModel(tensor_blocks=True)), "
            "or set mesh.tensor = 1 with the pipeline",
        )


def _require_whole_stage_keys(model: LayeredModel, roles: Roles) -> None:
    """The stacked layers are split over ``stage``: embed and head (on one stage each) cannot read them."""
    readers = shared_keys(model).get(model.layers_key)
    if readers is None:
        return
    other = next(part for part in readers if part != "layers")
    raise NotSupportedYetError(
        f"{other} reads the stacked layers {model.layers_key!r}, which a pipeline over "
        f"stage={roles.size(STAGE_AXIS)} splits over its stages (the {other} runs on one stage)",
        key=f"loss_fn.{other}_keys",
        fix=f"keep what the {other} reads outside the stacked layers (a top-level key of its own), "
        "or set mesh.stage = 1",
    )


def stage_specs(compute: PyTree, params_like: PyTree, plan: ParallelPlan, roles: Roles, stacked_key: str):
    """``compute`` with the stacked layers' leading dim split over ``stage`` (contiguous groups).

    Raises:
        PlanError: a stacked leaf's layer count does not divide into stages x virtual stages.
    """
    if roles.stage_axis is None:
        return compute
    groups = roles.size(STAGE_AXIS) * plan.pipeline.virtual_stages

    def one(path, leaf, spec: P):
        if not (path and path_str(path[:1]) == stacked_key):
            return spec
        layers = leaf.shape[0] if leaf.shape else 0
        if layers % groups:
            raise PlanError(
                f"{layers} stacked layers do not split into {roles.size(STAGE_AXIS)} stages x "
                f"{plan.pipeline.virtual_stages} virtual stages (mesh {dict(roles.mesh_shape)})",
                key=path_str(path),
                fix=f"use a layer count divisible by {groups}, or change mesh.stage or the virtual stages",
            )
        return P(STAGE_AXIS, *tuple(spec)[1:])

    return jax.tree_util.tree_map_with_path(one, params_like, compute)


def _take(tree: PyTree, index: jax.Array) -> PyTree:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), tree)


def _put(tree: PyTree, index: jax.Array, value: PyTree) -> PyTree:
    return jax.tree.map(lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), index, 0),
                        tree, value)  # fmt: skip


def _add_at(tree: PyTree, index: jax.Array, value: PyTree) -> PyTree:
    return _put(tree, index, jax.tree.map(jnp.add, _take(tree, index), value))


def _like(cotangent: jax.Array, output: jax.Array) -> jax.Array:
    """``cotangent`` with ``output``'s dtype and varying axes (what ``vjp`` expects)."""
    return _cast(cotangent.astype(output.dtype), varying_axes(output))


def _add(tree: PyTree, value: PyTree) -> PyTree:
    return jax.tree.map(lambda x, v: x + v.astype(x.dtype), tree, value)


class _Pass:
    """The branches of one pipeline pass over ``m`` micro-batches (closes over parameters and batch)."""

    def __init__(self, model: LayeredModel, schedule: Schedule, params, batch, seed):
        self.model, self.v = model, schedule.virtual_stages
        self.split = schedule.splits_backward
        self.embed_p, layers, self.head_p = split_params(model, params)
        # this stage's chunks [v, layers per chunk, ...]: stored so when interleaved (layer_chunks)
        self.chunks = layers if self.v > 1 else jax.tree.map(lambda x: x[None], layers)
        self.per_chunk = jax.tree.leaves(self.chunks)[0].shape[1]  # layers per chunk
        self.micro = split_micro_batches(batch, schedule.microbatches)
        self.seed = seed

    def batch_of(self, micro):
        return _take(self.micro, micro)

    def run_chunk(self, chunk_params, hidden):
        return scan_layers(self.model.layer, chunk_params, hidden, remat=self.model.remat)

    def branches(self) -> dict[str, Callable]:
        """``name -> (carry, ints) -> (carry, sent forward, sent backward)``."""
        return {name: getattr(self, name) for name in BRANCHES}

    def idle(self, carry: _Carry, ints):
        return carry, self.zeros, self.zeros

    def F_first(self, carry: _Carry, ints):
        batch = self.batch_of(ints["micro"])
        hidden = self.run_chunk(_take(self.chunks, ints["chunk"]), self.model.embed(self.embed_p, batch))
        return _counted(carry, 0), hidden.astype(self.dtype), self.zeros

    def F_mid(self, carry: _Carry, ints):
        hidden = self.run_chunk(_take(self.chunks, ints["chunk"]), carry.acts[ints["activation_in"]])
        return _counted(carry, 0), hidden.astype(self.dtype), self.zeros

    def F_last(self, carry: _Carry, ints):
        batch = self.batch_of(ints["micro"])
        hidden = self.run_chunk(_take(self.chunks, ints["chunk"]), carry.acts[ints["activation_in"]])
        loss = self.model.head(self.head_p, hidden, batch).astype(jnp.float32)
        return _counted(carry._replace(loss_sum=carry.loss_sum + loss), 0), self.zeros, self.zeros

    def B_first(self, carry: _Carry, ints):
        batch, chunk = self.batch_of(ints["micro"]), ints["chunk"]
        if self.split:
            chunk_params = _take(self.chunks, chunk)
            forward = lambda e, z: self._probed_chunk(chunk_params, self.model.embed(e, batch), z)
            cotangent = carry.cots[ints["gradient_in"]]
            carry, (g_embed,) = self._split_backward(carry, ints, forward, (self.embed_p,), cotangent)
            return _counted(_added(carry, embed=g_embed), 1), self.zeros, self.zeros
        forward = lambda e, c: self.run_chunk(c, self.model.embed(e, batch))
        out, vjp = jax.vjp(forward, self.embed_p, _take(self.chunks, chunk))
        g_embed, g_chunk = vjp(_like(carry.cots[ints["gradient_in"]], out))
        return _counted(_added(carry, embed=g_embed, chunk=(chunk, g_chunk)), 1), self.zeros, self.zeros

    def B_mid(self, carry: _Carry, ints):
        chunk, hidden = ints["chunk"], carry.acts[ints["activation_in"]]
        if self.split:
            forward = lambda h, z: self._probed_chunk(_take(self.chunks, chunk), h, z)
            cotangent = carry.cots[ints["gradient_in"]]
            carry, (g_in,) = self._split_backward(carry, ints, forward, (hidden,), cotangent)
            return _counted(carry, 1), self.zeros, g_in.astype(self.dtype)
        out, vjp = jax.vjp(self.run_chunk, _take(self.chunks, chunk), hidden)
        g_chunk, g_in = vjp(_like(carry.cots[ints["gradient_in"]], out))
        return _counted(_added(carry, chunk=(chunk, g_chunk)), 1), self.zeros, g_in.astype(self.dtype)

    def B_last(self, carry: _Carry, ints):
        batch, chunk, hidden = self.batch_of(ints["micro"]), ints["chunk"], carry.acts[ints["activation_in"]]
        if self.split:

            def forward(head_p, h, z):
                out, inputs = self._probed_chunk(_take(self.chunks, chunk), h, z)
                return self.model.head(head_p, out, batch), inputs

            primals = (self.head_p, hidden)
            carry, (g_head, g_in) = self._split_backward(carry, ints, forward, primals, self.seed)
            return _counted(_added(carry, head=g_head), 1), self.zeros, g_in.astype(self.dtype)
        forward = lambda c, h, x: self.model.head(h, self.run_chunk(c, x), batch)
        loss, vjp = jax.vjp(forward, _take(self.chunks, chunk), self.head_p, hidden)
        g_chunk, g_head, g_in = vjp(_like(self.seed, loss))
        carry = _added(carry, chunk=(chunk, g_chunk), head=g_head)
        return _counted(carry, 1), self.zeros, g_in.astype(self.dtype)

    def W(self, carry: _Carry, ints):
        """The weight gradients of a chunk whose ``B`` ran: one ``vjp`` per layer with respect to its
        parameters, at the input and output gradient ``B`` left in the ``W`` stash."""
        chunk = ints["chunk"]
        inputs, g_outs = carry.wstash[ints["weight_stash"]]

        def one(_, layer):
            params, hidden, g_out = layer
            out, vjp = jax.vjp(lambda w: self.model.layer(w, hidden), params)
            return None, vjp(_like(g_out, out))[0]

        _, g_chunk = jax.lax.scan(one, None, (_take(self.chunks, chunk), inputs, g_outs))
        return _counted(_added(carry, chunk=(chunk, g_chunk)), 2), self.zeros, self.zeros

    def _probed_chunk(self, chunk_params, hidden, probes):
        """The chunk's output with ``probes[i]`` added to layer ``i``'s output, and every layer's
        input ``[layers per chunk, *hidden]``. Probes are zeros: their gradients are the layers'
        output gradients."""
        body = jax.checkpoint(self.model.layer) if self.model.remat else self.model.layer

        def one(h, layer):
            params, probe = layer
            return body(params, h) + probe, h

        return jax.lax.scan(one, hidden, (chunk_params, probes))

    def _split_backward(self, carry: _Carry, ints, forward, primals: tuple, seed):
        """``B`` of a split backward: ``forward(*primals, probes) -> (output, layer inputs)`` runs the
        chunk (:meth:`_probed_chunk`); one ``vjp`` at ``seed`` gives the gradients of ``primals``
        (no weight gradients) and every layer's output gradient, which goes to the ``W`` stash with
        the layer inputs. Returns the carry and the gradients of ``primals``."""
        probes = jnp.broadcast_to(self.zeros, (self.per_chunk, *self.zeros.shape))
        out, vjp, inputs = jax.vjp(forward, *primals, probes, has_aux=True)
        *grads, g_outs = vjp(_like(seed, out))
        saved = jnp.stack([inputs, g_outs.astype(inputs.dtype)])
        return carry._replace(wstash=_put(carry.wstash, ints["weight_stash"], saved)), tuple(grads)


def _counted(carry: _Carry, which: int) -> _Carry:
    return carry._replace(counts=carry.counts.at[which].add(1))


def _added(carry: _Carry, *, embed=None, chunk=None, head=None) -> _Carry:
    """``carry`` with gradients added: of the embedding, of chunk ``(index, grads)``, of the head."""
    g_embed, g_chunks, g_head = carry.grads
    g_embed = g_embed if embed is None else _add(g_embed, embed)
    g_chunks = g_chunks if chunk is None else _add_at(g_chunks, chunk[0], chunk[1])
    g_head = g_head if head is None else _add(g_head, head)
    return carry._replace(grads=(g_embed, g_chunks, g_head))


def _at(table: np.ndarray, tick: int | jax.Array, stage: jax.Array) -> jax.Array:
    """``table[tick, stage]``; a static tick embeds one row, a scanned one the table."""
    if isinstance(tick, int):
        return jnp.asarray(table[tick])[stage]
    return jnp.asarray(table)[tick, stage]


def _ints(plan: SlotPlan, tick: int | jax.Array, stage: jax.Array) -> dict[str, jax.Array]:
    names = ("micro", "chunk", "activation_in", "gradient_in", "weight_stash")
    return {name: _at(getattr(plan, name), tick, stage) for name in names}


def _receive(buffer: jax.Array, received: jax.Array, slot: jax.Array) -> jax.Array:
    """Write ``received`` into this stage's ``slot`` (``-1``: keep the buffer). A select, not a ``cond``:
    XLA may sink the ``ppermute`` feeding a conditional into its branch, which only some devices run."""
    buffer = _cast(buffer, varying_axes(buffer) | varying_axes(received))
    row = jnp.maximum(slot, 0)
    kept = jax.lax.dynamic_index_in_dim(buffer, row, keepdims=False)
    value = jnp.where(slot >= 0, received.astype(buffer.dtype), kept)
    return jax.lax.dynamic_update_index_in_dim(buffer, value, row, 0)


def _pairs(sends: np.ndarray, step: int, stages: int) -> list[tuple[int, int]]:
    return [(s, (s + step) % stages) for s in np.flatnonzero(sends)]


def pipeline_gradients(
    model: LayeredModel, schedule: Schedule, *, accum_dtype: Any = jnp.float32, axis: str = STAGE_AXIS
) -> Callable:
    """Per device: ``(params, batch, scale) -> (grads, mean loss, [[forward, backward, weight]] slots
    run)``.

    ``params`` hold this stage's layers (``[layers / stage, ...]``, or its
    ``[v, layers / (v stage), ...]`` chunks when interleaved); ``batch`` is
    one pass's batch, split into ``schedule.microbatches``. Gradients are of the
    mean loss times ``scale`` (1 when ``None``), in ``accum_dtype``. The
    embedding and head gradients and the loss are this stage's share (zero
    off the first / last stage): :func:`reduce_over_stage` sums them once per
    step, after the last pass.
    """
    plan = slot_plan(schedule)
    p, m = schedule.stages, schedule.microbatches

    def run(params, batch, scale=None):
        """``(grads, mean loss, slots run [1, 3])``."""
        stage = jax.lax.axis_index(axis)
        # every value below varies over stage: typed so up front, the backward of a branch sums no
        # parameter gradient over stage inside it (only some devices run it); the caller types the
        # parameters as varying over the batch axes whose sum it places itself
        params = _cast(params, jax.tree.map(lambda _: frozenset({axis}), params))
        seed = (jnp.float32(1.0) if scale is None else scale.astype(jnp.float32)) / m
        one = _Pass(model, schedule, params, batch, seed)
        shape = jax.eval_shape(lambda: model.embed(one.embed_p, one.batch_of(0)))
        # activations vary as the embedding's output does (and over stage) from the first tick on: a
        # scanned tick reading the stash before anything arrived sees the type it will have
        hidden = lambda *lead: _cast(jnp.zeros((*lead, *shape.shape), shape.dtype), _vmas(shape) | {axis})
        one.dtype, one.zeros = shape.dtype, hidden()
        zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, accum_dtype), tree)
        grads = (zeros(one.embed_p), zeros(one.chunks), zeros(one.head_p))
        carry = _Carry(acts=hidden(plan.activation_slots), cots=hidden(plan.gradient_slots),
                       wstash=hidden(plan.weight_slots, 2, one.per_chunk), grads=grads,
                       loss_sum=jnp.float32(0.0), counts=jnp.zeros(3, jnp.int32))  # fmt: skip
        branches, types = one.branches(), {}
        run_ticks = lambda c, tick, like: _tick(c, tick, like, stage, plan, branches, axis, p, types)
        periods = (1, 2, 3) if schedule.splits_backward else (1, 2)  # a steady B, W, F repeats every 3
        for segment in tick_segments(plan, periods=(*periods, 2 * p * schedule.virtual_stages)):
            carry = _segment(carry, segment, run_ticks)
        g_embed, g_chunks, g_head = carry.grads
        g_layers = g_chunks if schedule.virtual_stages > 1 else jax.tree.map(lambda x: x[0], g_chunks)
        grads = join_params(model, g_embed, g_layers, g_head)  # a tied embedding: both parts summed
        return grads, carry.loss_sum / m, carry.counts[None]

    return run


def reduce_over_stage(grads: dict, loss: jax.Array, layers_key: str, axis: str = STAGE_AXIS):
    """Sum the embedding and head gradients (made on one stage each) and the loss over ``stage``;
    each stage keeps its own layers' gradients."""
    shared = {k: v for k, v in grads.items() if k != layers_key}
    shared, loss = jax.lax.psum((shared, loss), axis)
    return {**shared, layers_key: grads[layers_key]}, loss


def _segment(carry, segment: Segment, run_tick: Callable):
    """The ticks of ``segment``: one tick in line, or a ``lax.scan`` over the repeats of its block."""
    start, period, repeats = segment
    if repeats == 1:
        return run_tick(carry, start, [start])

    def block(carry, r):
        for j in range(period):
            carry = run_tick(
                carry, start + r * period + j, range(start + j, start + period * repeats, period)
            )
        return carry, None

    carry = _settled(lambda c: block(c, jnp.int32(0))[0], carry)
    return jax.lax.scan(block, carry, jnp.arange(repeats, dtype=jnp.int32))[0]


def _tick(carry, tick, like, stage, plan: SlotPlan, branches: dict, axis: str, p: int, types: dict):
    """One tick: ``tick`` (an int, or traced inside a scan) stands for the static ticks ``like``,
    which have the same senders; each stage runs its branch, then the senders ``ppermute``."""
    like = list(like)
    present = sorted(set(plan.branch[like].ravel().tolist()))
    index = np.zeros_like(plan.branch)
    index[like] = np.searchsorted(present, plan.branch[like])
    chosen = [branches[BRANCHES[b]] for b in present]
    ints = _ints(plan, tick, stage)
    carry, forward, backward = _switch(_at(index, tick, stage), chosen, carry, ints, types)
    sends_forward, sends_backward = plan.sends_forward[like[0]], plan.sends_backward[like[0]]
    if sends_forward.any():
        received = jax.lax.ppermute(forward, axis, _pairs(sends_forward, 1, p))
        carry = carry._replace(acts=_receive(carry.acts, received, _at(plan.receive_activation, tick, stage)))
    if sends_backward.any():
        received = jax.lax.ppermute(backward, axis, _pairs(sends_backward, -1, p))
        carry = carry._replace(cots=_receive(carry.cots, received, _at(plan.receive_gradient, tick, stage)))
    return carry


def _cast(tree: PyTree, axes: PyTree) -> PyTree:
    """``tree`` typed as varying over ``axes`` (per leaf; no data moves)."""

    return jax.tree.map(lambda x, want: vary_over(x, sorted(want)), tree, axes,
                        is_leaf=lambda a: isinstance(a, frozenset))  # fmt: skip


def _kinds(tree: PyTree) -> PyTree:
    return jax.tree.map(varying_axes, tree)


def _union(trees: list) -> PyTree:
    return jax.tree.map(lambda *s: frozenset().union(*s), *trees, is_leaf=lambda a: isinstance(a, frozenset))


def _settled(fn: Callable, carry):
    """``carry`` typed as varying over every axis ``fn(carry)`` makes it vary over (a scan's carry
    must keep its type)."""
    for _ in range(4):
        want = _union([_kinds(carry), _vmas(jax.eval_shape(fn, carry))])
        if want == _kinds(carry):
            break
        carry = _cast(carry, want)
    return carry


def _switch(index, branches: list[Callable], carry, ints, types: dict):
    """``lax.switch`` whose branches may differ in which manual axes a value varies over: every
    output (and the carry going in) is typed as varying over the union. ``types`` keeps each
    branch's output types by input types across ticks (a branch is traced for them once)."""
    kinds, union = _kinds, _union
    for _ in range(3):  # the carry's type settles after a pass or two
        target = union([_output_vmas(b, carry, ints, types) for b in branches])
        carry_target = union([kinds(carry), target[0]])
        if carry_target == kinds(carry):
            break
        carry = _cast(carry, carry_target)
    target = (carry_target, *target[1:])
    return jax.lax.switch(index, [_typed(b, target, types) for b in branches], carry, ints)


def _typed(branch: Callable, target: PyTree, types: dict) -> Callable:
    """``branch`` with its outputs cast to ``target``'s varying axes; one function per branch and
    target, so ``lax.switch`` reuses its trace in later ticks."""
    key = ("typed", branch, _frozen(target))
    if key not in types:
        types[key] = lambda carry, ints: _cast(branch(carry, ints), target)
    return types[key]


def _frozen(tree: PyTree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda a: isinstance(a, frozenset))
    return treedef, tuple(leaves)


def _output_vmas(branch: Callable, carry, ints, types: dict) -> PyTree:
    """Varying axes of ``branch(carry, ints)``'s outputs, traced once per branch and input types."""
    key = (branch, *(_avals(tree) for tree in (carry, ints)))
    if key not in types:
        types[key] = _vmas(jax.eval_shape(branch, carry, ints))
    return types[key]


def _avals(tree: PyTree) -> tuple:
    """Hashable types of ``tree`` (structure, and shape, dtype and varying axes of each leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(jax.typeof(leaf) for leaf in leaves)


def _vmas(tree: PyTree) -> PyTree:
    """Varying axes of every leaf of an ``eval_shape`` result."""

    def one(leaf):
        manual = getattr(leaf, "manual_axis_type", None)
        return frozenset(manual.varying) if manual is not None else frozenset(getattr(leaf, "vma", ()))

    return jax.tree.map(one, tree)
