"""PyTorch FSDP arguments -> plans.

Sources for the expected values:
- torch/distributed/fsdp/api.py: ``ShardingStrategy`` FULL_SHARD=1, SHARD_GRAD_OP=2,
  NO_SHARD=3, HYBRID_SHARD=4, _HYBRID_SHARD_ZERO2=5; ``MixedPrecision(param_dtype,
  reduce_dtype, buffer_dtype, keep_low_precision_grads, cast_forward_inputs,
  cast_root_forward_inputs, _module_classes_to_ignore)`` where a missing
  ``reduce_dtype`` follows ``param_dtype``; ``CPUOffload(offload_params)``.
- torch/distributed/fsdp/fully_sharded_data_parallel.py: FSDP1 argument order
  (module, process_group, sharding_strategy, cpu_offload, ...).
- torch/distributed/fsdp/_fully_shard/_fully_shard.py: ``fully_shard(module, *,
  mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
  ignored_params)``.
"""

from __future__ import annotations

import json

import pytest
from conftest import fuzz_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torsh_jax.errors import TorshError, TranslationError
from torsh_jax.plan.spec import AxisSize
from torsh_jax.translate.torch_fsdp import translate_torch_fsdp


def _note(result, key):
    matches = [n for n in result.notes if n.key == key]
    assert matches, f"no note {key!r} in {[n.key for n in result.notes]}"
    return matches[0]


@pytest.mark.parametrize(
    ("strategy", "stage", "data", "fsdp"),
    [
        ("FULL_SHARD", 3, AxisSize(), AxisSize(ici=-1)),
        ("SHARD_GRAD_OP", 2, AxisSize(), AxisSize(ici=-1)),
        ("NO_SHARD", 0, AxisSize(ici=-1), AxisSize()),
        ("HYBRID_SHARD", 3, AxisSize(ici=1, dcn=-1), AxisSize(ici=-1)),
        ("_HYBRID_SHARD_ZERO2", 2, AxisSize(ici=1, dcn=-1), AxisSize(ici=-1)),
        (1, 3, AxisSize(), AxisSize(ici=-1)),
        ("ShardingStrategy.NO_SHARD", 0, AxisSize(ici=-1), AxisSize()),
    ],
    ids=["full", "grad-op", "no-shard", "hybrid", "hybrid-zero2", "enum-int", "qualified"],
)
def test_sharding_strategy(strategy, stage, data, fsdp):
    r = translate_torch_fsdp({"fsdp": {"sharding_strategy": strategy}})
    assert r.kind == "torch_fsdp"
    assert r.plan.zero.stage == stage
    assert (r.plan.mesh.data, r.plan.mesh.fsdp) == (data, fsdp)


def test_hybrid_with_node_size_and_world_size():
    r = translate_torch_fsdp(
        {"fsdp": {"sharding_strategy": "HYBRID_SHARD", "devices_per_node": 8}}, world_size=32
    )
    assert r.plan.mesh.fsdp == AxisSize(ici=8)
    assert r.plan.mesh.data == AxisSize(ici=1, dcn=4)
    assert r.plan.mesh.resolve(32, num_slices=4).shape["fsdp"] == 8
    r = translate_torch_fsdp(
        {"fsdp": {"sharding_strategy": "HYBRID_SHARD"}}, overrides={"fsdp.devices_per_node": 4}
    )
    assert r.plan.mesh.fsdp == AxisSize(ici=4)
    with pytest.raises(TranslationError):
        translate_torch_fsdp({"fsdp": {"sharding_strategy": 4, "devices_per_node": 8}}, world_size=12)


def test_hybrid_without_node_size_is_noted():
    r = translate_torch_fsdp({"fsdp": {"sharding_strategy": "HYBRID_SHARD"}})
    assert _note(r, "devices_per_node").status == "approximated"


def test_mixed_precision_and_offload():
    r = translate_torch_fsdp(
        {
            "fsdp": {
                "mixed_precision": {"param_dtype": "bfloat16", "buffer_dtype": "bfloat16"},
                "cpu_offload": {"offload_params": True},
                "backward_prefetch": None,
            }
        }
    )
    p = r.plan.precision
    assert (p.param_dtype, p.compute_dtype, p.reduce_dtype) == ("float32", "bfloat16", "bfloat16")
    assert r.plan.zero.offload_params and r.plan.zero.offload_optimizer
    assert r.plan.zero.prefetch_layers == 0
    assert _note(r, "fsdp.mixed_precision.buffer_dtype").status == "ignored"


def test_python_call_excerpt():
    text = """
mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
model = FullyShardedDataParallel(
    model,
    sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
    mixed_precision=mp,
    cpu_offload=CPUOffload(offload_params=False),
    backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    use_orig_params=True,
    sync_module_states=True,
)
"""
    r = translate_torch_fsdp(text)
    assert r.plan.zero.stage == 2 and not r.plan.zero.offload_params
    assert (r.plan.precision.compute_dtype, r.plan.precision.reduce_dtype) == ("float16", "float32")
    assert _note(r, "fsdp.sharding_strategy").status == "approximated"
    assert _note(r, "fsdp.auto_wrap_policy").status == "approximated"
    for key in ("fsdp.module", "fsdp.use_orig_params", "fsdp.sync_module_states"):
        assert _note(r, key).status == "ignored"
    assert _note(r, "fsdp.mixed_precision.param_dtype").status == "mapped"


def test_positional_arguments_follow_the_signature():
    r = translate_torch_fsdp("FSDP(model, None, ShardingStrategy.NO_SHARD)")
    assert r.plan.zero.stage == 0
    assert _note(r, "fsdp.process_group").status == "ignored"


def test_fsdp2_fully_shard_calls():
    text = """
for layer in model.layers:
    fully_shard(layer, reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
fully_shard(model, reshard_after_forward=False, offload_policy=CPUOffloadPolicy())
"""
    r = translate_torch_fsdp(text)
    assert r.plan.zero.stage == 3 and r.plan.zero.reshard_after_forward is False
    assert r.plan.zero.offload_params
    assert r.plan.precision.compute_dtype == "bfloat16"
    assert _note(r, "fully_shard[1].reshard_after_forward").status == "mapped"


def test_conflicting_calls_raise():
    text = "fully_shard(a, reshard_after_forward=True)\nfully_shard(b, reshard_after_forward=False)"
    with pytest.raises(TranslationError) as err:
        translate_torch_fsdp(text)
    assert err.value.key == "fully_shard[1].reshard_after_forward"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"fsdp": {"sharding_strategy": "QUARTER_SHARD"}}, "fsdp.sharding_strategy"),
        ({"fsdp": {"mixed_precision": {"param_dtype": "int8"}}}, "fsdp.mixed_precision.param_dtype"),
        ({"fsdp": {"mixed_precision": {"bogus": 1}}}, "fsdp.mixed_precision.bogus"),
        ({"fsdp": {"ignored_modules": ["head"]}}, "fsdp.ignored_modules"),
        ({"fsdp": {"shard_everything": True}}, "fsdp.shard_everything"),
        ({"deepspeed": {}}, "deepspeed"),
        ({"fsdp": {"backward_prefetch": "SIDEWAYS"}}, "fsdp.backward_prefetch"),
    ],
    ids=["strategy", "dtype", "mp-field", "ignored-modules", "unknown-arg", "top-level", "prefetch"],
)
def test_bad_arguments_name_their_key(data, key):
    with pytest.raises(TranslationError) as err:
        translate_torch_fsdp(data)
    assert err.value.key == key


def test_lenient_notes_unsupported():
    r = translate_torch_fsdp({"fsdp": {"ignored_modules": ["head"]}}, lenient=True)
    assert _note(r, "fsdp.ignored_modules").status == "unsupported"


def test_every_json_leaf_is_noted():
    data = {
        "fsdp": {
            "sharding_strategy": "FULL_SHARD",
            "mixed_precision": {
                "param_dtype": "bf16",
                "reduce_dtype": "fp32",
                "keep_low_precision_grads": False,
            },
            "cpu_offload": {"offload_params": False},
            "forward_prefetch": True,
            "limit_all_gathers": True,
            "device_id": 0,
        }
    }
    keys = {n.key for n in translate_torch_fsdp(data).notes}
    leaves = {f"fsdp.{k}.{s}" for k, v in data["fsdp"].items() if isinstance(v, dict) for s in v}
    leaves |= {f"fsdp.{k}" for k, v in data["fsdp"].items() if not isinstance(v, dict)}
    assert leaves <= keys


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 9) | st.floats(allow_nan=True) | st.text(max_size=12)
    | st.sampled_from(["FULL_SHARD", "HYBRID_SHARD", "bfloat16", "torch.float16", "BACKWARD_PRE"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
_names = st.sampled_from(
    ["sharding_strategy", "mixed_precision", "cpu_offload", "backward_prefetch", "forward_prefetch",
     "reshard_after_forward", "devices_per_node", "ignored_modules", "device_mesh", "use_orig_params", "x"]
)  # fmt: skip


_tops = st.sampled_from(["fsdp", "fully_shard", "device_mesh", "parallelize_module", "other"])
_keys = _names | st.sampled_from(["mesh_shape", "mesh_dim_names", "mesh"])


@settings(max_examples=fuzz_examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_tops, st.dictionaries(_keys, _values)), st.integers(1, 64) | st.none())
def test_fuzzed_dicts_raise_only_typed_errors(data, world_size):
    try:
        r = translate_torch_fsdp(data, world_size=world_size)
    except TorshError:
        return
    json.dumps([n.to_dict() for n in r.notes])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("fsdp.json", json.dumps({"fsdp": {"sharding_strategy": "NO_SHARD"}})),
        ("wrap.py", "model = FSDP(model, sharding_strategy=ShardingStrategy.NO_SHARD)\n"),
        ("notes.txt", "FullyShardedDataParallel(model, sharding_strategy=3)\n"),
    ],
    ids=["json", "py", "txt"],
)
def test_translate_file_detects_fsdp(tmp_path, name, text):
    from torsh_jax.translate.detect import detect_kind, translate_file

    path = tmp_path / name
    path.write_text(text)
    assert detect_kind(path) == "torch_fsdp"
    result = translate_file(path, world_size=8)
    assert result.kind == "torch_fsdp" and result.plan.zero.stage == 0


#: The device-mesh JSON form of docs/translate.md ("Device meshes"): HSDP over (replicate, shard) x TP.
MESH_JSON = {
    "device_mesh": {"mesh_shape": [2, 2, 2], "mesh_dim_names": ["replicate", "shard", "tp"]},
    "parallelize_module": {"device_mesh": "tp"},
    "fully_shard": {"mesh": ["replicate", "shard"]},
}


@pytest.mark.parametrize(
    "data",
    [MESH_JSON, dict(reversed(MESH_JSON.items())), {"device_mesh": MESH_JSON["device_mesh"], "fsdp": {}}],
    ids=["mesh-first", "fully-shard-first", "fsdp1-with-mesh"],
)
def test_translate_file_detects_fsdp_with_a_device_mesh(tmp_path, data):
    from torsh_jax.translate.detect import detect_kind, translate_file

    path = tmp_path / "mesh.json"
    path.write_text(json.dumps(data))
    assert detect_kind(path) == "torch_fsdp"
    assert translate_file(path, world_size=8, lenient=True).kind == "torch_fsdp"


_DEEPSPEED_OR_FSDP = ("DeepSpeed or PyTorch FSDP", "for DeepSpeed remove")


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("mixed.json", json.dumps({"fsdp": {}, "train_batch_size": 8}), _DEEPSPEED_OR_FSDP),
        ("mixed.json", json.dumps({**MESH_JSON, "zero_optimization": {"stage": 3}}), _DEEPSPEED_OR_FSDP),
        ("mixed.py", "model = FSDP(model)\nopt = hvd.DistributedOptimizer(opt)\n",
         ("Horovod or PyTorch FSDP", "separate files")),
    ],
    ids=["fsdp-and-deepspeed-keys", "mesh-and-deepspeed-keys", "fsdp-call-and-hvd"],
)  # fmt: skip
def test_input_of_two_kinds_is_an_error_naming_both(tmp_path, name, text, expected):
    from torsh_jax.translate.detect import detect_kind

    kinds, fix = expected
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TranslationError) as err:
        detect_kind(path)
    assert err.value.key == str(path) and f"could be {kinds} input" in err.value.message
    assert fix in err.value.fix


@pytest.mark.parametrize("world_size", [4, 16])
def test_world_size_that_differs_from_the_device_mesh_is_one_error_naming_both(world_size):
    with pytest.raises(TranslationError) as err:
        translate_torch_fsdp(MESH_JSON, world_size=world_size)
    assert err.value.key == "device_mesh"
    assert (
        "(2, 2, 2) has 8 devices" in err.value.message
        and f"--world-size says {world_size}" in err.value.message
    )
    assert "drop --world-size" in err.value.fix
    assert translate_torch_fsdp(MESH_JSON, world_size=8).plan.mesh.tensor == AxisSize(ici=2)


def test_translate_file_rejects_unknown_content(tmp_path):
    from torsh_jax.translate.detect import translate_file

    path = tmp_path / "notes.txt"
    path.write_text("nothing to see here\n")
    with pytest.raises(TranslationError) as err:
        translate_file(path)
    assert err.value.key == str(path)
