"""DeepSpeed top-level keys that are not precision, ZeRO, optimizer or batch:
parallel layout (``tensor_parallel``, ``pipeline``), communication knobs, and
everything that is ignored, unsupported or removed, each with its reason.

Example:
    >>> from torsh_jax.translate.ds_context import Context
    >>> ctx = Context()
    >>> translate_other(ctx, "wall_clock_breakdown", False)
    >>> ctx.notes.items[0].status
    'ignored'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torsh_jax.translate.ds_context import Context, join

__all__ = [
    "translate_other",
    "translate_layout",
    "translate_communication",
    "IGNORED",
    "REMOVED",
    "LAYOUT_KEYS",
    "COMMUNICATION_KEYS",
]

LAYOUT_KEYS = ("tensor_parallel", "pipeline")
COMMUNICATION_KEYS = ("prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op")

_LOGGING = "logging/monitoring output; no effect on training"
IGNORED: dict[str, str] = {
    "steps_per_print": _LOGGING,
    "wall_clock_breakdown": _LOGGING,
    "memory_breakdown": _LOGGING,
    "tensorboard": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "comet": _LOGGING,
    "monitor_config": _LOGGING,
    "flops_profiler": _LOGGING,
    "comms_logger": _LOGGING,
    "comms_config": _LOGGING,
    "timers": _LOGGING,
    "dump_state": _LOGGING,
    "log_level": _LOGGING,
    "zero_allow_untested_optimizer": "a DeepSpeed safety switch; any optax optimizer works with any stage",
    "zero_force_ds_cpu_optimizer": "choice of DeepSpeed's CPU Adam kernel for offload; same update",
    "disable_allgather": "DeepSpeed internal collective switch",
    "aio": "NVMe asynchronous I/O tuning; offload goes to host memory here",
    "checkpoint": "checkpoint layout (orbax checkpoints follow the plan)",
    "nebula": "checkpoint service",
    "datastates": "checkpoint service",
    "autotuning": "DeepSpeed's autotuner is a separate tool",
    "compile": "torch.compile; XLA always compiles the step",
    "dataloader_drop_last": "data loading is outside the plan",
    "seq_parallel_communication_data_type": "Ulysses sequence-parallel all-to-all dtype (not in the plan)",
    "sparse_gradients": "sparse embedding-gradient all-reduce; same sum as the dense reduction",
    "graph_harvesting": "CUDA graph capture",
    "vocabulary_size": "only used for a tensor-core alignment warning",
    "use_data_before_expert_parallelism": "expert-parallel group order (no experts in the plan)",
    "hybrid_engine": "RLHF inference engine; not training",
    "disable_python_gc": "Python runtime detail",
    "activation_checkpointing": "recomputation is a model choice (jax.checkpoint); the update is the same",
    "gradient_accumulation_dtype": "see data_types",
    "cuda_graph": "CUDA graph capture",
}
_REMOVED_WHY = "section removed from DeepSpeed; the pinned release ignores it"
REMOVED: dict[str, str] = {
    "sparse_attention": f"{_REMOVED_WHY} (sparse attention kernels)",
    "progressive_layer_drop": f"{_REMOVED_WHY} (progressive layer drop)",
    "eigenvalue": f"{_REMOVED_WHY} (eigenvalue-based quantisation schedule)",
    "quantize_training": f"{_REMOVED_WHY} (MoQ quantised training)",
    "compression_training": f"{_REMOVED_WHY} (compression library)",
    "curriculum_learning": f"{_REMOVED_WHY} (legacy curriculum learning; replaced by data_efficiency)",
}
_ENABLED_UNSUPPORTED = {
    "elasticity": "elastic training changes the batch size with the world size",
    "data_efficiency": "data sampling and routing (random-LTD, curriculum) change what the model trains on",
    "weight_quantization": "quantised weights in the forward pass",
    "expert_parallel": "mixture-of-experts layout has no plan axis",
}


def _note_leaves(ctx: Context, key: str, value: Any, status: str, reason: str) -> None:
    """One note per leaf key of a table (or one for a scalar)."""
    if isinstance(value, dict) and value:
        for name, item in value.items():
            _note_leaves(ctx, join(key, str(name)), item, status, reason)
    else:
        ctx.notes.add(key, status, value, reason)


def translate_other(ctx: Context, key: str, value: Any, main_keys: Iterable[str] = ()) -> None:
    """Note a top-level key that does not reach the plan, or raise for an unsupported one.

    DeepSpeed ignores unknown top-level keys: they are noted as ignored, with
    the closest known key (``main_keys`` or another section) when one is close.
    """
    key = join("", key)
    if key in IGNORED:
        _note_leaves(ctx, key, value, "ignored", IGNORED[key])
    elif key in REMOVED:
        _note_leaves(ctx, key, value, "removed", REMOVED[key])
    elif key in _ENABLED_UNSUPPORTED:
        table = value if isinstance(value, dict) else {"enabled": value}
        enabled = ctx.read_enabled(key, table, default=True)
        if enabled:
            ctx.unsupported(key, value, _ENABLED_UNSUPPORTED[key], fix=f"disable {key}")
        else:
            _note_leaves(ctx, key, value, "ignored", f"{key} is disabled")
    elif key.startswith("_"):
        ctx.ignored(key, value, "keys starting with '_' are comments by convention")
    else:
        known = [*main_keys, *IGNORED, *REMOVED, *_ENABLED_UNSUPPORTED]
        ctx.ignored_unknown(key, value, known, "DeepSpeed ignores unknown top-level keys")


def _tensor_parallel(ctx: Context, value: Any) -> int:
    table = ctx.read_table("tensor_parallel", value)
    size = 1
    for name, item in table.items():
        key = join("tensor_parallel", name)
        if name == "autotp_size":
            size = ctx.read_int(key, item, minimum=1) or 1
            ctx.mapped(key, item, f"mesh.tensor = {size} (rules shard heads/mlp/vocab over tensor)")
        elif name == "tp" and isinstance(item, dict):
            for sub, sub_item in item.items():
                if sub == "tp_size":
                    size = ctx.read_int(join(key, sub), sub_item, minimum=1) or 1
                    ctx.mapped(join(key, sub), sub_item, f"mesh.tensor = {size}")
                else:
                    ctx.ignored(join(key, sub), sub_item, "AutoTP implementation detail")
        elif name in (
            "preset_model",
            "partition_config",
            "tp_overlap_comm",
            "tp_grain_size",
            "injection_policy_tuple",
            "keep_module_on_host",
            "enabled",
        ):
            ctx.ignored(key, item, "AutoTP layer matching; the plan's param_dims rules say what is split")
        else:
            ctx.unknown(
                key, item, ["autotp_size", "tp", "preset_model", "partition_config"], "tensor_parallel"
            )
    return size


def _pipeline(ctx: Context, value: Any) -> int:
    table = ctx.read_table("pipeline", value)
    stages = 1
    for name, item in table.items():
        key = join("pipeline", name)
        if name == "stages" and item != "auto":
            stages = ctx.read_int(key, item, minimum=1) or 1
            ctx.approximated(key, item, f"mesh.stage = {stages} (DeepSpeed takes it from PipelineModule)")
        else:
            ctx.ignored(
                key,
                item,
                "layer partitioning/activation details of PipelineModule; the plan's 1F1B "
                "schedule splits stacked layers evenly",
            )
    return stages


def translate_layout(ctx: Context, config: dict) -> tuple[int, int]:
    """-> (tensor size, pipeline stages) from ``tensor_parallel`` and ``pipeline``."""
    tensor = _tensor_parallel(ctx, config["tensor_parallel"]) if "tensor_parallel" in config else 1
    stages = _pipeline(ctx, config["pipeline"]) if "pipeline" in config else 1
    return tensor, stages


def translate_communication(ctx: Context, config: dict) -> dict[str, Any]:
    """``prescale_gradients``, ``gradient_predivide_factor``, ``gradient_allreduce_op``.

    Returns:
        :class:`CommunicationSpec` fields.
    """
    out: dict[str, Any] = {}
    if "prescale_gradients" in config:
        out["prescale_gradients"] = bool(ctx.read_bool("prescale_gradients", config["prescale_gradients"]))
        ctx.mapped("prescale_gradients", config["prescale_gradients"], "communication.prescale_gradients")
    if "gradient_predivide_factor" in config:
        factor = ctx.read_number("gradient_predivide_factor", config["gradient_predivide_factor"], minimum=0)
        if factor == 0:
            ctx.fail("gradient_predivide_factor", "must be > 0")
        out["gradient_predivide_factor"] = factor or 1.0
        ctx.mapped(
            "gradient_predivide_factor",
            config["gradient_predivide_factor"],
            "communication.gradient_predivide_factor",
        )
    if "gradient_allreduce_op" in config:
        op = ctx.read_str("gradient_allreduce_op", config["gradient_allreduce_op"], choices=("mean", "sum"))
        out["reduce_op"] = op or "mean"
        ctx.mapped("gradient_allreduce_op", config["gradient_allreduce_op"], "communication.reduce_op")
    return out
