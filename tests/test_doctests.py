"""The docstring examples of every module run and print what they claim.

Command modules show shell lines (``$ torsh-jax ...``) instead: each parses
with the real argument parser.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import shlex
import tempfile

import pytest

import torsh_jax
from torsh_jax.cli.main import build_parser

#: modules without a docstring example, and why
NO_EXAMPLE = {"torsh_jax.__main__": "runs the command line"}


def _modules() -> list[str]:
    names = ["torsh_jax", *(m.name for m in pkgutil.walk_packages(torsh_jax.__path__, "torsh_jax."))]
    return sorted(n for n in names if n not in NO_EXAMPLE)


def _shell_examples(doc: str) -> list[list[str]]:
    lines = [line.strip()[2:] for line in doc.splitlines() if line.strip().startswith("$ torsh-jax")]
    return [shlex.split(line)[1:] for line in lines]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' directories go with it
    module = importlib.import_module(name)
    shell = _shell_examples(module.__doc__ or "")
    for argv in shell:
        build_parser().parse_args(argv)  # exits (SystemExit) on a wrong example
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted or shell, f"{name} has no docstring example"
