"""``demo --verify``'s judgement: the twin criterion on the losses, against the twin in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from torsh_jax.cli.demo_cmd import _summary_rows
from torsh_jax.demo.verify import SUMMARY_KEYS, DemoTwins
from torsh_jax.plan import ParallelPlan


def _loss(params, batch):
    return jnp.mean(jnp.tanh(batch["x"] @ params["w"]) ** 2)


def _run(parallel_losses) -> dict:
    """:class:`DemoTwins` over 3 steps of a small tanh model, told ``parallel_losses(twin loss)``."""
    twins = DemoTwins(_loss, optax.adam(1e-2), ParallelPlan())
    twins.start({"w": jax.random.normal(jax.random.key(0), (16, 4))})
    for i in range(3):
        batch = {"x": jax.random.normal(jax.random.key(i + 1), (32, 16))}
        twin_loss = float(twins.twin[1](twins.states[0], batch)[1]["loss"])  # what the twin will say
        assert twins.step(batch, loss=parallel_losses(twin_loss)) == twin_loss
    return twins.summary()


def test_the_twins_own_losses_are_within_roundoff():
    summary = _run(lambda twin_loss: twin_loss)
    assert summary["within_roundoff"] is True and summary["max_rel_err"] == 0.0, summary
    assert summary["parallel_vs_float64"] == summary["twin_vs_float64"] < summary["roundoff_bound"] < 1e-5


@pytest.mark.parametrize("off", [1e-3, 5e-6])
def test_a_loss_off_by_more_than_roundoff_is_not_within_and_says_no(off):
    """5e-6 passes a fixed tolerance of 1e-5 on ``max_rel_err``; the losses' round-off bound is ~1e-6."""
    summary = _run(lambda twin_loss: twin_loss * (1 + off))
    assert summary["within_roundoff"] is False, summary
    assert summary["max_rel_err"] == pytest.approx(off, rel=1e-2)
    assert summary["parallel_vs_float64"] > summary["roundoff_bound"]
    row = _summary_rows(_demo_summary(summary))["within round-off of float64"]
    assert row.startswith("no (loss ") and " > " in row, row


def test_no_step_leaves_every_key_null():
    twins = DemoTwins(_loss, optax.adam(1e-2), ParallelPlan())
    assert twins.summary() == dict.fromkeys(SUMMARY_KEYS)
    assert "within round-off of float64" not in _summary_rows(_demo_summary(twins.summary()))


def _demo_summary(verify_keys: dict) -> dict:
    """A demo summary around ``verify_keys`` (the other keys as a 1-device, 3-step run reports them)."""
    return {
        "mesh": {"data": 1},
        "param_count": 64,
        "global_batch_size": 32,
        "steps": 3,
        "final_loss": 0.5,
        "wire_bytes_per_step": 0,
        "theoretical_wire_bytes_per_step": 0,
        "memory_per_device_bytes": 1024,
        "compiles": 1,
        **verify_keys,
    }
