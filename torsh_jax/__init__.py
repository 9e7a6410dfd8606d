"""torsh_jax: data-, fully-sharded-, tensor- and pipeline-parallel training on JAX.

The public API is re-exported here and loaded lazily, so that importing
``torsh_jax`` (or running ``torsh-jax translate``) does not import JAX.

Example:
    >>> import torsh_jax as tj
    >>> tj.load_plan("ddp").mesh.data.ici
    -1
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # errors
    "TorshError": "torsh_jax.errors",
    "PlanError": "torsh_jax.errors",
    "PresetNotFoundError": "torsh_jax.errors",
    "MeshError": "torsh_jax.errors",
    "ShardingError": "torsh_jax.errors",
    "NotSupportedYetError": "torsh_jax.errors",
    "TranslationError": "torsh_jax.errors",
    "DistributedError": "torsh_jax.errors",
    "CompressionError": "torsh_jax.errors",
    "CheckpointError": "torsh_jax.errors",
    "CheckpointUnreadableError": "torsh_jax.errors",
    "ParameterError": "torsh_jax.errors",
    "DeviceMemoryError": "torsh_jax.errors",
    "ArgumentError": "torsh_jax.errors",
    "PrecisionWarning": "torsh_jax.errors",
    # plans
    "ParallelPlan": "torsh_jax.plan",
    "MeshSpec": "torsh_jax.plan",
    "AxisSize": "torsh_jax.plan",
    "ZeroSpec": "torsh_jax.plan",
    "PrecisionSpec": "torsh_jax.plan",
    "LossScaleSpec": "torsh_jax.plan",
    "BatchSpec": "torsh_jax.plan",
    "CommunicationSpec": "torsh_jax.plan",
    "CompressorSpec": "torsh_jax.plan",
    "AxisCompression": "torsh_jax.plan",
    "PipelineSpec": "torsh_jax.plan",
    "TensorSpec": "torsh_jax.plan",
    "OptimizerSpec": "torsh_jax.plan",
    "ScheduleSpec": "torsh_jax.plan",
    "load_plan": "torsh_jax.plan",
    "save_plan": "torsh_jax.plan",
    "load_compressor": "torsh_jax.plan",
    "plan_from_dict": "torsh_jax.plan",
    "plan_to_dict": "torsh_jax.plan",
    "plan_from_toml": "torsh_jax.plan",
    "plan_to_toml": "torsh_jax.plan",
    # runtime
    "build_mesh": "torsh_jax.runtime.mesh",
    "param_specs": "torsh_jax.runtime.specs",
    "compose": "torsh_jax.plan.roles",
    "Roles": "torsh_jax.plan.roles",
    "state_layout": "torsh_jax.runtime.layout",
    "StateLayout": "torsh_jax.runtime.layout",
    "LayeredModel": "torsh_jax.runtime.layered",
    "make_train_step": "torsh_jax.runtime.step",
    "TrainStep": "torsh_jax.runtime.step",
    "TrainState": "torsh_jax.runtime.state",
    "make_reference_step": "torsh_jax.runtime.twin",
    "compare_with_twin": "torsh_jax.runtime.verify",
    "record_gradients": "torsh_jax.runtime.verify",
    "inspect_step": "torsh_jax.runtime.inspect",
    # optimizers
    "build_optimizer": "torsh_jax.optim",
    "build_schedule": "torsh_jax.optim",
    "loss_scaler": "torsh_jax.optim",
    # analysis
    "collectives": "torsh_jax.analysis",
    "memory_report": "torsh_jax.analysis",
    "summarize": "torsh_jax.analysis",
    "render_text": "torsh_jax.analysis",
    # compression
    "make_compressor": "torsh_jax.compress",
    # translation
    "translate_file": "torsh_jax.translate.detect",
    "translate_deepspeed": "torsh_jax.translate.deepspeed",
    "translate_horovod": "torsh_jax.translate.horovod",
    "translate_torch_fsdp": "torsh_jax.translate.torch_fsdp",
    "translate_environment": "torsh_jax.translate.environment",
    "TranslationResult": "torsh_jax.translate.result",
    # distributed
    "initialize": "torsh_jax.distributed",
    "detect_environment": "torsh_jax.distributed",
    "ProcessEnv": "torsh_jax.distributed",
    "global_batch_from_local": "torsh_jax.distributed",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("torsh_jax", _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.errors import *  # noqa: F403
    from torsh_jax.plan import *  # noqa: F403
