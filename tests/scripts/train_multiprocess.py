"""Train the demo language model for a few steps on a plan's mesh; write the losses as JSON.

Run by tests/test_multiprocess_train.py both under
``torsh-jax launch -n 2 --devices-per-process 2`` and as one process with
``--devices 4``; the losses of both runs must agree.

Every process builds the same parameters (same PRNG key) and the mesh over all
global devices. By default every process generates the same global batch and
the train step places it; with ``--local-batches`` each process generates only
its own rows and assembles the global arrays with ``global_batch_from_local``.
Process 0 writes ``{"losses", "grad_norms", "mesh", "mesh_processes",
"process_count", "devices", ...}`` to ``--out``; process ``k > 0`` writes the
same to ``OUT.rank{k}`` so a test can check that every process saw the same
values. ``mesh_processes`` is the owning process of every mesh position.
With ``--checkpoint-dir`` the run saves its state after its last step
(``--stop-after K`` trains only steps ``0..K-1``); with ``--resume`` it
restores the newest checkpoint there first and trains the remaining steps,
keeping the saved global batch when fewer processes are left
(``launch --min-processes``).

Example:
    $ python tests/scripts/train_multiprocess.py --plan ddp --steps 3 --devices 4 --out /tmp/ref.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np

from torsh_jax.distributed import global_batch_from_local, initialize, local_batch_slice
from torsh_jax.distributed.launcher import RESTART_VAR


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="plan preset name or path (e.g. ddp, zero3, hsdp)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--out", type=Path, required=True, help="JSON file process 0 writes")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument(
        "--devices", type=int, default=None, help="simulated CPU devices (default: the launcher's count)"
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="save here (--resume: restore)")
    parser.add_argument("--stop-after", type=int, default=None, help="train only this many steps, then save")
    parser.add_argument(
        "--resume", action="store_true", help="restore the newest checkpoint (if any), then train"
    )
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    parser.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="rank 1 of attempt 0 SIGKILLs itself after this step, once earlier saves are complete",
    )
    parser.add_argument(
        "--local-batches",
        action="store_true",
        help="each process loads only its rows; global arrays come from global_batch_from_local",
    )
    return parser.parse_args()


def model_config(layers: int):
    from torsh_jax.demo.model import LMConfig

    return LMConfig(vocab=64, d_model=32, heads=2, head_dim=16, mlp=64, layers=layers, seq_len=16)


def local_rows(batch: dict, *, process_index: int, process_count: int) -> dict:
    """This process's contiguous share of a global numpy batch."""
    rows = local_batch_slice(len(batch["inputs"]), process_index=process_index, process_count=process_count)
    return {name: value[rows] for name, value in batch.items()}


def resume(args: argparse.Namespace, train, state):
    """``(state, first step)`` from the newest complete checkpoint, or ``(state, 0)`` when there is none."""
    from torsh_jax.checkpoint import restore
    from torsh_jax.checkpoint.store import has_complete_step

    if not has_complete_step(args.checkpoint_dir):
        return state, 0
    restored = restore(args.checkpoint_dir, train)
    return restored.state, restored.step


def checkpointer(args: argparse.Namespace):
    """A saver when the run saves: ``--checkpoint-dir`` without ``--resume``, or with ``--save-every``."""
    from torsh_jax.checkpoint import Checkpointer

    if args.checkpoint_dir is None or (args.resume and not args.save_every):
        return None
    return Checkpointer(args.checkpoint_dir, keep_last=2)


def scalar(value) -> float:
    """A replicated (possibly multi-process) scalar as a Python float."""
    return float(np.asarray(value.addressable_data(0)))


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    env = initialize(num_cpu_devices=args.devices, timeout_s=60)

    import jax
    import optax

    from torsh_jax.checkpoint import continue_plan
    from torsh_jax.checkpoint.store import has_complete_step
    from torsh_jax.demo.model import init_params, layered_model, synthetic_tokens
    from torsh_jax.plan import load_plan
    from torsh_jax.runtime.mesh import build_mesh
    from torsh_jax.runtime.step import make_train_step

    plan = load_plan(args.plan)
    if args.resume and has_complete_step(args.checkpoint_dir):  # perhaps on fewer processes: same batch
        plan = continue_plan(args.checkpoint_dir, plan, num_devices=jax.device_count())
    cfg = model_config(args.layers)
    mesh = build_mesh(plan, jax.devices())
    # One compiled program instead of many small eager ones; same values on every process.
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    train = make_train_step(layered_model(cfg), optax.adamw(1e-2), plan, mesh, params)
    state = train.init(params)
    state, start = resume(args, train, state) if args.resume else (state, 0)
    saver = checkpointer(args)

    losses, grad_norms, first_step_time = [], [], None
    stop = args.steps if args.stop_after is None else args.stop_after
    for step in range(start, stop):
        batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=step)
        if args.local_batches:
            mine = local_rows(batch, process_index=jax.process_index(), process_count=jax.process_count())
            batch = global_batch_from_local(mine, mesh=mesh, spec=train.batch_spec)
        state, metrics = train.step(state, batch)
        losses.append(scalar(metrics["loss"]))
        grad_norms.append(scalar(metrics["grad_norm"]))
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
        first_step_time = first_step_time or time.time()
        if args.kill_at == step and env.process_id == 1 and os.environ.get(RESTART_VAR) == "0":
            if saver:
                saver.wait()  # the previous step's checkpoint is complete: the restart resumes here
            Path(f"{args.out}.killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # a process lost mid-run, before saving this step
        if saver and (step + 1 == stop or (args.save_every and (step + 1) % args.save_every == 0)):
            saver.save(state, plan=plan, data_position={"next_step": step + 1})
    if saver:
        saver.close()

    result = {
        "start_step": start,
        "first_step_time": first_step_time,
        "restart": int(os.environ.get(RESTART_VAR, "0")),
        "plan": args.plan,
        "losses": losses,
        "grad_norms": grad_norms,
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "batch": [plan.batch.micro_batch_size, plan.batch.accumulation_steps, train.global_batch_size],
        "mesh_processes": np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_batches": args.local_batches,
        "traces": train.traces,
    }
    out = args.out if env.process_id == 0 else args.out.with_name(f"{args.out.name}.rank{env.process_id}")
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
