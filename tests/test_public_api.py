"""The public API: every re-export resolves, and importing the package stays light."""

from __future__ import annotations

import subprocess
import sys

import torsh_jax


def test_every_export_resolves():
    for name in torsh_jax.__all__:
        assert getattr(torsh_jax, name) is not None, name


def test_import_has_no_side_effects():
    code = (
        "import os, sys; before = dict(os.environ); import torsh_jax; "
        "assert dict(os.environ) == before; assert 'jax' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
