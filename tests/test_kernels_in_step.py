"""The Pallas kernels run in the train step: on TPU and GPU devices, every compressed collective of the
int8 presets (gradient all-reduce and reduce-scatter, ZeRO-3 weight all-gather) is a Mosaic or Triton
kernel; on CPU devices the same step runs the ``jnp`` reference (``compression.implementation = auto``).

The TPU and GPU devices are compile-only devices of targets this machine does not have
(:mod:`torsh_jax.targets`); the tests skip, saying what to install, where the target's compiler is
absent: ``libtpu`` (``torsh-jax[tpu-aot]``) or the CUDA plugin (``torsh-jax[gpu-aot]``, installed
beside the test environment, not in it: ``.ci/run``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import SMALL, mlp_model, mlp_params

from torsh_jax.plan import load_plan
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.targets import missing_compiler, target_devices

#: Presets whose collectives are int8-compressed (ddp: all-reduce; zero2: reduce-scatter; hsdp:
#: all-reduce across slices and ZeRO-3 weight all-gathers within a slice).
PRESETS = ("ddp_int8", "zero2_int8", "hsdp_int8")
#: platform -> (target with 8 devices, marker of the kernel's custom call in the StableHLO)
TARGETS = {"tpu": ("v5e-8", "tpu_custom_call"), "gpu": ("h100-8", "xla.gpu.triton")}
#: Markers of any Pallas kernel (Mosaic TPU, Triton, Mosaic GPU).
KERNEL_MARKERS = ("tpu_custom_call", "triton", "mosaic_gpu")


def _train_step(plan, mesh, model, params):
    return make_train_step(model, optax.adamw(1e-2), plan, mesh, params)


def _devices(platform: str) -> list[jax.Device]:
    target = TARGETS[platform][0]
    missing = missing_compiler(target)
    if missing is not None:
        pytest.skip(missing)
    return target_devices(target)


@functools.cache
def _lowered(preset: str, platform: str) -> jax.stages.Lowered:
    """``preset``'s step on the small MLP, lowered from its abstract state for ``platform`` devices."""
    devices = jax.devices() if platform == "cpu" else _devices(platform)
    plan = load_plan(preset)
    params = jax.eval_shape(mlp_params, SMALL, jax.random.key(0))
    train = _train_step(plan, build_mesh(plan, devices), mlp_model(SMALL), params)
    tokens = jax.ShapeDtypeStruct((train.global_batch_size, SMALL.seq_len), jnp.int32)
    return train.lower(train.abstract_state(), {"inputs": tokens, "targets": tokens})


def _int8_converts(text: str) -> int:
    """``stablehlo.convert`` ops to or from int8 outside kernels: the reference's (de)quantisation."""
    return sum("stablehlo.convert" in line and "xi8>" in line for line in text.splitlines())


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("platform", list(TARGETS))
def test_accelerator_step_runs_every_compressed_collective_in_kernels(platform, preset):
    text = _lowered(preset, platform).as_text()
    marker = TARGETS[platform][1]
    assert marker in text, f"{preset} on {platform}: no {marker} custom call in the lowered step"
    assert _int8_converts(text) == 0, f"{preset} on {platform}: a collective (de)quantises with jnp"


@pytest.mark.parametrize("preset", PRESETS)
def test_cpu_step_runs_the_reference(preset):
    text = _lowered(preset, "cpu").as_text()
    assert not [m for m in KERNEL_MARKERS if m in text], f"{preset} on CPU lowers a Pallas kernel"
    assert _int8_converts(text) > 0, f"{preset} on CPU: no int8 (de)quantisation in the step"


@pytest.mark.parametrize("platform", list(TARGETS))
def test_kernel_step_compiles_for_the_target(platform):
    """The target's own compiler accepts the kernels in place (Mosaic's layout passes, Triton)."""
    compiled = _lowered("hsdp_int8", platform).compile()
    assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_a_shorter_last_tile_compiles_for_a_tpu():
    """Mosaic takes a grid whose last row tile is shorter (262 blocks: 256 and 6), as
    :func:`~torsh_jax.compress.kernels.blockwise.rows_per_tile` asks for a long buffer."""
    from torsh_jax.compress.kernels import blockwise

    device = _devices("tpu")[0]
    x = jax.ShapeDtypeStruct((262 * 256,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    fused = functools.partial(blockwise.encode_with_feedback, method="int8", block_size=256, platform="tpu")
    text = jax.jit(fused).trace(x, x).lower().compile().as_text()
    assert 'custom_call_target="tpu_custom_call"' in text
