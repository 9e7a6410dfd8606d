"""Compile for accelerators this machine does not have: TPU pods and GPU nodes, as users name them.

A target is ``v5e-16`` (16 TPU v5e chips), ``v4-32`` (32 TensorCores), ``h100-16`` (two 8-GPU
nodes), ... (:mod:`~torsh_jax.targets.catalog`); its devices are compile-only devices of JAX's
deviceless topologies (:mod:`~torsh_jax.targets.devices`), and a train step built over them
compiles with the target's compiler and reports memory fit and a roofline bound
(:mod:`~torsh_jax.targets.report`). libtpu's environment: :mod:`~torsh_jax.targets.libtpu_env`.
The catalog and the environment load without JAX; the rest import it on first use.

Example:
    >>> from torsh_jax.targets import parse_target
    >>> parse_target("v5e-16", slices=2).devices
    32
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CHIPS": "torsh_jax.targets.catalog",
    "FAMILIES": "torsh_jax.targets.catalog",
    "Chip": "torsh_jax.targets.catalog",
    "Target": "torsh_jax.targets.catalog",
    "parse_target": "torsh_jax.targets.catalog",
    "target_names": "torsh_jax.targets.catalog",
    "TPU_OVERLAP_FLAGS": "torsh_jax.targets.libtpu_env",
    "tpu_init_args": "torsh_jax.targets.libtpu_env",
    "missing_compiler": "torsh_jax.targets.devices",
    "target_devices": "torsh_jax.targets.devices",
    "TargetReport": "torsh_jax.targets.report",
    "compile_for_target": "torsh_jax.targets.report",
    "parse_out_of_memory": "torsh_jax.targets.report",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.targets", _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.targets.catalog import CHIPS, FAMILIES, Chip, Target, parse_target, target_names
    from torsh_jax.targets.devices import missing_compiler, target_devices
    from torsh_jax.targets.libtpu_env import TPU_OVERLAP_FLAGS, tpu_init_args
    from torsh_jax.targets.report import TargetReport, compile_for_target, parse_out_of_memory
