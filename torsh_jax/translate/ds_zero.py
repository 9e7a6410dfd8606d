"""DeepSpeed ``zero_optimization`` -> :class:`ZeroSpec`, bucketing, hybrid sharding, ZeRO++ compression.

Key names and defaults follow DeepSpeed ``deepspeed/runtime/zero/config.py``
(which rejects unknown keys, as this translator does). ``"zero_optimization":
true`` is DeepSpeed's legacy form of stage 1; ``cpu_offload`` its legacy form
of ``offload_optimizer: {device: cpu}``.

Example:
    >>> from torsh_jax.translate.ds_context import Context
    >>> out = translate_zero(Context(), {"stage": 3, "offload_param": {"device": "cpu"},
    ...                                  "stage3_param_persistence_threshold": 1e5})
    >>> out.zero.stage, out.zero.offload_params, out.zero.persistence_threshold
    (3, True, 100000)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torsh_jax.plan.spec import AxisCompression, CompressorSpec, ZeroSpec
from torsh_jax.translate.ds_context import Context, join

__all__ = ["ZeroResult", "translate_zero"]

Z = "zero_optimization"

_IGNORED = {
    "allgather_partitions": "all-gather vs broadcast of updated partitions; same values",
    "allgather_bucket_size": "parameter all-gather bucketing; XLA schedules the all-gathers",
    "overlap_comm": "XLA's scheduler overlaps collectives with compute; there is no switch",
    "contiguous_gradients": "gradient memory layout in PyTorch",
    "round_robin_gradients": "gradient partition order for CPU offload; same values",
    "sub_group_size": "optimizer-step chunking for offload; same update",
    "elastic_checkpoint": "checkpoint layout",
    "load_from_fp32_weights": "checkpoint loading",
    "ignore_unused_parameters": "PyTorch hook bookkeeping",
    "legacy_stage1": "an older stage-1 implementation; same math",
    "use_multi_rank_bucket_allreduce": "bucket scheduling",
    "stage3_gather_16bit_weights_on_model_save": "checkpoint export",
    "stage3_gather_fp16_weights_on_model_save": "checkpoint export",
    "gather_16bit_weights_on_model_save": "checkpoint export",
    "stage3_model_persistence_threshold": "stage-3 memory tuning; see persistence_threshold",
    "model_persistence_threshold": "stage-3 memory tuning",
    "memory_efficient_linear": "PyTorch autograd memory detail",
    "mics_hierarchical_params_gather": "all-gather algorithm choice",
    "zero_quantized_nontrainable_weights": "frozen weights are not all-gathered for training updates",
    "log_trace_cache_warnings": "logging",
    "stage3_use_all_reduce_for_fetch_params": "collective choice; same values",
    "module_granularity_threshold": "hook granularity",
    "pipeline_loading_checkpoint": "checkpoint loading",
    "override_module_apply": "PyTorch module hooks",
    "cpu_offload_use_pin_memory": "host allocation detail",
}
_LIVE = (
    "stage3_max_live_parameters",
    "max_live_parameters",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
)
_PREFETCH = ("stage3_prefetch_bucket_size", "prefetch_bucket_size")
_PERSIST = ("stage3_param_persistence_threshold", "param_persistence_threshold")
_HANDLED = (
    "stage",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_params",
    "reduce_bucket_size",
    "reduce_scatter",
    "zero_hpz_partition_size",
    "mics_shard_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zenflow",
    *_LIVE,
    *_PREFETCH,
    *_PERSIST,
)
_OFFLOAD_IGNORED = (
    "pin_memory",
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "max_in_cpu",
    "super_offload",
    "cpuadam_cores_perc",
)


@dataclass(frozen=True)
class ZeroResult:
    """What ``zero_optimization`` became.

    Attributes:
        zero: the plan's ZeRO settings.
        bucket_elements: ``reduce_bucket_size`` in elements, when given.
        hybrid_size: shard group size for hybrid sharding (hpZ / MiCS), when given.
        compression: ZeRO++ quantised collectives over ``fsdp``, when enabled.
    """

    zero: ZeroSpec
    bucket_elements: int | None = None
    hybrid_size: int | None = None
    compression: AxisCompression | None = None


def _offload(ctx: Context, name: str, value: Any, stage: int) -> bool:
    key = join(Z, name)
    table = ctx.read_table(key, value)
    device = ctx.read_str(join(key, "device"), table.get("device", "none"), choices=("none", "cpu", "nvme"))
    target = "offload_optimizer" if name == "offload_optimizer" else "offload_params"
    on = device in ("cpu", "nvme")
    if name == "offload_param" and on and stage < 3:
        ctx.ignored(key, value, f"DeepSpeed offloads parameters only in stage 3 (stage is {stage})")
        return False
    if "device" in table:
        detail = f"zero.{target} = {on}"
        if device == "nvme":
            ctx.approximated(join(key, "device"), device, f"{detail}: host memory instead of NVMe")
        else:
            ctx.mapped(join(key, "device"), device, detail)
    for sub, sub_value in table.items():
        sub_key = join(key, sub)
        if sub == "device":
            continue
        if sub == "ratio" and ctx.read_number(sub_key, sub_value, minimum=0) not in (None, 1.0):
            ctx.unsupported(
                sub_key, sub_value, "partial optimizer offload is not available", fix="use ratio 1.0"
            )
        elif sub in (*_OFFLOAD_IGNORED, "ratio"):
            ctx.ignored(sub_key, sub_value, "offload transfer tuning; where state lives is zero." + target)
        else:
            ctx.unknown(sub_key, sub_value, ["device", *_OFFLOAD_IGNORED, "ratio"], key)
    return on


def _stage(ctx: Context, table: dict) -> int:
    if "stage" not in table:
        return 0
    stage = ctx.read_int(join(Z, "stage"), table["stage"], minimum=0)
    if stage is not None and stage > 3:
        ctx.fail(join(Z, "stage"), f"Maximum supported ZeRO stage is 3, got {stage}")
    ctx.mapped(join(Z, "stage"), table["stage"], f"zero.stage = {stage}")
    return stage or 0


def _quantized(ctx: Context, table: dict) -> AxisCompression | None:
    weights = gradients = None
    for name, attr in (("zero_quantized_weights", "weights"), ("zero_quantized_gradients", "gradients")):
        if name in table and ctx.read_bool(join(Z, name), table[name]):
            ctx.approximated(
                join(Z, name),
                table[name],
                f"compression fsdp.{attr} = int8 (block-wise scales differ from DeepSpeed's kernels)",
            )
            if attr == "weights":
                weights = CompressorSpec(method="int8", error_feedback=False)
            else:
                gradients = CompressorSpec(method="int8", error_feedback=False)
        elif name in table:
            ctx.mapped(join(Z, name), table[name], "no compression")
    if weights is None and gradients is None:
        return None
    return AxisCompression(axis="fsdp", gradients=gradients, weights=weights)


def _hybrid(ctx: Context, table: dict) -> int | None:
    size = None
    for name in ("zero_hpz_partition_size", "mics_shard_size"):
        if name not in table:
            continue
        key = join(Z, name)
        value = ctx.read_int(key, table[name], minimum=-1)
        if value is None or value in (-1, 0, 1):
            ctx.mapped(key, table[name], "no hybrid sharding")
            continue
        size = value
        how = "mapped" if name == "mics_shard_size" else "approximated"
        detail = f"hybrid sharding: mesh fsdp = {value} within a group, data = remaining devices"
        if how == "approximated":
            detail += " (ZeRO++ keeps a full primary partition too; here parameters replicate across groups)"
        ctx.notes.add(key, how, table[name], detail)
    return size


def _stage3_knobs(ctx: Context, table: dict, stage: int) -> dict:
    out = {}
    for name in (*_PERSIST, *_PREFETCH, *_LIVE):
        if name not in table:
            continue
        key = join(Z, name)
        value = ctx.read_int(key, table[name], minimum=0)
        if stage < 3:
            ctx.ignored(key, table[name], f"stage-3 setting; stage is {stage}")
        elif name in _PERSIST:
            out["persistence_threshold"] = value or 0
            ctx.mapped(key, table[name], f"zero.persistence_threshold = {value}")
        elif name in _PREFETCH:
            out["prefetch_layers"] = 1 if (value is None or value > 0) else 0
            ctx.approximated(
                key,
                table[name],
                f"zero.prefetch_layers = {out['prefetch_layers']} "
                "(the plan prefetches whole layers, not element buckets)",
            )
        else:
            ctx.approximated(
                key,
                table[name],
                "the plan gathers one layer at a time, which bounds live parameters to about one layer",
            )
    return out


def _legacy_offload(ctx: Context, table: dict, stage: int) -> dict:
    out = {}
    for name, target in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_params")):
        if name in table:
            on = bool(ctx.read_bool(join(Z, name), table[name]))
            if on and target == "offload_params" and stage < 3:
                ctx.ignored(join(Z, name), table[name], "parameters are offloaded only in stage 3")
                continue
            out[target] = on
            ctx.mapped(join(Z, name), table[name], f"zero.{target} = {on} (deprecated DeepSpeed key)")
    return out


def _drop_auto(ctx: Context, table: dict) -> dict:
    """DeepSpeed's config models drop ``"auto"`` values (``DeepSpeedConfigModel``): the default applies."""
    for name, item in table.items():
        if item == "auto":
            ctx.mapped(join(Z, name), item, 'DeepSpeed drops "auto" here and uses its default')
    return {name: item for name, item in table.items() if item != "auto"}


def translate_zero(ctx: Context, value: Any) -> ZeroResult:
    """Translate ``zero_optimization`` (a table, or the legacy boolean).

    Raises:
        TranslationError: unknown keys (with the closest spelling), bad values,
            ZenFlow (unless lenient).
    """
    if isinstance(value, bool):
        ctx.mapped(Z, value, f"zero.stage = {1 if value else 0} (legacy boolean form)")
        return ZeroResult(ZeroSpec(stage=1 if value else 0))
    table = _drop_auto(ctx, ctx.read_table(Z, value))
    stage = _stage(ctx, table)
    fields: dict[str, Any] = {"stage": stage, **_legacy_offload(ctx, table, stage)}
    for name in ("offload_optimizer", "offload_param"):
        if name in table:
            on = _offload(ctx, name, table[name], stage)
            fields["offload_optimizer" if name == "offload_optimizer" else "offload_params"] = on
    fields.update(_stage3_knobs(ctx, table, stage))
    bucket = None
    if "reduce_bucket_size" in table:
        bucket = ctx.read_int(join(Z, "reduce_bucket_size"), table["reduce_bucket_size"], minimum=0)
    if "reduce_scatter" in table:
        flag = ctx.read_bool(join(Z, "reduce_scatter"), table["reduce_scatter"])
        detail = (
            "gradients reduce-scattered over fsdp" if flag else "DeepSpeed all-reduces; here reduce-scatter"
        )
        ctx.notes.add(
            join(Z, "reduce_scatter"), "mapped" if flag or stage == 0 else "approximated", flag, detail
        )
    if "zenflow" in table:
        ctx.unsupported(
            join(Z, "zenflow"),
            table["zenflow"],
            "ZenFlow's selective, delayed optimizer updates change the training result",
            fix="remove zenflow",
        )
    for name, item in table.items():
        if name in _IGNORED:
            ctx.ignored(join(Z, name), item, _IGNORED[name])
        elif name not in _HANDLED:
            ctx.unknown(join(Z, name), item, [*_HANDLED, *_IGNORED], Z)
    return ZeroResult(ZeroSpec(**fields), bucket, _hybrid(ctx, table), _quantized(ctx, table))
