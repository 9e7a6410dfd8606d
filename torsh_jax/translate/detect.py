"""Pick the right translator for a file and run it.

- ``.json`` -> PyTorch FSDP when every top-level key is an FSDP section
  (``fsdp``, ``fully_shard``, ``device_mesh``, ``parallelize_module``), DeepSpeed
  when none is; a mix of both is ambiguous (an error naming both kinds);
- ``.hjson`` / ``.yml`` / ``.yaml`` -> DeepSpeed (gpt-neox dialect included);
- ``.txt`` / ``.sh`` / ``.bash`` / ``.py`` / anything else -> by content:
  an ``FSDP(``/``fully_shard(`` call without Horovod markers is FSDP,
  Horovod launchers, ``HOROVOD_*`` variables or ``hvd.`` calls are Horovod;
  an FSDP call next to ``hvd.`` or ``horovodrun`` is ambiguous (an error).

Translators are imported lazily; none of them imports JAX.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "launch.sh"
    >>> _ = path.write_text("horovodrun -np 4 python train.py")
    >>> translate_file(path).kind
    'horovod'
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torsh_jax.errors import NotSupportedYetError, TranslationError
from torsh_jax.translate.fsdp_args import JSON_SECTIONS, looks_like_fsdp
from torsh_jax.translate.messages import clip, short_errors
from torsh_jax.translate.result import TranslationResult

__all__ = ["translate_file", "detect_kind", "KINDS"]

KINDS = ("deepspeed", "horovod", "torch_fsdp")
_DEEPSPEED_SUFFIXES = (".hjson", ".yml", ".yaml")
#: Text that marks Horovod for sure (``mpirun`` alone may start any program, FSDP ones too).
_HOROVOD_ONLY = ("hvd.", "horovodrun")


def _ambiguous(path: Path, kinds: str, evidence: str, *, fix: str) -> TranslationError:
    """The error for input that two translators could read: which kinds, why, how to choose."""
    return TranslationError(f"could be {kinds} input: {evidence}", key=str(path), fix=fix)


def _json_kind(text: str, path: Path) -> str:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError):
        return "deepspeed"
    if not isinstance(data, dict) or not data:
        return "deepspeed"
    fsdp = [key for key in data if key in JSON_SECTIONS]
    other = [clip(repr(key)) for key in data if key not in JSON_SECTIONS]
    if not fsdp:
        return "deepspeed"
    if not other:
        return "torch_fsdp"
    others = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
    raise _ambiguous(
        path,
        "DeepSpeed or PyTorch FSDP",
        f"FSDP sections {fsdp} next to other top-level keys ({others})",
        fix=f"for FSDP keep only {list(JSON_SECTIONS)} at the top level; for DeepSpeed remove {fsdp}",
    )


def _text_kind(text: str, path: Path) -> str:
    from torsh_jax.translate.horovod import looks_like_horovod

    horovod_only = [marker for marker in _HOROVOD_ONLY if marker in text]
    if looks_like_fsdp(text) and horovod_only:
        raise _ambiguous(
            path,
            "Horovod or PyTorch FSDP",
            f"it calls FSDP/fully_shard and uses {' and '.join(horovod_only)}",
            fix="put the FSDP call and the Horovod lines in separate files and translate each",
        )
    if looks_like_fsdp(text):
        return "torch_fsdp"
    if looks_like_horovod(text):
        return "horovod"
    raise TranslationError(
        "cannot tell what this file configures (no DeepSpeed JSON, Horovod launch or FSDP call found)",
        key=str(path),
        fix="give a DeepSpeed .json/.yml, a horovodrun/mpirun line, or an FSDP(...) call",
    )


def detect_kind(path: str | Path, /) -> str:
    """``deepspeed``, ``horovod`` or ``torch_fsdp`` for the file at ``path``.

    Raises:
        TranslationError: the file cannot be read, its kind cannot be told, or it
            mixes the keys or calls of two kinds (the message names both).
    """
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise TranslationError(
            f"cannot read file: {err.strerror or err}", key=str(path), fix="check the path"
        ) from None
    if not text.strip():
        raise TranslationError("the file is empty", key=str(path), fix="pass a config, launch line or script")
    suffix = path.suffix.lower()
    if suffix == ".json" or (suffix not in (".py", ".sh", ".txt", ".bash") and text.lstrip().startswith("{")):
        return _json_kind(text, path)
    if suffix in _DEEPSPEED_SUFFIXES:
        return "deepspeed"
    return _text_kind(text, path)


def _deepspeed():
    try:
        from torsh_jax.translate.deepspeed import translate_deepspeed
    except ImportError as err:
        raise NotSupportedYetError(
            f"DeepSpeed translation is not available: {err}", key="deepspeed", fix="install the full package"
        ) from None
    return translate_deepspeed


@short_errors
def translate_file(
    path: str | Path,
    /,
    *,
    world_size: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    hf_trainer: Mapping[str, Any] | None = None,
    lenient: bool = False,
    strict: bool = False,
) -> TranslationResult:
    """Translate a DeepSpeed, Horovod or PyTorch FSDP file into a plan.

    Args:
        path: the file.
        world_size: number of devices/processes, where the input leaves it open.
        overrides: ``--set`` values (key path -> value); their meaning depends
            on the kind (see docs/translate.md).
        hf_trainer: Hugging Face ``TrainingArguments`` values that fill
            DeepSpeed's ``"auto"`` entries (DeepSpeed only).
        lenient: note unsupported settings instead of raising.
        strict: raise for keys the source tool itself ignores (DeepSpeed's
            unknown top-level keys).

    Returns:
        The :class:`TranslationResult`; ``kind`` says which translator ran.

    Raises:
        TranslationError: the file cannot be read, its kind cannot be told,
            or a setting cannot be translated (the key names it).
    """
    path = Path(path)
    kind = detect_kind(path)
    overrides = dict(overrides or {})
    if kind == "deepspeed":
        translate = _deepspeed()
        return translate(
            path, world_size=world_size, overrides=overrides, hf_trainer=hf_trainer, lenient=lenient,
            strict=strict,
        )  # fmt: skip
    if hf_trainer:
        raise TranslationError(
            f"Hugging Face Trainer values only apply to DeepSpeed configs, not {kind}",
            key="--hf-trainer",
            fix="drop --hf-trainer",
        )
    if kind == "horovod":
        from torsh_jax.translate.horovod import translate_horovod

        return translate_horovod(path, world_size=world_size, overrides=overrides, lenient=lenient)
    from torsh_jax.translate.torch_fsdp import translate_torch_fsdp

    return translate_torch_fsdp(path, world_size=world_size, overrides=overrides, lenient=lenient)
