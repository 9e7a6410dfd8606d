"""Property tests: plans round-trip through TOML and JSON; malformed plans raise only typed errors."""

from __future__ import annotations

from conftest import fuzz_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from torsh_jax.errors import TorshError
from torsh_jax.plan import (
    plan_from_dict,
    plan_from_json,
    plan_from_toml,
    plan_to_dict,
    plan_to_json,
    plan_to_toml,
)

sizes = st.sampled_from([-1, 1, 2, 4, 8])
axis = st.one_of(sizes, st.fixed_dictionaries({"ici": sizes, "dcn": st.sampled_from([1, 2])}))
dtypes = st.sampled_from(["float32", "bfloat16", "float16"])
compressor = st.one_of(
    st.sampled_from(["int8", "int4", "sign", "fp16", "topk", "powersgd"]),
    st.fixed_dictionaries(
        {"method": st.sampled_from(["int8", "sign"]), "block_size": st.sampled_from([64, 256])}
    ),
)

plans = st.fixed_dictionaries(
    {},
    optional={
        "mesh": st.fixed_dictionaries({}, optional={"data": axis, "fsdp": axis}),
        "zero": st.fixed_dictionaries(
            {}, optional={"stage": st.integers(0, 3), "reshard_after_forward": st.booleans()}
        ),
        "precision": st.fixed_dictionaries(
            {}, optional={"param_dtype": dtypes, "compute_dtype": dtypes, "reduce_dtype": dtypes}
        ),
        "batch": st.fixed_dictionaries(
            {}, optional={"micro_batch_size": st.integers(1, 64), "accumulation_steps": st.integers(1, 16)}
        ),
        "communication": st.fixed_dictionaries({}, optional={"bucket_mb": st.floats(0, 512)}),
        "compression": st.lists(
            st.fixed_dictionaries({"axis": st.just("data"), "gradients": compressor}), max_size=1
        ),
    },
)


#: each example round-trips three formats (~30 ms); 100 examples draw every section and most of
#: their values (hypothesis also tries the boundary values first)
@settings(max_examples=fuzz_examples(100), deadline=None)
@given(plans)
def test_plans_round_trip(data):
    plan = plan_from_dict(data)
    assert plan_from_toml(plan_to_toml(plan)) == plan
    assert plan_from_json(plan_to_json(plan)) == plan
    assert plan_from_dict(plan_to_dict(plan, full=True)) == plan


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=12,
)
keys = st.sampled_from(
    [
        "mesh",
        "zero",
        "precision",
        "batch",
        "communication",
        "compression",
        "rules",
        "param_dims",
        "optimizer",
        "pipeline",
        "name",
        "extra",
    ]
)


#: 200 dictionaries of up to 4 of the keys, each any JSON value of up to 12 leaves (~10 ms each)
@settings(max_examples=fuzz_examples(200), deadline=None)
@given(st.dictionaries(keys, json_values, max_size=4))
def test_malformed_plans_raise_only_typed_errors(data):
    try:
        plan_from_dict(data)
    except TorshError as err:
        assert err.key is not None
