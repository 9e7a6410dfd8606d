"""Convergence with compressed gradients: 300 DDP steps on 8 simulated devices.

A one-layer LM (vocab 32, width 16, about 3.3k parameters) learns the
synthetic permutation task with Adam; the final loss (mean of the last 50
steps) of each compressed run is compared with the uncompressed run on the
same batches. Without error feedback, top-k and 1-bit must end visibly worse:
that shows the feedback is what keeps them on track.

After 300 steps (measured: final loss over the uncompressed run's) int8 ends at
0.999x, int4 at 1.001x, PowerSGD rank 4 at 1.028x, top-k 1% at 1.039x and 1-bit
at 1.027x. Without error feedback int4 ends at 1.022x, PowerSGD at 1.11x, top-k
at 1.43x and 1-bit at 1.24x: each ceiling below fails them (int8 without feedback
stays at 0.999x: its error is too small to matter here; its bounds are tested on
the kernels). The compressors' gap closes with length (docs/compression.md has
1000 and 2000 steps).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices

from torsh_jax.demo.model import LMConfig, init_params, loss_fn, synthetic_tokens
from torsh_jax.plan import plan_from_dict
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.step import make_train_step

pytestmark = pytest.mark.slow

TINY = LMConfig(vocab=32, d_model=16, heads=1, head_dim=16, mlp=32, layers=1, seq_len=8)
STEPS, DISTINCT_BATCHES, TAIL = 300, 64, 50
LEARNING_RATE = 1e-2


@functools.cache
def final_loss(gradients: str | None = None, feedback: bool = True) -> float:
    """Mean loss of the last ``TAIL`` of ``STEPS`` steps, gradients compressed with preset ``gradients``."""
    require_devices(8)
    data = {"mesh": {"data": -1}, "batch": {"micro_batch_size": 2}}
    if gradients is not None:
        spec = gradients if feedback else {"method": gradients, "error_feedback": False}
        data["compression"] = [{"axis": "data", "gradients": spec}]
    plan = plan_from_dict(data)
    params = init_params(TINY, jax.random.key(0))
    train = make_train_step(loss_fn(TINY), optax.adam(LEARNING_RATE), plan, build_mesh(plan), params)
    state = train.init(params)
    batches = [
        train.shard_batch(synthetic_tokens(TINY, batch_size=train.global_batch_size, seed=i))
        for i in range(DISTINCT_BATCHES)
    ]
    losses = []
    for i in range(STEPS):
        state, metrics = train.step(state, batches[i % DISTINCT_BATCHES])
        losses.append(float(metrics["loss"]))  # one step in flight at a time
    assert train.traces == 1
    return float(np.mean(losses[-TAIL:]))


@pytest.mark.parametrize(
    "preset, ceiling",
    [
        pytest.param("int8", 1.005, id="int8"),
        pytest.param("int4", 1.01, id="int4"),
        pytest.param("powersgd", 1.05, id="powersgd"),
        pytest.param("topk", 1.06, id="topk-1%"),
        pytest.param("sign", 1.07, id="1-bit"),
    ],
)
def test_final_loss_with_error_feedback_is_close_to_uncompressed(preset, ceiling):
    """Within the ceiling of the uncompressed loss; top-k and 1-bit without their feedback end visibly
    worse (checked here, so that the runs with feedback are not repeated on another worker)."""
    with_feedback = final_loss(preset)
    ratio = with_feedback / final_loss()
    print(f"{preset}: final loss {ratio:.4f}x uncompressed")
    assert ratio <= ceiling
    if preset in ("topk", "sign"):
        without = final_loss(preset, feedback=False)
        print(f"{preset} without feedback: final loss {without / final_loss():.4f}x uncompressed")
        assert without / final_loss() >= 1.15
        assert without > with_feedback * 1.15
