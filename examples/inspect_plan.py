"""Print what a plan's compiled train step sends over the wire and keeps in memory.

python examples/inspect_plan.py zero3
"""

from __future__ import annotations

import sys

import jax
import optax

import torsh_jax as tj
from torsh_jax.demo.model import LMConfig, init_params, layered_model, synthetic_tokens


def main(plan_name: str) -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    plan = tj.load_plan(plan_name)
    cfg = LMConfig(layers=8)
    params = init_params(cfg, jax.random.key(0))
    train = tj.make_train_step(layered_model(cfg), optax.adamw(1e-3), plan, tj.build_mesh(plan), params)
    state = train.init(params)
    summary = tj.inspect_step(train, state, synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0))
    print(tj.render_text(summary))
    theory = summary["theory"]
    print(f"{theory['description']}: measured / theoretical bytes on the wire = {theory['wire_ratio']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "zero3")
