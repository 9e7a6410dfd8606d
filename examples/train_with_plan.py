"""Train the demo transformer under any plan, in a plain functional loop, with checkpoints.

Run on 8 simulated CPU devices:

    python examples/train_with_plan.py --plan zero3 --steps 20
    torsh-jax launch -n 2 --devices-per-process 4 examples/train_with_plan.py --plan hsdp

Under ``torsh-jax launch`` (or torchrun/SLURM/mpirun) ``initialize()`` joins the
processes; run alone it uses simulated CPU devices.

With ``--checkpoint-dir DIR`` the loop saves every ``--save-every`` steps
(asynchronously) and, when DIR already holds a complete checkpoint, resumes
from it. That makes the script restartable by the launcher, also on fewer
processes (the plan is re-resolved for the devices present and the saved
global batch kept):

    torsh-jax launch -n 2 --devices-per-process 4 --max-restarts 1 --min-processes 1 \\
        examples/train_with_plan.py --plan zero3 --steps 20 --checkpoint-dir /tmp/run --save-every 5
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import optax

import torsh_jax as tj
from torsh_jax.checkpoint import Checkpointer, continue_plan, list_checkpoints, restore
from torsh_jax.demo.model import LMConfig, init_params, layered_model, synthetic_tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="zero3")
    parser.add_argument("--steps", type=int, default=20, help="total optimizer steps")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices when run alone")
    parser.add_argument("--checkpoint-dir", default=None, help="save here; resume when it holds a step")
    parser.add_argument("--save-every", type=int, default=5, help="steps between checkpoints [5]")
    parser.add_argument("--log-every", type=int, default=5, help="steps between printed lines [5]")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks [4]")
    return parser.parse_args()


def has_checkpoint(directory: str | None) -> bool:
    """Whether ``directory`` holds a complete checkpoint to resume from."""
    if directory is None or not Path(directory).is_dir():
        return False
    return any(entry["complete"] for entry in list_checkpoints(directory))


def main() -> None:
    args = parse_args()
    env = tj.detect_environment()
    if env.is_multi_process:
        tj.initialize()
    else:
        jax.config.update("jax_num_cpu_devices", args.devices)

    plan = tj.load_plan(args.plan)
    resuming = has_checkpoint(args.checkpoint_dir)
    if resuming:  # perhaps on fewer devices than the run that saved: keep its global batch
        plan = continue_plan(args.checkpoint_dir, plan, num_devices=jax.device_count())
    mesh = tj.build_mesh(plan)
    cfg = LMConfig(layers=args.layers)
    optimizer = tj.build_optimizer(plan.optimizer) if plan.optimizer else optax.adamw(3e-3)
    params = init_params(cfg, jax.random.key(0))
    train = tj.make_train_step(layered_model(cfg), optimizer, plan, mesh, params)
    state, first = train.init(params), 0
    if resuming:
        restored = restore(args.checkpoint_dir, train, fallback=True)
        state, first = restored.state, restored.step
    saver = Checkpointer(args.checkpoint_dir, keep_last=2) if args.checkpoint_dir else None
    talk = jax.process_index() == 0
    if talk and resuming:
        roles, steps = tj.compose(plan, mesh.shape).describe(), plan.batch.accumulation_steps
        how = f"{roles}, {steps} accumulation step(s)"
        print(f"resumed at step {first} on {jax.device_count()} devices ({how})", flush=True)
    for i in range(first, args.steps):
        state, metrics = train.step(state, synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=i))
        if talk and (i % args.log_every == 0 or i == args.steps - 1):
            loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
            print(f"step {i:4d}  loss {loss:.4f}  grad norm {norm:.3f}", flush=True)
        if saver and ((i + 1) % args.save_every == 0 or i + 1 == args.steps):
            saver.save(state, plan=plan, data_position={"next_step": i + 1})
    if saver:
        saver.close()  # waits for the last asynchronous save


if __name__ == "__main__":
    main()
