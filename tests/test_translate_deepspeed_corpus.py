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
#: DeepSpeed key -> the Trainer argument a user would pass to match it (transformers refuses mismatches).
TRAINER_MATCH = {
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "scheduler.params.total_num_steps": "max_steps",
}


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


def _lookup(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def trainer_for(config: dict) -> dict:
    """Trainer arguments that agree with the values ``config`` sets, as a user would pass them."""
    args = dict(TRAINER)
    for key, arg in TRAINER_MATCH.items():
        value = _lookup(config, key)
        if value is not None and value != "auto":
            args[arg] = value
    betas = _lookup(config, "optimizer.params.betas")
    if isinstance(betas, list) and len(betas) == 2:
        args["adam_beta1"], args["adam_beta2"] = betas
    return args


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
        for trainer in (trainer_for(config), None):  # None: values the Trainer would refuse
            try:
                return translate_deepspeed(
                    path, world_size=world, hf_trainer=trainer, overrides=overrides, lenient=True
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
        config, _ = _config_keys(path)
        try:
            translate_deepspeed(path, world_size=8, hf_trainer=trainer_for(config or {}))
            ok += 1
        except TranslationError as err:
            if err.key != "hf_trainer":
                failed += 1
                continue
            try:  # the Trainer refuses the set values; DeepSpeed alone may not
                translate_deepspeed(path, world_size=8)
                ok += 1
            except TranslationError:
                failed += 1
    assert ok >= 30 and failed >= 5
