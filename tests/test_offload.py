"""Host offload of optimizer state and ZeRO-3 parameters (pinned host memory)."""

from __future__ import annotations

import jax
import pytest
from helpers import SMALL, assert_matches_twin, mlp_params, twin_report

from torsh_jax.demo.model import init_params, synthetic_tokens
from torsh_jax.errors import NotSupportedYetError
from torsh_jax.plan import plan_from_dict
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step


def _plan(**zero):
    return plan_from_dict(
        {"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": 3, **zero}, "batch": {"micro_batch_size": 4}}
    )


@pytest.mark.parametrize(
    "zero, host_parts",
    [
        pytest.param({"offload_optimizer": True}, ("opt_state",), id="optimizer"),
        pytest.param({"offload_optimizer": True, "offload_params": True}, ("opt_state", "params"), id="both"),
    ],
)
def test_offloaded_state_lives_in_host_memory_and_matches_the_twin(zero, host_parts):
    report, train = twin_report(
        _plan(**zero), steps=3, mlp=True
    )  # where the state lives, not the layers' math
    assert_matches_twin(report)
    state = train.init(mlp_params(SMALL, jax.random.key(0)))
    state, _ = train.step(state, synthetic_tokens(SMALL, batch_size=train.global_batch_size, seed=0))
    for part in ("opt_state", "params"):
        kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(getattr(state, part))}
        assert kinds == ({"pinned_host"} if part in host_parts else {"device"}), part


def test_parameter_offload_needs_stage_3():
    plan = plan_from_dict({"mesh": {"data": 1, "fsdp": -1}, "zero": {"stage": 2, "offload_params": True}})
    with pytest.raises(NotSupportedYetError, match="zero.offload_params"):
        make_train_step(lambda p, b: p, None, plan, build_mesh(plan), init_params(SMALL, jax.random.key(0)))
