"""What the run log costs: the demo's step with and without ``RunLog.begin``/``end``, alternating.

The same compiled step runs in pairs, one step logged and one not, the order swapped every pair;
each time covers the step, reading its loss (as the demo does) and, when logged, writing its
record (one flushed JSON line). With TensorBoard scalars (``--tensorboard``) the writer's calls
are included.

Prints one JSON object: ``runlog_overhead`` with ``ratio`` = median logged / median plain step
time, ``paired_ratio`` = median of the pairs' ratios, ``log_call_share`` = median time of the
logging calls alone / median plain step time (target < 0.02), and the medians.

Usage:
    python benchmarks/bench_runlog.py [--devices 8] [--steps 60] [--layers 2] [--quick] [--tensorboard]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import common

TARGET_SHARE = 0.02


def _timed(step, state, batch, log=None, index: int = 0):
    """``(state, seconds, seconds of the logging calls)`` of one step."""
    start = time.perf_counter()
    if log is not None:
        log.begin(index)
    state, metrics = step(state, batch)
    float(metrics["loss"])
    logging_start = time.perf_counter()
    if log is not None:
        log.end(index, metrics, step_time_s=logging_start - start)
    end = time.perf_counter()
    return state, end - start, end - logging_start if log is not None else 0.0


def main() -> None:
    tensorboard = "--tensorboard" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--tensorboard"]
    args = common.parse_args(__doc__.splitlines()[0], default_steps=60, default_layers=2)
    common.setup_devices(args.devices)

    import jax

    from torsh_jax.demo.model import LMConfig, init_params, layered_model, synthetic_tokens
    from torsh_jax.optim import build_optimizer
    from torsh_jax.plan import load_plan
    from torsh_jax.runlog import RunLog
    from torsh_jax.runtime.mesh import build_mesh
    from torsh_jax.runtime.step import make_train_step

    steps, layers = (8, 1) if args.quick else (args.steps, args.layers)
    plan, cfg = load_plan("ddp"), LMConfig(layers=layers)
    params = init_params(cfg, jax.random.key(0))
    train = make_train_step(
        layered_model(cfg), build_optimizer(plan.optimizer), plan, build_mesh(plan), params
    )
    state = train.init(params)
    batch = synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    for _ in range(2):  # compile and warm up
        state, _, _ = _timed(train.step, state, batch)
    plain, logged, calls = [], [], []
    with tempfile.TemporaryDirectory() as directory:
        log = RunLog.for_step(
            directory,
            train,
            state,
            batch,
            tokens_per_step=train.global_batch_size * cfg.seq_len,
            tensorboard=tensorboard,
        )
        for i in range(steps):
            for with_log in (i % 2 == 0, i % 2 == 1):
                state, seconds, call = _timed(train.step, state, batch, log if with_log else None, i + 1)
                (logged if with_log else plain).append(seconds)
                calls += [call] if with_log else []
        log.close()
    plain_median = statistics.median(plain)
    common.emit(
        {
            "name": "runlog_overhead",
            "ratio": statistics.median(logged) / plain_median,
            "paired_ratio": statistics.median(a / b for a, b in zip(logged, plain)),
            "log_call_share": statistics.median(calls) / plain_median,
            "target": TARGET_SHARE,
            "plain_median_s": plain_median,
            "logged_median_s": statistics.median(logged),
            "log_call_median_s": statistics.median(calls),
            "steps": steps,
            "tensorboard": tensorboard,
            "plan": "ddp",
            "devices": args.devices,
            "layers": layers,
        }
    )


if __name__ == "__main__":
    main()
