"""The demo's run log (``torsh-jax demo --log-dir DIR``): a :class:`~torsh_jax.runlog.RunLog` of its step.

The step's FLOPs are the compiled program's (``cost_analysis``) when it has no while loop, else
the demo model's formula (:meth:`~torsh_jax.planner.shape.ModelShape.train_flops_per_token`, no
recomputation) times the tokens of a step.

Example:
    >>> import jax
    >>> from torsh_jax.demo.model import init_params
    >>> cfg = LMConfig(layers=1)
    >>> shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    >>> f"{model_flops_per_step(cfg, shapes, 1000) / 1e9:.2f} GFLOP"
    '0.42 GFLOP'
"""

from __future__ import annotations

from typing import Any

from torsh_jax.demo.model import LMConfig, param_count
from torsh_jax.runlog.flops import peak_flops, step_flops
from torsh_jax.runlog.log import RunLog, describe_devices, machine_file
from torsh_jax.runlog.profile import hlo_module_name

__all__ = ["demo_run_log", "model_flops_per_step", "MODEL_FLOPS_SOURCE"]

MODEL_FLOPS_SOURCE = (
    "model: 3 x (2 N + 4 layers seq_len d_model) per token (Chowdhery et al. 2022, PaLM, appendix B; "
    "no recomputation) x tokens"
)


def model_flops_per_step(cfg: LMConfig, shapes: Any, tokens: int) -> float:
    """3 x the forward pass's ``2 N + 4 layers seq_len d_model`` per token, ``N`` the blocks' and the
    head projection's parameters (the count of
    :meth:`~torsh_jax.planner.shape.ModelShape.train_flops_per_token` without recomputation)."""
    matmul = param_count(shapes["layers"]) + cfg.vocab * cfg.d_model
    forward = 2 * matmul + 4 * cfg.layers * cfg.seq_len * cfg.d_model
    return 3.0 * forward * tokens


def demo_run_log(
    config, train, compiled, summary: dict, *, cfg: LMConfig, shapes: Any, continues: int | None = None
) -> RunLog:
    """The run log of the demo's ``train`` step (``compiled``, its ``inspect`` ``summary``); resumed at
    step ``continues``, it keeps the earlier run's steps up to it."""
    devices = list(train.mesh.devices.flat)
    tokens = train.global_batch_size * cfg.seq_len
    flops = step_flops(
        compiled,
        devices=len(devices),
        model_flops_per_step=model_flops_per_step(cfg, shapes, tokens),
        model_source=MODEL_FLOPS_SOURCE,
    )
    header = describe_devices(devices, train.mesh) | {
        "command": "demo",
        "hlo_module": hlo_module_name(compiled),
        "plan": train.plan.name,
        "model": {"d_model": cfg.d_model, "layers": cfg.layers, "vocab": cfg.vocab, "seq_len": cfg.seq_len},
        "global_batch_size": train.global_batch_size,
        "steps_planned": config.steps,
    }
    machine = machine_file(config.machine, key="--machine") if config.machine else None
    return RunLog(
        config.log_dir,
        header=header,
        flops=flops,
        peak=peak_flops(devices),
        devices=len(devices),
        tokens_per_step=tokens,
        plan=train.plan,
        inspect=summary,
        profile=config.profile,
        tensorboard=config.tensorboard,
        machine=machine,
        continues=continues,
    )
