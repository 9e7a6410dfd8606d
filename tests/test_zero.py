"""ZeRO-1/2/3 and HSDP on 8 simulated devices: twin equality, memory and wire bytes from the compiled step."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import SMALL, assert_matches_twin, mlp_model, mlp_params, recording_optimizer, twin_report

from torsh_jax.demo.model import LMConfig, init_params, layered_model, synthetic_tokens
from torsh_jax.errors import NotSupportedYetError
from torsh_jax.plan import load_plan, plan_from_dict
from torsh_jax.runtime.inspect import inspect_step
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step


def zero_plan(stage: int, **extra) -> object:
    data = {"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": stage}, "batch": {"micro_batch_size": 4}}
    for key, value in extra.items():
        data.setdefault(key, {}).update(value)
    return plan_from_dict(data)


ACCUM = {"batch": {"micro_batch_size": 2, "accumulation_steps": 2}}

CASES = [
    pytest.param(zero_plan(1), id="zero1"),
    pytest.param(zero_plan(1, **ACCUM), id="zero1-accum"),
    pytest.param(zero_plan(2), id="zero2"),
    pytest.param(zero_plan(2, **ACCUM), id="zero2-accum"),
    pytest.param(zero_plan(2, communication={"bucket_mb": 0}), id="zero2-leaf-by-leaf"),  # in own shape
    pytest.param(zero_plan(3), id="zero3"),
    pytest.param(zero_plan(3, **ACCUM), id="zero3-accum"),
    pytest.param(zero_plan(3, zero={"reshard_after_forward": False}), id="zero3-keep-gathered"),
    pytest.param(zero_plan(3, zero={"prefetch_layers": 1}), id="zero3-prefetch"),
    pytest.param(zero_plan(3, zero={"prefetch_layers": 1}, **ACCUM), id="zero3-prefetch-accum"),
    pytest.param(load_plan("hsdp"), id="hsdp-2x4"),
    pytest.param(
        plan_from_dict({"mesh": {"data": {"ici": 1, "dcn": 2}, "fsdp": -1}, "zero": {"stage": 2}, **ACCUM}),
        id="hsdp-zero2-accum",
    ),
]


@pytest.mark.parametrize("plan", CASES)
def test_zero_matches_single_device_twin(plan):
    report, train = twin_report(plan, steps=5, mlp=True)  # ZeRO shards what the layers hold, not their math
    assert train.mesh.shape["fsdp"] > 1
    assert_matches_twin(report)
    assert report.losses[-1] < report.losses[0]
    assert train.traces == 1


def test_zero3_with_a_plain_loss_gathers_per_top_level_entry():
    plan = zero_plan(3)
    mesh = build_mesh(plan)
    optimizer = recording_optimizer()
    from torsh_jax.runtime.layered import layered_loss
    from torsh_jax.runtime.twin import make_reference_step
    from torsh_jax.runtime.verify import compare_with_twin

    loss = layered_loss(mlp_model(SMALL))  # a plain loss over {"embed", "layers", "head"}
    params = mlp_params(SMALL, jax.random.key(0))
    train = make_train_step(loss, optimizer, plan, mesh, params)
    twin = make_reference_step(loss, optimizer, plan)
    exact = make_reference_step(loss, optimizer, plan, dtype="float64")
    batches = [synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=i) for i in range(3)]
    assert_matches_twin(compare_with_twin(tuple(train), twin, params, batches, exact=exact))


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_compute_within_roundoff_of_the_float64_run(stage):
    """bf16 compute, f32 master weights and reduction: losses and gradients within round-off of
    the float64 run, the bf16 twin's own error the measure of it, and the gradients about as far
    from it as the twin's (the larger of the two at most 1.5 times the other's, over 5 steps: a
    real error moves one program, not both). Not a constant against the bf16 twin: two bf16
    programs of the same math differ by where the compiler rounds (the twin of the causal
    attention adding its mask moved 0.08 to 0.18 from this step, the step itself unchanged at
    0.26 from float64)."""
    plan = zero_plan(stage, precision={"compute_dtype": "bfloat16"})
    report, _ = twin_report(plan, steps=5)
    assert_matches_twin(report)
    ours, twins = max(report.parallel_error.grads), max(report.twin_error.grads)
    assert max(ours, twins) <= 1.5 * min(ours, twins), (ours, twins)


@functools.cache
def _compiled_preset(name: str, layers: int):
    """:func:`_compiled` of preset ``name``, compiled once per module (its tests only read it)."""
    return _compiled(load_plan(name), layers)


def _compiled(plan, layers: int, **config):
    """``(train, abstract state, compiled step, cfg)``: the state's shapes and shardings are all its
    tests read (test_layout.py checks that an initialised state holds them), so none is initialised."""
    cfg = LMConfig(layers=layers, **config)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    train = make_train_step(layered_model(cfg), optax.adamw(1e-3), plan, build_mesh(plan), shapes)
    state = train.abstract_state()
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    return train, state, train.lower(state, batch).compile(), cfg


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds, from the compiled program's input shardings."""
    leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
    return sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize for x, s in leaves)


def test_stage3_per_device_state_is_an_eighth():
    train, state, compiled, _ = _compiled_preset("zero3", layers=8)
    shardings = compiled.input_shardings[0][0]
    per_device = _per_device_bytes(state.params, shardings.params) + _per_device_bytes(
        state.opt_state, shardings.opt_state
    )
    total = _bytes(state.params) + _bytes(state.opt_state)
    assert per_device <= 1.02 * total / 8


def test_stage1_shards_optimizer_state_only():
    train, state, compiled, _ = _compiled_preset("zero1", layers=8)
    shardings = compiled.input_shardings[0][0]
    assert _per_device_bytes(state.opt_state, shardings.opt_state) <= 1.02 * _bytes(state.opt_state) / 8
    assert _per_device_bytes(state.params, shardings.params) == _bytes(state.params)


def test_stage3_temp_memory_does_not_grow_with_gathered_layers():
    """Going from 8 to 16 layers adds only what must grow with depth (one saved
    activation carry and one gradient shard per layer); gathered parameters add
    less than one layer's full parameters."""
    (t8, s8, c8, cfg), (_, _, c16, _) = _compiled_preset("zero3", 8), _compiled_preset("zero3", 16)
    layer_bytes = _bytes(s8.params["layers"]) / 8
    local_batch = t8.global_batch_size // 8
    carry_bytes = local_batch * cfg.seq_len * cfg.d_model * 4
    growth = c16.memory_analysis().temp_size_in_bytes - c8.memory_analysis().temp_size_in_bytes
    necessary = 8 * (carry_bytes + layer_bytes / 8)
    assert growth - necessary <= layer_bytes, (growth, necessary, layer_bytes)
    assert growth < 8 * layer_bytes  # full layers are not kept: that would be 8 layers' worth


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_wire_bytes_equal_theory(name):
    train, state, compiled, cfg = _compiled_preset(name, layers=8)
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    summary = inspect_step(train, state, batch, compiled=compiled)
    theory = summary["theory"]
    assert theory["wire_ratio"] == pytest.approx(1.0, abs=0.02)
    for kind, ratio in theory["payload_ratio_by_kind"].items():
        assert ratio == pytest.approx(1.0, abs=0.02), kind


def test_hsdp_accumulating_wire_bytes_equal_theory():
    """HSDP accumulating: the head's shards pass the barrier that finishes its backward first
    (``runtime.fsdp._head_first``), so they are gathered every micro-step, as the theory counts
    (a vocabulary of 1,024; counted as gathered once a step, the all-gathers would send 1.07 of
    the theory's bytes)."""
    import dataclasses

    plan = load_plan("hsdp")
    plan = dataclasses.replace(plan, batch=dataclasses.replace(plan.batch, accumulation_steps=2))
    train, state, compiled, cfg = _compiled(plan, layers=4, vocab=1024)
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    theory = inspect_step(train, state, batch, compiled=compiled)["theory"]
    assert theory["wire_ratio"] == pytest.approx(1.0, abs=0.02)
    for kind, ratio in theory["payload_ratio_by_kind"].items():
        assert ratio == pytest.approx(1.0, abs=0.02), kind


def test_stage3_without_regather_gathers_once():
    """Every layer gathered in the forward is kept for the backward: one gather of the parameters per
    step (the MLP layers: what is gathered is what the layers hold, not their math)."""
    plan = zero_plan(3, zero={"reshard_after_forward": False})
    shapes = jax.eval_shape(lambda: mlp_params(SMALL, jax.random.key(0)))
    train = make_train_step(mlp_model(SMALL), optax.adamw(1e-3), plan, build_mesh(plan), shapes)
    state = train.abstract_state()  # the compiled step is all the summary reads: none initialised
    summary = inspect_step(train, state, synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=0))
    gathered = summary["totals"]["by_kind"]["all-gather"]["payload_bytes"]
    assert gathered == pytest.approx(_bytes(state.params), rel=0.02)


HF_BF16_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
}


def _hf_bf16_zero3_plan():
    """The plan a Hugging Face Trainer run with ``bf16=True`` and a ZeRO-3 "auto" config translates to."""
    from torsh_jax.translate.deepspeed import translate_deepspeed

    trainer = {"bf16": True, "per_device_train_batch_size": 2, "hidden_size": 32}
    return translate_deepspeed(HF_BF16_ZERO3, world_size=8, hf_trainer=trainer).plan


def _bf16_reduce_plan(mesh: dict, stage: int):
    return plan_from_dict(
        {"mesh": mesh, "zero": {"stage": stage}, "batch": {"micro_batch_size": 2},
         "precision": {"reduce_dtype": "bfloat16"}}
    )  # fmt: skip


BF16_REDUCE_CASES = [
    pytest.param(_hf_bf16_zero3_plan, id="hf-trainer-zero3"),
    pytest.param(lambda: _bf16_reduce_plan({"data": -1}, 0), id="ddp"),
    pytest.param(lambda: _bf16_reduce_plan({"data": 2, "fsdp": -1}, 2), id="hsdp-zero2"),
]


def _is_gradient_reduction(row: dict) -> bool:
    """A reduce-scatter, or an all-reduce carrying more than scalars (the loss and norms are f32)."""
    return row["kind"] == "reduce-scatter" or (
        row["kind"] == "all-reduce" and any(not shape.endswith("[]") for shape in row["operand_shapes"])
    )


@pytest.mark.parametrize("make_plan", BF16_REDUCE_CASES)
def test_bf16_reductions_send_bf16_and_equal_theory(make_plan):
    """``precision.reduce_dtype = "bfloat16"``: every gradient reduction carries bf16 data (the CPU
    backend runs it in f32, and the report says so) and the bytes equal the bf16 theory."""
    plan = make_plan()
    assert plan.precision.reduce_dtype == "bfloat16"
    shapes = jax.eval_shape(lambda: mlp_params(SMALL, jax.random.key(0)))
    train = make_train_step(mlp_model(SMALL), optax.adamw(1e-3), plan, build_mesh(plan), shapes)
    state = train.abstract_state()  # the compiled step is all the summary reads: none initialised
    summary = inspect_step(train, state, synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=0))
    reductions = [row for row in summary["collectives"] if _is_gradient_reduction(row)]
    assert reductions
    assert {row["widened_from"] or row["dtype"] for row in reductions} == {"bf16"}
    theory = summary["theory"]
    assert theory["wire_ratio"] == pytest.approx(1.0, abs=0.02)
    for kind, ratio in theory["payload_ratio_by_kind"].items():
        assert ratio == pytest.approx(1.0, abs=0.02), kind
    assert any("bf16 collective" in note and "in f32" in note for note in summary["notes"])


#: bf16 unit round-off (8 significand bits).
BF16_ROUNDOFF = 2.0**-8


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(_bf16_reduce_plan({"data": -1}, 0), id="ddp"),
        pytest.param(_bf16_reduce_plan({"data": 1, "fsdp": -1}, 3), id="zero3"),
    ],
)
def test_bf16_reduction_matches_twin_within_bf16_roundoff(plan):
    """f32 compute, bf16 reduction, one step at a time from the same state: the parallel step rounds
    each device's partial gradient and the sum to bf16, the twin rounds the whole gradient once, so the
    reduced gradients differ by a few bf16 round-offs of the leaf's largest element (bound 4u, u = 2^-8;
    about 1.5u measured) and the f32 loss not at all beyond f32 round-off."""
    from torsh_jax.runtime.layered import layered_loss
    from torsh_jax.runtime.twin import make_reference_step
    from torsh_jax.runtime.verify import compare_with_twin, record_gradients

    optimizer = optax.chain(record_gradients(), optax.sgd(0.1))
    model = mlp_model(SMALL)
    params = mlp_params(SMALL, jax.random.key(0))
    train = make_train_step(model, optimizer, plan, build_mesh(plan), params)
    twin = make_reference_step(layered_loss(model), optimizer, plan)
    batches = [synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=i) for i in range(3)]
    report = compare_with_twin(tuple(train), twin, params, batches, lockstep=True)
    assert report.max_loss_rel_err <= 1e-5, report
    assert 0 < report.max_grad_rel_err <= 4 * BF16_ROUNDOFF, report


def test_prefetching_more_than_one_layer_is_refused_before_compiling():
    plan = zero_plan(3, zero={"prefetch_layers": 2})
    with pytest.raises(NotSupportedYetError, match="prefetch_layers: 2 layers ahead.*Fix: set"):
        make_train_step(
            mlp_model(SMALL), optax.adamw(1e-3), plan, build_mesh(plan), mlp_params(SMALL, jax.random.key(0))
        )


def test_a_float32_leaf_alone_in_its_bucket_is_reduce_scattered_in_its_own_shape():
    """One leaf per bucket: each float32 reduce-scatter takes the leaf as it is, along its shard dim
    (no flat row, which is a relayout copy on a TPU), and the shards equal those of one packed
    bucket exactly; a bfloat16 leaf is still sent as its row (module docstring of runtime.sync)."""
    import chex
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from torsh_jax.analysis.hlo import collectives_from_text
    from torsh_jax.runtime.sync import SyncSpec, sync_gradients

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))

    def synced(grads, dims, bucket_bytes: int):
        spec = SyncSpec(axes=("fsdp",), scatter_axis="fsdp", scatter_size=8, bucket_bytes=bucket_bytes)
        run = lambda g: sync_gradients(g, (), spec=spec, dims=dims)[0]
        out = {k: P(None, "fsdp") if d == 1 else P("fsdp") for k, d in dims.items()}
        step = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=out))
        operands = [c.operand_shapes for c in collectives_from_text(step.lower(grads).compile().as_text())]
        return step(grads), operands

    a, b, c = jax.random.split(jax.random.key(0), 3)
    grads, dims = (
        {"wide": jax.random.normal(a, (6, 40)), "tall": jax.random.normal(b, (24, 5))},
        {"wide": 1, "tall": 0},
    )
    alone, operands = synced(grads, dims, 0)
    assert sorted(operands) == [("f32[24,5]",), ("f32[6,40]",)]  # reduced as they are
    packed, [[row]] = synced(grads, dims, 2**20)
    assert row == "f32[8,45]"
    chex.assert_trees_all_equal(alone, packed)
    _, [[bf16]] = synced({"g": jax.random.normal(c, (16, 3), jnp.bfloat16)}, {"g": 0}, 0)
    assert bf16 == "f32[8,6]"  # its row, widened on the CPU


def _f32(shape) -> str:
    return f"f32[{','.join(map(str, shape))}]"


def test_zero3_reduces_each_gradient_in_its_own_shape():
    """ZeRO-3's per-layer reductions in the gather's backward take each float32 gradient as it is
    (a layer's slice, the embedding, the head), not as a flat ``[fsdp, n]`` row: every
    reduce-scatter of the compiled step has a parameter's shape."""
    from torsh_jax.analysis.hlo import collectives_from_text

    _, state, compiled, _ = _compiled_preset("zero3", layers=2)
    params = state.params
    layer = {_f32(x.shape[1:]) for x in jax.tree.leaves(params["layers"])}
    whole = {_f32(x.shape) for key in ("embed", "head") for x in jax.tree.leaves(params[key])}
    reductions = [c for c in collectives_from_text(compiled.as_text()) if c.kind == "reduce-scatter"]
    scattered = {shape for c in reductions for shape in c.operand_shapes}
    assert len(reductions) >= 6
    assert scattered <= layer | whole, scattered - layer - whole


def test_one_leaf_reduced_in_its_own_shape_equals_its_row():
    """:func:`~torsh_jax.runtime.sync.sync_leaf` (ZeRO-3's backward): a float32 leaf is
    reduce-scattered as it is and its shard equals the one its flat row gives, exactly; a bfloat16
    leaf is sent as its row."""
    import chex
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from torsh_jax.analysis.hlo import collectives_from_text
    from torsh_jax.runtime.sync import SyncSpec, sync_gradients, sync_leaf

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = SyncSpec(axes=("fsdp",), scatter_axis="fsdp", scatter_size=8, bucket_bytes=2**20)

    def run(fn, g, dim):
        out = P(*([None] * dim), "fsdp")
        step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=out))
        [operands] = [c.operand_shapes for c in collectives_from_text(step.lower(g).compile().as_text())]
        return step(g), operands

    def packed(x):  # a second leaf in the bucket: the leaf travels in the bucket's row
        pair = {"g": x, "pad": jnp.zeros((8,))}
        return sync_gradients(pair, (), spec=spec, dims={"g": 1, "pad": 0})[0]["g"]

    g = jax.random.normal(jax.random.key(0), (6, 40))
    own, operands = run(lambda x: sync_leaf(x, 1, spec), g, 1)
    assert operands == ("f32[6,40]",)
    row, row_operands = run(packed, g, 1)
    assert row_operands == ("f32[8,31]",)
    chex.assert_trees_all_equal(own, row)
    _, bf16 = run(lambda x: sync_leaf(x, 0, spec), jnp.zeros((16, 3), jnp.bfloat16), 0)
    assert bf16 == ("f32[8,6]",)  # its row, widened on the CPU


def test_zero3_reduces_the_heads_gradient_before_the_layers_backward(monkeypatch):
    """ZeRO-3 over ``fsdp`` alone, accumulating: the layers' backward waits for the head's
    gradient, reduce-scattered (``runtime.fsdp._head_first``), so the step does not hold it whole
    through them. Compiled without that order, XLA:CPU holds about the head's gradient more (the
    benchmark's small model: 10.49 MB against 10.03 MB, its head's gradient 0.52 MB)."""
    from torsh_jax.analysis.memory import memory_report
    from torsh_jax.runtime import fsdp

    cfg = LMConfig(vocab=1024, d_model=128, heads=2, head_dim=64, mlp=512, layers=4, seq_len=128)
    plan = zero_plan(3, **ACCUM)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    batch = synthetic_tokens(cfg, batch_size=32, seed=0)

    def peak() -> int:
        train = make_train_step(layered_model(cfg), optax.adamw(1e-3), plan, build_mesh(plan), shapes)
        return memory_report(train.lower(train.abstract_state(), batch).compile()).peak_estimate_bytes

    ordered = peak()
    monkeypatch.setattr(fsdp, "_head_first", lambda model, embed, shards, hidden, _: (embed, shards, hidden))
    head_gradient = cfg.d_model * cfg.vocab * 4
    assert peak() - ordered >= head_gradient / 2
