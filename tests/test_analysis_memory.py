"""Per-device memory from ``compiled.memory_analysis()``: exact argument, output and alias bytes."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.analysis import MemoryReport, memory_report

AUTO = jax.sharding.AxisType.Auto


@pytest.fixture(scope="module")
def sharded_args():
    require_devices(8)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AUTO, AUTO))
    x = jax.device_put(jnp.ones((8 * 256,), jnp.float32), NamedSharding(mesh, P(("data", "fsdp"))))
    y = jax.device_put(jnp.ones((100,), jnp.bfloat16), NamedSharding(mesh, P()))
    return x, y


def _double(a, b):
    return a * 2, b + 1


def test_argument_bytes_are_the_per_device_shards(sharded_args):
    report = memory_report(jax.jit(_double).lower(*sharded_args).compile())
    assert report.argument_bytes == 256 * 4 + 100 * 2  # f32 shard of 256 + replicated bf16[100]
    # outputs: the same arrays plus the CPU backend's tuple index table (8 bytes per element)
    assert report.output_bytes == 256 * 4 + 100 * 2 + 2 * 8
    assert report.alias_bytes == 0
    assert report.available
    assert report.peak_estimate_bytes == report.argument_bytes + report.output_bytes + report.temp_bytes


def test_donated_argument_is_aliased_and_counted_once(sharded_args):
    report = memory_report(jax.jit(_double, donate_argnums=(0,)).lower(*sharded_args).compile())
    assert report.alias_bytes == 256 * 4
    assert report.peak_estimate_bytes == 1224 + 1240 + report.temp_bytes - 1024


def test_single_device_program():
    report = memory_report(jax.jit(lambda a: a * 2).lower(jnp.ones((1000,), jnp.float32)).compile())
    assert (report.argument_bytes, report.output_bytes) == (4000, 4000)


class _NoAnalysis:
    def memory_analysis(self):
        return None


class _Raises:
    def memory_analysis(self):
        raise NotImplementedError("not on this backend")


class _Partial:
    def memory_analysis(self):
        return SimpleNamespace(argument_size_in_bytes=10, output_size_in_bytes=20)


@pytest.mark.parametrize("compiled", [_NoAnalysis(), _Raises()], ids=["none", "raises"])
def test_backends_without_analysis_give_an_empty_report(compiled):
    report = memory_report(compiled)
    assert report == MemoryReport()
    assert not report.available and report.peak_estimate_bytes is None


def test_missing_fields_read_as_none():
    report = memory_report(_Partial())
    assert (report.argument_bytes, report.output_bytes, report.temp_bytes) == (10, 20, None)
    assert report.peak_estimate_bytes is None
    assert report.to_dict()["argument_bytes"] == 10
