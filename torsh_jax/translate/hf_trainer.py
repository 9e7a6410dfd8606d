"""How the Hugging Face Trainer fills ``"auto"`` values of a DeepSpeed config.

The Trainer replaces each ``"auto"`` with a value from its
``TrainingArguments`` (source: transformers
``src/transformers/integrations/deepspeed.py``, ``HfTrainerDeepSpeedConfig``
``trainer_config_process`` / ``trainer_config_finalize``). Arguments not given
take the ``TrainingArguments`` defaults below. Values the Trainer derives from
the model (``hidden_size``) or from the data (``max_steps``) must be passed.
Like the Trainer (``fill_match``), a value that is set (not ``"auto"``) and
differs from the Trainer's is a mismatch: :func:`hf_mismatches` lists them.

Example:
    >>> values = hf_auto_values({"learning_rate": 3e-5, "max_steps": 100, "warmup_ratio": 0.1}, world_size=8)
    >>> values["optimizer.params.lr"], values["scheduler.params.warmup_num_steps"], values["train_batch_size"]
    (3e-05, 10, 64)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.translate.ds_values import get_path
from torsh_jax.translate.messages import clip

__all__ = [
    "hf_auto_values",
    "hf_mismatches",
    "trainer_bool",
    "trainer_number",
    "TRAINING_ARGUMENT_DEFAULTS",
    "BOOLEAN_ARGUMENTS",
    "NUMBER_ARGUMENTS",
]

#: ``transformers.TrainingArguments`` defaults for the arguments the DeepSpeed integration reads.
TRAINING_ARGUMENT_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "warmup_ratio": 0.0,
    "fp16": False,
    "bf16": False,
    "max_steps": None,
    "hidden_size": None,
}

#: The Trainer arguments read here that are booleans (checked by :func:`trainer_bool`).
BOOLEAN_ARGUMENTS = tuple(name for name, default in TRAINING_ARGUMENT_DEFAULTS.items() if default is False)

#: Spellings ``HfArgumentParser`` accepts for a boolean (transformers ``hf_argparser.string_to_bool``,
#: case-insensitive); anything else is an error there.
_TRUE_WORDS = ("yes", "true", "t", "y", "1")
_FALSE_WORDS = ("no", "false", "f", "n", "0")


#: The Trainer arguments read here that are numbers: their type, and the least value that trains
#: (``None``: any; ``max_steps`` <= 0 means "until the epochs end", as in transformers).
NUMBER_ARGUMENTS: dict[str, tuple[type, float | None]] = {
    "per_device_train_batch_size": (int, 1),
    "gradient_accumulation_steps": (int, 1),
    "learning_rate": (float, 0),
    "weight_decay": (float, 0),
    "adam_beta1": (float, 0),
    "adam_beta2": (float, 0),
    "adam_epsilon": (float, 0),
    "max_grad_norm": (float, 0),
    "warmup_steps": (float, 0),
    "warmup_ratio": (float, 0),
    "max_steps": (int, None),
    "hidden_size": (int, 1),
    "world_size": (int, 1),
    "num_training_steps": (int, 1),
}


def trainer_number(value: Any, name: str) -> int | float | None:
    """``value`` of the number Trainer argument ``name`` (:data:`NUMBER_ARGUMENTS`), read as
    ``HfArgumentParser`` reads it (``"4"`` is 4); ``None`` stays ``None``.

    Example:
        >>> trainer_number("4", "per_device_train_batch_size"), trainer_number(3e-5, "learning_rate")
        (4, 3e-05)

    Raises:
        TranslationError: not a number of its type, or below the least value that trains.
    """
    kind, least = NUMBER_ARGUMENTS[name]
    if value is None:
        return None
    number = _as_number(value, kind)
    if number is None or (least is not None and number < least):
        what = "a whole number" if kind is int else "a finite number"
        bound = "" if least is None else f" >= {least}"
        raise TranslationError(
            f"must be {what}{bound}, got {clip(repr(value))}",
            key=f"--hf-trainer {name}",
            fix=f"pass --hf-trainer {name}=N, e.g. {name}={TRAINING_ARGUMENT_DEFAULTS.get(name) or 1}",
        )
    return number


def _as_number(value: Any, kind: type) -> int | float | None:
    """``value`` as ``kind`` (``int``: no fraction), or ``None`` when it is not one."""
    if isinstance(value, bool):
        return None
    try:
        number = kind(value) if isinstance(value, str) else value
    except ValueError:
        return None
    if kind is int:
        return number if isinstance(number, int) else None
    return float(number) if isinstance(number, (int, float)) and math.isfinite(number) else None


def trainer_bool(value: Any, name: str) -> bool:
    """``value`` of the boolean Trainer argument ``name``, read as ``HfArgumentParser`` reads it.

    Example:
        >>> trainer_bool("Yes", "bf16"), trainer_bool(0, "bf16"), trainer_bool("F", "fp16")
        (True, False, False)

    Raises:
        TranslationError: not a spelling transformers accepts (``maybe``, ``2``, ``1.0``).
    """
    if isinstance(value, bool):
        return value
    text = str(value).lower() if isinstance(value, (str, int)) else None
    if text in _TRUE_WORDS:
        return True
    if text in _FALSE_WORDS:
        return False
    raise TranslationError(
        f"must be a boolean (yes/no, true/false, t/f, y/n, 1/0, any case, as transformers reads it), "
        f"got {clip(repr(value))}",
        key=f"--hf-trainer {name}",
        fix=f"pass --hf-trainer {name}=true or {name}=false",
    )


def _arguments(args: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(args) - set(TRAINING_ARGUMENT_DEFAULTS) - {"world_size", "num_training_steps"})
    if unknown:
        raise TranslationError(
            f"unknown Trainer argument {unknown[0]!r}",
            key=f"hf_trainer.{unknown[0]}",
            fix=f"use one of {sorted(TRAINING_ARGUMENT_DEFAULTS)}",
        )
    merged = {**TRAINING_ARGUMENT_DEFAULTS, **args}
    for name in BOOLEAN_ARGUMENTS:
        merged[name] = trainer_bool(merged[name], name)
    for name in NUMBER_ARGUMENTS.keys() & merged.keys():
        merged[name] = trainer_number(merged[name], name)
    if merged.get("max_steps") is None and "num_training_steps" in args:
        merged["max_steps"] = args["num_training_steps"]
    return merged


def _step_values(a: dict[str, Any]) -> dict[str, Any]:
    steps = a["max_steps"]
    if steps is None or steps <= 0:
        return {}
    return {"scheduler.params.total_num_steps": steps, "scheduler.params.warmup_num_steps": _warmup(a, steps)}


def _warmup(a: dict[str, Any], steps: int) -> int:
    """``max(1, args.get_warmup_steps(steps))``: a ``warmup_steps`` below 1 is a fraction of the
    steps (transformers 5; ``warmup_ratio`` before); at least 1, because DeepSpeed 0.19.3 and later
    refuse 0 (transformers 5.24 ``integrations/deepspeed.py`` fills it so)."""
    given = a["warmup_steps"]
    if given >= 1:
        return int(given)
    return max(1, math.ceil(steps * (given if given > 0 else a["warmup_ratio"])))


def _model_values(a: dict[str, Any]) -> dict[str, Any]:
    hidden = a["hidden_size"]
    if hidden is None:
        return {}
    return {
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
    }


def hf_auto_values(args: Mapping[str, Any], *, world_size: int | None) -> dict[str, Any]:
    """Dotted DeepSpeed key -> the value the Trainer would put in place of ``"auto"``.

    Args:
        args: ``TrainingArguments`` names -> values (``max_steps``: optimizer
            steps; ``hidden_size``: the model's, for ZeRO bucket sizes).
        world_size: data-parallel size; without it ``train_batch_size`` is
            left out (the Trainer's value always agrees with the other two).

    Raises:
        TranslationError: an unknown argument name.
    """
    a = _arguments(args)
    world = world_size if world_size is not None else a.get("world_size")
    micro, accum = a["per_device_train_batch_size"], a["gradient_accumulation_steps"]
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": a["max_grad_norm"],
        "optimizer.params.lr": a["learning_rate"],
        "optimizer.params.betas": [a["adam_beta1"], a["adam_beta2"]],
        "optimizer.params.eps": a["adam_epsilon"],
        "optimizer.params.weight_decay": a["weight_decay"],
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": a["learning_rate"],
        "fp16.enabled": a["fp16"],
        "bf16.enabled": a["bf16"],
    }
    if world is not None:
        values["train_batch_size"] = world * micro * accum
    return {**values, **_step_values(a), **_model_values(a)}


#: DeepSpeed keys the Trainer requires to match its arguments -> the argument named in its message.
#: ``warmup_min_lr`` and the ``hidden_size`` bucket sizes are only filled, never checked.
_MUST_MATCH = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "train_batch_size (calculated)",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1+adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "scheduler.params.total_num_steps": "num_training_steps (calculated)",
    "scheduler.params.warmup_num_steps": "warmup_steps",
}


def hf_mismatches(config: Mapping[str, Any], args: Mapping[str, Any], *, world_size: int | None) -> list[str]:
    """Values set in ``config`` that differ from the Trainer's, in the Trainer's wording.

    Example:
        >>> hf_mismatches({"fp16": {"enabled": True}}, {"fp16": False}, world_size=None)
        ['- ds fp16.enabled=True vs hf fp16=False']
    """
    values = hf_auto_values(args, world_size=world_size)
    out = []
    for key, hf_key in _MUST_MATCH.items():
        ds_value = get_path(config, key)
        if key in values and ds_value is not None and ds_value != "auto" and ds_value != values[key]:
            out.append(f"- ds {key}={ds_value} vs hf {hf_key}={values[key]}")
    return out
