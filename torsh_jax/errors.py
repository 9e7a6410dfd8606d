"""Typed errors raised by torsh_jax.

Every error says what is wrong, where (config key path, parameter path or
mesh shape) and how to fix it. All inherit from :class:`TorshError`, so a
caller can catch one type.

Example:
    >>> from torsh_jax.errors import PlanError
    >>> err = PlanError("must be >= 1", key="batch.micro_batch_size", fix="use 8")
    >>> str(err)
    'batch.micro_batch_size: must be >= 1. Fix: use 8'
"""

from __future__ import annotations

__all__ = [
    "TorshError",
    "PlanError",
    "PresetNotFoundError",
    "MeshError",
    "ShardingError",
    "NotSupportedYetError",
    "TranslationError",
    "DistributedError",
    "CompressionError",
    "CheckpointError",
    "CheckpointUnreadableError",
    "ParameterError",
    "DeviceMemoryError",
    "ArgumentError",
    "TargetError",
    "ModelStructureError",
    "RunLogError",
    "OutputError",
    "PrecisionWarning",
    "BusyHostWarning",
]


class TorshError(Exception):
    """Base of all torsh_jax errors.

    Args:
        message: what is wrong.
        key: where: a config key path (``zero_optimization.stage``), a
            parameter path (``layers/wq``) or another locator.
        fix: how to fix it, phrased as an instruction.
    """

    def __init__(self, message: str, *, key: str | None = None, fix: str | None = None):
        self.message = message
        self.key = key
        self.fix = fix
        super().__init__(self._render())

    def reword(self, *, message: str | None = None, key: str | None = None, fix: str | None = None) -> None:
        """Replace this error's message, key or fix (``None`` keeps it); ``str(err)`` follows.

        Example:
            >>> err = TorshError("must be positive", key="steps")
            >>> err.reword(key="--steps")
            >>> str(err)
            '--steps: must be positive'
        """
        TorshError.__init__(
            self,
            self.message if message is None else message,
            key=self.key if key is None else key,
            fix=self.fix if fix is None else fix,
        )

    def _render(self) -> str:
        text = f"{self.key}: {self.message}" if self.key else self.message
        if self.fix:
            text += f". Fix: {self.fix}"
        return text


class PlanError(TorshError, ValueError):
    """A plan (TOML/JSON or dataclass fields) is invalid."""


class PresetNotFoundError(TorshError, FileNotFoundError):
    """A preset name or path does not exist."""


class MeshError(TorshError, ValueError):
    """The plan's mesh does not fit the available devices."""


class ShardingError(TorshError, ValueError):
    """A parameter or batch cannot be sharded as the plan asks."""


class NotSupportedYetError(TorshError, NotImplementedError):
    """A valid plan asks for something this version cannot run yet."""


class TranslationError(TorshError, ValueError):
    """A foreign config (DeepSpeed, Horovod, env, FSDP) cannot be translated."""


class DistributedError(TorshError, RuntimeError):
    """Multi-process start-up failed or is misconfigured."""


class CompressionError(TorshError, ValueError):
    """A compressor is misconfigured or given an unsupported input."""


class CheckpointError(TorshError, RuntimeError):
    """A checkpoint cannot be saved or restored for this plan."""


class CheckpointUnreadableError(CheckpointError):
    """A checkpoint step's files are damaged or missing (an earlier complete step may still restore)."""


class ParameterError(TorshError, TypeError):
    """A parameter tree holds something a train step cannot train (names the parameter path)."""


class ArgumentError(TorshError, TypeError):
    """A train step is called with what it cannot use: a state made by another plan's or optimizer's
    step, a loss that does not return a scalar (names what was passed and what was expected)."""


class DeviceMemoryError(TorshError, ValueError):
    """A train step needs more memory per device than a device has (the figures, the limit, a fix)."""


class TargetError(TorshError, ValueError):
    """An accelerator target is unknown, or the compiler for it is not installed."""


class ModelStructureError(TorshError, ValueError):
    """A model does not split into embedding, repeated blocks and head (names the submodule that
    broke the pattern)."""


class RunLogError(TorshError, ValueError):
    """A run directory cannot be written or read, or a run-log option is malformed (``--profile``)."""


class OutputError(TorshError, OSError):
    """A file a command was asked to write (``-o``) cannot be written there."""


class PrecisionWarning(UserWarning):
    """A value changes dtype because of the plan's precision policy."""


class BusyHostWarning(UserWarning):
    """Other work took a share of the host while it was being measured (``torsh-jax calibrate``):
    the figures may be slower than the host is."""
