"""A step that cannot fit in device memory is refused with one line (the per-device figure, the limit
and a fix): before the batch is made or the step compiled when the lower bound already exceeds the
limit, and after compiling, before running, when XLA's own figure does."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import SMALL, mlp_model, mlp_params, model_for
from jax import monitoring

from torsh_jax.analysis.memory import memory_report
from torsh_jax.cli.main import main
from torsh_jax.demo.model import synthetic_tokens
from torsh_jax.errors import DeviceMemoryError, PlanError
from torsh_jax.plan import BatchSpec, ParallelPlan, load_plan
from torsh_jax.runtime import fit
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step

GiB = 2**30
ZERO3 = """[mesh]
data = 1
fsdp = -1
[zero]
stage = 3
[batch]
micro_batch_size = {mbs}
accumulation_steps = {acc}
"""


def _refusal(tmp_path, monkeypatch, capsys, *, mbs: int, acc: int) -> tuple[str, float]:
    """Run the demo as the command line does on a host of 16 GiB; its one error line and wall time."""
    monkeypatch.delenv(fit.LIMIT_VAR, raising=False)
    monkeypatch.setattr(fit, "_host_memory_bytes", lambda: 16 * GiB)
    plan = tmp_path / "big.toml"
    plan.write_text(ZERO3.format(mbs=mbs, acc=acc))
    start = time.perf_counter()
    code = main(["demo", "--plan", str(plan), "--devices", "8", "--steps", "1"])
    wall = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2 and "final loss" not in out, (out, err)
    assert "Traceback" not in err and "MemoryError:" not in err and "RESOURCE_EXHAUSTED" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("torsh-jax demo: error: ") and "Fix: lower batch." in line, err
    assert "a device has 2.00 GiB (host memory 16.00 GiB over 8 CPU devices)" in line, line
    return line, wall


def test_demo_refuses_a_global_batch_beyond_memory_before_making_it(tmp_path, monkeypatch, capsys):
    require_devices(8)
    line, wall = _refusal(tmp_path, monkeypatch, capsys, mbs=8, acc=100_000_000)
    # 8 x 10^8 examples per device of 2 x 32 int32 tokens: 190.73 GiB (the whole batch was 787 GiB)
    assert "error: batch.accumulation_steps: the step needs at least 190.7" in line, line
    assert "batch 190.73 GiB" in line and "800,000,000 examples" in line, line
    assert wall < 10, f"refused after {wall:.1f} s"


def test_demo_refuses_a_micro_batch_beyond_memory_before_compiling(tmp_path, monkeypatch, capsys):
    require_devices(8)
    line, wall = _refusal(tmp_path, monkeypatch, capsys, mbs=1_000_000, acc=1)
    # the hidden state between layers: 10^6 x 32 tokens x 64 float32 = 7.63 GiB per device
    assert "error: batch.micro_batch_size:" in line and "activations 7.63 GiB" in line, line
    assert "batch 244.14 MiB" in line, line
    assert wall < 10, f"refused after {wall:.1f} s"


def _mlp_step(plan: ParallelPlan, devices: int, *, width: int = 256):
    """A two-layer MLP loss under ``plan``: its train step and parameters (a plain loss function,
    so no activations in the lower bound)."""
    mesh = build_mesh(plan, require_devices(devices))
    loss = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2)
    params = {"w": jnp.full((16, width), 0.01, jnp.float32), "v": jnp.full((width, 1), 0.01, jnp.float32)}
    return make_train_step(loss, optax.sgd(0.1), plan, mesh, params), params


def _batch(rows: int) -> dict:
    x = np.linspace(-1, 1, rows * 16, dtype=np.float32).reshape(rows, 16)
    return {"x": x, "y": x[:, :1] ** 2}


@pytest.fixture
def compiles():
    """Names of the XLA compilations that run while the test does."""
    events: list[str] = []

    def record(name: str, _secs: float, **_) -> None:
        if name.endswith("backend_compile_duration"):
            events.append(name)

    monitoring.register_event_duration_secs_listener(record)
    yield events
    monitoring.unregister_event_duration_listener(record)


def test_first_step_refuses_a_batch_beyond_memory_before_compiling(monkeypatch):
    plan = ParallelPlan(batch=BatchSpec(micro_batch_size=512))
    train, params = _mlp_step(plan, 2)
    state = train.init(params)
    need = fit.step_memory(train, _batch(train.global_batch_size))
    assert need.batch_bytes == 512 * 17 * 4  # x and y, half the global batch of 1024 on each device
    monkeypatch.setenv(fit.LIMIT_VAR, str(need.total_bytes - 1))
    refusal = r"^batch\.micro_batch_size: the step needs at least .* per device"
    with pytest.raises(DeviceMemoryError, match=refusal):
        train.step(state, _batch(train.global_batch_size))
    assert train.traces == 0, "refused before tracing and compiling"
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state)), "the state was not donated"


def test_compiled_figure_beyond_the_limit_is_refused_before_running(monkeypatch):
    """The lower bound passes, XLA's figure (the [8, 4096] hidden activations, the gradients) does not."""
    plan = ParallelPlan(batch=BatchSpec(micro_batch_size=8))
    train, params = _mlp_step(plan, 2, width=4096)
    state = train.init(params)
    batch = _batch(train.global_batch_size)
    need = fit.step_memory(train, batch)
    compiled = train.lower(state, batch).compile()
    peak = memory_report(compiled).peak_estimate_bytes
    assert need.total_bytes < peak
    monkeypatch.setenv(fit.LIMIT_VAR, str((need.total_bytes + peak) // 2))
    refusal = r"the compiled step needs .* temporaries .* Fix: lower batch"
    with pytest.raises(DeviceMemoryError, match=refusal):
        train.step(state, batch)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state)), "refused before running"
    monkeypatch.setenv(fit.LIMIT_VAR, str(peak))  # exactly enough: runs, on the program already compiled
    state, metrics = train.step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and train.traces == 1


def test_a_tpu_steps_refusal_names_parts_that_add_up_to_libtpus_peak():
    """libtpu's ``temp`` is more than the temporaries live at its peak (150 M ``zero1 fsdp=16 acc=2``
    on v5e-16: 15.42 GiB against a peak of 14.62 GiB, docs/targets.md): the message's temporaries are
    the rest of the peak, so its arguments, temporaries and outputs less the donated add up to it."""
    from types import SimpleNamespace

    from torsh_jax.runtime.fit import MemoryLimit

    stats = SimpleNamespace(argument_size_in_bytes=1 * GiB, output_size_in_bytes=GiB // 2,
                            alias_size_in_bytes=GiB // 2, temp_size_in_bytes=round(15.42 * GiB),
                            peak_memory_in_bytes=round(14.62 * GiB))  # fmt: skip
    compiled = SimpleNamespace(memory_analysis=lambda: stats)
    tpu = SimpleNamespace(platform="tpu")
    train = SimpleNamespace(mesh=SimpleNamespace(devices=np.array([tpu]), shape={"fsdp": 16}),
                            plan=ParallelPlan(batch=BatchSpec(micro_batch_size=14)))  # fmt: skip
    with pytest.raises(DeviceMemoryError) as info:
        fit.check_compiled_fits(train, compiled, limit=MemoryLimit(14 * GiB, "v5e HBM"))
    message = str(info.value)
    assert "needs 14.62 GiB per device on mesh fsdp=16 (arguments 1.00 GiB, temporaries 13.62 GiB," in message
    assert info.value.key == "batch.micro_batch_size"  # the temporaries, not the state


def test_a_step_that_fits_compiles_once_and_runs(monkeypatch, compiles):
    monkeypatch.delenv(fit.LIMIT_VAR, raising=False)
    train, params = _mlp_step(ParallelPlan(batch=BatchSpec(micro_batch_size=4)), 2)
    state = train.init(params)
    compiles.clear()
    losses = []
    for _ in range(3):
        state, metrics = train.step(state, _batch(train.global_batch_size))
        losses.append(float(metrics["loss"]))
    assert train.traces == 1 and len(compiles) == 1, compiles  # the checked program is the one that runs
    assert losses[2] < losses[0]


def test_init_refuses_a_state_beyond_memory(monkeypatch):
    train, params = _mlp_step(ParallelPlan(), 2)
    monkeypatch.setenv(fit.LIMIT_VAR, "4KiB")  # the parameters alone: (16 x 256 + 256) float32 = 17.00 KiB
    with pytest.raises(DeviceMemoryError, match=r"^zero\.stage: .*state 17\.00 KiB.* a device has 4\.00 KiB"):
        train.init(params)


def _prepared(preset: str, devices: int, *, tensor_blocks: bool | None = None):
    """The train step of ``preset`` for a 2-layer model (made from shapes) and its batch's shapes;
    ``tensor_blocks`` picks the demo model (True) or the plain MLP (False) over :func:`model_for`'s choice."""
    plan = load_plan(preset)
    model, init = model_for(plan, SMALL)
    if tensor_blocks is False:
        model, init = mlp_model(SMALL), mlp_params
    shapes = jax.eval_shape(lambda key: init(SMALL, key), jax.random.key(0))
    mesh = build_mesh(plan, require_devices(devices))
    train = make_train_step(model, optax.adamw(1e-3), plan, mesh, shapes)
    return train, fit.batch_like(synthetic_tokens(SMALL, batch_size=1, seed=0), train.global_batch_size)


@pytest.mark.parametrize("preset", ["ddp_accum", "zero3"], ids=str)
def test_the_estimate_is_below_the_compiled_figure(preset, monkeypatch):
    """The refusal never comes from an over-estimate: state + batch + the carried hidden state stay
    below ``argument + output + temp - alias`` of the compiled step."""
    monkeypatch.delenv(fit.LIMIT_VAR, raising=False)
    train, batch = _prepared(preset, 2)
    need = fit.check_step_fits(train, batch)
    assert need.activation_bytes == train.plan.batch.micro_batch_size * SMALL.seq_len * SMALL.d_model * 4
    peak = memory_report(train.lower(train.abstract_state(), batch).compile()).peak_estimate_bytes
    assert need.total_bytes <= peak, (need, peak)


@pytest.mark.parametrize(
    "preset, tensor_blocks, split",
    [("tp_sp", True, 2), ("tp", True, 1), ("tp", False, 2)],
    ids=["sequence-parallel", "tensor-blocks", "compiler-partitioned"],
)
def test_the_carried_hidden_state_is_split_where_tensor_splits_it(preset, tensor_blocks, split):
    """Tensor blocks keep the hidden state whole on every device unless sequence parallelism splits it;
    the compiler may split a plain model's over ``tensor``, so the lower bound does."""
    train, batch = _prepared(preset, 2, tensor_blocks=tensor_blocks)
    hidden = train.plan.batch.micro_batch_size * SMALL.seq_len * SMALL.d_model * 4
    assert fit.step_memory(train, batch).activation_bytes == hidden // split


def test_limit_from_the_environment_the_backend_or_the_host(monkeypatch):
    mesh = build_mesh(load_plan("ddp"), require_devices(8))
    monkeypatch.setenv(fit.LIMIT_VAR, "1.5GiB")
    assert fit.device_memory_limit(mesh) == fit.MemoryLimit(3 * 2**29, fit.LIMIT_VAR)
    monkeypatch.setenv(fit.LIMIT_VAR, "lots")
    with pytest.raises(PlanError, match=r"^TORSH_JAX_DEVICE_MEMORY: must be a positive byte count, got 'lo"):
        fit.device_memory_limit(mesh)
    monkeypatch.delenv(fit.LIMIT_VAR)
    monkeypatch.setattr(fit, "_host_memory_bytes", lambda: 16 * GiB)
    limit = fit.device_memory_limit(mesh)
    stats = jax.devices()[0].memory_stats() or {}
    expected = stats.get("bytes_limit") or 2 * GiB  # CPU devices report none: the host's share
    assert limit.bytes == expected


def test_accumulation_holds_one_micro_steps_activations():
    """Half the micro-batch over 2 accumulation steps: the compiled step's temporaries shrink by
    about the activations of the half not held (every micro-step runs in the loop; a first step
    peeled out of it kept its activations beside the loop body's, and the temporaries did not shrink)."""
    from torsh_jax.demo.model import LMConfig
    from torsh_jax.demo.run import abstract_train_step

    devices = require_devices(4)
    cfg = LMConfig(layers=2, seq_len=64)

    def temp(acc: int) -> int:
        plan = load_plan("zero2").replace(batch=BatchSpec(micro_batch_size=8 // acc, accumulation_steps=acc))
        train, batch = abstract_train_step(plan, cfg, devices)
        return memory_report(train.lower(train.abstract_state(), batch).compile()).temp_bytes

    one, two = temp(1), temp(2)
    assert two < 0.7 * one, (one, two)
