"""DeepSpeed -> plan: what each section becomes (source of the rules: DeepSpeed
``deepspeed/runtime/config.py``, ``zero/config.py``, ``constants.py`` and the config-json docs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torsh_jax.errors import TranslationError
from torsh_jax.plan import plan_from_dict, plan_to_dict
from torsh_jax.translate.deepspeed import PINNED_DEEPSPEED, translate_deepspeed

BASE = {"train_micro_batch_size_per_gpu": 2}


def tr(extra: dict, **kwargs):
    return translate_deepspeed({**BASE, **extra}, **kwargs)


def note(result, key):
    return next(n for n in result.notes if n.key == key)


def test_boolean_zero_and_fp16_dynamic_defaults():
    """dsdoc getting-started: "zero_optimization": true is stage 1; fp16 defaults 2**16, 1000, 2, 1."""
    plan = tr({"zero_optimization": True, "fp16": {"enabled": True}}).plan
    assert plan.zero.stage == 1 and plan.mesh.fsdp.ici == -1 and plan.mesh.data.ici == 1
    scale = plan.precision.loss_scale
    assert (scale.mode, scale.initial_scale_power, scale.loss_scale_window, scale.hysteresis) == (
        "dynamic",
        16,
        1000,
        2,
    )
    assert plan.precision.compute_dtype == plan.precision.reduce_dtype == "float16"
    assert plan.precision.param_dtype == "float32"


def test_stage0_mesh_is_data_parallel():
    plan = tr({"zero_optimization": {"stage": 0}}).plan
    assert plan.mesh.data.ici == -1 and plan.mesh.fsdp.ici == 1


def test_static_loss_scale_and_window_keys():
    plan = tr({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4}}).plan
    assert plan.precision.loss_scale.mode == "static" and plan.precision.loss_scale.static_scale == 128
    dyn = tr(
        {
            "fp16": {
                "enabled": True,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "consecutive_hysteresis": True,
                "min_loss_scale": 0.5,
            }
        }
    ).plan.precision.loss_scale
    assert (
        dyn.initial_scale_power,
        dyn.loss_scale_window,
        dyn.consecutive_hysteresis,
        dyn.min_loss_scale,
    ) == (12, 500, True, 0.5)


def test_bf16_legacy_key_and_conflict():
    result = tr({"bfloat16": {"enabled": True}})
    assert result.plan.precision.compute_dtype == "bfloat16"
    assert "legacy" in note(result, "bfloat16.enabled").detail
    assert result.plan.precision.loss_scale.mode == "none"
    with pytest.raises(TranslationError, match="simultaneously") as info:
        tr({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert info.value.key == "bf16.enabled"


def test_offload_legacy_and_stage_rules():
    plan = tr(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "nvme", "nvme_path": "/x"},
            }
        }
    ).plan
    assert plan.zero.offload_optimizer and plan.zero.offload_params
    legacy = tr({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert (
        legacy.plan.zero.offload_optimizer
        and "deprecated" in note(legacy, "zero_optimization.cpu_offload").detail
    )
    stage2 = tr({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert not stage2.plan.zero.offload_params
    assert note(stage2, "zero_optimization.offload_param").status == "ignored"


def test_stage3_knobs_and_bucket_size():
    result = tr(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 1e5,
                "reduce_bucket_size": 5e7,
                "stage3_prefetch_bucket_size": 0,
                "stage3_max_live_parameters": 1e9,
            },
        }
    )
    plan = result.plan
    assert plan.zero.persistence_threshold == 100_000 and plan.zero.prefetch_layers == 0
    assert plan.communication.bucket_mb == pytest.approx(100.0)  # 5e7 bf16 elements
    assert note(result, "zero_optimization.stage3_max_live_parameters").status == "approximated"


def test_zeropp_hybrid_and_quantized_collectives():
    """ZeRO++ (dsdoc zeropp): hpZ -> hybrid sharding, qwZ/qgZ -> int8 over fsdp."""
    result = tr(
        {
            "zero_optimization": {
                "stage": 3,
                "zero_hpz_partition_size": 16,
                "zero_quantized_weights": True,
                "zero_quantized_gradients": True,
            }
        }
    )
    plan = result.plan
    assert plan.mesh.fsdp.ici == 16 and plan.mesh.data.ici == -1
    comp = plan.compression_for("fsdp")
    assert comp.weights.method == "int8" and comp.gradients.method == "int8"
    assert note(result, "zero_optimization.zero_hpz_partition_size").status == "approximated"


def test_one_bit_optimizers_map_to_base_plus_sign_compression():
    result = tr(
        {"optimizer": {"type": "OnebitAdam", "params": {"lr": 3e-5, "freeze_step": 400, "cuda_aware": False}}}
    )
    opt, comp = result.plan.optimizer, result.plan.compression_for("data")
    assert opt.name == "adamw" and opt.learning_rate == 3e-5
    assert (comp.gradients.method, comp.gradients.warmup_steps, comp.gradients.error_feedback) == (
        "sign",
        400,
        True,
    )
    zero_one = tr(
        {"optimizer": {"type": "ZeroOneAdam", "params": {"var_freeze_step": 12, "local_step_scaler": 9}}}
    )
    assert zero_one.plan.compression_for("data").gradients.warmup_steps == 12
    assert note(zero_one, "optimizer.params.local_step_scaler").status == "approximated"
    lamb = tr({"optimizer": {"type": "OneBitLamb", "params": {"freeze_step": 7, "max_coeff": 0.3}}}).plan
    assert lamb.optimizer.name == "lamb" and lamb.optimizer.params["max_coeff"] == 0.3
    with pytest.raises(TranslationError, match="stage 0"):
        tr({"optimizer": {"type": "OneBitAdam", "params": {}}, "zero_optimization": {"stage": 2}})


def test_adam_modes_and_parameter_names():
    """DeepSpeed Adam decouples weight decay unless adam_w_mode is false."""
    default = tr(
        {
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
            }
        }
    ).plan.optimizer
    assert default.name == "adamw"
    assert default.params == {"b1": 0.8, "b2": 0.999, "eps": 1e-8, "weight_decay": 3e-7}
    l2 = tr({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).plan.optimizer
    assert l2.name == "adam"
    sgd = tr(
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}}
    ).plan.optimizer
    assert sgd.name == "sgd" and sgd.params == {"momentum": 0.9, "nesterov": True}
    with pytest.raises(TranslationError) as info:
        tr({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})
    assert info.value.key == "optimizer.params.max_grad_norm" and "gradient_clipping" in info.value.fix
    with pytest.raises(TranslationError) as info:
        tr({"optimizer": {"type": "Adagrad", "params": {}}})
    assert info.value.key == "optimizer.type"


def test_scheduler_names_defaults_and_errors():
    plan = tr({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}).plan
    sched = plan.optimizer.schedule
    assert sched.name == "warmup_lr"
    assert sched.params["warmup_type"] == "log" and sched.params["warmup_num_steps"] == 1000
    assert sched.params["last_batch_iteration"] == -1
    with pytest.raises(TranslationError) as info:
        tr({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3}}})
    assert info.value.key == "scheduler.params.total_num_steps"
    with pytest.raises(TranslationError) as info:
        tr({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})
    assert "warmup_num_steps" in info.value.fix
    with pytest.raises(TranslationError, match="unknown scheduler"):
        tr({"scheduler": {"type": "Cyclic", "params": {}}})


def test_auto_values_error_lists_every_key():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"},
    }
    with pytest.raises(TranslationError) as info:
        translate_deepspeed(config, world_size=8)
    message = info.value.message
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "optimizer.params.lr",
        "optimizer.params.weight_decay",
    ):
        assert key in message
    assert "stage3_gather_16bit" not in message  # ignored keys need no value
    assert "--set" in info.value.fix


def test_auto_values_from_overrides_and_trainer():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
    }
    trainer = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "learning_rate": 2e-5,
        "max_steps": 500,
        "warmup_ratio": 0.1,
        "bf16": True,
    }
    result = translate_deepspeed(config, world_size=8, hf_trainer=trainer)
    plan = result.plan
    assert plan.batch.micro_batch_size == 4 and plan.batch.accumulation_steps == 2
    assert result.extras["train_batch_size"] == 64
    assert plan.optimizer.learning_rate == 2e-5 and plan.optimizer.gradient_clipping == 1.0
    assert plan.optimizer.schedule.params["warmup_num_steps"] == 50
    assert plan.optimizer.schedule.params["total_num_steps"] == 500
    assert plan.precision.compute_dtype == "float32"  # fp16 False from the Trainer; bf16 key absent
    sets = {
        "train_micro_batch_size_per_gpu": "4",
        "gradient_accumulation_steps": 1,
        "train_batch_size": 32,
        "gradient_clipping": 0.5,
        "fp16.enabled": "false",
        "optimizer.params.lr": 1e-4,
        "optimizer.params.betas": "[0.9, 0.95]",
        "optimizer.params.weight_decay": 0.1,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": 1e-4,
        "scheduler.params.warmup_num_steps": 10,
        "scheduler.params.total_num_steps": 100,
    }
    plan = translate_deepspeed(config, world_size=8, overrides=sets).plan
    assert plan.optimizer.params["b2"] == 0.95 and plan.optimizer.gradient_clipping == 0.5
    with pytest.raises(TranslationError) as info:
        translate_deepspeed(config, hf_trainer={"learning_rat": 1.0})
    assert info.value.key == "hf_trainer.learning_rat"


def test_gradient_clipping_default_is_pinned_and_overridable():
    result = tr({"optimizer": {"type": "AdamW", "params": {}}})
    assert result.plan.optimizer.gradient_clipping == 1.0
    assert PINNED_DEEPSPEED in result.extras["gradient_clipping_default"]
    older = tr({"optimizer": {"type": "AdamW", "params": {}}}, overrides={"gradient_clipping": 0})
    assert older.plan.optimizer.gradient_clipping == 0.0


def test_unknown_keys_raise_with_suggestion_or_are_noted_when_lenient():
    """DeepSpeed's zero config rejects unknown keys (so do we); zenflow is refused unless lenient."""
    with pytest.raises(TranslationError) as info:
        tr({"zero_optimization": {"stage": 3, "stage3_param_persitence_threshold": 1e5}})
    assert info.value.key == "zero_optimization.stage3_param_persitence_threshold"
    assert "stage3_param_persistence_threshold" in info.value.fix
    lenient = tr({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}, lenient=True)
    assert {n.key for n in lenient.by_status("unsupported")} == {"zero_optimization.zenflow"}


def test_unknown_top_level_keys_are_ignored_as_deepspeed_does_and_refused_when_strict():
    """DeepSpeedConfig reads the keys it knows and ignores the rest (cuda_visible_devices is in a
    DeepSpeedExamples config); a near miss of a known key gets a suggestion."""
    result = tr({"cuda_visible_devices": 0, "train_batch_sizes": 16})
    notes = {n.key: n for n in result.by_status("ignored")}
    assert "DeepSpeed ignores unknown top-level keys" in notes["cuda_visible_devices"].detail
    assert "did you mean 'train_batch_size'?" in notes["train_batch_sizes"].detail
    with pytest.raises(TranslationError) as info:
        tr({"train_batch_sizes": 16}, strict=True)
    assert info.value.key == "train_batch_sizes" and "train_batch_size" in info.value.fix


def test_auto_inside_zero_optimization_takes_deepspeeds_default():
    """DeepSpeedConfigModel drops "auto" values, so the plan is the one without those keys."""
    result = tr({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": "auto"}})
    assert result.plan == tr({"zero_optimization": {"stage": 2}}).plan
    keys = {n.key for n in result.by_status("mapped")}
    assert {"zero_optimization.reduce_bucket_size", "zero_optimization.overlap_comm"} <= keys


def test_max_grad_norm_in_optimizer_params_is_refused_as_deepspeed_does():
    """DeepSpeed's _configure_basic_optimizer raises ValueError for it (use gradient_clipping)."""
    with pytest.raises(TranslationError) as info:
        tr({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})
    assert info.value.key == "optimizer.params.max_grad_norm"
    assert "gradient_clipping" in info.value.fix


def test_clipping_applies_without_any_optimizer_key():
    """DeepSpeed 0.19.8 clips at 1.0 even with the client's optimizer and no clipping key."""
    result = translate_deepspeed({"train_batch_size": 8}, world_size=8)
    assert result.plan.optimizer.gradient_clipping == 1.0
    assert "optimizer" in {n.key for n in result.by_status("approximated")}


def test_removed_ignored_and_enabled_sections():
    result = tr(
        {
            "sparse_attention": {"mode": "fixed"},
            "progressive_layer_drop": {"enabled": True},
            "wall_clock_breakdown": True,
            "activation_checkpointing": {"partition_activations": True},
            "data_efficiency": {"enabled": False},
            "_comment": "x",
        }
    )
    assert note(result, "sparse_attention.mode").status == "removed"
    assert note(result, "progressive_layer_drop.enabled").status == "removed"
    assert note(result, "wall_clock_breakdown").status == "ignored"
    assert note(result, "activation_checkpointing.partition_activations").status == "ignored"
    assert note(result, "data_efficiency.enabled").status == "ignored"
    with pytest.raises(TranslationError) as info:
        tr({"data_efficiency": {"enabled": True}})
    assert info.value.key == "data_efficiency"


def test_communication_keys():
    result = tr(
        {
            "prescale_gradients": True,
            "gradient_predivide_factor": 8,
            "communication_data_type": "fp32",
            "fp16": {"enabled": True},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
        }
    )
    plan = result.plan
    assert plan.communication.prescale_gradients and plan.communication.gradient_predivide_factor == 8
    assert plan.precision.reduce_dtype == "float32"
    assert plan.communication.bucket_mb == pytest.approx(2000.0)


def test_tensor_parallel_and_pipeline_section():
    result = translate_deepspeed(
        {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 1,
            "tensor_parallel": {"autotp_size": 2, "preset_model": "llama"},
            "pipeline": {"stages": 2, "partition": "parameters"},
        },
        world_size=8,
    )
    plan = result.plan
    assert plan.mesh.tensor.ici == 2 and plan.mesh.stage.ici == 2
    assert result.extras["data_parallel_size"] == 2
    # DeepSpeed's pipeline engine runs the 8 accumulation micro-batches as one pass
    assert plan.batch.accumulation_steps == 1 and plan.batch.micro_batch_size == 8
    assert plan.pipeline.microbatches == 8 and plan.pipeline.schedule == "1f1b"


def test_neox_yaml_dialect(tmp_path):
    path = tmp_path / "run.yml"
    path.write_text(
        "# neox\n{\n  'pipe-parallel-size': 2, 'model_parallel_size': 2, 'num_layers': 4,\n"
        "  'optimizer': {'type': 'Adam', 'params': {'lr': 0.0006, 'betas': [0.9, 0.95], 'eps': 1.0e-8,}},\n"
        "  'zero_optimization': {'stage': 1, 'overlap_comm': True,},\n"
        "  'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 8,\n"
        "  'precision': 'bfloat16', 'fp32_allreduce': True, 'weight_decay': 0.1,\n"
        "  'lr_decay_style': 'cosine', 'lr_decay_iters': 1000, 'warmup': 0.01, 'min_lr': 0.00006,\n}\n"
    )
    result = translate_deepspeed(path, world_size=16)
    plan = result.plan
    assert result.extras["dialect"] == "gpt-neox"
    assert (plan.mesh.stage.ici, plan.mesh.tensor.ici) == (2, 2)
    assert plan.precision.compute_dtype == "bfloat16" and plan.precision.reduce_dtype == "float32"
    assert plan.optimizer.params["weight_decay"] == 0.1
    assert plan.optimizer.schedule.name == "cosine" and plan.optimizer.schedule.params["warmup_steps"] == 10
    assert plan.pipeline.microbatches == 8


def test_hjson_text_and_bad_syntax(tmp_path):
    text = '{\n  // comment\n  train_micro_batch_size_per_gpu: 4,\n  "fp16": {"enabled": true,},\n}'
    assert translate_deepspeed(text).plan.batch.micro_batch_size == 4
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": [1, 2}')
    with pytest.raises(TranslationError) as info:
        translate_deepspeed(bad)
    assert info.value.key == str(bad)
    with pytest.raises(TranslationError):
        translate_deepspeed(tmp_path / "missing.json")


def test_plan_round_trips_through_plain_data():
    result = tr(
        {
            "zero_optimization": {"stage": 3, "zero_quantized_gradients": True},
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}},
        }
    )
    assert plan_from_dict(plan_to_dict(result.plan)) == result.plan


def test_translate_does_not_import_jax():
    code = (
        "import sys, torsh_jax.translate.deepspeed as d; d.translate_deepspeed({'train_batch_size': 8}, "
        "world_size=8); assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trainer_bf16_fills_only_bf16_enabled_as_transformers_does():
    """transformers fills ``bf16.enabled``; a legacy ``bfloat16`` section left "auto" stays unfilled."""
    config = {**BASE, "bf16": {"enabled": "auto"}}
    trainer = {"bf16": True, "per_device_train_batch_size": 2}
    result = translate_deepspeed(config, world_size=8, hf_trainer=trainer)
    assert result.plan.precision.compute_dtype == "bfloat16"
    with pytest.raises(TranslationError, match=r"bfloat16\.enabled"):
        translate_deepspeed({**BASE, "bfloat16": {"enabled": "auto"}}, world_size=8, hf_trainer=trainer)


@pytest.mark.parametrize(
    "config, trainer, mismatch",
    [
        ({"fp16": {"enabled": True}}, {"fp16": False}, "- ds fp16.enabled=True vs hf fp16=False"),
        ({"gradient_clipping": 0.5}, {}, "- ds gradient_clipping=0.5 vs hf max_grad_norm=1.0"),
        ({"train_micro_batch_size_per_gpu": 4}, {"per_device_train_batch_size": 2},
         "- ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=2"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, {"learning_rate": 3e-5},
         "- ds optimizer.params.lr=0.0001 vs hf learning_rate=3e-05"),
    ],
)  # fmt: skip
def test_trainer_conflicts_are_refused_with_transformers_wording(config, trainer, mismatch):
    with pytest.raises(TranslationError) as info:
        translate_deepspeed({"train_micro_batch_size_per_gpu": 2, **config}, world_size=8, hf_trainer=trainer)
    assert info.value.key == "hf_trainer"
    assert mismatch in str(info.value) and '"auto"' in info.value.fix


def test_trainer_values_equal_to_the_config_are_no_conflict():
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "gradient_clipping": 1.0}
    trainer = {"fp16": True, "per_device_train_batch_size": 2}
    assert (
        translate_deepspeed(config, world_size=8, hf_trainer=trainer).plan.precision.compute_dtype
        == "float16"
    )


#: The Hugging Face "auto" config of the transformers DeepSpeed docs (ZeRO-2), as users copy it.
HF_AUTO = {
    "fp16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {"stage": 2},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


@pytest.mark.parametrize(
    "warmup", [{}, {"warmup_steps": 0}, {"warmup_ratio": 0.0}], ids=["default", "steps", "ratio"]
)
def test_hf_auto_config_without_warmup_fills_one_step(warmup):
    """transformers 5.24 fills ``max(1, get_warmup_steps())``, since DeepSpeed 0.19.3+ refuses 0."""
    trainer = {"max_steps": 100, "per_device_train_batch_size": 2, **warmup}
    plan = translate_deepspeed(HF_AUTO, world_size=8, hf_trainer=trainer).plan
    assert plan.optimizer.schedule.params["warmup_num_steps"] == 1


def test_hf_trainer_warmup_steps_below_one_is_a_fraction():
    """transformers 5 ``get_warmup_steps``: ``warmup_steps`` < 1 is a fraction of the training steps."""
    trainer = {"max_steps": 100, "warmup_steps": 0.05}
    assert (
        translate_deepspeed(HF_AUTO, world_size=8, hf_trainer=trainer).plan.optimizer.schedule.params[
            "warmup_num_steps"
        ]
        == 5
    )


@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_warmup_zero_written_in_the_config_is_refused_as_deepspeed_refuses_it(scheduler):
    params = {"warmup_num_steps": 0, "total_num_steps": 100}
    if scheduler == "WarmupLR":
        params.pop("total_num_steps")
    with pytest.raises(TranslationError) as info:
        tr({"scheduler": {"type": scheduler, "params": params}})
    assert info.value.key == "scheduler.params.warmup_num_steps"
    assert "0.19.3" in str(info.value) and "warmup_num_steps to 1" in info.value.fix


@pytest.mark.parametrize(
    "text, key",
    [
        ('{"train_batch_size": 16, "train_batch_size": 32}', "train_batch_size"),
        (
            '{"zero_optimization": {"stage": 1, "stage": 3}, "train_batch_size": 16}',
            "zero_optimization.stage",
        ),
        ("{train_batch_size: 16, x: [{a: 1, a: 1}]}", "x[0].a"),
    ],
    ids=["top", "nested", "hjson-list"],
)
def test_duplicate_keys_are_refused_as_deepspeed_refuses_them(tmp_path, text, key):
    """DeepSpeed reads config files with ``object_pairs_hook=dict_raise_error_on_duplicate_keys``."""
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(TranslationError) as info:
        translate_deepspeed(path, world_size=8)
    assert info.value.key == key
    assert "ds.json" in str(info.value) and "Duplicate keys" in str(info.value) and info.value.fix


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_with_a_pipeline_are_refused_as_deepspeed_refuses_them(stage):
    config = {"zero_optimization": {"stage": stage}, "pipeline": {"stages": 2}}
    with pytest.raises(TranslationError) as info:
        tr(config, world_size=8)
    assert info.value.key == "zero_optimization.stage"
    assert "incompatible with pipeline parallelism" in str(info.value) and "0 or 1" in info.value.fix


def test_zero_1_with_a_pipeline_translates():
    plan = tr({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}, world_size=8).plan
    assert (plan.zero.stage, plan.mesh.stage.ici) == (1, 2)


#: ``HfArgumentParser.string_to_bool`` (transformers ``hf_argparser.py``): these, in any case.
_TRAINER_TRUE = [True, 1, "yes", "TRUE", "t", "Y", "1"]
_TRAINER_FALSE = [False, 0, "no", "False", "f", "N", "0", "false"]


@pytest.mark.parametrize(
    ("value", "enabled"),
    [(v, True) for v in _TRAINER_TRUE] + [(v, False) for v in _TRAINER_FALSE],
    ids=[f"true-{v!r}" for v in _TRAINER_TRUE] + [f"false-{v!r}" for v in _TRAINER_FALSE],
)
def test_trainer_booleans_are_read_as_transformers_reads_them(value, enabled):
    config = {**BASE, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    for name in ("bf16", "fp16"):
        trainer = {name: value, "per_device_train_batch_size": 2}
        result = translate_deepspeed(config, world_size=8, hf_trainer=trainer)
        assert note(result, f"{name}.enabled").value is enabled


@pytest.mark.parametrize("value", ["maybe", 2, 1.0, None, "on", "", [True]])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_trainer_boolean_transformers_refuses_is_one_error_naming_the_flag(name, value):
    config = {**BASE, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    with pytest.raises(TranslationError) as err:
        translate_deepspeed(config, world_size=8, hf_trainer={name: value, "per_device_train_batch_size": 2})
    assert err.value.key == f"--hf-trainer {name}"
    assert "must be a boolean" in err.value.message and repr(value) in err.value.message
    assert f"{name}=true" in err.value.fix


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("per_device_train_batch_size", "abc", "must be a whole number >= 1"),
        ("per_device_train_batch_size", -3, "must be a whole number >= 1"),
        ("per_device_train_batch_size", 2.5, "must be a whole number >= 1"),
        ("gradient_accumulation_steps", 0, "must be a whole number >= 1"),
        ("learning_rate", "fast", "must be a finite number >= 0"),
        ("learning_rate", float("nan"), "must be a finite number >= 0"),
        ("max_grad_norm", True, "must be a finite number >= 0"),
        ("max_steps", "ten", "must be a whole number, got"),
    ],
)
def test_a_trainer_number_transformers_would_refuse_is_one_error_naming_the_flag(name, value, says):
    """Named by the ``--hf-trainer`` argument given, not by the DeepSpeed key it fills."""
    config = {**BASE, "train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW",
              "params": {"lr": "auto"}}, "gradient_clipping": "auto"}  # fmt: skip
    with pytest.raises(TranslationError) as err:
        translate_deepspeed(config, world_size=8, hf_trainer={"per_device_train_batch_size": 2, name: value})
    assert err.value.key == f"--hf-trainer {name}" and says in err.value.message, err.value
    assert f"--hf-trainer {name}=" in err.value.fix


def test_trainer_numbers_given_as_text_are_read_as_numbers():
    config = {**BASE, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}
    result = translate_deepspeed(config, world_size=8, hf_trainer={"per_device_train_batch_size": "4"})
    assert result.plan.batch.micro_batch_size * 8 * result.plan.batch.accumulation_steps == 32


def test_missing_world_size_fix_names_the_flag():
    with pytest.raises(TranslationError) as err:
        translate_deepspeed({"train_batch_size": 16})
    assert err.value.key == "train_micro_batch_size_per_gpu"
    assert "--world-size" in err.value.fix and "world_size (devices)" not in err.value.fix


def test_long_unknown_key_is_clipped_in_the_error():
    long_key = "k" * 100_000
    with pytest.raises(TranslationError) as err:
        tr({long_key: 1}, strict=True)
    assert len(err.value.key) <= 80 and err.value.key.startswith("kkk") and "..." in err.value.key
    assert len(str(err.value)) < 300
    assert str(err.value).startswith(err.value.key)
