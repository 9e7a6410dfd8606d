"""Property-based fuzzing: malformed DeepSpeed configs raise only TranslationError, never another error."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import fuzz_examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from torsh_jax.errors import TranslationError
from torsh_jax.translate.deepspeed import translate_deepspeed
from torsh_jax.translate.ds_precision import PRECISION_KEYS

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "deepspeed"

KEYS = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    *PRECISION_KEYS,
    "zero_optimization",
    "optimizer",
    "scheduler",
    "tensor_parallel",
    "pipeline",
    "prescale_gradients",
    "gradient_predivide_factor",
    "gradient_allreduce_op",
    "activation_checkpointing",
    "sparse_attention",
    "data_efficiency",
    "elasticity",
    "stage",
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "hysteresis",
    "loss_scale_window",
    "min_loss_scale",
    "consecutive_hysteresis",
    "offload_optimizer",
    "offload_param",
    "device",
    "cpu_offload",
    "reduce_bucket_size",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "stage3_param_persistence_threshold",
    "type",
    "params",
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "adam_w_mode",
    "freeze_step",
    "warmup_min_lr",
    "warmup_max_lr",
    "warmup_num_steps",
    "warmup_type",
    "total_num_steps",
    "cycle_min_lr",
    "cycle_max_lr",
    "autotp_size",
    "stages",
    "pipe_parallel_size",
    "model_parallel_size",
    "precision",
    "lr_decay_style",
    "warmup",
    "_comment",
    "x",
]
TYPES = [
    "Adam",
    "AdamW",
    "Lamb",
    "SGD",
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "cpu",
    "nvme",
    "none",
    "fp16",
    "bf16",
    "fp32",
    "auto",
    "log",
    "linear",
    "cosine",
    "mean",
    "sum",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(TYPES),
    st.text(max_size=6),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=12,
)
configs = st.dictionaries(keys, values, max_size=8)


def fuzzed(n: int) -> settings:
    """Hypothesis settings for ``n`` examples (:func:`~conftest.fuzz_examples`), no deadline or
    database."""
    return settings(
        max_examples=fuzz_examples(n), deadline=None, suppress_health_check=list(HealthCheck), database=None
    )


def _translate(source, **kwargs) -> None:
    try:
        translate_deepspeed(source, **kwargs)
    except TranslationError as err:
        assert err.key, f"error without a key: {err}"


@fuzzed(300)
@given(configs, st.sampled_from([None, 1, 8, 64]), st.booleans())
def test_random_configs_raise_only_translation_errors(config, world_size, lenient):
    _translate(config, world_size=world_size, lenient=lenient)


def _corpus_configs() -> list[dict]:
    out = []
    for path in sorted(CORPUS.glob("*.json")) if CORPUS.is_dir() else []:
        try:
            out.append(json.loads(path.read_text()))
        except ValueError:
            continue
    return out or [{"train_batch_size": 8, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}]


CORPUS_CONFIGS = _corpus_configs()


def _paths(value, prefix=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))


@fuzzed(400)
@given(
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=0, max_value=10**6),
    values,
    st.sampled_from([None, 8]),
    st.booleans(),
)
def test_mutated_corpus_configs_raise_only_translation_errors(pick, where, new_value, world_size, lenient):
    config = json.loads(json.dumps(CORPUS_CONFIGS[pick % len(CORPUS_CONFIGS)]))
    paths = list(_paths(config))
    if paths:
        path = paths[where % len(paths)]
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = new_value
    hf = {"max_steps": 100, "warmup_steps": 5, "hidden_size": 64} if where % 2 else None
    _translate(config, world_size=world_size, lenient=lenient, hf_trainer=hf)


@fuzzed(1000)
@given(st.text(max_size=60).map(lambda s: "{" + s))
@example("{/*")  # an unterminated comment: hjson itself raises IndexError
def test_random_text_raises_only_translation_errors(text):
    _translate(text)


@fuzzed(150)
@given(
    st.dictionaries(st.text(max_size=12), values, max_size=3),
    st.dictionaries(st.text(max_size=12), values, max_size=3),
)
def test_random_overrides_and_trainer_arguments(overrides, trainer):
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    _translate(config, world_size=8, overrides=overrides, hf_trainer=trainer)
