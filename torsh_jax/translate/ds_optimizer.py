"""DeepSpeed ``optimizer`` and ``scheduler`` sections -> :class:`OptimizerSpec` + :class:`ScheduleSpec`.

Optimizer names are case-insensitive, as in DeepSpeed. ``Adam`` decouples
weight decay unless ``adam_w_mode`` is false (DeepSpeed ``FusedAdam``). The
1-bit family becomes its base optimizer plus sign compression with error
feedback over the ``data`` axis, starting after ``freeze_step`` (source:
DeepSpeed ``deepspeed/runtime/fp16/onebit/``). Schedule parameters keep
DeepSpeed's names and defaults (``deepspeed/runtime/lr_schedules.py``).

Example:
    >>> from torsh_jax.translate.ds_context import Context
    >>> out = translate_optimizer(Context(), {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999]}})
    >>> out.name, out.learning_rate, out.params["b1"]
    ('adamw', 0.001, 0.8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torsh_jax.plan.spec import AxisCompression, CompressorSpec, ScheduleSpec
from torsh_jax.translate.ds_context import Context, join

__all__ = ["OptimizerResult", "translate_optimizer", "translate_scheduler", "SCHEDULE_NAMES"]

OPT, S = "optimizer", "scheduler"
_BASE = {
    "adam": "adamw",
    "adamw": "adamw",
    "lamb": "lamb",
    "sgd": "sgd",
    "lion": "lion",
    "onebitadam": "adamw",
    "zerooneadam": "adamw",
    "onebitlamb": "lamb",
}
_ONE_BIT = {"onebitadam": "freeze_step", "zerooneadam": "var_freeze_step", "onebitlamb": "freeze_step"}
_TRANSPORT = {
    "cuda_aware",
    "comm_backend_name",
    "torch_adam",
    "fused",
    "foreach",
    "capturable",
    "differentiable",
    "maximize",
    "set_grad_none",
    "adamw_mode_legacy",
}
_ONE_BIT_TUNING = {
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
    "coeff_beta",
    "factor_max",
    "factor_min",
    "factor_threshold",
}

SCHEDULE_NAMES = {
    "warmuplr": "warmup_lr",
    "warmupdecaylr": "warmup_decay_lr",
    "warmupcosinelr": "warmup_cosine_lr",
    "onecycle": "one_cycle",
    "lrrangetest": "lr_range_test",
}
_SCHEDULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "warmup_lr": {
        "warmup_min_lr": 0.0,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "warmup_decay_lr": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "warmup_cosine_lr": {
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "one_cycle": {
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_first_stair_count": 0,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
        "last_batch_iteration": -1,
    },
    "lr_range_test": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
        "last_batch_iteration": -1,
    },
}
_SCHEDULE_REQUIRED = {
    "warmup_decay_lr": ("total_num_steps",),
    "warmup_cosine_lr": ("total_num_steps",),
    "one_cycle": ("cycle_min_lr", "cycle_max_lr"),
}
_SCHEDULE_OPTIONAL = {
    "warmup_lr": ("warmup_max_lr",),
    "one_cycle": ("cycle_second_step_size", "cycle_second_stair_count"),
}


@dataclass(frozen=True)
class OptimizerResult:
    """Optimizer name (optax), learning rate, params (optax names) and 1-bit compression."""

    name: str
    learning_rate: float
    params: dict[str, Any]
    compression: AxisCompression | None = None


def _betas(ctx: Context, key: str, value: Any) -> dict[str, float]:
    if isinstance(value, str) and value == "auto":
        ctx.read_number(key, value)
        return {}
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        ctx.fail(key, f"must be a list of two numbers, got {value!r}")
    b1 = ctx.read_number(f"{key}[0]", value[0], minimum=0)
    b2 = ctx.read_number(f"{key}[1]", value[1], minimum=0)
    if b1 >= 1 or b2 >= 1:
        ctx.fail(key, f"betas must be < 1, got {value!r}")
    return {"b1": b1, "b2": b2}


def _param(ctx: Context, kind: str, name: str, value: Any, out: dict) -> None:
    """Translate one optimizer parameter into ``out`` (optax names), noting it."""
    key = join(join(OPT, "params"), name)
    numeric = {
        "lr": "learning_rate",
        "eps": "eps",
        "weight_decay": "weight_decay",
        "momentum": "momentum",
        "max_coeff": "max_coeff",
        "min_coeff": "min_coeff",
    }
    if name == "betas":
        out.update(_betas(ctx, key, value))
        ctx.mapped(key, value, "b1, b2")
    elif name in numeric:
        out[numeric[name]] = ctx.read_number(key, value, minimum=0)
        ctx.mapped(key, value, numeric[name])
    elif name in ("bias_correction", "nesterov"):
        out[name] = ctx.read_bool(key, value)
        ctx.mapped(key, value, name)
    elif name == "adam_w_mode":
        decoupled = ctx.read_bool(key, value)
        out["_decoupled"] = decoupled
        ctx.mapped(key, value, "adamw (decoupled weight decay)" if decoupled else "adam (L2 weight decay)")
    elif name == "amsgrad" and not ctx.read_bool(key, value):
        ctx.mapped(key, value, "plain Adam")
    elif name == "dampening" and not ctx.read_number(key, value):
        ctx.mapped(key, value, "no dampening (optax trace)")
    elif name in _ONE_BIT.values() and kind in _ONE_BIT:
        out["_freeze"] = ctx.read_int(key, value, minimum=0)
        ctx.approximated(key, value, "compression data.gradients.warmup_steps")
    elif name in _ONE_BIT_TUNING and kind in _ONE_BIT:
        ctx.approximated(key, value, "1-bit tuning knob without an equivalent; plain sign compression")
    elif name in _TRANSPORT:
        ctx.ignored(key, value, "implementation/transport choice; same update")
    elif name == "max_grad_norm":
        ctx.unsupported(
            key,
            value,
            "max_grad_norm is not an optimizer argument in DeepSpeed (it is dropped in "
            "fp32 and handed to the fp16 wrapper)",
            fix="use the top-level gradient_clipping",
        )
    else:
        ctx.unsupported(key, value, f"{name!r} is not a known parameter of {kind}", fix="remove it")


def translate_optimizer(ctx: Context, value: Any) -> OptimizerResult:
    """Translate the ``optimizer`` section.

    Raises:
        TranslationError: unknown optimizer type or parameter (unless lenient), bad values.
    """
    table = ctx.read_table(OPT, value)
    type_name = ctx.read_str(join(OPT, "type"), table.get("type", ""))
    if not type_name:
        ctx.fail(join(OPT, "type"), "the optimizer type is missing", fix='set "type", e.g. "AdamW"')
    kind = type_name.lower().replace("_", "")
    if kind not in _BASE:
        ctx.unsupported(
            join(OPT, "type"),
            type_name,
            f"optimizer {type_name!r} has no optax equivalent here",
            fix="use Adam, AdamW, Lamb, SGD, Lion, OneBitAdam, ZeroOneAdam or OneBitLamb",
        )
        kind = "adamw"
    params = ctx.read_table(join(OPT, "params"), table.get("params", {}))
    out: dict[str, Any] = {}
    for name, item in params.items():
        _param(ctx, kind, name, item, out)
    for name, item in table.items():
        if name not in ("type", "params"):
            ctx.ignored(join(OPT, name), item, "legacy_fusion/implementation flag; same update")
    name = _BASE[kind]
    if kind == "adam" and out.get("_decoupled") is False:
        name = "adam"
    how = "approximated" if kind in _ONE_BIT else "mapped"
    detail = f"optax {name}" + (" + sign compression" if how != "mapped" else "")
    ctx.notes.add(join(OPT, "type"), how, type_name, detail)
    lr = out.pop("learning_rate", None)
    freeze = out.pop("_freeze", 0) or 0
    out.pop("_decoupled", None)
    compression = None
    if kind in _ONE_BIT:
        gradients = CompressorSpec(method="sign", warmup_steps=freeze, error_feedback=True)
        compression = AxisCompression(axis="data", gradients=gradients)
    params_out = {k: v for k, v in out.items() if v is not None}
    return OptimizerResult(name, 1e-3 if lr is None else lr, params_out, compression)


def _warmup_steps(ctx: Context, key: str, value: Any) -> int | None:
    """``warmup_num_steps`` >= 1: DeepSpeed 0.19.3 and later raise ``ValueError`` for 0 or less."""
    steps = ctx.read_int(key, value)
    if steps is not None and steps < 1:
        ctx.fail(
            key,
            f'must be >= 1, got {value!r}; DeepSpeed refuses it ("warmup_num_steps must be a positive '
            'integer", since 0.19.3; earlier releases warmed up over 2 steps)',
            fix="set warmup_num_steps to 1: DeepSpeed warms up over at least 2 steps, as it did for 0",
        )
    return steps


def _schedule_value(ctx: Context, key: str, name: str, value: Any) -> Any:
    if name == "warmup_type":
        return ctx.read_str(key, value, choices=("log", "linear"))
    if name in ("lr_range_test_staircase", "cycle_momentum"):
        return ctx.read_bool(key, value)
    if name in ("last_batch_iteration",):
        return ctx.read_int(key, value, minimum=-1)
    if name.endswith(("_steps", "_step_size", "_stair_count")) or name == "total_num_steps":
        if name == "warmup_num_steps":
            return _warmup_steps(ctx, key, value)
        minimum = 1 if name in ("lr_range_test_step_size", "cycle_first_step_size") else 0
        if name.endswith("_stair_count") or name == "cycle_second_step_size":
            minimum = -1
        return ctx.read_int(key, value, minimum=minimum)
    return ctx.read_number(key, value, minimum=0)


def translate_scheduler(ctx: Context, value: Any) -> ScheduleSpec:
    """Translate the ``scheduler`` section (DeepSpeed parameter names kept, defaults filled in).

    Raises:
        TranslationError: unknown type or parameter, missing required parameter, bad values.
    """
    table = ctx.read_table(S, value)
    type_name = ctx.read_str(join(S, "type"), table.get("type", ""))
    if type_name is None or type_name.lower() not in SCHEDULE_NAMES:
        ctx.fail(
            join(S, "type"),
            f"unknown scheduler {type_name!r}",
            fix="use WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest",
        )
    name = SCHEDULE_NAMES[type_name.lower()]
    ctx.mapped(join(S, "type"), type_name, f"optimizer.schedule.name = {name}")
    defaults = _SCHEDULE_DEFAULTS[name]
    known = {*defaults, *_SCHEDULE_REQUIRED.get(name, ()), *_SCHEDULE_OPTIONAL.get(name, ())}
    params = dict(defaults)
    for key_name, item in ctx.read_table(join(S, "params"), table.get("params", {})).items():
        key = join(join(S, "params"), key_name)
        if key_name not in known:
            ctx.unknown(key, item, sorted(known), f"{type_name} parameters")
            continue
        parsed = _schedule_value(ctx, key, key_name, item)
        if parsed is not None:
            params[key_name] = parsed
        ctx.mapped(key, item, f"optimizer.schedule.params.{key_name}")
    for required in _SCHEDULE_REQUIRED.get(name, ()):
        if required not in params and join(join(S, "params"), required) not in ctx.missing_auto:
            ctx.fail(
                join(join(S, "params"), required), f"{type_name} needs {required}", fix=f"set {required}"
            )
    for extra, item in table.items():
        if extra not in ("type", "params"):
            ctx.unknown(join(S, extra), item, ["type", "params"], S)
    return ScheduleSpec(name=name, params=params)
