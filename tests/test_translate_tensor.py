"""Tensor parallelism from translated inputs: PyTorch device meshes (FSDP + ``parallelize_module``),
DeepSpeed AutoTP and GPT-NeoX ``model_parallel_size`` become plans that run and equal their twin.

Sources: torch/distributed/device_mesh.py (``init_device_mesh(device_type, mesh_shape, *,
mesh_dim_names)``), torch/distributed/tensor/parallel/api.py (``parallelize_module(module,
device_mesh, parallelize_plan)``), torch/distributed/fsdp/_fully_shard/_fully_shard.py (a 2-D mesh
is HSDP: replicate over dim 0, shard over dim 1); DeepSpeed ``tensor_parallel.autotp_size``;
GPT-NeoX ``model_parallel_size``.
"""

from __future__ import annotations

import jax
import optax
import pytest
from conftest import require_devices
from flax_models import SEQ, VOCAB, linen_loss, linen_params
from helpers import assert_matches_twin, shared_twin_runs, twin_plan_key

from torsh_jax.errors import TranslationError
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step
from torsh_jax.runtime.verify import compare_with_twin, record_gradients
from torsh_jax.translate.deepspeed import translate_deepspeed
from torsh_jax.translate.torch_fsdp import translate_torch_fsdp

FSDP_TP = """
from torch.distributed.device_mesh import init_device_mesh
dp = 4
tp = 2
mesh_2d = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
tp_mesh = mesh_2d["tp"]
model = parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
for layer in model.layers:
    fully_shard(layer, mesh=mesh_2d["dp"])
fully_shard(model, mesh=mesh_2d["dp"])
"""

HSDP_TP = {
    "device_mesh": {"mesh_shape": [2, 2, 2], "mesh_dim_names": ["replicate", "shard", "tp"]},
    "parallelize_module": {"device_mesh": "tp"},
    "fully_shard": {"mesh": ["replicate", "shard"]},
}


def _sizes(plan) -> tuple[int, int, int]:
    mesh = plan.mesh
    return mesh.data.ici * mesh.data.dcn, mesh.fsdp.ici * mesh.fsdp.dcn, mesh.tensor.ici * mesh.tensor.dcn


def _note(result, key):
    return next(n for n in result.notes if n.key == key)


def test_fsdp2_with_a_2d_mesh_and_parallelize_module():
    result = translate_torch_fsdp(FSDP_TP)
    assert _sizes(result.plan) == (1, 4, 2) and result.plan.zero.stage == 3
    assert _note(result, "parallelize_module.device_mesh").status == "mapped"
    assert "['dp']" in _note(result, "fully_shard[0].mesh").detail


def test_hsdp_over_two_dims_and_tensor_over_the_third():
    result = translate_torch_fsdp(HSDP_TP)
    assert _sizes(result.plan) == (2, 2, 2)
    assert _note(result, "device_mesh").status == "mapped"


def test_a_mesh_dim_used_by_neither_is_refused_with_its_name():
    data = {
        "device_mesh": {"mesh_shape": [2, 2, 2], "mesh_dim_names": ["pp", "dp", "tp"]},
        "parallelize_module": {"device_mesh": "tp"},
        "fully_shard": {"mesh": "dp"},
    }
    with pytest.raises(TranslationError, match="device_mesh.pp") as err:
        translate_torch_fsdp(data)
    assert "Fix:" in str(err.value)
    assert _note(translate_torch_fsdp(data, lenient=True), "device_mesh.pp").status == "unsupported"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"device_mesh": {"mesh_shape": [4, 2], "mesh_dim_names": ["dp", "tp"]},
          "parallelize_module": {"device_mesh": "dp"}, "fully_shard": {"mesh": "dp"}}, "both FSDP"),
        ({"device_mesh": {"mesh_shape": [4, 2], "mesh_dim_names": ["dp"]}, "fully_shard": {}},
         "mesh_dim_names"),
        ({"device_mesh": {"mesh_shape": [4, 2], "mesh_dim_names": ["dp", "tp"]},
          "fully_shard": {"mesh": "cp"}}, "which dims of the device mesh"),
    ],
    ids=["shared-dim", "names-short", "unknown-dim"],
)  # fmt: skip
def test_bad_meshes_name_the_problem(data, match):
    with pytest.raises(TranslationError, match=match):
        translate_torch_fsdp(data)


def _momentum() -> optax.GradientTransformation:
    return optax.chain(record_gradients(), optax.sgd(0.05, momentum=0.9))


def _runs_and_equals_its_twin(plan) -> None:
    """``plan`` on micro-batches of 2 against its twin (the twin runs shared by the translated plans
    with the same global batch: helpers.shared_twin_runs)."""
    plan = plan.replace(batch=plan.batch.__class__(micro_batch_size=2))
    params = linen_params(jax.random.key(0))
    train = make_train_step(linen_loss, _momentum(), plan, build_mesh(plan), params)
    n = train.global_batch_size
    batches = [jax.random.randint(jax.random.key(i), (n, SEQ), 0, VOCAB) for i in range(3)]
    key = ("translate_tensor", linen_loss, _momentum, twin_plan_key(plan))
    twin, exact = shared_twin_runs(key, linen_loss, linen_loss, _momentum, plan, params, batches)
    report = compare_with_twin(tuple(train), twin, params, batches, exact=exact)
    assert train.layout.roles.tensor_axis == "tensor"
    assert_matches_twin(report, params=True)


def test_torch_tensor_plans_are_the_twin_tested_presets():
    """FSDP2 + TP over (4, 2) is fsdp_tp and HSDP x TP over (2, 2, 2) hsdp_tp in mesh and ZeRO stage
    (both run the same linen model equal to its twin in tests/test_tensor_compiler.py)."""
    from torsh_jax import load_plan

    for source, preset, slices in ((FSDP_TP, "fsdp_tp", 1), (HSDP_TP, "hsdp_tp", 2)):
        plan, want = translate_torch_fsdp(source).plan, load_plan(preset)
        # the translation sizes axes in devices; the preset puts hsdp_tp's data axis across 2 slices
        got, expected = plan.mesh.resolve(8).shape, want.mesh.resolve(8, num_slices=slices).shape
        assert got == expected and plan.zero.stage == want.zero.stage, preset


TRANSLATED = [
    pytest.param(lambda: translate_deepspeed({"train_micro_batch_size_per_gpu": 2, "zero_optimization":
                                              {"stage": 1}, "tensor_parallel": {"autotp_size": 2}},
                                             world_size=8).plan, id="deepspeed-autotp"),
    pytest.param(lambda: translate_deepspeed({"model_parallel_size": 2, "pipe_parallel_size": 1,
                                              "train_micro_batch_size_per_gpu": 2, "num_layers": 2},
                                             world_size=8).plan, id="gpt-neox"),
]  # fmt: skip


@pytest.mark.parametrize("make_plan", TRANSLATED)
def test_translated_tensor_plans_run_and_equal_their_twin(make_plan):
    require_devices(8)
    _runs_and_equals_its_twin(make_plan())
