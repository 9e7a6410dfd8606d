"""Compile for accelerators this machine does not have: TPU pods and GPU nodes, as users name them.

A target is ``v5e-16`` (16 TPU v5e chips), ``v4-32`` (32 TensorCores), ``h100-16`` (two 8-GPU
nodes), ... (:mod:`~torsh_jax.targets.catalog`); its devices are compile-only devices of JAX's
deviceless topologies (:mod:`~torsh_jax.targets.devices`), and a train step built over them
compiles with the target's compiler and reports memory fit and a roofline bound
(:mod:`~torsh_jax.targets.report`).

Example:
    >>> parse_target("v5e-16", slices=2).devices
    32
"""

from torsh_jax.targets.catalog import CHIPS, FAMILIES, Chip, Target, parse_target, target_names
from torsh_jax.targets.devices import TPU_OVERLAP_FLAGS, missing_compiler, target_devices, tpu_init_args
from torsh_jax.targets.report import TargetReport, compile_for_target, parse_out_of_memory

__all__ = [
    "CHIPS",
    "TPU_OVERLAP_FLAGS",
    "FAMILIES",
    "Chip",
    "Target",
    "TargetReport",
    "compile_for_target",
    "missing_compiler",
    "parse_out_of_memory",
    "parse_target",
    "target_devices",
    "target_names",
    "tpu_init_args",
]
