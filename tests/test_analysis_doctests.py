"""The docstring examples of torsh_jax.analysis run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "torsh_jax.analysis",
    "torsh_jax.analysis._hlo_text",
    "torsh_jax.analysis._groups",
    "torsh_jax.analysis._calls",
    "torsh_jax.analysis.hlo",
    "torsh_jax.analysis.memory",
    "torsh_jax.analysis.report",
    "torsh_jax.analysis.theory",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
