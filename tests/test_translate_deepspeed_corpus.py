"""Every file of ../shared/corpus/deepspeed translates or fails with a typed error naming the key,
and every key of every file appears in the notes."""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh_jax.errors import TranslationError
from torsh_jax.translate.deepspeed import load_deepspeed_config, translate_deepspeed
from torsh_jax.translate.ds_values import leaf_paths

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "deepspeed"
FILES = (
    sorted(p for p in CORPUS.rglob("*") if p.suffix in (".json", ".yml", ".yaml")) if CORPUS.is_dir() else []
)
TRAINER = {"max_steps": 1000, "warmup_steps": 10, "hidden_size": 768}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _ids():
    return [str(p.relative_to(CORPUS)) for p in FILES]


def _config_keys(path: Path) -> tuple[dict | None, set[str]]:
    try:
        config = load_deepspeed_config(path)
    except TranslationError:
        return None, set()
    prefixes = set()
    for leaf in leaf_paths(config):
        parts = leaf.split(".")
        prefixes |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return config, prefixes


def _error_names_a_key(err: TranslationError, path: Path, keys: set[str]) -> bool:
    key = err.key or ""
    return key == str(path) or key in keys or key.split("[")[0] in keys or key in BATCH_KEYS


pytestmark = pytest.mark.skipif(not FILES, reason=f"corpus not found at {CORPUS}")


@pytest.mark.parametrize("path", FILES, ids=_ids())
def test_file_translates_or_fails_naming_the_key(path):
    _, keys = _config_keys(path)
    try:
        result = translate_deepspeed(path, world_size=8)
    except TranslationError as err:
        assert err.key, f"{path.name}: error without a key: {err}"
        assert _error_names_a_key(err, path, keys), f"{path.name}: {err.key!r} is not a key of the file"
        assert err.fix or "auto" in err.message or err.key == str(path)
        return
    assert result.kind == "deepspeed"
    assert result.extras["world_size"] == 8
    assert {n.status for n in result.notes} <= {"mapped", "approximated", "ignored", "removed"}


def _lenient(path: Path, config: dict) -> object:
    overrides = {} if any(k in config for k in BATCH_KEYS) else {"train_micro_batch_size_per_gpu": 1}
    last = None
    for world in (8, 1):
        try:
            return translate_deepspeed(
                path, world_size=world, hf_trainer=TRAINER, overrides=overrides, lenient=True
            )
        except TranslationError as err:
            last = err
    return last


@pytest.mark.parametrize("path", FILES, ids=_ids())
def test_every_key_appears_in_the_notes(path):
    config, keys = _config_keys(path)
    if config is None:
        pytest.skip("not parseable; covered by the test above")
    outcome = _lenient(path, config)
    if isinstance(outcome, TranslationError):
        assert _error_names_a_key(outcome, path, keys), outcome
        return
    noted = {n.key for n in outcome.notes}
    missing = [
        leaf
        for leaf in leaf_paths(config)
        if not any(".".join(leaf.split(".")[:i]) in noted for i in range(1, leaf.count(".") + 2))
    ]
    assert not missing, f"{path.name}: keys without a note: {missing}"
    assert all(n.detail for n in outcome.notes)


def test_corpus_has_both_outcomes():
    """The corpus holds negative cases: some files must fail, most must translate."""
    ok = failed = 0
    for path in FILES:
        try:
            translate_deepspeed(path, world_size=8, hf_trainer=TRAINER)
            ok += 1
        except TranslationError:
            failed += 1
    assert ok >= 30 and failed >= 5
