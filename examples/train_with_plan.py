"""Train the demo transformer under any plan, in a plain functional loop.

Run on 8 simulated CPU devices:

    python examples/train_with_plan.py --plan zero3 --steps 20
    torsh-jax launch -n 2 --devices-per-process 4 examples/train_with_plan.py --plan hsdp

Under ``torsh-jax launch`` (or torchrun/SLURM/mpirun) ``initialize()`` joins the
processes; run alone it uses simulated CPU devices.
"""

from __future__ import annotations

import argparse

import jax
import optax

import torsh_jax as tj
from torsh_jax.demo.model import LMConfig, init_params, layered_model, synthetic_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="zero3")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices when run alone")
    args = parser.parse_args()

    env = tj.detect_environment()
    if env.is_multi_process:
        tj.initialize()
    else:
        jax.config.update("jax_num_cpu_devices", args.devices)

    plan = tj.load_plan(args.plan)
    mesh = tj.build_mesh(plan)
    cfg = LMConfig()
    optimizer = tj.build_optimizer(plan.optimizer) if plan.optimizer else optax.adamw(3e-3)
    train = tj.make_train_step(layered_model(cfg), optimizer, plan, mesh)
    state = train.init(init_params(cfg, jax.random.key(0)))
    for i in range(args.steps):
        state, metrics = train.step(state, synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=i))
        if jax.process_index() == 0 and (i % 5 == 0 or i == args.steps - 1):
            print(
                f"step {i:4d}  loss {float(metrics['loss']):.4f}  grad norm {float(metrics['grad_norm']):.3f}"
            )


if __name__ == "__main__":
    main()
