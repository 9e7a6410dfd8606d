"""The demo: a small flax language model trained on simulated CPU devices.

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.demo import LMConfig
    >>> LMConfig().layers > 0
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LMConfig": "torsh_jax.demo.model",
    "init_params": "torsh_jax.demo.model",
    "layered_model": "torsh_jax.demo.model",
    "loss_fn": "torsh_jax.demo.model",
    "synthetic_tokens": "torsh_jax.demo.model",
    "DemoConfig": "torsh_jax.demo.run",
    "run_demo": "torsh_jax.demo.run",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.demo", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.demo.model import LMConfig, init_params, layered_model, loss_fn, synthetic_tokens
    from torsh_jax.demo.run import DemoConfig, run_demo
