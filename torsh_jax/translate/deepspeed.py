"""DeepSpeed config -> :class:`~torsh_jax.plan.ParallelPlan` (no JAX import).

Reads a DeepSpeed JSON (hjson-lenient, as DeepSpeed is) or a gpt-neox YAML,
resolves ``"auto"`` values from ``overrides`` (``--set key=value``) or the
Hugging Face Trainer's rules, and translates every key into the plan or a
note saying why not. Behaviour follows DeepSpeed :data:`PINNED_DEEPSPEED`;
where releases differ (the ``gradient_clipping`` default) the other value is
one override away.

Example:
    >>> result = translate_deepspeed({"train_batch_size": 32, "gradient_accumulation_steps": 2,
    ...                               "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
    ...                              world_size=8)
    >>> plan = result.plan
    >>> plan.zero.stage, plan.batch.micro_batch_size, plan.precision.compute_dtype, plan.mesh.fsdp.ici
    (2, 2, 'bfloat16', -1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torsh_jax.errors import PlanError, TranslationError
from torsh_jax.plan.spec import (
    MAX_BATCH_SIZE,
    AxisCompression,
    AxisSize,
    BatchSpec,
    CommunicationSpec,
    MeshSpec,
    OptimizerSpec,
    ParallelPlan,
    PipelineSpec,
    PrecisionSpec,
    ScheduleSpec,
)
from torsh_jax.translate import ds_batch
from torsh_jax.translate.ds_context import Context
from torsh_jax.translate.ds_neox import NEOX_KEYS, NeoxResult, is_neox, normalize_neox, translate_neox
from torsh_jax.translate.ds_optimizer import OptimizerResult, translate_optimizer, translate_scheduler
from torsh_jax.translate.ds_parse import load_deepspeed_config, parse_text, plain
from torsh_jax.translate.ds_precision import PRECISION_KEYS, translate_precision
from torsh_jax.translate.ds_sections import (
    COMMUNICATION_KEYS,
    LAYOUT_KEYS,
    translate_communication,
    translate_layout,
    translate_other,
)
from torsh_jax.translate.ds_values import apply_overrides, fill_auto
from torsh_jax.translate.ds_zero import ZeroResult, translate_zero
from torsh_jax.translate.hf_trainer import hf_auto_values, hf_mismatches
from torsh_jax.translate.messages import short_errors
from torsh_jax.translate.overrides import PLAN_SECTIONS, apply_plan_overrides
from torsh_jax.translate.result import Note, TranslationResult

__all__ = ["translate_deepspeed", "load_deepspeed_config", "PINNED_DEEPSPEED", "GRADIENT_CLIPPING_DEFAULTS"]

#: The DeepSpeed release whose rules are reproduced.
PINNED_DEEPSPEED = "0.19.8"
#: ``gradient_clipping`` when the key is absent: the pinned release clips at 1.0;
#: earlier releases did not clip (``GRADIENT_CLIPPING_DEFAULT = 0.``).
#: Pass ``overrides={"gradient_clipping": 0}`` for the older behaviour.
GRADIENT_CLIPPING_DEFAULTS = {"pinned": 1.0, "earlier": 0.0}

_BATCH_KEYS = (ds_batch.TRAIN, ds_batch.MICRO, ds_batch.ACCUM)
_MAIN_KEYS = {
    *_BATCH_KEYS,
    *PRECISION_KEYS,
    *LAYOUT_KEYS,
    *COMMUNICATION_KEYS,
    "zero_optimization",
    "optimizer",
    "scheduler",
    "gradient_clipping",
}


#: ``--set`` prefix that addresses the plan when its first segment is also a DeepSpeed key.
PLAN_PREFIX = "plan."


def split_overrides(overrides: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--set`` items -> (DeepSpeed keys, plan fields applied after translation).

    A key is a plan field when its first segment is a plan section and not a
    DeepSpeed key (``zero.stage``), or when it starts with ``plan.``
    (``plan.optimizer.gradient_clipping``: ``optimizer`` alone is DeepSpeed's).

    Example:
        >>> split_overrides({"zero.stage": 3, "optimizer.params.lr": 0.1})
        ({'optimizer.params.lr': 0.1}, {'zero.stage': 3})
    """
    config_keys: dict[str, Any] = {}
    plan_fields: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        head = key.split(".", 1)[0] if isinstance(key, str) else None
        if isinstance(key, str) and key.startswith(PLAN_PREFIX):
            plan_fields[key.removeprefix(PLAN_PREFIX)] = value
        elif head in PLAN_SECTIONS and head not in _MAIN_KEYS:
            plan_fields[key] = value
        else:
            config_keys[key] = value
    return config_keys, plan_fields


def _apply_plan_fields(ctx: Context, plan: ParallelPlan, fields: dict[str, Any]) -> ParallelPlan:
    for key, value in fields.items():
        ctx.mapped(key, value, "plan field set by --set after translation")
    return apply_plan_overrides(plan, fields)


def _load(source: str | Path | dict) -> tuple[dict, str]:
    if isinstance(source, dict):
        return plain(source), "<dict>"
    if isinstance(source, Path) or (isinstance(source, str) and not source.lstrip().startswith("{")):
        return load_deepspeed_config(source), str(source)
    return parse_text(source), "<text>"


def _prepare(config, source, overrides, hf_trainer, world_size, extras) -> tuple[dict, bool]:
    neox = is_neox(config, source)
    if neox:
        config = normalize_neox(config)
    config = apply_overrides(config, overrides)
    if overrides:
        extras["overrides"] = dict(overrides)
    if hf_trainer is not None:
        _check_trainer_matches(config, hf_trainer, world_size)
        dropped = config.get(ds_batch.TRAIN) == "auto"
        if dropped:  # the Trainer's value follows from the other two
            del config[ds_batch.TRAIN]
        config, filled = fill_auto(config, hf_auto_values(hf_trainer, world_size=None))
        filled += [ds_batch.TRAIN] if dropped else []
        extras["hf_trainer_filled"] = filled
    return config, neox


def _check_trainer_matches(config: dict, hf_trainer: Mapping[str, Any], world_size: int | None) -> None:
    """Refuse what the Trainer refuses: set values that differ from its arguments."""
    mismatches = hf_mismatches(config, hf_trainer, world_size=world_size)
    if mismatches:
        raise TranslationError(
            "DeepSpeed config values mismatch the Trainer's arguments (transformers refuses them): "
            + " ".join(mismatches),
            key="hf_trainer",
            fix='set these DeepSpeed config values to "auto", or pass matching --hf-trainer values',
        )


def _batch(ctx: Context, config: dict, world_size: int | None, tensor: int, stages: int) -> BatchSpec:
    parallel = tensor * stages
    values = {
        k: ctx.read_int(k, config[k], maximum=MAX_BATCH_SIZE) if k in config else None for k in _BATCH_KEYS
    }
    if any(k in ctx.missing_auto for k in _BATCH_KEYS):
        return BatchSpec()
    train, micro, accum = (values[k] for k in _BATCH_KEYS)
    if world_size is not None:
        if world_size % parallel:
            ctx.fail(
                "tensor_parallel",
                f"world size {world_size} is not divisible by tensor x pipeline = {parallel}",
            )
        triple = ds_batch.resolve_batch(train, micro, accum, world_size=world_size // parallel)
        ctx.extras.update(world_size=world_size, data_parallel_size=triple.world_size)
    else:
        triple = _batch_without_world(ctx, train, micro, accum)
    where = f"batch (micro {triple.micro_batch_size} x accumulation {triple.accumulation_steps} x " \
        f"data-parallel {triple.world_size or 'N'})"  # fmt: skip
    if stages > 1:
        where += (f"; the {triple.accumulation_steps} accumulation micro-batches run as one pipeline pass "
                  "(pipeline.microbatches, as DeepSpeed's pipeline engine does)")  # fmt: skip
    for key in _BATCH_KEYS:
        if key in config:
            ctx.mapped(key, config[key], where)
    ctx.extras["train_batch_size"] = triple.train_batch_size or None
    return BatchSpec(micro_batch_size=triple.micro_batch_size, accumulation_steps=triple.accumulation_steps)


def _batch_without_world(ctx: Context, train, micro, accum) -> ds_batch.BatchTriple:
    """Infer what does not depend on the world size; the data-parallel size when all three are given."""
    if train is None:
        checked = ds_batch.resolve_batch(None, micro, accum, world_size=1)  # DeepSpeed's own checks
        return ds_batch.BatchTriple(0, checked.micro_batch_size, checked.accumulation_steps, 0)
    if micro is not None and accum is not None:
        product = micro * accum
        if micro < 1 or accum < 1 or train < product or train % product:
            ctx.fail(
                ds_batch.TRAIN,
                f"train_batch_size {train} is not micro_batch_per_gpu * gradient_acc_step "
                f"* world_size for any world size ({micro} * {accum} * N)",
                fix=f"make {ds_batch.TRAIN} a multiple of {product}",
            )
        triple = ds_batch.resolve_batch(train, micro, accum, world_size=train // product)
        ctx.extras["implied_world_size"] = triple.world_size
        return triple
    missing = ds_batch.MICRO if micro is None else ds_batch.ACCUM
    ctx.fail(
        missing,
        "depends on the data-parallel world size, which was not given",
        fix=f"pass the number of devices (--world-size N; world_size=N in Python), or set {missing}",
    )


def _optimizer(ctx, config, neox: NeoxResult | None) -> tuple[OptimizerSpec | None, AxisCompression | None]:
    result = OptimizerResult("adamw", 1e-3, {})
    if "optimizer" in config:
        result = translate_optimizer(ctx, config["optimizer"])
    elif not neox:
        ctx.approximated(
            "optimizer",
            None,
            "absent: DeepSpeed uses the client's optimizer (and still clips gradients, see "
            "gradient_clipping); the plan uses optax adamw, lr 1e-3, no weight decay",
        )
    schedule = translate_scheduler(ctx, config["scheduler"]) if "scheduler" in config else None
    params = dict(result.params)
    if neox is not None:
        schedule = schedule or neox.schedule
        if neox.weight_decay is not None:
            params["weight_decay"] = neox.weight_decay
    clip = _clipping(ctx, config)
    if schedule is not None and schedule.name == "one_cycle" and schedule.params.get("cycle_momentum"):
        if result.name not in ("adam", "adamw", "lamb"):
            schedule = ScheduleSpec(schedule.name, {**schedule.params, "cycle_momentum": False})
    spec = OptimizerSpec(result.name, result.learning_rate, params, schedule, clip)
    return spec, result.compression


def _clipping(ctx: Context, config: dict) -> float:
    if "gradient_clipping" not in config:
        return GRADIENT_CLIPPING_DEFAULTS["pinned"]
    value = ctx.read_number("gradient_clipping", config["gradient_clipping"], minimum=0)
    ctx.mapped("gradient_clipping", config["gradient_clipping"], "optimizer.gradient_clipping (0 = off)")
    return value or 0.0


def _mesh(zero: ZeroResult, tensor: int, stages: int) -> MeshSpec:
    extra = {"tensor": AxisSize(ici=tensor), "stage": AxisSize(ici=stages)}
    if zero.hybrid_size:
        return MeshSpec(data=AxisSize(ici=-1), fsdp=AxisSize(ici=zero.hybrid_size), **extra)
    if zero.zero.stage >= 1:
        return MeshSpec(data=AxisSize(), fsdp=AxisSize(ici=-1), **extra)
    return MeshSpec(**extra)


def _communication(
    ctx: Context, config: dict, zero: ZeroResult, precision: PrecisionSpec
) -> CommunicationSpec:
    fields = translate_communication(ctx, config)
    if zero.bucket_elements is not None:
        width = 4 if precision.reduce_dtype == "float32" else 2
        fields["bucket_mb"] = zero.bucket_elements * width / 1e6
        ctx.mapped(
            "zero_optimization.reduce_bucket_size",
            zero.bucket_elements,
            f"communication.bucket_mb = {fields['bucket_mb']:g} ({width}-byte {precision.reduce_dtype})",
        )
    return CommunicationSpec(**fields)


def _compression(
    ctx: Context, zero: ZeroResult, one_bit: AxisCompression | None
) -> tuple[AxisCompression, ...]:
    if one_bit is not None and zero.zero.stage >= 1:
        ctx.unsupported(
            "optimizer.type",
            None,
            "DeepSpeed's 1-bit optimizers run with ZeRO stage 0 only",
            fix="set zero_optimization.stage to 0",
        )
        one_bit = None
    return tuple(c for c in (one_bit, zero.compression) if c is not None)


def _sections(ctx: Context, config: dict, neox: bool, world_size: int | None) -> ParallelPlan:
    neox_result = translate_neox(ctx, config) if neox else None
    for key, value in config.items():
        if key not in _MAIN_KEYS and not (neox and key in NEOX_KEYS):
            translate_other(ctx, key, value, _MAIN_KEYS)
    zero = translate_zero(ctx, config.get("zero_optimization", {}))
    precision = translate_precision(ctx, config)
    tensor, stages = translate_layout(ctx, config)
    if neox_result is not None:
        tensor, stages = max(tensor, neox_result.tensor), max(stages, neox_result.stages)
        precision = _neox_precision(precision, neox_result)
    _check_zero_with_pipeline(ctx, zero.zero.stage, stages)
    optimizer, one_bit = _optimizer(ctx, config, neox_result)
    batch, pipeline = _pipelined(_batch(ctx, config, world_size, tensor, stages), stages)
    return ParallelPlan(
        name="deepspeed",
        mesh=_mesh(zero, tensor, stages),
        zero=zero.zero,
        precision=precision,
        batch=batch,
        communication=_communication(ctx, config, zero, precision),
        compression=_compression(ctx, zero, one_bit),
        pipeline=pipeline,
        optimizer=optimizer,
    )


def _check_zero_with_pipeline(ctx: Context, zero_stage: int, stages: int) -> None:
    """Refuse what DeepSpeed's ``PipelineEngine`` asserts against: ZeRO stage 2 or 3 with a pipeline."""
    if zero_stage >= 2 and stages > 1:
        ctx.fail(
            "zero_optimization.stage",
            f"ZeRO stage {zero_stage} with a {stages}-stage pipeline: DeepSpeed's pipeline engine "
            'refuses it ("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism")',
            fix="set zero_optimization.stage to 0 or 1, or remove the pipeline; for ZeRO 2/3 with a "
            "pipeline write a plan instead (see meshes/fsdp_pp.toml)",
        )


def _pipelined(batch: BatchSpec, stages: int) -> tuple[BatchSpec, PipelineSpec]:
    """DeepSpeed's PipelineEngine runs the gradient-accumulation micro-batches as one pipeline pass
    (``TrainSchedule``, 1F1B): here one pass of ``pipeline.microbatches = gas`` micro-batches."""
    if stages == 1:
        return batch, PipelineSpec()
    m = batch.accumulation_steps
    schedule = "1f1b" if m >= stages else "gpipe"  # 1F1B needs a micro-batch per stage at least
    pipelined = dataclasses.replace(batch, micro_batch_size=batch.micro_batch_size * m, accumulation_steps=1)
    return pipelined, PipelineSpec(schedule=schedule, microbatches=m)


def _neox_precision(precision: PrecisionSpec, neox: NeoxResult) -> PrecisionSpec:
    compute = (
        precision.compute_dtype if precision.compute_dtype != "float32" else neox.compute_dtype or "float32"
    )
    reduce = (
        "float32"
        if neox.reduce_fp32
        else (precision.reduce_dtype if precision.compute_dtype != "float32" else compute)
    )
    return PrecisionSpec(precision.param_dtype, compute, reduce, precision.loss_scale)


def _raise_missing_auto(ctx: Context) -> None:
    keys = ctx.missing_auto
    raise TranslationError(
        f'{len(keys)} key(s) still "auto": {", ".join(keys)}',
        key=keys[0],
        fix="pass values with --set key=value (overrides), or the Trainer's arguments with --hf-trainer",
    )


@short_errors
def translate_deepspeed(
    source: str | Path | dict,
    /,
    *,
    world_size: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    hf_trainer: Mapping[str, Any] | None = None,
    lenient: bool = False,
    strict: bool = False,
) -> TranslationResult:
    """Translate a DeepSpeed config into a plan with one note per input key.

    Args:
        source: a path, the config text, or the parsed dict.
        world_size: devices; the batch triple is resolved for
            ``world_size / (tensor x pipeline)`` data-parallel ranks. Without
            it, only what does not depend on it is inferred.
        overrides: dotted key -> value (``--set``): DeepSpeed keys are applied
            first; plan fields (see :func:`split_overrides`) after translation.
        hf_trainer: ``TrainingArguments`` names -> values; fills ``"auto"``
            values as the Hugging Face Trainer does.
        lenient: record unsupported keys as notes instead of raising.
        strict: raise for keys DeepSpeed ignores (unknown top-level keys).

    Returns:
        The plan (mesh ``data=-1`` for stage 0, ``fsdp=-1`` otherwise), notes,
        and extras (world size, train batch size, settings without a plan field).

    Raises:
        TranslationError: bad syntax or values, unsupported keys (unless
            lenient), inconsistent batch sizes, unresolved ``"auto"`` values;
            the error's ``key`` is the key path.
    """
    config, name = _load(source)
    Context().read_table(name, config)  # top-level keys must be strings
    spellings = {k.replace("-", "_"): k for k in config if isinstance(k, str) and "-" in k}
    extras: dict[str, Any] = {"deepspeed_version": PINNED_DEEPSPEED}
    overrides, plan_fields = split_overrides(overrides)
    config, neox = _prepare(config, name, overrides, hf_trainer, world_size, extras)
    ctx = Context(lenient=lenient, strict=strict)
    ctx.extras.update(extras, dialect="gpt-neox" if neox else "deepspeed")
    if ds_batch.TRAIN in extras.get("hf_trainer_filled", ()):
        ctx.mapped(ds_batch.TRAIN, "auto", "Trainer rule: data-parallel size x micro batch x accumulation")
    try:
        plan = _sections(ctx, config, neox, world_size)
        if not name.startswith("<"):
            plan = plan.replace(name=Path(name).stem, description=f"translated from DeepSpeed config {name}")
        plan = _apply_plan_fields(ctx, plan, plan_fields)
    except PlanError as err:
        raise TranslationError(err.message, key=err.key, fix=err.fix) from None
    if ctx.missing_auto:
        _raise_missing_auto(ctx)
    if "gradient_clipping" not in config:
        ctx.extras["gradient_clipping_default"] = (
            f"{GRADIENT_CLIPPING_DEFAULTS['pinned']} (DeepSpeed {PINNED_DEEPSPEED}); earlier releases "
            "used 0.0: pass --set gradient_clipping=0 for that"
        )
    notes = tuple(_as_written(n, spellings) for n in ctx.notes) if neox else tuple(ctx.notes)
    return TranslationResult(plan=plan, notes=notes, source=name, kind="deepspeed", extras=ctx.extras)


def _as_written(note: Note, spellings: dict[str, str]) -> Note:
    """The note keyed by the top-level key as the file spells it (gpt-neox accepts ``-`` for ``_``)."""
    head, dot, rest = note.key.partition(".")
    if head not in spellings:
        return note
    return dataclasses.replace(note, key=spellings[head] + dot + rest)
