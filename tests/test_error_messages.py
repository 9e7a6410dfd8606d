"""Every typed error the package raises says how to fix it (a ``fix=`` at each raise site)."""

from __future__ import annotations

import ast
from pathlib import Path

import torsh_jax.errors as errors

PACKAGE = Path(errors.__file__).resolve().parent
TYPED = {name for name in errors.__all__ if name.endswith("Error")}


def _raises_without_fix(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            call = node.exc
            name = getattr(call.func, "id", getattr(call.func, "attr", None))
            keywords = {k.arg for k in call.keywords}
            if name in TYPED and "fix" not in keywords and None not in keywords:
                out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return out


def test_every_typed_raise_has_a_fix():
    missing = [site for path in sorted(PACKAGE.rglob("*.py")) for site in _raises_without_fix(path)]
    assert not missing, "typed errors raised without fix=: " + ", ".join(missing)


def test_the_scan_sees_raise_sites():
    """The scan above finds something to check (it would pass vacuously otherwise)."""
    sites = 0
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                sites += getattr(node.exc.func, "id", None) in TYPED
    assert sites > 100
