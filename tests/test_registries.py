"""Registries: compressors and pipeline schedules enter by name, and every reader uses the same table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torsh_jax.pipeline
from torsh_jax.analysis.theory import compressed_payload_bytes
from torsh_jax.compress import make_compressor
from torsh_jax.errors import PlanError
from torsh_jax.optim import schedules as lr_schedules
from torsh_jax.pipeline.schedule import PIPELINE_SCHEDULES, build_pipeline_schedule
from torsh_jax.plan.compressors import METHODS
from torsh_jax.plan.spec import COMPRESSION_METHODS, CompressorSpec, PipelineSpec


def test_plan_accepts_exactly_the_registered_pipeline_schedules():
    for name in PIPELINE_SCHEDULES:
        assert PipelineSpec(schedule=name).schedule == name
        assert build_pipeline_schedule(name, stages=2, microbatches=2).name == name
    with pytest.raises(PlanError) as info:
        PipelineSpec(schedule="not_a_schedule")
    assert info.value.key == "pipeline.schedule"
    assert all(name in str(info.value) for name in PIPELINE_SCHEDULES)


def test_pipeline_and_learning_rate_schedules_have_distinct_names():
    assert "build_pipeline_schedule" in torsh_jax.pipeline.__all__
    assert "build_schedule" not in torsh_jax.pipeline.__all__
    assert not set(torsh_jax.pipeline.__all__) & set(lr_schedules.__all__)
    assert torsh_jax.pipeline.build_schedule is build_pipeline_schedule  # the earlier name still imports


def test_plan_accepts_exactly_none_and_the_registered_compressors():
    assert COMPRESSION_METHODS == ("none", *METHODS)


@pytest.mark.parametrize("method", [name for name, m in METHODS.items() if m.bits is not None])
def test_registered_wire_format_is_the_encoded_payload(method):
    spec = CompressorSpec(method=method, block_size=256)
    payload, _ = make_compressor(spec, implementation="reference").compress(jnp.ones(4096), ())
    encoded = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(payload))
    assert METHODS[method].payload_bytes(4096, block_size=256) == encoded
    assert compressed_payload_bytes(method, 4096, block_size=256) == encoded
