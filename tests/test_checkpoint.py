"""Checkpoints on orbax: restore onto other plans and meshes, exact resume, typed errors, damage.

The model is the small demo language model; optimizer SGD with momentum (so the
optimizer state is restored too, and continuing runs can be compared to 1e-6).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices

from torsh_jax import load_plan
from torsh_jax.checkpoint import Checkpointer, list_checkpoints, restore, show_checkpoint
from torsh_jax.demo.model import LMConfig, init_params, layered_model, synthetic_tokens
from torsh_jax.errors import CheckpointError, CheckpointUnreadableError
from torsh_jax.plan.spec import LossScaleSpec
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.tensor import tensor_axis

OPTIMIZER = optax.sgd(0.05, momentum=0.9)
TINY = LMConfig(vocab=32, d_model=16, heads=2, head_dim=8, mlp=32, layers=2, seq_len=8)


def _train_step(plan_name: str, devices: int, cfg: LMConfig = TINY):
    """A new train step (as a new process would build)."""
    plan = load_plan(plan_name)
    mesh = build_mesh(plan, require_devices(8)[:devices])
    return make_train_step(layered_model(cfg, tp=tensor_axis(plan)), OPTIMIZER, plan, mesh, _shapes(cfg))


def _shapes(cfg: LMConfig = TINY):
    """The shapes of ``cfg``'s parameters, which a train step is made for."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


@functools.cache
def _shared_step(plan_name: str, devices: int):
    """One compiled train step per plan and device count, shared by the restore matrix and the
    hsdp_int8 tests that save with it."""
    return _train_step(plan_name, devices)


def _batch(train, step: int, cfg: LMConfig = TINY):
    # the same examples whatever the plan: 16 sequences per step, repeated to the global batch
    tokens = synthetic_tokens(cfg, batch_size=16, seed=step)
    return {k: np.resize(v, (train.global_batch_size, *v.shape[1:])) for k, v in tokens.items()}


def _run(train, state, steps: range):
    losses = []
    for step in steps:
        state, metrics = train.step(state, _batch(train, step))
        losses.append(float(metrics["loss"]))
    return state, losses


def _host(tree):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_host(a), _host(b), strict=True))


def _max_rel(a, b) -> float:
    return max(
        float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) for x, y in zip(_host(a), _host(b))
    )


RESTORE_MATRIX = [
    # (saved plan, devices) -> (restored plan, devices), all with the same global batch of 16
    pytest.param(("zero3", 8), ("ddp", 4), id="zero3x8-to-ddpx4"),
    pytest.param(("ddp", 8), ("zero3", 8), id="ddpx8-to-zero3x8"),
    pytest.param(("zero3", 8), ("zero3", 4), id="fsdp8-to-fsdp4"),
    pytest.param(("zero3", 8), ("fsdp_tp", 8), id="zero3-to-fsdp_tp"),
    pytest.param(("hsdp", 8), ("zero1", 2), id="hsdp-to-zero1x2"),
    pytest.param(("tp_sp", 8), ("zero2", 4), id="tp_sp-to-zero2x4"),
]


@pytest.mark.parametrize(("source", "target"), RESTORE_MATRIX)
def test_restore_onto_another_plan_equals_the_saved_state_and_continues(tmp_path, source, target):
    saved_train = _shared_step(*source)
    state = saved_train.init(init_params(TINY, jax.random.key(0)))
    state, _ = _run(saved_train, state, range(2))
    with Checkpointer(tmp_path) as saver:
        saver.save(state, plan=saved_train.plan, data_position={"step": 2})
    saved = jax.device_get((state.params, state.opt_state))
    straight, straight_losses = _run(saved_train, state, range(2, 3))  # donates state

    new_train = _shared_step(*target)
    restored = restore(tmp_path, new_train)
    assert restored.step == 2 and restored.data_position == {"step": 2}
    assert _same((restored.state.params, restored.state.opt_state), saved)
    leaf = jax.tree.leaves(restored.state.params)[0]
    assert leaf.sharding.mesh.size == target[1]
    resumed, resumed_losses = _run(new_train, restored.state, range(2, 3))
    np.testing.assert_allclose(resumed_losses, straight_losses, rtol=1e-6)
    assert _max_rel(resumed.params, straight.params) <= 1e-6


def test_resume_on_the_same_plan_is_bit_identical_with_feedback(tmp_path):
    """k steps, save, a new train step, restore, n - k steps == n steps straight, bit for bit
    (hsdp_int8: the per-device compression feedback comes back too)."""
    train = _shared_step("hsdp_int8", 8)  # the one that saves; the one that restores is new
    start = train.init(init_params(TINY, jax.random.key(0)))
    straight, straight_losses = _run(train, start, range(4))
    first, first_losses = _run(train, train.init(init_params(TINY, jax.random.key(0))), range(2))
    with Checkpointer(tmp_path, asynchronous=True) as saver:
        saver.save(first, plan=train.plan, rng=jax.random.key(7))
    again = _train_step("hsdp_int8", 8)
    restored = restore(tmp_path, again)
    assert not restored.notes
    assert restored.state.feedback is not None and _same(restored.state.feedback, first.feedback)
    assert np.array_equal(jax.random.key_data(restored.rng), jax.random.key_data(jax.random.key(7)))
    resumed, resumed_losses = _run(again, restored.state, range(2, 4))
    assert first_losses + resumed_losses == straight_losses
    assert _same(resumed, straight)


def test_feedback_restarts_from_zero_on_another_mesh(tmp_path):
    train = _shared_step("hsdp_int8", 8)
    state, _ = _run(train, train.init(init_params(TINY, jax.random.key(0))), range(1))
    with Checkpointer(tmp_path) as saver:
        saver.save(state, plan=train.plan)
    restored = restore(tmp_path, _train_step("ddp_int8", 4))
    assert any("feedback restarts from zero" in note for note in restored.notes), restored.notes
    assert all(not np.any(x) for x in _host(restored.state.feedback))


def test_keeps_the_last_n_and_every_kth(tmp_path):
    train = _train_step("ddp", 1)
    state = train.init(init_params(TINY, jax.random.key(0)))
    with Checkpointer(tmp_path, keep_last=2, keep_every=3) as saver:
        for step in range(1, 8):
            saver.save(state._replace(step=state.step + step), plan=train.plan)
    assert [c["step"] for c in list_checkpoints(tmp_path) if c["complete"]] == [3, 6, 7]
    shown = show_checkpoint(tmp_path)
    assert shown["step"] == 7 and 'name = "ddp"' in shown["plan"] and shown["bytes_on_disk"] > 0
    assert shown["params"]["params/head/kernel"]["shape"] == [TINY.d_model, TINY.vocab]


def test_bad_input_gets_typed_errors(tmp_path):
    train = _train_step("ddp", 1)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        restore(tmp_path / "missing", train)
    state = train.init(init_params(TINY, jax.random.key(0)))
    with Checkpointer(tmp_path) as saver:
        saver.save(state, plan=train.plan)
    with pytest.raises(CheckpointError, match=r"complete steps: \[0\]"):
        restore(tmp_path, train, step=5)
    wider = dataclasses.replace(TINY, d_model=32)
    other = make_train_step(layered_model(wider), OPTIMIZER, train.plan, train.mesh, _shapes(wider))
    with pytest.raises(CheckpointError) as err:
        restore(tmp_path, other)
    message = str(err.value)
    assert "params/embed/embedding" in message and "(32, 16)" in message and "(32, 32)" in message
    assert "Fix:" in message


# orbax leaves its other array reads un-awaited when one fails; they are reported at collection
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_step_is_named_and_resume_falls_back(tmp_path):
    train = _train_step("ddp", 1)
    state = train.init(init_params(TINY, jax.random.key(0)))
    with Checkpointer(tmp_path) as saver:
        saver.save(state, plan=train.plan)
        saver.save(state._replace(step=state.step + 1), plan=train.plan)
    for data in (tmp_path / "1" / "state" / "ocdbt.process_0" / "d").iterdir():  # the array data files
        data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointUnreadableError, match="step 1 cannot be read") as err:
        restore(tmp_path, _train_step("ddp", 1), step=1)
    assert str(tmp_path / "1" / "state") in str(err.value) and "params." in str(err.value)
    restored = restore(tmp_path, _train_step("ddp", 1), fallback=True)
    assert restored.step == 0 and "step 1 skipped" in restored.notes[0]


def test_a_flipped_bit_in_array_data_is_caught_by_its_checksum_and_resume_falls_back(tmp_path):
    """Random parameters do not compress, so zarr stores them raw: one flipped bit in a data file
    decodes to a different value, which only the saved checksum catches."""
    train = _shared_step("ddp", 1)
    params = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype),
                          init_params(TINY, jax.random.key(0)))  # fmt: skip
    state = train.init(params)
    with Checkpointer(tmp_path) as saver:
        saver.save(state, plan=train.plan)
        saver.save(state._replace(step=state.step + 1), plan=train.plan)
    data = max((tmp_path / "1" / "state").rglob("d/*"), key=lambda f: f.stat().st_size)
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    data.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointUnreadableError, match="differ from what was saved, first 'params") as err:
        restore(tmp_path, train, step=1)
    assert str(tmp_path / "1" / "state") in str(err.value) and "Fix:" in str(err.value)
    restored = restore(tmp_path, train, fallback=True)
    assert restored.step == 0 and "step 1 skipped" in restored.notes[0]
    assert all(np.array_equal(a, b) for a, b in zip(_host(restored.state.params), _host(state.params)))


def _step_for(plan, devices: int = 2):
    return make_train_step(
        layered_model(TINY), OPTIMIZER, plan, build_mesh(plan, require_devices(8)[:devices]), _shapes()
    )


def test_loss_scale_state_comes_back_and_is_dropped_or_started_with_a_note(tmp_path):
    """Dynamic loss scaling: its state restores as saved; a plan without scaling drops it, and a
    checkpoint saved without it starts the scale afresh, each with a note."""
    ddp = load_plan("ddp")
    scaled = dataclasses.replace(
        ddp, precision=dataclasses.replace(ddp.precision, loss_scale=LossScaleSpec(mode="dynamic"))
    )
    train = _step_for(scaled)
    state, _ = _run(train, train.init(init_params(TINY, jax.random.key(0))), range(2))
    with Checkpointer(tmp_path / "scaled") as saver:
        saver.save(state, plan=train.plan)
    restored = restore(tmp_path / "scaled", _step_for(scaled))
    assert not restored.notes and _same(restored.state.loss_scale, state.loss_scale)
    dropped = restore(tmp_path / "scaled", _step_for(ddp))
    assert dropped.state.loss_scale is None
    assert any("loss-scale state dropped" in note for note in dropped.notes), dropped.notes

    plain = _step_for(ddp)
    with Checkpointer(tmp_path / "plain") as saver:
        saver.save(plain.init(init_params(TINY, jax.random.key(0))), plan=plain.plan)
    fresh_target = _step_for(scaled)
    started = restore(tmp_path / "plain", fresh_target)
    assert any("initial scale" in note for note in started.notes), started.notes
    initial = fresh_target.init(init_params(TINY, jax.random.key(0))).loss_scale
    assert _same(started.state.loss_scale, initial)
