"""Every file of the shared corpus translates, or fails with a typed error naming a key.

The corpus (``../shared/corpus``, provenance in each folder's SOURCES.md) holds
real DeepSpeed configs and Horovod launch lines / script excerpts. For each file
that translates, every key it contains must appear in the notes:

- JSON/YAML configs: every leaf key path (``zero_optimization.offload_optimizer.device``);
  a note on an enclosing section covers the leaves below it.
- Horovod text: every launcher flag, ``-x``/prefix ``NAME=value`` variable,
  ``HOROVOD_*=`` assignment, training-script option, ``add_argument`` option,
  ``DistributedOptimizer`` keyword and ``hvd.*`` name, found here by a scanner
  independent of the translator.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import CORPUS

from torsh_jax.errors import TorshError
from torsh_jax.translate.detect import translate_file

HOROVOD_FILES = sorted((CORPUS / "horovod").glob("*.txt")) if CORPUS.is_dir() else []
DEEPSPEED_FILES = (
    sorted(p for p in (CORPUS / "deepspeed").rglob("*") if p.suffix in (".json", ".yml", ".yaml", ".hjson"))
    if CORPUS.is_dir()
    else []
)
HAS_DEEPSPEED = importlib.util.find_spec("torsh_jax.translate.deepspeed") is not None


def _ids(paths):
    return [p.name for p in paths]


def _leaf_paths(data, prefix=""):
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from _leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
    elif prefix:
        yield prefix


def _covered(leaf: str, keys: set[str]) -> bool:
    return leaf in keys or any(leaf.startswith(k + ".") for k in keys)


def _load_config(path: Path):
    text = path.read_text()
    if path.suffix in (".yml", ".yaml"):
        yaml = pytest.importorskip("yaml")
        return yaml.safe_load(text)
    import hjson

    return hjson.loads(text) if path.suffix == ".hjson" else json.loads(text)


# ---------------------------------------------------------------- Horovod key scanner


def _joined_lines(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()


_LAUNCH = re.compile(r"^\s*(\$\s+)?([A-Za-z_]\w*=\S*\s+)*(\S*/)?(horovodrun|mpirun)(\s|$)")


def _launch_keys(line: str) -> set[tuple[str, str]]:
    """(kind, name) pairs: ("flag", "-np"), ("env", "NAME"), ("script", "--lr")."""
    found: set[tuple[str, str]] = set()
    tokens = shlex.split(line)
    at = next(i for i, t in enumerate(tokens) if t.rsplit("/", 1)[-1] in ("horovodrun", "mpirun"))
    found |= {("env", t.split("=", 1)[0]) for t in tokens[:at] if "=" in t}
    rest = tokens[at + 1 :]
    program = next((i for i, t in enumerate(rest) if t.startswith("python") or t.endswith(".py")), len(rest))
    for i, token in enumerate(rest[:program]):
        if token == "-x":
            found.add(("env", rest[i + 1].split("=", 1)[0]))
        elif token.startswith("-"):
            found.add(("flag", token.split("=", 1)[0]))
    script_at = next((i for i, t in enumerate(rest) if t.endswith(".py")), None)
    if script_at is not None:
        found |= {("script", t.split("=", 1)[0]) for t in rest[script_at + 1 :] if t.startswith("-")}
    return found


def _call_keywords(text: str, name: str) -> set[str]:
    keywords = set()
    for match in re.finditer(rf"(?<![\w.])(?:\w+\.)*{name}\(", text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        call = ast.parse("f" + text[match.end() - 1 : end + 1].replace("\n", " ").strip(), mode="eval").body
        keywords |= {k.arg for k in call.keywords if k.arg}
    return keywords


def horovod_expected_keys(text: str) -> set[tuple[str, str]]:
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    expected: set[tuple[str, str]] = set()
    for line in _joined_lines(body):
        if _LAUNCH.match(line):
            expected |= _launch_keys(line)
    expected |= {("env", name) for name in re.findall(r"\b(HOROVOD_\w+)=", body)}
    expected |= {("kwarg", kw) for kw in _call_keywords(body, "DistributedOptimizer")}
    expected |= {("hvd", name) for name in re.findall(r"(?<![\w.])hvd\.([A-Za-z_][\w.]*\w)", body)}
    expected |= {("argparse", flag) for flag in re.findall(r"add_argument\(\s*['\"](--[\w-]+)", body)}
    return expected


def _noted(kind: str, name: str, keys: set[str]) -> bool:
    if kind == "flag":
        return any(
            name in re.split(r"\.(?=-)|(?<=\w)\.", key) or key.endswith("." + name) for key in keys
        ) or any(f".{name}." in key for key in keys)
    suffix = {
        "env": f"env.{name}",
        "script": f"script.{name}",
        "hvd": f"hvd.{name}",
        "argparse": f"argparse.{name}",
    }
    if kind == "kwarg":
        return any(re.fullmatch(rf"DistributedOptimizer(\[\d+\])?\.{re.escape(name)}", key) for key in keys)
    return any(key == suffix[kind] or key.endswith("." + suffix[kind]) for key in keys)


@pytest.mark.parametrize("path", HOROVOD_FILES, ids=_ids(HOROVOD_FILES))
def test_horovod_file_translates_or_names_the_key(path: Path, corpus_dir):
    """Launch flags per horovod/runner/launch.py; DistributedOptimizer per horovod/torch/optimizer.py."""
    text = path.read_text()
    try:
        result = translate_file(path)
    except TorshError as err:
        assert err.key, f"{path.name}: error without a key: {err}"
        assert err.key.split(".")[-1].split("[")[0] in text, f"{path.name}: key {err.key!r} not in the file"
        return
    keys = {n.key for n in result.notes}
    missing = sorted(f"{k}:{n}" for k, n in horovod_expected_keys(text) if not _noted(k, n, keys))
    assert not missing, f"{path.name}: not in the notes: {missing}"
    assert result.kind == "horovod"


@pytest.mark.parametrize("path", HOROVOD_FILES, ids=_ids(HOROVOD_FILES))
def test_horovod_file_lenient_always_translates(path: Path, corpus_dir):
    """With lenient=True unsupported settings become notes instead of errors."""
    result = translate_file(path, lenient=True)
    keys = {n.key for n in result.notes}
    missing = sorted(f"{k}:{n}" for k, n in horovod_expected_keys(path.read_text()) if not _noted(k, n, keys))
    assert not missing


def test_corpus_has_both_kinds(corpus_dir):
    assert HOROVOD_FILES and DEEPSPEED_FILES


@pytest.mark.parametrize("path", DEEPSPEED_FILES, ids=_ids(DEEPSPEED_FILES))
def test_deepspeed_file_translates_or_names_the_key(path: Path, corpus_dir):
    """Every leaf key path of a translated DeepSpeed config appears in the notes."""
    if not HAS_DEEPSPEED:
        pytest.skip("torsh_jax.translate.deepspeed is not present in this checkout")
    try:
        result = translate_file(path, world_size=8)
    except TorshError as err:
        # The key may name a missing required key (train_batch_size), so it need not be in the file.
        assert err.key, f"{path.name}: error without a key: {err}"
        assert str(err).startswith(err.key), str(err)
        return
    keys = {n.key for n in result.notes}
    missing = [leaf for leaf in _leaf_paths(_load_config(path)) if not _covered(leaf, keys)]
    assert not missing, f"{path.name}: leaf keys without a note: {missing[:10]}"
