"""DeepSpeed's batch-size inference and validation.

Given two or three of ``train_batch_size``, ``train_micro_batch_size_per_gpu``
and ``gradient_accumulation_steps`` and the data-parallel world size, the
missing ones are inferred with integer division and the triple is checked, as
DeepSpeed's ``DeepSpeedConfig._set_batch_related_parameters`` and
``_batch_assertion`` do (source: DeepSpeed ``deepspeed/runtime/config.py``).

Example:
    >>> resolve_batch(32, None, 2, world_size=8)
    BatchTriple(train_batch_size=32, micro_batch_size=2, accumulation_steps=2, world_size=8)
"""

from __future__ import annotations

from dataclasses import dataclass

from torsh_jax.errors import TranslationError

__all__ = ["BatchTriple", "resolve_batch", "TRAIN", "MICRO", "ACCUM"]

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
ACCUM = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchTriple:
    """A consistent batch triple for a data-parallel world size."""

    train_batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    world_size: int


def _infer(train: int | None, micro: int | None, accum: int | None, world: int) -> tuple[int, int, int]:
    if train is not None and micro is not None and accum is not None:
        return train, micro, accum
    if train is not None and micro is not None:
        return train, micro, train // micro // world
    if train is not None and accum is not None:
        return train, train // world // accum, accum
    if micro is not None and accum is not None:
        return micro * accum * world, micro, accum
    if train is not None:
        return train, train // world, 1
    if micro is not None:
        return micro * world, micro, 1
    raise TranslationError(
        f"Either {TRAIN} or {MICRO} needs to be provided",
        key=TRAIN,
        fix=f"set {TRAIN} or {MICRO}",
    )


def _check(train: int, micro: int, accum: int, world: int, given: set[str]) -> None:
    for key, value, label in (
        (TRAIN, train, "Train batch size"),
        (MICRO, micro, "Micro batch size per gpu"),
        (ACCUM, accum, "Gradient accumulation steps"),
    ):
        if value <= 0:
            raise TranslationError(
                f"{label}: {value} has to be greater than 0 (world size {world})",
                key=key if key in given else TRAIN,
                fix=f"make {TRAIN} a multiple of {MICRO} x {ACCUM} x world size ({world})",
            )
    if train != micro * accum * world:
        raise TranslationError(
            "Check batch related parameters. train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size {train} != {micro} * {accum} * {world}",
            key=TRAIN,
            fix=f"set {TRAIN} = {micro * accum * world}, or give only two of the three keys",
        )


def resolve_batch(train: int | None, micro: int | None, accum: int | None, *, world_size: int) -> BatchTriple:
    """Infer and validate the batch triple for a data-parallel ``world_size``.

    Args:
        train: ``train_batch_size`` or ``None``.
        micro: ``train_micro_batch_size_per_gpu`` or ``None``.
        accum: ``gradient_accumulation_steps`` or ``None``.
        world_size: data-parallel ranks (devices / (tensor x pipeline)).

    Raises:
        TranslationError: DeepSpeed would reject the triple; the message keeps
            DeepSpeed's wording and the fix gives consistent values.
    """
    if world_size < 1:
        raise TranslationError(
            f"world size must be >= 1, got {world_size}",
            key="world_size",
            fix="pass --world-size as a positive integer (devices in the job)",
        )
    given = {k for k, v in ((TRAIN, train), (MICRO, micro), (ACCUM, accum)) if v is not None}
    t, m, a = _infer(train, micro, accum, world_size)
    _check(t, m, a, world_size, given)
    return BatchTriple(t, m, a, world_size)
