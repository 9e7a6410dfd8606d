"""The gpt-neox dialect: NeoX arguments around a DeepSpeed subset (``neox/*.yml``).

NeoX spells keys with ``-`` or ``_`` and adds its own: parallel sizes
(``pipe_parallel_size``, ``model_parallel_size``), ``precision``,
``fp32_allreduce``, a top-level ``weight_decay`` and its learning-rate decay
(``lr_decay_style``, ``lr_decay_iters``, ``warmup`` fraction, ``min_lr``).
Model, data and logging arguments do not reach the plan.

Example:
    >>> from torsh_jax.translate.ds_context import Context
    >>> is_neox({"pipe_parallel_size": 1}, "x.json"), is_neox({"fp16": {}}, "x.json")
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torsh_jax.plan.spec import ScheduleSpec
from torsh_jax.translate.ds_context import Context

__all__ = ["is_neox", "normalize_neox", "translate_neox", "NeoxResult", "NEOX_KEYS"]

_MARKERS = {"pipe_parallel_size", "model_parallel_size", "train_iters", "lr_decay_style", "num_layers"}
_MODEL_DATA_LOG = (
    "num_layers hidden_size num_attention_heads seq_length max_position_embeddings norm pos_emb rotary_pct "
    "no_weight_tying gpt_j_residual output_layer_parallelism scaled_upper_triang_masked_softmax_fusion "
    "bias_gelu_fusion rope_fusion layernorm_fusion init_method output_layer_init_method data_impl split "
    "hidden_dropout attention_dropout vocab_file save load data_path tokenizer_type tensorboard_dir log_dir "
    "checkpoint_factor save_interval eval_interval eval_iters log_interval keep_last_n_checkpoints "
    "distributed_backend hostfile launcher deepspeed_slurm synchronize_each_layer comment autotuning_config "
    "checkpoint_activations checkpoint_num_layers partition_activations train_iters"
).split()
_SCHEDULE_KEYS = ("lr_decay_style", "lr_decay_iters", "warmup", "min_lr")
NEOX_KEYS = (
    *_MODEL_DATA_LOG,
    *_SCHEDULE_KEYS,
    "pipe_parallel_size",
    "model_parallel_size",
    "precision",
    "fp32_allreduce",
    "weight_decay",
)


def normalize_neox(config: dict) -> dict:
    """NeoX treats ``-`` and ``_`` in top-level keys alike."""
    return {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in config.items()}


def is_neox(config: dict, source: str) -> bool:
    """A ``.yml``/``.yaml`` file, or NeoX-only keys at the top level."""
    if source.endswith((".yml", ".yaml")):
        return True
    return bool(_MARKERS & set(normalize_neox(config)))


@dataclass
class NeoxResult:
    """Plan pieces from NeoX keys."""

    tensor: int = 1
    stages: int = 1
    compute_dtype: str | None = None
    reduce_fp32: bool = False
    weight_decay: float | None = None
    schedule: ScheduleSpec | None = None
    schedule_params: dict[str, Any] = field(default_factory=dict)


def _schedule(ctx: Context, config: dict, out: NeoxResult) -> None:
    style = ctx.read_str("lr_decay_style", config.get("lr_decay_style", "linear"))
    iters = ctx.read_int(
        "lr_decay_iters", config.get("lr_decay_iters", config.get("train_iters", 0)), minimum=0
    )
    warmup = ctx.read_number("warmup", config.get("warmup", 0.0), minimum=0) or 0.0
    low = ctx.read_number("min_lr", config.get("min_lr", 0.0), minimum=0) or 0.0
    present = [k for k in _SCHEDULE_KEYS if k in config]
    if style == "cosine":
        params = {"warmup_steps": int(warmup * (iters or 0)), "decay_steps": iters or 1, "min_lr": low}
        out.schedule = ScheduleSpec("cosine", params)
        for key in present:
            ctx.mapped(
                key, config[key], "optimizer.schedule = cosine (linear warm-up, cosine decay to min_lr)"
            )
    elif present:
        for key in present:
            ctx.unsupported(
                key,
                config[key],
                f"gpt-neox lr_decay_style {style!r} is not translated",
                fix="use lr_decay_style cosine",
            )


def translate_neox(ctx: Context, config: dict) -> NeoxResult:
    """Translate the NeoX keys of a normalized config (others are left to the DeepSpeed path)."""
    out = NeoxResult()
    for key in ("pipe_parallel_size", "model_parallel_size"):
        if key in config:
            size = max(ctx.read_int(key, config[key], minimum=0) or 1, 1)
            axis = "stage" if key.startswith("pipe") else "tensor"
            setattr(out, "stages" if axis == "stage" else "tensor", size)
            ctx.mapped(key, config[key], f"mesh.{axis} = {size}")
    if "precision" in config:
        name = ctx.read_str(
            "precision", config["precision"], choices=("fp16", "bfloat16", "bf16", "fp32", "float32")
        )
        out.compute_dtype = {"fp16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}.get(
            name, "float32"
        )
        ctx.mapped("precision", config["precision"], f"precision.compute_dtype = {out.compute_dtype}")
    if "fp32_allreduce" in config:
        out.reduce_fp32 = bool(ctx.read_bool("fp32_allreduce", config["fp32_allreduce"]))
        ctx.mapped("fp32_allreduce", config["fp32_allreduce"], "precision.reduce_dtype = float32")
    if "weight_decay" in config:
        out.weight_decay = ctx.read_number("weight_decay", config["weight_decay"], minimum=0)
        ctx.mapped("weight_decay", config["weight_decay"], "optimizer.params.weight_decay")
    _schedule(ctx, config, out)
    for key in _MODEL_DATA_LOG:
        if key in config:
            ctx.ignored(key, config[key], "gpt-neox model/data/logging argument; not part of a parallel plan")
    return out
