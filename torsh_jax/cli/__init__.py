"""The ``torsh-jax`` command line (``python -m torsh_jax`` runs it too).

Public names load on first use, so importing the package imports nothing else.

Example:
    >>> from torsh_jax.cli import build_parser
    >>> build_parser().prog
    'torsh-jax'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torsh_jax._lazy import lazy_exports

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "main": "torsh_jax.cli.main",
    "build_parser": "torsh_jax.cli.main",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("torsh_jax.cli", _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.cli.main import build_parser, main
