"""The demo job: train the small transformer LM on synthetic tokens under a plan.

Prints a progress bar (or one JSON object per step) with loss, tokens/s,
per-device memory and bytes on the wire, and a final summary. With
``verify`` it also runs the single-device twin and the twin in float64 on the
same batches and reports the largest relative loss difference from the twin and
whether the run is within round-off of float64 (:mod:`torsh_jax.demo.verify`).

Example:
    >>> summary = run_demo(DemoConfig(plan="ddp", devices=1, steps=2, layers=1), emit=lambda r: None)
    >>> summary["steps"], summary["compiles"]
    (2, 1)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax

from torsh_jax.demo.devices import select_devices
from torsh_jax.demo.model import LMConfig, init_params, layered_model, loss_fn, param_count, synthetic_tokens
from torsh_jax.demo.verify import DemoTwins
from torsh_jax.errors import PlanError
from torsh_jax.optim import build_optimizer
from torsh_jax.plan.io import load_plan
from torsh_jax.plan.roles import compose
from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runlog.files import make_run_dir
from torsh_jax.runlog.log import machine_file
from torsh_jax.runlog.profile import ProfileWindow
from torsh_jax.runtime.fit import batch_like, check_step_fits
from torsh_jax.runtime.inspect import headline, inspect_step
from torsh_jax.runtime.mesh import build_mesh
from torsh_jax.runtime.pipeline import layer_chunks
from torsh_jax.runtime.step import abstract_step, make_train_step
from torsh_jax.tensor.axis import tensor_axis

__all__ = ["DemoConfig", "run_demo", "abstract_train_step"]


@dataclass(frozen=True)
class DemoConfig:
    """What ``torsh-jax demo`` runs.

    Args:
        plan: preset name, plan file, or a loaded plan.
        devices: devices to use (simulated on CPU); ``None`` = all.
        steps: optimizer steps.
        verify: also run the single-device twin and the twin in float64.
        seed: parameter and data seed.
        layers, d_model: model size; ``layers=None``: 4, rounded up to a
            multiple of the plan's pipeline chunks (stages x virtual stages),
            said in a phase message. Given layers are never changed: a count
            the chunks do not divide is a ``PlanError`` before compiling.
        checkpoint_dir: save checkpoints here (every ``save_every`` steps and
            at the last step).
        save_every: steps between checkpoints (0: only the last step).
        resume: continue from the newest complete checkpoint in
            ``checkpoint_dir`` (falling back to an older one if it cannot be
            read), on the batches the run would have seen; ``steps`` is the total.
        log_dir: write a run log here (:mod:`torsh_jax.runlog`): plan, ``inspect`` summary, one
            JSON line per step.
        profile: steps to trace with ``jax.profiler`` into ``log_dir`` (``"3:5"``).
        tensorboard: also write TensorBoard scalars into ``log_dir`` (needs ``tensorboardX``).
        machine: a machine file (``torsh-jax calibrate -o``) whose links model the communication
            time in the run log's findings when no profile measures it.
    """

    plan: str | ParallelPlan = "ddp"
    devices: int | None = 8
    steps: int = 20
    verify: bool = False
    seed: int = 0
    layers: int | None = None
    d_model: int = 64
    checkpoint_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    log_dir: str | None = None
    profile: str | None = None
    tensorboard: bool = False
    machine: str | None = None

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise PlanError(f"must be an integer >= 0, got {self.steps!r}", key="steps", fix="pass 0 or more")
        if (self.resume or self.save_every) and not self.checkpoint_dir:
            flag = "--resume" if self.resume else "--save-every"
            raise PlanError("needs a checkpoint directory", key=flag, fix="pass --checkpoint-dir DIR")
        if (self.profile or self.tensorboard or self.machine) and not self.log_dir:
            flag = "--profile" if self.profile else "--tensorboard" if self.tensorboard else "--machine"
            raise PlanError("needs a run directory", key=flag, fix="pass --log-dir DIR")
        if self.profile:
            window = ProfileWindow.parse(self.profile)
            if window.last > self.steps:
                raise PlanError(
                    f"steps {window.first} to {window.last} pass the run's last step, {self.steps}",
                    key="--profile",
                    fix=f"write {min(window.first, self.steps)}:{self.steps}, or raise --steps",
                )


def model_config(config: DemoConfig, mesh_shape: dict | None = None) -> LMConfig:
    """The demo model of ``config`` (for the plan's pipeline on ``mesh_shape``).

    Raises:
        PlanError: ``config.layers`` does not split into the pipeline's stages x
            virtual stages (checked before anything compiles; never rounded).
    """
    heads = max(config.d_model // 16, 1)
    return LMConfig(
        d_model=config.d_model,
        heads=heads,
        head_dim=config.d_model // heads,
        mlp=4 * config.d_model,
        layers=_layers(config, mesh_shape or {}),
    )


def abstract_train_step(
    plan: ParallelPlan, cfg: LMConfig, devices, /, *, num_slices: int | None = None, remat: bool = False
):
    """The demo model's train step under ``plan`` over ``devices`` (a target's compile-only devices
    too), built from parameter shapes (nothing is allocated), and a global batch of token shapes;
    ``remat``: each layer recomputed in the backward pass."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    model = layered_model(cfg, remat=remat, tp=tensor_axis(plan))
    example = synthetic_tokens(cfg, batch_size=1, seed=0)
    return abstract_step(model, shapes, example, plan, devices, num_slices=num_slices)


def _layers(config: DemoConfig, mesh_shape: dict) -> int:
    """``config.layers`` if the pipeline's chunks divide it; ``None``: 4 rounded up to a multiple of them."""
    plan = config.plan if isinstance(config.plan, ParallelPlan) else load_plan(config.plan)
    stages = mesh_shape.get("stage", 1)
    virtual = layer_chunks(plan, compose(plan, mesh_shape))
    chunks = stages * virtual
    if config.layers is None:
        return chunks * -(-4 // chunks)
    if config.layers % chunks:
        raise PlanError(
            f"{config.layers} layers do not split into the {stages} pipeline stages x {virtual} virtual "
            f"stages of plan {plan.name!r} (mesh {mesh_shape})",
            key="--layers",
            fix=f"pass --layers {chunks * -(-config.layers // chunks)} (a multiple of {chunks}), or omit "
            "--layers",
        )
    return config.layers


def run_demo(
    config: DemoConfig, *, emit: Callable[[dict], None], phase: Callable[[str], None] = lambda message: None
) -> dict:
    """Train; call ``phase`` before slow set-up work (devices, compiling), ``emit``
    with one record per step; return the summary record.

    With ``steps=0`` the step is built and compiled (its memory and wire bytes
    are in the summary) but nothing is trained: ``final_loss`` is ``None``.
    """
    plan = config.plan if isinstance(config.plan, ParallelPlan) else load_plan(config.plan)
    _check_checkpoint_dir(config)
    if config.machine:  # a bad file fails before anything compiles or is made
        machine_file(config.machine, key="--machine")
    if config.log_dir:
        make_run_dir(config.log_dir, key="--log-dir")
    phase(f"starting {config.devices or 'all'} devices")
    devices = select_devices(config.devices)
    plan = _plan_to_continue(config, plan, len(devices), phase)
    mesh = build_mesh(plan, devices)
    cfg = model_config(config, dict(mesh.shape))
    if config.layers is None and cfg.layers != 4:
        phase(f"{cfg.layers} layers: 4 rounded up to a multiple of the pipeline's stages x virtual stages "
              "(--layers chooses)")  # fmt: skip
    optimizer = build_optimizer(plan.optimizer)
    tp = tensor_axis(plan)
    shapes = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(config.seed))
    train = make_train_step(layered_model(cfg, tp=tp), optimizer, plan, mesh, shapes)
    check_step_fits(train, batch_like(synthetic_tokens(cfg, batch_size=1, seed=0), train.global_batch_size))
    phase("initialising the parameters")
    params = init_params(cfg, jax.random.key(config.seed))
    batch_of = lambda i: synthetic_tokens(
        cfg, batch_size=train.global_batch_size, seed=config.seed * 100003 + i
    )
    phase("compiling the train step")
    state = train.init(params)
    compiled = train.lower(state, batch_of(0)).compile()
    inspected = inspect_step(train, state, batch_of(0), compiled=compiled)
    report = headline(inspected)
    state, first_step = _resumed(config, train, state, phase)
    log = _run_log(config, train, compiled, inspected, cfg=cfg, shapes=shapes, continues=first_step or None)
    twins = _twins(config, loss_fn(cfg, tp=tp), optimizer, plan, params, state, resumed=first_step > 0)
    if twins and first_step < config.steps:
        phase("compiling the single-device twin and its float64 run")
        twins.compile(batch_of(first_step))
    saver = _saver(config)
    tokens = train.global_batch_size * cfg.seq_len
    loss = None
    try:
        for i in range(first_step, config.steps):
            batch = batch_of(i)
            if log:
                log.begin(i + 1)
            start = time.perf_counter()
            state, metrics = train.step(state, batch)
            loss = float(metrics["loss"])
            elapsed = time.perf_counter() - start
            if log:
                log.end(i + 1, metrics, step_time_s=elapsed)
            record = {"step": i + 1, "loss": loss, "step_time_s": elapsed, "tokens_per_s": tokens / elapsed}
            if twins:
                record["twin_loss"] = twins.step(batch, loss=loss)
            emit({**record, **report})
            if saver and _due(config, i + 1):
                saver.save(state, plan=plan, data_position={"next_step": i + 1, "seed": config.seed})
    finally:  # a step that raises (or Ctrl-C) still leaves a closed log and no running trace
        if log:
            log.close(final_loss=loss, compiles_of_step=train.traces)
    if saver:
        saver.close()  # waits for the last asynchronous save
    summary = {
        "summary": True,
        "plan": plan.name,
        "mesh": dict(mesh.shape),
        "devices": mesh.size,
        "steps": config.steps,
        "global_batch_size": train.global_batch_size,
        "param_count": param_count(params),
        "final_loss": loss,
        "compiles": train.traces,
        "resumed_from_step": first_step if config.resume else None,
        "checkpoint_steps": saver.steps if saver else None,
        "log_dir": config.log_dir,
        **report,
    }
    if twins:
        summary.update(twins.summary())
    return summary


def _plan_to_continue(config: DemoConfig, plan: ParallelPlan, num_devices: int, phase) -> ParallelPlan:
    """Resuming (possibly on another device count): ``plan`` with the saved run's global batch."""
    from torsh_jax.checkpoint import continue_plan
    from torsh_jax.checkpoint.store import has_complete_step

    if not (config.resume and has_complete_step(config.checkpoint_dir)):
        return plan
    continued = continue_plan(config.checkpoint_dir, plan, num_devices=num_devices)
    if continued.batch != plan.batch:
        b = continued.batch
        phase(f"keeping the saved global batch: micro batch {b.micro_batch_size} x "
              f"{b.accumulation_steps} accumulation steps on {num_devices} devices")  # fmt: skip
    return continued


def _resumed(config: DemoConfig, train, state, phase: Callable[[str], None]):
    """``(state, first step)``: the newest readable checkpoint with ``resume``, else ``(state, 0)``."""
    from torsh_jax.checkpoint import restore
    from torsh_jax.checkpoint.store import has_complete_step

    if not config.resume:
        return state, 0
    if not has_complete_step(config.checkpoint_dir):
        phase(f"no complete checkpoint in {config.checkpoint_dir}: starting at step 0")
        return state, 0
    restored = restore(config.checkpoint_dir, train, fallback=True)
    for note in restored.notes[len(restored.skipped) :]:  # a skipped step was logged, in one line
        phase(note)
    phase(f"resuming at step {restored.step} from {config.checkpoint_dir}")
    return restored.state, restored.step


def _twins(config: DemoConfig, loss, optimizer, plan, params, state, *, resumed: bool) -> DemoTwins | None:
    """With ``verify``: the twin and its float64 run, started from the parameters, or (resuming) from
    the restored state on one device."""
    if not config.verify:
        return None
    twins = DemoTwins(loss, optimizer, plan)
    twins.start(params, state if resumed else None)
    return twins


def _run_log(config: DemoConfig, train, compiled, inspected: dict, *, cfg, shapes, continues: int | None):
    """The run log with ``log_dir`` (else ``None``); resumed at step ``continues``, it keeps the
    earlier run's steps up to it."""
    from torsh_jax.demo.runlog import demo_run_log

    if not config.log_dir:
        return None
    return demo_run_log(config, train, compiled, inspected, cfg=cfg, shapes=shapes, continues=continues)


def _check_checkpoint_dir(config: DemoConfig) -> None:
    """A checkpoint directory that cannot be written fails here, before anything compiles."""
    from torsh_jax.checkpoint.store import require_writable_dir

    if config.checkpoint_dir:
        require_writable_dir(config.checkpoint_dir)


def _saver(config: DemoConfig):
    from torsh_jax.checkpoint import Checkpointer

    return Checkpointer(config.checkpoint_dir) if config.checkpoint_dir else None


def _due(config: DemoConfig, step: int) -> bool:
    """Save after ``step``: every ``save_every`` steps, and at the last step."""
    return step == config.steps or bool(config.save_every and step % config.save_every == 0)
