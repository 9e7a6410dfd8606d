"""Compile-only devices of a target, from JAX's deviceless topologies and the target's compiler.

``libtpu`` (``pip install "torsh-jax[tpu-aot]"``) compiles for TPUs; the CUDA plugin
(``torsh-jax[gpu-aot]``; no GPU, driver or CUDA libraries needed) for GPUs. A mesh over these
devices lowers and compiles real programs for the target; nothing runs on them.

Example:
    >>> (missing_compiler("v5e-8") or 'pip install "torsh-jax[tpu-aot]"').endswith('"torsh-jax[tpu-aot]"')
    True
    >>> devices = target_devices("v5e-8")  # doctest: +SKIP
    >>> len(devices), devices[0].device_kind  # doctest: +SKIP
    (8, 'TPU v5 lite')
"""

from __future__ import annotations

import importlib.util
import warnings
from importlib import resources

import jax
from jax.experimental import topologies

from torsh_jax.errors import TargetError
from torsh_jax.targets.catalog import TPU_HOST, Target, parse_target
from torsh_jax.targets.libtpu_env import quiet_for_target

__all__ = ["missing_compiler", "target_devices"]

#: Python module that brings each platform's compiler, and the extra that installs it.
_COMPILERS = {"tpu": ("libtpu", "tpu-aot"), "gpu": ("jax_plugins.xla_cuda12", "gpu-aot")}
#: libtpu's chip configuration: both TensorCores of a v4/v5p chip as one device (megacore), as
#: JAX shows them on the hardware; v5e and v6e chips have one TensorCore.
_CHIP_CONFIG = {"v4": "megacore", "v5p": "megacore"}


def missing_compiler(name: str, /) -> str | None:
    """What is missing to compile for target ``name`` (``None``: nothing).

    Example:
        >>> missing_compiler("v5e-16")  # doctest: +SKIP
        'the tpu compiler is not installed: pip install "torsh-jax[tpu-aot]"'
    """
    platform = parse_target(name).platform
    module, extra = _COMPILERS[platform]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is absent too
        found = False
    return None if found else f'the {platform} compiler is not installed: pip install "torsh-jax[{extra}]"'


#: What JAX warns when its persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) holds a
#: program compiled for compile-only devices: their client cannot load an executable, so the read
#: fails and the program is compiled again, which is all a target compile needs.
_COMPILE_ONLY_CACHE_READ = (
    r"Error reading persistent compilation cache entry .*PjRtCompiler must be constructed with a Client"
)


def _quiet_compilation_cache() -> None:
    """Silence :data:`_COMPILE_ONLY_CACHE_READ`, and it alone: a target compiled again (``plan
    --target`` run twice) would warn once per program, and nothing can be done about it."""
    warnings.filterwarnings("ignore", message=_COMPILE_ONLY_CACHE_READ, category=UserWarning)


def _gpu_config(file_name: str) -> str:
    return (resources.files("torsh_jax") / "gpu_targets" / file_name).read_text(encoding="utf-8")


def _topology(target: Target) -> topologies.TopologyDescription:
    if target.platform == "tpu":
        quiet_for_target(target.accelerator_type)
        return topologies.get_topology_desc(
            platform="tpu",
            topology_name=target.topology,
            chip_config_name=_CHIP_CONFIG.get(target.family, "default"),
            chips_per_host_bounds=TPU_HOST,
            num_slices=target.slices,
        )
    return topologies.get_topology_desc(
        platform="cuda", target_config=_gpu_config(target.gpu_config), topology=target.topology
    )


def target_devices(name: str | Target, /, *, slices: int = 1) -> list[jax.Device]:
    """Compile-only devices of ``slices`` copies of target ``name`` (TPU slices joined over DCN).

    Build a mesh over them (:func:`~torsh_jax.runtime.mesh.build_mesh`) and lower a step from
    ``abstract_state()``: the program is lowered and compiled for the target, on this machine.

    Raises:
        TargetError: an unknown target, or its compiler is not installed (says which extra brings it).
    """
    target = name if isinstance(name, Target) else parse_target(name, slices=slices)
    missing = missing_compiler(target.name)
    if missing is not None:
        raise TargetError(missing, key=f"target {target.name!r}", fix="install it, then start Python again")
    _quiet_compilation_cache()
    try:
        return list(_topology(target).devices)
    except NotImplementedError as err:  # the CUDA plugin refused to start without a GPU
        raise TargetError(
            f"the GPU compiler did not start: {err}",
            key=f"target {target.name!r}",
            fix="set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 and JAX_PLATFORMS=cpu before Python starts",
        ) from None
