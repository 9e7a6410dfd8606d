"""The train step: state layout, axis roles composed into one ``shard_map`` program, twins.

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from torsh_jax.plan import load_plan
    >>> from torsh_jax.runtime import build_mesh, state_layout
    >>> plan = load_plan("zero1")
    >>> layout = state_layout(plan, build_mesh(plan, jax.devices()[:1]), {"w": jnp.zeros(4)}, optax.sgd(0.1))
    >>> layout.bytes_per_device()["params"]
    16
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "build_mesh": "torsh_jax.runtime.mesh",
    "resolve_mesh": "torsh_jax.runtime.mesh",
    "param_specs": "torsh_jax.runtime.specs",
    "LayeredModel": "torsh_jax.runtime.layered",
    "layered_loss": "torsh_jax.runtime.layered",
    "StateLayout": "torsh_jax.runtime.layout",
    "state_layout": "torsh_jax.runtime.layout",
    "TrainState": "torsh_jax.runtime.state",
    "TrainStep": "torsh_jax.runtime.step",
    "make_train_step": "torsh_jax.runtime.step",
    "make_reference_step": "torsh_jax.runtime.twin",
    "compare_with_twin": "torsh_jax.runtime.verify",
    "record_gradients": "torsh_jax.runtime.verify",
    "TwinReport": "torsh_jax.runtime.verify",
    "inspect_step": "torsh_jax.runtime.inspect",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.runtime", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.runtime.inspect import inspect_step
    from torsh_jax.runtime.layered import LayeredModel, layered_loss
    from torsh_jax.runtime.layout import StateLayout, state_layout
    from torsh_jax.runtime.mesh import build_mesh, resolve_mesh
    from torsh_jax.runtime.specs import param_specs
    from torsh_jax.runtime.state import TrainState
    from torsh_jax.runtime.step import TrainStep, make_train_step
    from torsh_jax.runtime.twin import make_reference_step
    from torsh_jax.runtime.verify import TwinReport, compare_with_twin, record_gradients
