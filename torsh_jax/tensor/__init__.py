"""Tensor parallelism: building blocks that run on local shards inside the train step's ``shard_map``.

Use them in a ``loss_fn`` or a :class:`~torsh_jax.runtime.layered.LayeredModel`
layer and mark the model with ``tensor_blocks=True``; the plan's rules (``heads``,
``mlp``, ``vocab`` -> ``tensor``) split the weights, and the blocks place the
tensor collectives. Outside ``shard_map`` they compute the dense result.

Example:
    >>> import jax.numpy as jnp
    >>> from torsh_jax.tensor import TensorAxis, mlp
    >>> mlp(jnp.ones((1, 2, 4)), jnp.ones((4, 8)), jnp.ones((8, 4)), tp=TensorAxis()).shape
    (1, 2, 4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "TensorAxis": "torsh_jax.tensor.axis",
    "tensor_axis": "torsh_jax.tensor.axis",
    "uses_tensor_blocks": "torsh_jax.tensor.axis",
    "has_tensor_blocks": "torsh_jax.tensor.axis",
    "column": "torsh_jax.tensor.layers",
    "row": "torsh_jax.tensor.layers",
    "mlp": "torsh_jax.tensor.layers",
    "attention": "torsh_jax.tensor.layers",
    "embed": "torsh_jax.tensor.vocab",
    "cross_entropy": "torsh_jax.tensor.vocab",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.tensor", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.tensor.axis import TensorAxis, has_tensor_blocks, tensor_axis, uses_tensor_blocks
    from torsh_jax.tensor.layers import attention, column, mlp, row
    from torsh_jax.tensor.vocab import cross_entropy, embed
