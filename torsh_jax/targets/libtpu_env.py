"""libtpu's environment: its compiler flags, and what it looks up when it starts, given where a
host has no TPUs.

libtpu (``pip install "torsh-jax[tpu-aot]"``) starts at the first TPU topology of a target compile,
or earlier, when JAX's backend starts: with libtpu installed, JAX tries the TPU before the CPU. On
a TPU VM it reads the workers' host names and the accelerator type from the VM's metadata; on any
other host it prints warnings and an error trace before JAX goes on without it. It reads these
variables, and its flags (``LIBTPU_INIT_ARGS``), once per process, when it starts, so they are set
before: for a target compile (:func:`quiet_for_target`), and by the ``torsh-jax`` commands that
start JAX, on a host with no TPU chip (:func:`quiet_without_tpus`). A variable the environment
already sets keeps its value, and on a TPU VM only the flags are added.

Example:
    >>> env = {}
    >>> quiet_without_tpus(env, chips=0, installed=True)
    >>> env["TPU_WORKER_HOSTNAMES"], env["TPU_ACCELERATOR_TYPE"]
    ('localhost', 'v5litepod-8')
    >>> quiet_for_target("v4-32", env, chips=0)  # a target names its own type
    >>> env["TPU_ACCELERATOR_TYPE"]
    'v4-32'
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

__all__ = [
    "NO_TPU_ACCELERATOR",
    "TPU_OVERLAP_FLAGS",
    "quiet_for_target",
    "quiet_without_tpus",
    "tpu_init_args",
]

#: libtpu flags that let collectives run while the TensorCore computes: asynchronous all-gathers
#: and all-reduces (a reduce-scatter compiles to one) fused with the compute they overlap, and no
#: combining of all-reduces (a combined one stays synchronous). Flag names as MaxText's
#: ``benchmarks/xla_flags_library.py`` uses them; the effect measured in docs/targets.md.
TPU_OVERLAP_FLAGS = (
    "--xla_enable_async_all_gather=true",
    "--xla_enable_async_all_reduce=true",
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_jf_crs_combiner_threshold_count=1",
)

#: The accelerator type named on a host without TPUs, until a target names its own. Any valid type
#: will do: compiling needs none (a target's topology is passed whole), and targets of other
#: families compile the same after libtpu started under it (v4-8 and v6e-8 checked).
NO_TPU_ACCELERATOR = "v5litepod-8"
#: Set beside :data:`NO_TPU_ACCELERATOR` by :func:`quiet_without_tpus` (a type the user set stays).
_PLACEHOLDER_NAMED = "TORSH_JAX_TPU_ACCELERATOR_PLACEHOLDER"


def tpu_init_args(current: str = "", /) -> str:
    """``LIBTPU_INIT_ARGS`` with :data:`TPU_OVERLAP_FLAGS` added where ``current`` does not set them.

    Example:
        >>> tpu_init_args("--xla_enable_async_all_gather=false").split()[:2]
        ['--xla_enable_async_all_gather=false', '--xla_enable_async_all_reduce=true']
    """
    given = {flag.split("=", 1)[0] for flag in current.split()}
    return " ".join([*current.split(), *(f for f in TPU_OVERLAP_FLAGS if f.split("=", 1)[0] not in given)])


def quiet_for_target(
    accelerator_type: str, environ: MutableMapping[str, str] = os.environ, /, *, chips: int | None = None
) -> None:
    """Before a target's first TPU topology: :data:`TPU_OVERLAP_FLAGS` in ``LIBTPU_INIT_ARGS``;
    unless this host has TPU ``chips`` (looked up unless given), also this host as the only worker, several
    processes allowed to load libtpu (there are no chips to own: tests in parallel, a second tool)
    and the target's ``accelerator_type`` (in place of :data:`NO_TPU_ACCELERATOR` where
    :func:`quiet_without_tpus` named it)."""
    if tpu_chips() if chips is None else chips:  # a TPU VM: its own workers and type
        environ["LIBTPU_INIT_ARGS"] = tpu_init_args(environ.get("LIBTPU_INIT_ARGS", ""))
        return
    quiet_without_tpus(environ, chips=0, installed=True)
    if environ.pop(_PLACEHOLDER_NAMED, None) is not None:
        environ["TPU_ACCELERATOR_TYPE"] = accelerator_type


def quiet_without_tpus(
    environ: MutableMapping[str, str] = os.environ,
    /,
    *,
    chips: int | None = None,
    installed: bool | None = None,
) -> None:
    """Where libtpu is ``installed`` and this host has no TPU ``chips`` (both looked up unless
    given): this host as the only worker, :data:`NO_TPU_ACCELERATOR`, several processes allowed,
    and :data:`TPU_OVERLAP_FLAGS` (a target compiled after JAX's backend started compiles with
    them: libtpu has read its flags by then). Nothing where either cannot be told."""
    installed = importlib.util.find_spec("libtpu") is not None if installed is None else installed
    if not installed or (tpu_chips() if chips is None else chips) != 0:
        return
    environ["LIBTPU_INIT_ARGS"] = tpu_init_args(environ.get("LIBTPU_INIT_ARGS", ""))
    _no_chips_to_own(environ)
    if "TPU_ACCELERATOR_TYPE" not in environ:
        environ["TPU_ACCELERATOR_TYPE"] = NO_TPU_ACCELERATOR
        environ[_PLACEHOLDER_NAMED] = "1"


def tpu_chips() -> int | None:
    """TPU chips on this host's PCI bus, as JAX counts them (its TPU start-up does the same);
    ``None`` where that cannot be read."""
    try:
        from jax._src.hardware_utils import num_available_tpu_chips_and_device_id

        return num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError, OSError):
        return None


def _no_chips_to_own(environ: MutableMapping[str, str]) -> None:
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
