"""Checkpoint cost: how long an asynchronous save blocks training, restore throughput, crash safety.

The state of a ZeRO-3 train step (preset ``zero3``, 8 simulated CPU devices;
``--megabytes`` MB of float32 parameters, optimizer ``optax.sgd`` so the
parameters are the state) is saved with :class:`torsh_jax.checkpoint.Checkpointer`
and restored into the same train step with :func:`torsh_jax.checkpoint.restore`:

* ``checkpoint_save_blocking``: ``ratio`` = seconds the ``save`` call blocks
  with ``asynchronous=True`` / seconds of a synchronous save of the same state
  (target <= 0.25), medians over ``--repeats`` alternating rounds;
* ``checkpoint_restore_throughput``: ``ratio`` = restore MB/s / MB/s of a plain
  copy of the same step directory (``shutil.copytree``) in the same run;
* ``checkpoint_crash_safety`` (``--crashes N``, default 20): a child process
  saves in a loop and is killed with SIGKILL at a random moment, N times; after
  every kill the newest complete step must restore (``restored`` counts them,
  ``ratio`` = restored / kills, target 1.0);
* ``checkpoint_recovery`` (not with ``--no-recovery`` or ``--quick``; its
  path is tested in tests/test_multiprocess_train.py): ``torsh-jax launch -n 2
  --max-restarts 1 --min-processes 1`` runs examples/train_with_plan.py with a
  checkpoint every step; rank 1 is killed with SIGKILL after step 3, the job
  continues on the one process left. ``recovery_s`` = seconds from the kill to
  the first resumed step (target < 60), ``ratio`` = that / the seconds from
  the launch to the first step of the same job (a cold start).

Usage:
    python benchmarks/bench_checkpoint.py [--megabytes 256] [--repeats 3] [--crashes 20] [--quick]
        [--no-recovery]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAVE_TARGET = 0.25


def _params(leaves: int, rows: int = 1024) -> dict:
    """``leaves`` random float32 ``[rows, 4096]`` arrays (random: constants would compress to nothing)."""
    import jax
    import jax.numpy as jnp

    return {f"w{i}": jax.random.normal(jax.random.key(i), (rows, 4096), jnp.float32) for i in range(leaves)}


def _child_params() -> dict:
    """What :func:`child` saves: 8 arrays of 1 MiB."""
    return _params(8, rows=64)


def _train_step(params):
    """A ZeRO-3 train step for ``params`` (or their shapes): its ``init`` and :func:`restore` give a
    state its real layout."""
    import jax.numpy as jnp
    import optax

    from torsh_jax import build_mesh, load_plan, make_train_step

    plan = load_plan("zero3")
    loss = lambda params, batch: sum(jnp.mean(w) for w in params.values()) * jnp.mean(batch)
    return make_train_step(loss, optax.sgd(1e-3), plan, build_mesh(plan), params)


def _state(megabytes: int):
    """``(train step, its state)`` with ``megabytes`` MB of parameters (16 MiB per array)."""
    params = _params(max(megabytes // 16, 1))
    train = _train_step(params)
    return train, train.init(params)


def child(directory: str) -> None:
    """Save an 8 MiB ZeRO-3 state to ``directory`` in a loop, one line per save, until killed."""
    import jax.numpy as jnp

    from torsh_jax.checkpoint import Checkpointer

    params = _child_params()
    train = _train_step(params)
    state = train.init(params)
    with Checkpointer(directory, keep_last=2) as saver:
        for step in range(10**6):
            saver.save(state._replace(step=jnp.int32(step)), plan=train.plan)
            print(step, flush=True)


def _save_seconds(state, plan, *, asynchronous: bool) -> tuple[float, float]:
    """``(seconds save() blocked, seconds until written)`` of one save into a fresh directory."""
    from torsh_jax.checkpoint import Checkpointer

    directory = tempfile.mkdtemp(prefix="bench_ckpt_")
    try:
        saver = Checkpointer(directory, asynchronous=asynchronous)
        start = time.perf_counter()
        saver.save(state, plan=plan)
        blocked = time.perf_counter() - start
        saver.close()
        return blocked, time.perf_counter() - start
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def save_row(train, state, repeats: int, megabytes: float) -> dict:
    plan = train.plan
    _save_seconds(state, plan, asynchronous=True)  # warm-up: handlers, thread pools
    rounds = []
    for _ in range(repeats):
        sync = _save_seconds(state, plan, asynchronous=False)[1]
        blocked, written = _save_seconds(state, plan, asynchronous=True)
        rounds.append((blocked, written, sync))
    blocked = statistics.median(r[0] for r in rounds)
    sync = statistics.median(r[2] for r in rounds)
    return {
        "name": "checkpoint_save_blocking",
        "ratio": blocked / sync,
        "target": SAVE_TARGET,
        "async_blocked_s": blocked,
        "async_written_s": statistics.median(r[1] for r in rounds),
        "sync_save_s": sync,
        "state_megabytes": megabytes,
        "rounds": repeats,
    }


def restore_row(train, state, megabytes: float) -> dict:
    import jax

    from torsh_jax.checkpoint import Checkpointer, restore

    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        with Checkpointer(root / "ckpt") as saver:
            saver.save(state, plan=train.plan)
        step_dir = root / "ckpt" / str(int(state.step))
        start = time.perf_counter()
        shutil.copytree(step_dir, root / "copy")
        copy_s = time.perf_counter() - start
        start = time.perf_counter()
        restored = restore(root / "ckpt", train)
        jax.block_until_ready(restored.state)
        restore_s = time.perf_counter() - start
        on_disk = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()) / 1e6
        return {
            "name": "checkpoint_restore_throughput",
            "ratio": (megabytes / restore_s) / (on_disk / copy_s),
            "restore_mb_per_s": megabytes / restore_s,
            "copy_mb_per_s": on_disk / copy_s,
            "restore_s": restore_s,
            "copy_s": copy_s,
            "state_megabytes": megabytes,
            "megabytes_on_disk": on_disk,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def crash_row(kills: int) -> dict:
    """Kill a saving child with SIGKILL ``kills`` times; restore the newest complete step after each."""
    import jax

    from torsh_jax.checkpoint import restore

    train = _train_step(jax.eval_shape(_child_params))  # the layout of what the child saves
    root = Path(tempfile.mkdtemp(prefix="bench_crash_"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    rng = random.Random(0)
    restored, steps = 0, []
    try:
        for _ in range(kills):
            argv = [sys.executable, __file__, "--child", str(root)]
            child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
            child.stdout.readline()  # the first save has started
            time.sleep(rng.uniform(0.0, 1.0))
            child.kill()
            child.wait()
            result = restore(root, train, fallback=True)
            jax.block_until_ready(result.state)
            restored += 1
            steps.append(result.step)
        return {"name": "checkpoint_crash_safety", "ratio": restored / kills, "target": 1.0,
                "kills": kills, "restored": restored, "restored_steps": steps}  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


REPO = Path(__file__).resolve().parents[1]
RECOVERY_TARGET_S = 60.0


def _pid_of_rank(rank: int, marker: str) -> int:
    """The process of the first attempt's ``rank`` whose command line contains ``marker`` (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in cmdline and f"TORSH_JAX_PROCESS_ID={rank}".encode() in environ:
            if b"TORSH_JAX_RESTART=0" in environ:
                return int(entry.name)
    raise RuntimeError(f"no process of rank {rank} running {marker}")


def recovery_row(kill_after: int = 3, steps: int = 6) -> dict:
    """Kill rank 1 of a 2-process job after ``kill_after`` steps; time the restart on 1 process."""
    root = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    script = [str(REPO / "examples" / "train_with_plan.py"), "--plan", "zero3", "--steps", str(steps),
              "--checkpoint-dir", str(root), "--save-every", "1", "--log-every", "1"]  # fmt: skip
    launch = [sys.executable, "-m", "torsh_jax.cli.main", "launch", "-n", "2", "--devices-per-process", "2",
              "--max-restarts", "1", "--min-processes", "1", "--timeout", "600", *script]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    started = time.monotonic()
    job = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    times: dict[str, float] = {}
    try:
        for line in job.stdout:
            now = time.monotonic()
            if line.startswith("[rank 0] step") and "cold" not in times:
                times["cold"] = now - started
            if line.startswith(f"[rank 0] step {kill_after - 1:4d}") and "kill" not in times:
                os.kill(_pid_of_rank(1, str(root)), 9)
                times["kill"] = now
            if line.startswith("[rank 0] resumed at step"):
                times["resumed_step"] = int(line.split()[5])
            elif "resumed_step" in times and line.startswith("[rank 0] step") and "resumed" not in times:
                times["resumed"] = now
        code = job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
        shutil.rmtree(root, ignore_errors=True)
    recovery = times["resumed"] - times["kill"]
    return {"name": "checkpoint_recovery", "ratio": recovery / times["cold"], "recovery_s": recovery,
            "target_s": RECOVERY_TARGET_S, "cold_start_s": times["cold"], "exit_code": code,
            "killed_after_step": kill_after, "resumed_at_step": times["resumed_step"],
            "processes": "2 -> 1"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256, help="state size [256]")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of sync/async saves [3]")
    parser.add_argument("--crashes", type=int, default=20, help="SIGKILLs during saves [20]")
    parser.add_argument(
        "--quick", action="store_true", help="32 MB, 1 round, 2 kills, no recovery row (a smoke run)"
    )
    parser.add_argument("--no-recovery", action="store_true", help="skip the 2-process kill-and-restart row")
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)  # crash_row's saving process
    args = parser.parse_args()
    if args.quick:
        args.megabytes, args.repeats, args.crashes, args.no_recovery = 32, 1, 2, True
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if args.child:
        return child(args.child)
    train, state = _state(args.megabytes)
    megabytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) / 1e6
    for row in (save_row(train, state, args.repeats, megabytes), restore_row(train, state, megabytes)):
        print(json.dumps(row), flush=True)
    if args.crashes:
        print(json.dumps(crash_row(args.crashes)), flush=True)
    if not args.no_recovery:
        print(json.dumps(recovery_row()), flush=True)


if __name__ == "__main__":
    main()
