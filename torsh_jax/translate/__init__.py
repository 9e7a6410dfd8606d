"""Translate DeepSpeed, Horovod, PyTorch FSDP configs and launcher environments into plans (no JAX import).

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.translate import translate_deepspeed
    >>> config = {"train_batch_size": 16, "zero_optimization": {"stage": 2}}
    >>> translate_deepspeed(config, world_size=8).plan.zero.stage
    2
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "translate_file": "torsh_jax.translate.detect",
    "detect_kind": "torsh_jax.translate.detect",
    "translate_deepspeed": "torsh_jax.translate.deepspeed",
    "load_deepspeed_config": "torsh_jax.translate.deepspeed",
    "translate_horovod": "torsh_jax.translate.horovod",
    "translate_torch_fsdp": "torsh_jax.translate.torch_fsdp",
    "translate_environment": "torsh_jax.translate.environment",
    "Note": "torsh_jax.translate.result",
    "TranslationResult": "torsh_jax.translate.result",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.translate", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.translate.deepspeed import load_deepspeed_config, translate_deepspeed
    from torsh_jax.translate.detect import detect_kind, translate_file
    from torsh_jax.translate.environment import translate_environment
    from torsh_jax.translate.horovod import translate_horovod
    from torsh_jax.translate.result import Note, TranslationResult
    from torsh_jax.translate.torch_fsdp import translate_torch_fsdp
