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
    "TargetError": "torsh_jax.errors",
    "ModelStructureError": "torsh_jax.errors",
    "RunLogError": "torsh_jax.errors",
    "PrecisionWarning": "torsh_jax.errors",
    "BusyHostWarning": "torsh_jax.errors",
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
    "StepPlan": "torsh_jax.runtime.decide",
    "decide": "torsh_jax.runtime.decide",
    "LayeredModel": "torsh_jax.runtime.layered",
    "from_linen": "torsh_jax.models.linen",
    "from_nnx": "torsh_jax.models.nnx",
    "from_scan": "torsh_jax.models.scanned",
    "FlaxLayers": "torsh_jax.models.blocks",
    "make_train_step": "torsh_jax.runtime.step",
    "TrainStep": "torsh_jax.runtime.step",
    "TrainState": "torsh_jax.runtime.state",
    "make_reference_step": "torsh_jax.runtime.twin",
    "compare_with_twin": "torsh_jax.runtime.verify",
    "record_gradients": "torsh_jax.runtime.verify",
    "inspect_step": "torsh_jax.runtime.inspect",
    # targets (compile for accelerators this machine does not have)
    "target_devices": "torsh_jax.targets",
    "compile_for_target": "torsh_jax.targets",
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
    # run logs
    "RunLog": "torsh_jax.runlog.log",
    "read_run": "torsh_jax.runlog.read",
    "findings": "torsh_jax.runlog.findings",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("torsh_jax", _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover - what a type checker sees; at run time __getattr__ loads lazily
    from torsh_jax.analysis import collectives, memory_report, render_text, summarize
    from torsh_jax.compress import make_compressor
    from torsh_jax.distributed import ProcessEnv, detect_environment, global_batch_from_local, initialize
    from torsh_jax.errors import (
        ArgumentError,
        BusyHostWarning,
        CheckpointError,
        CheckpointUnreadableError,
        CompressionError,
        DeviceMemoryError,
        DistributedError,
        MeshError,
        ModelStructureError,
        NotSupportedYetError,
        ParameterError,
        PlanError,
        PrecisionWarning,
        PresetNotFoundError,
        RunLogError,
        ShardingError,
        TargetError,
        TorshError,
        TranslationError,
    )
    from torsh_jax.models.blocks import FlaxLayers
    from torsh_jax.models.linen import from_linen
    from torsh_jax.models.nnx import from_nnx
    from torsh_jax.models.scanned import from_scan
    from torsh_jax.optim import build_optimizer, build_schedule, loss_scaler
    from torsh_jax.plan import (
        AxisCompression,
        AxisSize,
        BatchSpec,
        CommunicationSpec,
        CompressorSpec,
        LossScaleSpec,
        MeshSpec,
        OptimizerSpec,
        ParallelPlan,
        PipelineSpec,
        PrecisionSpec,
        ScheduleSpec,
        TensorSpec,
        ZeroSpec,
        load_compressor,
        load_plan,
        plan_from_dict,
        plan_from_toml,
        plan_to_dict,
        plan_to_toml,
        save_plan,
    )
    from torsh_jax.plan.roles import Roles, compose
    from torsh_jax.runlog.findings import findings
    from torsh_jax.runlog.log import RunLog
    from torsh_jax.runlog.read import read_run
    from torsh_jax.runtime.decide import StepPlan, decide
    from torsh_jax.runtime.inspect import inspect_step
    from torsh_jax.runtime.layered import LayeredModel
    from torsh_jax.runtime.layout import StateLayout, state_layout
    from torsh_jax.runtime.mesh import build_mesh
    from torsh_jax.runtime.specs import param_specs
    from torsh_jax.runtime.state import TrainState
    from torsh_jax.runtime.step import TrainStep, make_train_step
    from torsh_jax.runtime.twin import make_reference_step
    from torsh_jax.runtime.verify import compare_with_twin, record_gradients
    from torsh_jax.targets import compile_for_target, target_devices
    from torsh_jax.translate.deepspeed import translate_deepspeed
    from torsh_jax.translate.detect import translate_file
    from torsh_jax.translate.environment import translate_environment
    from torsh_jax.translate.horovod import translate_horovod
    from torsh_jax.translate.result import TranslationResult
    from torsh_jax.translate.torch_fsdp import translate_torch_fsdp
