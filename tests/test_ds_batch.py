"""Batch inference and validation against DeepSpeed's rules for world sizes 1, 8 and 64.

Reference: DeepSpeed ``deepspeed/runtime/config.py``,
``DeepSpeedConfig._set_batch_related_parameters`` (integer division to infer
the missing values) followed by ``_batch_assertion`` (all > 0 and
``train == micro * accumulation * world``).
"""

from __future__ import annotations

import itertools

import pytest

from torsh_jax.errors import TranslationError
from torsh_jax.translate.deepspeed import translate_deepspeed
from torsh_jax.translate.ds_batch import resolve_batch


def deepspeed_reference(train, micro, accum, world):
    """(train, micro, accum) or the first assertion DeepSpeed would fail."""
    if train is not None and micro is not None and accum is not None:
        pass
    elif train is not None and micro is not None:
        accum = train // micro // world
    elif train is not None and accum is not None:
        micro = train // world // accum
    elif micro is not None and accum is not None:
        train = micro * accum * world
    elif train is not None:
        accum, micro = 1, train // world
    elif micro is not None:
        train, accum = micro * world, 1
    else:
        return "Either train_batch_size or train_micro_batch_size_per_gpu"
    if train <= 0:
        return "Train batch size"
    if micro <= 0:
        return "Micro batch size per gpu"
    if accum <= 0:
        return "Gradient accumulation steps"
    if train != micro * accum * world:
        return "Check batch related parameters"
    return train, micro, accum


VALUES = (None, 1, 2, 3, 8, 16, 64, 96, 512)


@pytest.mark.parametrize("world", [1, 8, 64])
def test_every_combination_agrees_with_deepspeed(world):
    """DeepSpeed config.py batch inference + assertion, over a grid of triples."""
    accepted = rejected = 0
    for train, micro, accum in itertools.product(VALUES, VALUES, (None, 1, 2, 4, 3)):
        expected = deepspeed_reference(train, micro, accum, world)
        if isinstance(expected, str):
            with pytest.raises(TranslationError, match=expected):
                resolve_batch(train, micro, accum, world_size=world)
            rejected += 1
        else:
            got = resolve_batch(train, micro, accum, world_size=world)
            assert (got.train_batch_size, got.micro_batch_size, got.accumulation_steps) == expected
            accepted += 1
    assert accepted > 20 and rejected > 20


CASES = [
    # (train, micro, accum, world, expected or error fragment)
    (32, None, None, 8, (32, 4, 1)),
    (32, 4, None, 8, (32, 4, 1)),
    (32, None, 2, 8, (32, 2, 2)),
    (None, 4, 2, 64, (512, 4, 2)),
    (None, 3, None, 1, (3, 3, 1)),
    (4096, 16, None, 64, (4096, 16, 4)),
    (8, None, 1, 64, "Micro batch size per gpu: 0"),
    (8, 1, None, 64, "Gradient accumulation steps: 0"),
    (24, 3, None, 8, (24, 3, 1)),
    (24, 3, None, 64, "Gradient accumulation steps: 0"),
    (100, 3, 4, 8, "100 != 3 * 4 * 8"),
    (36, 4, None, 8, "36 != 4 * 1 * 8"),
    (None, None, 4, 8, "Either train_batch_size or train_micro_batch_size_per_gpu"),
]


@pytest.mark.parametrize(
    ("train", "micro", "accum", "world", "expected"),
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}-w{c[3]}" for c in CASES],
)
def test_named_cases(train, micro, accum, world, expected):
    """Worked examples of DeepSpeed config.py; rejects keep DeepSpeed's wording."""
    if isinstance(expected, str):
        with pytest.raises(TranslationError, match=expected.replace("*", r"\*")) as info:
            resolve_batch(train, micro, accum, world_size=world)
        assert info.value.key in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        )
        assert info.value.fix
    else:
        got = resolve_batch(train, micro, accum, world_size=world)
        assert (got.train_batch_size, got.micro_batch_size, got.accumulation_steps) == expected


@pytest.mark.parametrize("world", [1, 8, 64])
def test_translation_records_world_size_and_batch(world):
    result = translate_deepspeed(
        {"train_batch_size": 512, "gradient_accumulation_steps": 2}, world_size=world
    )
    assert result.extras["world_size"] == world
    assert result.plan.batch.global_batch_size(world) == 512
    assert result.plan.batch.accumulation_steps == 2


def test_tensor_parallel_divides_world_before_batch():
    """DeepSpeed's batch world size is the data-parallel size: devices / (tensor x pipeline)."""
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 1,
        "tensor_parallel": {"autotp_size": 4},
    }
    result = translate_deepspeed(config, world_size=8)
    assert result.extras["data_parallel_size"] == 2
    assert result.plan.batch.accumulation_steps == 4
    assert result.plan.mesh.tensor.ici == 4
    with pytest.raises(TranslationError, match="not divisible"):
        translate_deepspeed(config, world_size=6)


def test_without_world_size_only_what_is_determined():
    three = translate_deepspeed(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    )
    assert three.extras["implied_world_size"] == 8
    micro_only = translate_deepspeed({"train_micro_batch_size_per_gpu": 4})
    assert micro_only.plan.batch.micro_batch_size == 4
    with pytest.raises(TranslationError) as info:
        translate_deepspeed({"train_batch_size": 64})
    assert info.value.key == "train_micro_batch_size_per_gpu" and "world_size" in info.value.fix
    with pytest.raises(TranslationError, match="for any world size"):
        translate_deepspeed(
            {"train_batch_size": 60, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
        )
