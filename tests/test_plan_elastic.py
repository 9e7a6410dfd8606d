"""Keeping the global batch when a run continues on another number of data-parallel ranks."""

from __future__ import annotations

import pytest

from torsh_jax.errors import CheckpointError, PlanError
from torsh_jax.plan import BatchSpec, load_plan
from torsh_jax.plan.elastic import global_batch_size, keep_global_batch

FSDP = lambda n: {"data": 1, "stage": 1, "fsdp": n, "tensor": 1}  # noqa: E731


@pytest.mark.parametrize(
    ("micro", "accum", "ranks_before", "ranks_after", "want"),
    [
        (8, 1, 4, 2, (8, 2)),  # fewer ranks: more accumulation, same micro batch
        (8, 1, 4, 1, (8, 4)),
        (8, 4, 1, 4, (8, 1)),  # more ranks: less accumulation
        (8, 1, 1, 2, (4, 1)),  # more ranks than accumulation steps: a smaller micro batch
        (6, 1, 4, 8, (3, 1)),
        (8, 1, 3, 2, (6, 2)),  # 24 on 2 ranks: 12 each, the largest micro batch <= 8 dividing 12
    ],
)
def test_keep_global_batch(micro, accum, ranks_before, ranks_after, want):
    plan = load_plan("zero3").replace(batch=BatchSpec(micro_batch_size=micro, accumulation_steps=accum))
    saved = global_batch_size(plan, FSDP(ranks_before))
    continued = keep_global_batch(plan, saved, FSDP(ranks_after))
    assert (continued.batch.micro_batch_size, continued.batch.accumulation_steps) == want
    assert global_batch_size(continued, FSDP(ranks_after)) == saved
    assert continued.batch.micro_batch_size <= micro, "per-device memory must not grow"


def test_same_ranks_keep_the_plan_itself():
    plan = load_plan("zero3")
    assert keep_global_batch(plan, 32, FSDP(4)) is plan


def test_tensor_and_unsharded_axes_do_not_count_as_ranks():
    plan = load_plan("fsdp_tp")
    shape = {"data": 1, "stage": 1, "fsdp": 2, "tensor": 2}
    assert global_batch_size(plan, shape) == plan.batch.micro_batch_size * 2


def test_a_global_batch_that_does_not_split_names_the_mesh_and_the_fix():
    with pytest.raises(PlanError) as info:
        keep_global_batch(load_plan("zero3"), 30, FSDP(4))
    assert info.value.key == "batch"
    assert "30" in info.value.message and "fsdp=4" in info.value.message
    assert "divides 30" in info.value.fix


def test_continue_plan_needs_a_complete_checkpoint(tmp_path):
    from torsh_jax.checkpoint import continue_plan

    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        continue_plan(tmp_path / "missing", load_plan("zero3"), num_devices=2)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        continue_plan(tmp_path, load_plan("zero3"), num_devices=2)
