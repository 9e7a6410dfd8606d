"""Tensor parallelism: the blocks equal dense math inside ``shard_map``, every data-parallel mode
composes with ``tensor`` in one step and equals its single-device twin, and the bytes are measured."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import SMALL, assert_matches_twin, recording_optimizer, twin_report
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from torsh_jax import load_plan, tensor
from torsh_jax.demo.model import LMConfig
from torsh_jax.plan import plan_from_dict
from torsh_jax.runtime.inspect import headline
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.verify import record_gradients
from torsh_jax.tensor import TensorAxis

T = 4  # tensor axis size of the block tests


def _tensor_mesh():
    devices = require_devices(T)
    return jax.make_mesh((T,), ("tensor",), axis_types=(AxisType.Explicit,), devices=devices)


def _block_loss(tp: TensorAxis):
    """Embedding -> attention -> MLP -> vocabulary-parallel loss, all from the blocks."""

    def loss(p, tokens):
        x = tensor.embed(tokens, p["table"], tp=tp)  # this device's sequence chunk under SP
        x = x + tensor.attention(x, p["wq"], p["wk"], p["wv"], p["wo"], tp=tp)
        x = x + tensor.mlp(x, p["w_in"], p["w_out"], tp=tp)
        return tensor.cross_entropy(tensor.column(x, p["head"], tp=tp), tokens, tp=tp)

    return loss


SPECS = {
    "table": P("tensor", None),
    "wq": P(None, "tensor", None),
    "wk": P(None, "tensor", None),
    "wv": P(None, "tensor", None),
    "wo": P("tensor", None, None),
    "w_in": P(None, "tensor"),
    "w_out": P("tensor", None),
    "head": P(None, "tensor"),
}


def _block_params() -> dict:
    shapes = {"table": (32, 16), "wq": (16, 4, 8), "wk": (16, 4, 8), "wv": (16, 4, 8), "wo": (4, 8, 16),
              "w_in": (16, 32), "w_out": (32, 16), "head": (16, 32)}  # fmt: skip
    keys = jax.random.split(jax.random.key(1), len(shapes))
    return {k: jax.random.normal(key, s) / np.sqrt(s[0]) for key, (k, s) in zip(keys, shapes.items())}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence-parallel"])
def test_blocks_equal_dense_math_and_gradients(sequence_parallel):
    mesh = _tensor_mesh()
    tp = TensorAxis(sequence_parallel=sequence_parallel)
    params = _block_params()
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 32)
    dense_loss, dense_grads = jax.value_and_grad(_block_loss(TensorAxis()))(params, tokens)
    sharded = jax.shard_map(
        jax.value_and_grad(_block_loss(tp)), mesh=mesh, in_specs=(SPECS, P()), out_specs=(P(), SPECS)
    )
    placed = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    loss, grads = jax.jit(sharded)(placed, tokens)
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-5)
    for name in params:
        scale = float(jnp.max(jnp.abs(dense_grads[name])))
        np.testing.assert_allclose(grads[name], dense_grads[name], rtol=0, atol=1e-5 * scale, err_msg=name)


def test_vocab_parallel_loss_never_holds_full_logits():
    """Inside the step, the largest logits buffer is one vocabulary shard: [B, T, V / t]."""
    mesh = _tensor_mesh()
    tp = TensorAxis()
    x = jnp.ones((2, 8, 16))
    kernel = jnp.ones((16, 32))
    fn = jax.shard_map(
        lambda x, k: tensor.cross_entropy(tensor.column(x, k, tp=tp), jnp.zeros((2, 8), jnp.int32), tp=tp),
        mesh=mesh, in_specs=(P(), P(None, "tensor")), out_specs=P(),
    )  # fmt: skip
    hlo = jax.jit(fn).lower(x, jax.device_put(kernel, jax.sharding.NamedSharding(mesh, P(None, "tensor"))))
    text = hlo.compile().as_text()
    assert "f32[2,8,8]" in text and "f32[2,8,32]" not in text


def test_the_loss_picks_its_targets_logits_before_its_backward_pass():
    """The targets' logits (only the loss's value reads them) are picked before the barrier whose
    shift the softmax reads: libtpu otherwise picked them after the layers' backward pass and held
    the float32 logits through it (350 M's zero3 data=2 fsdp=32 on two v5e-32 slices: 1.82 GiB,
    1.33 GiB with the barrier)."""
    logits, targets = jnp.ones((2, 8, 32)), jnp.zeros((2, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(tensor.cross_entropy))(logits, targets).jaxpr
    eqns = list(_all_eqns(jaxpr))
    names = [e.primitive.name for e in eqns]
    assert "optimization_barrier" in names, names
    barrier = names.index("optimization_barrier")
    assert "gather" in names[:barrier], "the targets' logits are picked before it"
    after = names[barrier + 1 :]
    assert "exp" in after, "the softmax reads the barrier's shift"


def _all_eqns(jaxpr):
    """A jaxpr's equations in order, those of the functions it calls inlined (not loop bodies)."""
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit", "closed_call") else None
        if inner is not None:
            yield from _all_eqns(getattr(inner, "jaxpr", inner))
        else:
            yield eqn


def _outer_shapes(jaxpr) -> set[tuple[int, ...]]:
    """The shapes a jaxpr's own equations make (not those inside its scans' bodies)."""
    return {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars}


def test_causal_attention_equals_masked_softmax_and_holds_no_mask_beside_scanned_layers():
    """Causal attention is the softmax over each query's keys up to it; differentiated through a
    scan over layers, nothing of ``[B, H, T, T]`` is made outside the scan (a select's broadcast
    mask would be, and held through the step)."""
    batch, length, d, heads, k = 2, 8, 16, 4, 4
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (batch, length, d))
    wq, wk, wv = (jax.random.normal(key, (d, heads, k)) / 4 for key in keys[1:4])
    wo = jax.random.normal(keys[4], (heads, k, d)) / 4
    q, kk, v = (np.einsum("btd,dhk->bthk", x, w) for w in (wq, wk, wv))
    scores = np.einsum("bqhk,bshk->bhqs", q, kk) / np.sqrt(k)
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("bthk,hkd->btd", np.einsum("bhqs,bshk->bqhk", weights, v), wo)
    np.testing.assert_allclose(tensor.attention(x, wq, wk, wv, wo), expected, rtol=1e-5, atol=1e-5)

    def loss(stacked, x):
        layer = lambda h, w: (h + tensor.attention(h, *w), None)
        return jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, stacked)[0] ** 2)

    stacked = tuple(jnp.stack([w, w]) for w in (wq, wk, wv, wo))
    outer = _outer_shapes(jax.make_jaxpr(jax.grad(loss))(stacked, x).jaxpr)
    assert (batch, heads, length, length) not in outer


#: every plan's global batch is the tp presets' 32 (micro-batches of 4 or 8 per data-parallel rank):
#: the plans with the same sequence parallelism then share one twin run (helpers.shared_twin_runs)
TP_PLANS = [
    pytest.param(load_plan("tp"), id="tp"),
    pytest.param(load_plan("tp_sp"), id="tp-sequence-parallel"),
    # ZeRO-3 x tensor: here over data x fsdp, and fsdp 4 x tensor 2 (the fsdp_tp preset's mesh) below
    pytest.param(load_plan("hsdp_tp"), id="hsdp-tp-zero3"),
    pytest.param(
        plan_from_dict({"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "zero": {"stage": 1},
                        "batch": {"micro_batch_size": 8}}),
        id="zero1-hsdp-tp",
    ),
    pytest.param(
        plan_from_dict({"mesh": {"data": 1, "fsdp": -1, "tensor": 2}, "zero": {"stage": 1},
                        "batch": {"micro_batch_size": 4, "accumulation_steps": 2}}),
        id="zero1-tp-accum",
    ),
    pytest.param(
        plan_from_dict({"mesh": {"data": 1, "fsdp": -1, "tensor": 2}, "zero": {"stage": 2},
                        "tensor": {"sequence_parallel": True},
                        "batch": {"micro_batch_size": 4, "accumulation_steps": 2}}),
        id="zero2-tp-sp-accum",
    ),
    pytest.param(
        plan_from_dict({"mesh": {"data": 1, "fsdp": -1, "tensor": 2}, "zero": {"stage": 3},
                        "tensor": {"sequence_parallel": True},
                        "batch": {"micro_batch_size": 4, "accumulation_steps": 2}}),
        id="zero3-tp-sp-accum",
    ),
    pytest.param(
        plan_from_dict({"mesh": {"data": 1, "fsdp": -1, "tensor": 2},
                        "zero": {"stage": 3, "prefetch_layers": 1},
                        "tensor": {"sequence_parallel": True}, "batch": {"micro_batch_size": 8}}),
        id="zero3-prefetch-tp-sp",
    ),
    pytest.param(
        plan_from_dict({"mesh": {"data": 1, "fsdp": 2, "tensor": 4}, "zero": {"stage": 3},
                        "batch": {"micro_batch_size": 8}}),
        id="fsdp2-tp4-zero3",
    ),
]  # fmt: skip


def momentum() -> optax.GradientTransformation:
    """SGD with momentum, recording the gradients."""
    return optax.chain(record_gradients(), optax.sgd(0.05, momentum=0.9))


HEADS4 = LMConfig(vocab=64, d_model=32, heads=4, head_dim=8, mlp=64, layers=2, seq_len=16)


@pytest.mark.parametrize("plan", TP_PLANS)
def test_every_data_parallel_mode_composes_with_tensor_and_equals_its_twin(plan):
    """Free-running 5 steps. Adam on tensor=4 drifts in near-zero gradient elements (1e-4 in the
    parameters, 1.2e-5 in the gradients by step 5: docs/strategies.md), so that case uses momentum."""
    require_devices(8)
    optimizer = momentum if plan.mesh.tensor.ici == 4 else recording_optimizer
    report, train = twin_report(plan, steps=5, cfg=HEADS4, optimizer=optimizer)
    assert train.layout.roles.tensor_axis == "tensor"
    assert_matches_twin(report)
    assert report.losses[-1] < report.losses[0]


def test_tensor_split_weights_hold_half_the_bytes():
    require_devices(8)
    plan = load_plan("tp")
    params = {"layers": {"w_in": jnp.zeros((2, 8, 16))}, "w": jnp.zeros(3)}
    train = make_train_step(
        tensor.uses_tensor_blocks(lambda p, b: jnp.sum(p["w"]) * 0),
        optax.sgd(0.1),
        plan,
        build_mesh(plan),
        params,
    )
    train.init(params)
    layout = train.layout
    assert layout.state.params["layers"]["w_in"] == P(None, None, "tensor")
    assert layout.split["layers"]["w_in"] == ("tensor",) and layout.split["w"] == ()
    assert layout.bytes_per_device()["params"] == (2 * 8 * 16 // 2 + 3) * 4


ZERO3_SP_ACCUM = plan_from_dict({"mesh": {"data": 1, "fsdp": -1, "tensor": 2}, "zero": {"stage": 3},
                                 "tensor": {"sequence_parallel": True},
                                 "batch": {"micro_batch_size": 2, "accumulation_steps": 2}})  # fmt: skip


@pytest.fixture(scope="module")
def tp_reports():
    """inspect of the tp and tp_sp presets and ZeRO-3 x sequence parallel with accumulation, small model."""
    from torsh_jax.demo.model import init_params, layered_model, synthetic_tokens
    from torsh_jax.runtime.inspect import inspect_step
    from torsh_jax.tensor import tensor_axis

    require_devices(8)
    shapes = jax.eval_shape(lambda: init_params(SMALL, jax.random.key(0)))
    out = {}
    for name, plan in (
        ("tp", load_plan("tp")),
        ("tp_sp", load_plan("tp_sp")),
        ("zero3_sp_accum", ZERO3_SP_ACCUM),
    ):
        train = make_train_step(
            layered_model(SMALL, tp=tensor_axis(plan)), optax.adamw(1e-3), plan, build_mesh(plan), shapes
        )
        out[name] = inspect_step(  # compiled for the state's shapes and shardings: none initialised
            train, train.abstract_state(), synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=0)
        )
    return out


def test_data_parallel_bytes_equal_theory_for_one_tensor_shard(tp_reports):
    for name, report in tp_reports.items():
        assert report["shard_param_count"] < report["param_count"]
        assert report["theory"]["wire_ratio"] == pytest.approx(1.0, abs=1e-3), name
        assert report["theory"]["other_axes_wire_bytes"]["tensor"] > 0, name
        line = headline(report)  # the demo's summary: every axis measured, each against its theory
        assert set(line["wire_ratio_by_axis"]) == {"data_parallel", "tensor"}, name
        assert line["unmodelled_wire_bytes_by_axis"] == {}, name
        assert line["theoretical_wire_bytes_per_step"] == pytest.approx(
            line["wire_bytes_per_step"], rel=0.02
        ), name


@pytest.mark.parametrize("name", ["tp", "tp_sp", "zero3_sp_accum"])
def test_tensor_collectives_equal_megatron_theory_by_kind(tp_reports, name):
    """Per block 2 + 2 all-reduces (tp) or 4 all-gathers + 4 reduce-scatters (sequence parallel),
    plus embedding, head and loss; ZeRO-3 recomputes the blocks' forward: bytes by kind = theory."""
    section = tp_reports[name]["theory"]["axes"]["tensor"]
    assert section["wire_ratio"] == pytest.approx(1.0, abs=0.02), section
    for kind, ratio in section["wire_ratio_by_kind"].items():
        assert ratio == pytest.approx(1.0, abs=0.02), (kind, section)
    measured = {c["kind"] for c in tp_reports[name]["collectives"] if c["axes"] == ["tensor"]}
    assert measured == set(section["payload_bytes_by_kind"]), measured
    for kind in ("all-gather", "reduce-scatter"):  # never combined by the compiler: counts match too
        assert section["measured_count_by_kind"].get(kind) == section["count_by_kind"].get(kind), section


def test_vocab_parallel_loss_temp_memory_is_one_vocabulary_shard():
    """memory_analysis: the loss and its gradient hold [B, T, V / t] logits, not [B, T, V]."""
    mesh = _tensor_mesh()
    batch, length, width, vocab = 4, 64, 32, 1024
    x, labels = jnp.ones((batch, length, width)), jnp.zeros((batch, length), jnp.int32)

    def loss_and_grad(tp):
        loss = lambda k: tensor.cross_entropy(tensor.column(x, k, tp=tp), labels, tp=tp)
        return lambda k: jax.value_and_grad(loss)(k)

    kernel = jnp.ones((width, vocab))
    full = jax.jit(loss_and_grad(TensorAxis())).lower(kernel).compile().memory_analysis().temp_size_in_bytes
    sharded = jax.shard_map(loss_and_grad(TensorAxis()), mesh=mesh, in_specs=P(None, "tensor"),
                            out_specs=(P(), P(None, "tensor")))  # fmt: skip
    placed = jax.device_put(kernel, jax.sharding.NamedSharding(mesh, P(None, "tensor")))
    per_device = jax.jit(sharded).lower(placed).compile().memory_analysis().temp_size_in_bytes
    assert per_device <= full / T * 1.1, (per_device, full)


def test_fsdp_tp_state_per_device_is_the_total_over_all_devices():
    from torsh_jax.demo.model import LMConfig, init_params, layered_model

    require_devices(8)
    plan = load_plan("fsdp_tp")
    cfg = LMConfig(vocab=256, d_model=64, heads=4, head_dim=16, mlp=256, layers=2, seq_len=16)
    # the layout is decided when the step is made, from the parameters' shapes (test_layout.py checks
    # that the initialised state holds it): nothing is initialised or compiled here
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    train = make_train_step(layered_model(cfg), optax.adamw(1e-3), plan, build_mesh(plan), shapes)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(train.layout.abstract))
    per_device = sum(train.layout.bytes_per_device().values())
    assert per_device == pytest.approx(total / 8, rel=0.02), (per_device, total / 8)


def test_heads_not_divisible_by_tensor_name_the_parameter_and_dim():
    from torsh_jax.demo.model import init_params, layered_model
    from torsh_jax.errors import ShardingError

    require_devices(8)
    plan = plan_from_dict({"mesh": {"data": 1, "fsdp": 2, "tensor": 4}, "zero": {"stage": 3}})
    shapes = jax.eval_shape(lambda: init_params(SMALL, jax.random.key(0)))  # refused when the step is made
    with pytest.raises(ShardingError) as err:  # SMALL has 2 heads
        make_train_step(layered_model(SMALL), optax.sgd(0.1), plan, build_mesh(plan), shapes)
    message = str(err.value)
    assert "layers/" in message and "dim 2" in message and "not divisible by 4" in message
    assert "Fix:" in message


def test_a_tensor_block_on_an_axis_the_mesh_lacks_is_refused():
    """Inside the step a block must find its axis: computing on shards as if whole would be wrong."""
    from torsh_jax.errors import ShardingError

    require_devices(8)
    plan = load_plan("tp").replace(param_dims=((r"^w$", ("embed", "vocab")),))  # w split over tensor
    wrong = TensorAxis(name="model")

    @tensor.uses_tensor_blocks
    def loss(p, b):
        logits = tensor.column(b, p["w"], tp=wrong)
        return tensor.cross_entropy(logits, jnp.zeros(b.shape[:2], jnp.int32), tp=wrong)

    params = {"w": jnp.zeros((4, 8))}
    train = make_train_step(loss, optax.sgd(0.1), plan, build_mesh(plan), params)
    state = train.init(params)
    with pytest.raises(ShardingError, match="'model'") as err:
        train.step(state, jnp.ones((train.global_batch_size, 2, 4)))
    assert "Fix:" in str(err.value)


def test_fsdp_bytes_under_tensor_are_the_1d_plans_for_one_tensor_shard():
    """fsdp 4 x tensor 2 moves fsdp 4's bytes times the share of the parameters one tensor shard holds
    (split weights halve; norm weights replicated over tensor do not)."""
    from torsh_jax.demo.model import init_params, layered_model, synthetic_tokens
    from torsh_jax.runtime.inspect import inspect_step
    from torsh_jax.tensor import tensor_axis

    devices = require_devices(8)
    one_d = plan_from_dict(
        {"mesh": {"data": 1, "fsdp": 4}, "zero": {"stage": 3}, "batch": {"micro_batch_size": 8}}
    )
    fsdp_tp = load_plan("fsdp_tp")
    reports = {}
    shapes = jax.eval_shape(lambda: init_params(HEADS4, jax.random.key(0)))
    for name, plan, mesh in (
        ("1d", one_d, build_mesh(one_d, devices[:4])),
        ("tp", fsdp_tp, build_mesh(fsdp_tp)),
    ):
        train = make_train_step(
            layered_model(HEADS4, tp=tensor_axis(plan)), optax.adamw(1e-3), plan, mesh, shapes
        )
        reports[name] = inspect_step(  # compiled for the state's shapes and shardings: none initialised
            train,
            train.abstract_state(),
            synthetic_tokens(HEADS4, batch_size=train.global_batch_size, seed=0),
        )
    share = reports["tp"]["shard_param_count"] / reports["tp"]["param_count"]
    fsdp = {name: r["totals"]["by_axis"]["fsdp"]["wire_bytes"] for name, r in reports.items()}
    assert 0.5 < share < 0.55
    assert fsdp["tp"] == pytest.approx(fsdp["1d"] * share, rel=0.01), (fsdp, share)


def _lowered(preset: str, tp):
    """``preset``'s step of the demo model whose blocks are built with ``tp``, lowered."""
    from torsh_jax.demo.model import init_params, layered_model, synthetic_tokens

    plan = load_plan(preset)
    shapes = jax.eval_shape(lambda: init_params(SMALL, jax.random.key(0)))
    train = make_train_step(layered_model(SMALL, tp=tp), optax.sgd(0.1), plan, build_mesh(plan), shapes)
    batch = synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=0)
    return train.lower(train.abstract_state(), batch)


def test_blocks_left_unset_split_the_sequence_as_the_plan_says():
    """``TensorAxis()`` under ``tp_sp`` reduce-scatters after the split matmuls (sequence
    parallelism), as ``tensor_axis(plan)``'s blocks do; under ``tp`` it does not."""
    require_devices(8)
    assert "reduce_scatter" in _lowered("tp_sp", TensorAxis()).as_text()
    assert "reduce_scatter" not in _lowered("tp", TensorAxis()).as_text()


@pytest.mark.parametrize("preset, built", [("tp_sp", False), ("tp", True)])
def test_blocks_built_against_the_plans_sequence_parallelism_are_refused(preset, built):
    """Blocks built with sequence parallelism set one way under a plan that says the other: one
    error naming the key, not a step without (or with) what the plan says."""
    from torsh_jax.errors import PlanError

    require_devices(8)
    said = "off" if built else "on"
    with pytest.raises(PlanError, match=rf"^tensor\.sequence_parallel: the plan's .* is {said}") as caught:
        _lowered(preset, TensorAxis(sequence_parallel=built))
    assert "Fix: build the blocks with tensor_axis(plan)" in str(caught.value)
