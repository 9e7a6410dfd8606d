"""Malformed Horovod input raises only typed errors (TorshError), never anything else.

Launch flags are drawn from horovod/runner/launch.py and the Open MPI ``mpirun``
manual, variables from horovod/runner/common/util/config_parser.py, and
``DistributedOptimizer`` arguments from horovod/torch/optimizer.py, mixed with
garbage tokens, broken quoting, odd numbers and broken Python.
"""

from __future__ import annotations

import json

from conftest import fuzz_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torsh_jax.errors import TorshError
from torsh_jax.plan.io import plan_from_dict, plan_to_dict
from torsh_jax.translate.horovod import translate_horovod
from torsh_jax.translate.hvd_tables import HOROVOD_ENV, HOROVODRUN_FLAGS, MPIRUN_FLAGS

FUZZ = settings(max_examples=fuzz_examples(350), deadline=None, suppress_health_check=[HealthCheck.too_slow])

_numbers = st.sampled_from(
    ["0", "1", "4", "-1", "3.5", "1e400", "nan", "9" * 40, "0x10", "$NP", "", "a:4", "1e20"]
)
_garbage = st.text(alphabet="-=:,'\"\\$()[]{} abcHOROVD_0123456789.#\n", max_size=12)
_flag_tokens = st.sampled_from(sorted(HOROVODRUN_FLAGS) + sorted(MPIRUN_FLAGS) + ["-x", "--bogus", "-", "--"])
_hosts = st.lists(
    st.sampled_from(["a:4", "b:4", "c", "d:0", ":3", "e:x", "f:2"]), min_size=1, max_size=4
).map(",".join)
_token = st.one_of(
    _flag_tokens, _numbers, _hosts, _garbage, st.sampled_from(["python", "train.py", "--lr", "0.1"])
)
_env_names = st.sampled_from(sorted(HOROVOD_ENV) + ["HOROVOD_TYPO", "NCCL_DEBUG", "HOROVOD_WITH_TF", "lower"])
_env = st.builds(lambda n, v: f"{n}={v}", _env_names, _numbers)
_launch = st.builds(
    lambda pre, launcher, toks: " ".join([*pre, launcher, *toks]),
    st.lists(_env, max_size=2),
    st.sampled_from(["horovodrun", "mpirun", "/opt/bin/mpirun", "$ horovodrun"]),
    st.lists(_token, max_size=10),
)

_exprs = st.sampled_from(
    ["hvd.Sum", "hvd.Average", "hvd.Adasum", "hvd.Compression.fp16", "hvd.Compression.none", "None",
     "True", "0",
     "4", "-2", "1e400", "2.5", "'fp16'", "'Sum'", "[1, 2]", "args.x", "args.x * 2", "10**10**10",
     "hvd.Adasum if args.a else hvd.Average", "lambda: 0", "x", "MyCompressor()", "hvd.global_process_set",
     "(", "1 +", "{'a': 1}", "not args.b", "-args.c", "1/0", "'a' * 3",
     "optim.SGD(model.parameters(), lr=args.x * hvd.size(), momentum='m')", "tf.optimizers.Adam(-1)",
     "torch.optim.Adam(p, betas=(1, 'x'), eps=args.x)", "keras.optimizers.SGD(lr=1e400, nesterov=2)",
     "torch.optim.AdamW(p, 0.1, (0.9, 0.99), 1e-8, 0.1, True)", "args.a and hvd.size() or 2"]
)  # fmt: skip
_kwarg_names = st.sampled_from(
    ["compression", "op", "optimizer", "backward_passes_per_step", "gradient_predivide_factor",
     "average_aggregated_gradients",
     "process_set", "named_parameters", "num_groups", "sparse_as_dense", "bogus", "name"]
)  # fmt: skip
_call = st.builds(
    lambda kws, close: "opt = hvd.DistributedOptimizer(opt, " + ", ".join(f"{k}={v}" for k, v in kws) + close,
    st.lists(st.tuples(_kwarg_names, _exprs), max_size=5),
    st.sampled_from([")", ")", ")", "", "))", "\n)"]),
)
_python_lines = st.sampled_from(
    ["parser.add_argument('--a', action='store_true')", "parser.add_argument('--x', type=int, default=2)",
     "args.x = 3", "x = hvd.Sum", "lr = base_lr * hvd.size()", "hvd.init(process_sets=[s])",
     "s = hvd.ProcessSet([0, 2])", "os.environ['HOROVOD_FUSION_THRESHOLD'] = '1024'",
     "export HOROVOD_CYCLE_TIME=2",
     "hvd.broadcast_parameters(model.state_dict(), root_rank=0)", "# comment horovodrun -np 2", "\\"]
)  # fmt: skip
_document = st.lists(st.one_of(_launch, _call, _python_lines, _env, _garbage), min_size=1, max_size=6).map(
    "\n".join
)
_override_keys = st.sampled_from(
    ["args.x", "args.a", "env.HOROVOD_FUSION_THRESHOLD", "env.HOROVOD_TYPO", "DistributedOptimizer.op",
     "DistributedOptimizer.bogus", "horovodrun.-np", "horovodrun.--nope", "launch", "batch.micro_batch_size",
     "mesh.data", "zero.stage", "nonsense", "mpirun.-x"]
)  # fmt: skip
_override_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 64), st.floats(), st.text(max_size=6),
                             st.lists(st.integers(0, 3), max_size=2))  # fmt: skip


def _check(text, *, world_size=None, overrides=None, lenient=False):
    try:
        result = translate_horovod(text, world_size=world_size, overrides=overrides, lenient=lenient)
    except TorshError as err:
        assert str(err)
        return
    json.dumps([n.to_dict() for n in result.notes])
    json.dumps(result.extras, default=str)
    assert plan_from_dict(plan_to_dict(result.plan)) == result.plan.replace(name=result.plan.name)
    assert len({n.key for n in result.notes}) == len(result.notes)


@FUZZ
@given(_launch, st.booleans())
def test_fuzzed_launch_lines(text, lenient):
    _check(text, lenient=lenient)


@FUZZ
@given(_document, st.booleans())
def test_fuzzed_documents(text, lenient):
    _check(text, lenient=lenient)


@FUZZ
@given(
    _document, st.dictionaries(_override_keys, _override_values, max_size=3), st.none() | st.integers(-1, 64)
)
def test_fuzzed_overrides_and_world_size(text, overrides, world_size):
    _check(text, overrides=overrides, world_size=world_size)


@settings(max_examples=fuzz_examples(600), deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text(text):
    _check(text)
