"""The public API: every re-export resolves, and importing the package stays light."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_type_checkers_see_every_export():
    """``if TYPE_CHECKING`` imports every name of ``__all__`` (the lazy ``__getattr__`` hides them)."""
    tree = ast.parse(Path(torsh_jax.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {
        alias.name for node in ast.walk(block) if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert imported == set(torsh_jax.__all__)


def test_mypy_reveals_the_real_types_of_the_public_names(tmp_path):
    pytest.importorskip("mypy")
    root = Path(torsh_jax.__file__).parent.parent
    skipped = (
        "jax.*,jaxlib.*,flax.*,optax.*,orbax.*,numpy.*,chex.*,rich.*,yaml.*,hjson.*,tomli_w.*,ml_dtypes.*"
    )
    (tmp_path / "mypy.ini").write_text(
        f"[mypy]\nmypy_path = {root}\nfollow_imports = silent\nignore_missing_imports = True\n"
        f"[mypy-{skipped}]\nfollow_imports = skip\n"
    )
    names = sorted(torsh_jax.__all__)
    (tmp_path / "use.py").write_text(
        "import torsh_jax as tj\n" + "".join(f"reveal_type(tj.{n})\n" for n in names)
    )
    command = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", "cache", "use.py"]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True).stdout
    revealed = re.findall(r'^use\.py:(\d+): note: Revealed type is "(.*)"$', out, flags=re.M)
    assert len(revealed) == len(names), out
    for line, kind in revealed:
        assert kind not in ("Any", "object", "builtins.object"), f"tj.{names[int(line) - 2]} is {kind}"
    assert "error:" not in out, out
    assert "torsh_jax.runtime.step.TrainStep" in dict(revealed)[str(2 + names.index("make_train_step"))]
