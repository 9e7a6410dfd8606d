"""Find preset files (``meshes/*.toml``, ``meshes/param_dims/*.toml``, ``compression/*.toml``) by
name or path.

Presets ship inside the wheel (``torsh_jax/_presets/<kind>/``) and are read
from the checkout's top-level folders when running from source.

Example:
    >>> from torsh_jax.plan import presets
    >>> "ddp" in presets.names("meshes")
    True
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from torsh_jax.errors import PlanError, PresetNotFoundError

__all__ = ["find", "names", "preset_dirs"]

_SUFFIXES = (".toml", ".json")
#: What a file of each preset kind holds, for messages.
_WHAT = {"meshes": "plan", "compression": "compressor", "meshes/param_dims": "param_dims"}


def preset_dirs(kind: str) -> list[Path]:
    """Folders holding presets of ``kind`` (``meshes``, ``meshes/param_dims`` or ``compression``)."""
    dirs = []
    packaged = Path(str(resources.files("torsh_jax"))) / "_presets" / kind
    checkout = Path(__file__).resolve().parents[2] / kind
    for folder in (packaged, checkout):
        if folder.is_dir() and folder not in dirs:
            dirs.append(folder)
    return dirs


def names(kind: str) -> list[str]:
    """Sorted preset names of ``kind``."""
    return sorted({p.stem for d in preset_dirs(kind) for p in d.iterdir() if p.suffix in _SUFFIXES})


def find(kind: str, name_or_path: str, *, key: str | None = None) -> Path:
    """The file for a preset name or an explicit path.

    ``key`` names where the name came from in errors (``--plan``, a plan
    field); it defaults to ``kind``.

    Raises:
        PresetNotFoundError: neither a file nor a known preset name.
        PlanError: a directory, or a file in another format (``.yaml``).
    """
    path = Path(name_or_path).expanduser()
    if path.suffix in _SUFFIXES and path.is_file():
        return path
    for folder in preset_dirs(kind):
        for suffix in _SUFFIXES:
            candidate = folder / f"{name_or_path}{suffix}"
            if candidate.is_file():
                return candidate
    _refuse_other_files(path, kind, key=key or kind)
    raise PresetNotFoundError(
        f"no {kind} preset or file named {name_or_path!r}",
        key=key or kind,
        fix=f"use one of {names(kind)} or a path to a .toml/.json file",
    )


def _refuse_other_files(path: Path, kind: str, *, key: str) -> None:
    """A directory or a file in another format is not a preset: say what is read instead."""
    what = _WHAT.get(kind, kind)
    if path.is_dir():
        raise PlanError(
            f"{str(path)!r} is a directory, not a {what} file",
            key=key,
            fix=f"pass a .toml or .json file in it, or a preset name: one of {names(kind)}",
        )
    if path.suffix and path.is_file():
        raise PlanError(
            f"{what} files are read as .toml or .json, not {path.suffix}: {str(path)!r}",
            key=key,
            fix=f"write it as TOML in {path.with_suffix('.toml')} (as {kind}/*.toml are) or as JSON",
        )
