"""DeepSpeed ``fp16`` / ``bf16`` (and legacy ``bfloat16``), ``amp``, ``data_types``,
``torch_autocast`` and ``communication_data_type`` -> :class:`PrecisionSpec`.

DeepSpeed keeps an fp32 master copy in the optimizer, runs the model in the
half type and reduces gradients in the half type unless
``communication_data_type`` says otherwise. ``fp16.loss_scale: 0`` means
dynamic loss scaling starting at ``2**initial_scale_power`` (source: DeepSpeed
``deepspeed/runtime/constants.py`` and the config-json documentation).

Example:
    >>> from torsh_jax.translate.ds_context import Context
    >>> spec = translate_precision(Context(), {"fp16": {"enabled": True, "hysteresis": 4}})
    >>> spec.compute_dtype, spec.loss_scale.mode, spec.loss_scale.hysteresis
    ('float16', 'dynamic', 4)
"""

from __future__ import annotations

from typing import Any

from torsh_jax.plan.spec import LossScaleSpec, PrecisionSpec
from torsh_jax.translate.ds_context import Context, join

__all__ = ["translate_precision", "dtype_name", "PRECISION_KEYS"]

PRECISION_KEYS = (
    "fp16",
    "bf16",
    "bfloat16",
    "amp",
    "data_types",
    "torch_autocast",
    "communication_data_type",
)

_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "torch.float32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
}

_FP16_IGNORED = {
    "auto_cast": "casting of module inputs; the plan's compute dtype already sets the input dtype",
    "fused_mode": "choice between DeepSpeed's fused and unfused fp16 optimizers; same update",
    "fp16": "gpt-neox duplicate of fp16.enabled",
    "type": "gpt-neox duplicate of the precision name",
}
_BF16_IGNORED = {
    "immediate_grad_update": "when DeepSpeed's bf16 optimizer applies gradients; same result",
    "check_grad_overflow": "bf16 has fp32's range; overflow checks do not change the update",
    "accumulate_grads_via_hooks": "where accumulation happens in PyTorch; same sum",
}
_SCALE_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)


def dtype_name(ctx: Context, key: str, value: Any) -> str | None:
    """DeepSpeed dtype spelling (``fp16``, ``torch.bfloat16``...) -> plan dtype name."""
    name = ctx.read_str(key, value)
    if name is None:
        return None
    if name.lower() not in _DTYPES:
        ctx.fail(key, f"unknown dtype {name!r}", fix="use fp32, fp16 or bf16")
    return _DTYPES[name.lower()]


def _loss_scale(ctx: Context, table: dict) -> LossScaleSpec:
    read = {}
    for name in _SCALE_KEYS:
        if name not in table:
            continue
        key, value = join("fp16", name), table[name]
        if name == "consecutive_hysteresis":
            read[name] = ctx.read_bool(key, value)
        elif name in ("loss_scale", "min_loss_scale"):
            read[name] = ctx.read_number(key, value, minimum=0)
        else:
            read[name] = ctx.read_int(key, value, minimum=1 if name != "initial_scale_power" else 0)
        ctx.mapped(key, value, f"precision.loss_scale.{name}")
    read = {k: v for k, v in read.items() if v is not None}
    if read.get("min_loss_scale") == 0:
        ctx.fail("fp16.min_loss_scale", "must be > 0")
    if read.get("initial_scale_power", 16) > 126:
        ctx.fail("fp16.initial_scale_power", "must be <= 126 (2**power must fit in float32)")
    static = read.pop("loss_scale", 0.0)
    if static:
        return LossScaleSpec(mode="static", static_scale=static)
    return LossScaleSpec(mode="dynamic", **read)


def _fp16(ctx: Context, table: dict) -> tuple[bool, LossScaleSpec, bool]:
    """-> (enabled, loss scale, fp16 master weights)."""
    enabled = bool(ctx.read_enabled("fp16", table))
    if "enabled" in table:
        ctx.mapped(
            "fp16.enabled", table["enabled"], "precision.compute_dtype = float16" if enabled else "fp16 off"
        )
    rest = {k: v for k, v in table.items() if k != "enabled"}
    if not enabled:
        for name, value in rest.items():
            ctx.ignored(join("fp16", name), value, "fp16 is disabled")
        return False, LossScaleSpec(), False
    scale = _loss_scale(ctx, table)
    master = False
    for name, value in rest.items():
        key = join("fp16", name)
        if name in _SCALE_KEYS:
            continue
        if name == "fp16_master_weights_and_grads":
            master = bool(ctx.read_bool(key, value))
            ctx.mapped(key, value, "precision.param_dtype = float16" if master else "fp32 master weights")
        elif name in _FP16_IGNORED:
            ctx.ignored(key, value, _FP16_IGNORED[name])
        else:
            ctx.unknown(
                key, value, [*_SCALE_KEYS, *_FP16_IGNORED, "enabled", "fp16_master_weights_and_grads"], "fp16"
            )
    return True, scale, master


def _bf16(ctx: Context, section: str, table: dict) -> tuple[bool, bool]:
    """-> (enabled, bf16 master weights)."""
    enabled = bool(ctx.read_enabled(section, table))
    legacy = " (legacy key 'bfloat16', read by DeepSpeed as 'bf16')" if section == "bfloat16" else ""
    if "enabled" in table:
        ctx.mapped(
            join(section, "enabled"),
            table["enabled"],
            ("precision.compute_dtype = bfloat16" if enabled else "bf16 off") + legacy,
        )
    master = False
    for name, value in table.items():
        key = join(section, name)
        if name == "enabled":
            continue
        if not enabled:
            ctx.ignored(key, value, "bf16 is disabled")
        elif name == "bf16_master_weights_and_grads":
            master = bool(ctx.read_bool(key, value))
            ctx.mapped(key, value, "precision.param_dtype = bfloat16" if master else "fp32 master weights")
        elif name == "bf16_optimizer_states":
            if ctx.read_bool(key, value):
                ctx.extras["optimizer_state_dtype"] = "bfloat16"
                ctx.approximated(key, value, "no plan field: recorded in extras['optimizer_state_dtype']")
            else:
                ctx.mapped(key, value, "fp32 optimizer state (the default)")
        elif name in _BF16_IGNORED:
            ctx.ignored(key, value, _BF16_IGNORED[name])
        else:
            ctx.unknown(
                key,
                value,
                ["enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states", *_BF16_IGNORED],
                section,
            )
    return enabled, master


def _side_sections(ctx: Context, config: dict, compute: str) -> tuple[str, str | None]:
    """``amp``, ``torch_autocast``, ``data_types`` -> (compute dtype, grad accumulation dtype)."""
    if "amp" in config:
        table = ctx.read_table("amp", config["amp"])
        if ctx.read_enabled("amp", table):
            ctx.unsupported(
                "amp", table, "NVIDIA Apex AMP opt levels are not available", fix="use fp16 or bf16"
            )
        else:
            ctx.ignored("amp", table, "amp is disabled")
    if "torch_autocast" in config:
        table = ctx.read_table("torch_autocast", config["torch_autocast"])
        if ctx.read_enabled("torch_autocast", table):
            dtype = dtype_name(ctx, "torch_autocast.dtype", table.get("dtype", "bf16")) or "bfloat16"
            if compute == "float32":
                compute = dtype
            ctx.approximated(
                "torch_autocast",
                table,
                f"precision.compute_dtype = {compute}: every op in the "
                "half type, where torch autocast keeps some ops in fp32",
            )
        else:
            ctx.ignored("torch_autocast", table, "torch_autocast is disabled")
    accum = None
    if "data_types" in config:
        table = ctx.read_table("data_types", config["data_types"])
        for name, value in table.items():
            key = join("data_types", name)
            dtype = dtype_name(ctx, key, value)
            if name == "grad_accum_dtype" and dtype is not None:
                accum = dtype
                ctx.approximated(key, value, "no plan field: recorded in extras['grad_accum_dtype']")
            else:
                ctx.ignored(key, value, "parameter/buffer storage dtype follows precision.param_dtype")
    return compute, accum


def translate_precision(ctx: Context, config: dict) -> PrecisionSpec:
    """Read the precision-related top-level keys of ``config``.

    Raises:
        TranslationError: fp16 and bf16 both enabled, bad values.
    """
    fp16_on, scale, fp16_master = False, LossScaleSpec(), False
    if "fp16" in config:
        fp16_on, scale, fp16_master = _fp16(ctx, ctx.read_table("fp16", config["fp16"]))
    bf16_on, bf16_master = False, False
    for section in ("bf16", "bfloat16"):
        if section in config:
            on, master = _bf16(ctx, section, ctx.read_table(section, config[section]))
            bf16_on, bf16_master = bf16_on or on, bf16_master or master
    if fp16_on and bf16_on:
        ctx.fail(
            "bf16.enabled", "bf16 and fp16 modes cannot be simultaneously enabled", fix="enable only one"
        )
    compute = "float16" if fp16_on else "bfloat16" if bf16_on else "float32"
    compute, accum = _side_sections(ctx, config, compute)
    if accum is not None:
        ctx.extras["grad_accum_dtype"] = accum
    param = "float16" if fp16_master else "bfloat16" if bf16_master else "float32"
    reduce = compute
    if "communication_data_type" in config:
        value = config["communication_data_type"]
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            ctx.mapped("communication_data_type", value, f"precision.reduce_dtype = {reduce} (the default)")
        else:
            reduce = dtype_name(ctx, "communication_data_type", value) or reduce
            ctx.mapped("communication_data_type", value, f"precision.reduce_dtype = {reduce}")
    return PrecisionSpec(param_dtype=param, compute_dtype=compute, reduce_dtype=reduce, loss_scale=scale)
