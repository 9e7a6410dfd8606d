"""Horovod launch lines, variables and DistributedOptimizer calls -> plans.

Sources for the expected values:
- horovod/runner/launch.py: ``-np``, ``-H host:slots``, ``--fusion-threshold-mb``,
  ``--hierarchical-allreduce``, ``--slots-per-host`` (argparse accepts ``--slots``).
- horovod/runner/common/util/config_parser.py: ``HOROVOD_FUSION_THRESHOLD`` is
  ``fusion_threshold_mb * 1024 * 1024`` bytes.
- docs/tensor-fusion.rst: default fusion buffer 128 MB (MiB), 0 disables fusion.
- horovod/torch/optimizer.py: ``DistributedOptimizer(optimizer, named_parameters,
  compression=Compression.none, backward_passes_per_step=1, op=Average,
  gradient_predivide_factor=1.0, ...)``; accumulated gradients are summed.
- horovod/tensorflow/__init__.py: ``average_aggregated_gradients`` divides by
  ``backward_passes_per_step``.
"""

from __future__ import annotations

import pytest

from torsh_jax.errors import PlanError, TorshError, TranslationError
from torsh_jax.plan.spec import AxisSize, CompressorSpec
from torsh_jax.translate.horovod import translate_horovod


def _note(result, key):
    matches = [n for n in result.notes if n.key == key]
    assert matches, f"no note {key!r} in {[n.key for n in result.notes]}"
    return matches[0]


def test_np_and_hosts_give_world_size_and_layout():
    r = translate_horovod("horovodrun -np 16 -H server1:4,server2:4,server3:4,server4:4 python train.py")
    assert r.kind == "horovod"
    assert r.extras["world_size"] == 16
    assert r.extras["num_hosts"] == 4 and r.extras["processes_per_host"] == 4
    assert r.plan.mesh.data == AxisSize(ici=-1)
    assert _note(r, "horovodrun.-np").status == "mapped"
    assert _note(r, "horovodrun.script").status == "ignored"


def test_world_size_argument_that_agrees_with_np_or_fills_a_shell_variable():
    assert translate_horovod("horovodrun -np 4 python train.py", world_size=4).extras["world_size"] == 4
    assert translate_horovod("horovodrun -np $NP python train.py", world_size=32).extras["world_size"] == 32


@pytest.mark.parametrize(
    ("text", "overrides", "key", "flag"),
    [
        ("horovodrun -np 8 -H localhost:4 python train.py", {}, "horovodrun.-np", "-np"),
        ("mpirun -n 8 python train.py", {}, "mpirun.-n", "-n"),
        ("horovodrun -np 4 python t.py", {"horovodrun.-np": 8}, "horovodrun.-np", "-np"),
        ("horovodrun -np 2 python a.py\nhorovodrun -np 8 python b.py", {"launch": 1}, "horovodrun[1].-np",
         "-np"),
    ],
    ids=["horovodrun", "mpirun", "set-np", "second-launch"],
)  # fmt: skip
def test_world_size_argument_that_differs_from_np_is_one_error_naming_both(text, overrides, key, flag):
    with pytest.raises(TranslationError) as err:
        translate_horovod(text, world_size=4, overrides=overrides)
    assert err.value.key == key
    assert "8 processes" in err.value.message and "--world-size says 4" in err.value.message
    assert "drop --world-size" in err.value.fix and f"make {flag} and --world-size agree" in err.value.fix


def test_horovodrun_with_more_processes_than_slots_is_refused_as_horovodrun_refuses_it():
    with pytest.raises(TranslationError) as err:
        translate_horovod("horovodrun -np 8 -H a:2,b:2 python train.py")
    assert err.value.key == "horovodrun.-np" and "8 processes on 4 slots" in err.value.message
    assert translate_horovod("horovodrun -np 2 -H a:2,b:2 python train.py").extras["world_size"] == 2


def test_mpirun_without_np_starts_a_process_per_slot_which_world_size_must_agree_with():
    assert translate_horovod("mpirun -H a:4,b:4 python train.py").extras["world_size"] == 8
    assert translate_horovod("mpirun -H a:4,b:4 python train.py", world_size=8).extras["world_size"] == 8
    with pytest.raises(TranslationError, match=r"one process per slot, 8 \(-H\), --world-size says 4"):
        translate_horovod("mpirun -H a:4,b:4 python train.py", world_size=4)


@pytest.mark.parametrize(
    ("line", "mb"),
    [
        ("horovodrun -np 4 --fusion-threshold-mb 32 python train.py", 32 * 1024 * 1024 / 1e6),
        ("horovodrun -np 4 --fusion-threshold-mb 0 python train.py", 0.0),
        ("mpirun -np 8 -x HOROVOD_FUSION_THRESHOLD=16777216 python train.py", 16777216 / 1e6),
        ("horovodrun -np 4 python train.py", 128 * 1024 * 1024 / 1e6),
        (
            "HOROVOD_FUSION_THRESHOLD=1000000 horovodrun -np 4 --fusion-threshold-mb 2 python t.py",
            2 * 1048576 / 1e6,
        ),
    ],
    ids=["flag-mib", "flag-zero", "env-bytes", "horovod-default", "flag-beats-env"],
)
def test_fusion_threshold_becomes_bucket_mb(line, mb):
    r = translate_horovod(line)
    assert r.plan.communication.bucket_mb == pytest.approx(mb, rel=1e-12)


def test_hierarchical_allreduce_splits_data_axis_when_hosts_known():
    r = translate_horovod("horovodrun -np 8 -H a:4,b:4 --hierarchical-allreduce python train.py")
    assert r.plan.mesh.data == AxisSize(ici=4, dcn=2)
    assert _note(r, "horovodrun.--hierarchical-allreduce").status == "approximated"
    assert r.plan.mesh.resolve(8, num_slices=2).shape["data"] == 8


def test_hierarchical_allreduce_without_hosts_keeps_flat_axis():
    r = translate_horovod("mpirun -np 8 -hostfile h -x HOROVOD_HIERARCHICAL_ALLREDUCE=1 python t.py")
    assert r.plan.mesh.data == AxisSize(ici=-1)
    note = _note(r, "env.HOROVOD_HIERARCHICAL_ALLREDUCE")
    assert note.status == "approximated" and "unknown" in note.detail


def test_fp16_compression_and_sum_op():
    text = (
        "compression = hvd.Compression.fp16\n"
        "optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),\n"
        "                                     compression=compression, op=hvd.Sum)\n"
    )
    r = translate_horovod(text)
    (section,) = r.plan.compression
    assert section.axis == "data"
    assert section.gradients == CompressorSpec(method="fp16", error_feedback=False)
    assert r.plan.communication.reduce_op == "sum"
    assert _note(r, "DistributedOptimizer.named_parameters").status == "ignored"


def test_backward_passes_sum_unlike_deepspeed():
    r = translate_horovod("opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=4)")
    assert (r.plan.batch.accumulation_steps, r.plan.batch.accumulation_reduce) == (4, "sum")


def test_average_aggregated_gradients_means():
    r = translate_horovod(
        "opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=2, average_aggregated_gradients=True)"
    )
    assert (r.plan.batch.accumulation_steps, r.plan.batch.accumulation_reduce) == (2, "mean")


def test_predivide_factor_maps_and_needs_average():
    r = translate_horovod("o = hvd.DistributedOptimizer(o, op=hvd.Average, gradient_predivide_factor=4.0)")
    assert r.plan.communication.gradient_predivide_factor == 4.0
    with pytest.raises(TranslationError) as err:
        translate_horovod("o = hvd.DistributedOptimizer(o, op=hvd.Sum, gradient_predivide_factor=4.0)")
    assert err.value.key == "DistributedOptimizer.gradient_predivide_factor"


def test_adasum_is_unsupported_unless_lenient():
    text = "o = hvd.DistributedOptimizer(o, op=hvd.Adasum)"
    with pytest.raises(TranslationError) as err:
        translate_horovod(text)
    assert err.value.key == "DistributedOptimizer.op"
    r = translate_horovod(text, lenient=True)
    assert _note(r, "DistributedOptimizer.op").status == "unsupported"
    assert r.plan.communication.reduce_op == "mean"


def test_argparse_defaults_resolve_script_options():
    text = (
        "parser.add_argument('--use-adasum', action='store_true', default=False)\n"
        "parser.add_argument('--batches-per-allreduce', type=int, default=3)\n"
        "opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=args.batches_per_allreduce,\n"
        "    op=hvd.Adasum if args.use_adasum else hvd.Average)\n"
    )
    r = translate_horovod(text)
    assert r.plan.batch.accumulation_steps == 3
    assert _note(r, "DistributedOptimizer.op").status == "mapped"
    assert _note(r, "argparse.--use-adasum").value is False
    with pytest.raises(TranslationError):
        translate_horovod(text, overrides={"args.use_adasum": True})


def test_unknown_script_value_is_approximated_with_default():
    r = translate_horovod(
        "o = hvd.DistributedOptimizer(o, op=hvd.Adasum if args.use_adasum else hvd.Average)"
    )
    note = _note(r, "DistributedOptimizer.op")
    assert note.status == "approximated" and "args.use_adasum" in note.detail
    assert r.plan.communication.reduce_op == "mean"


def test_lr_scaling_is_noted_with_extras():
    r = translate_horovod("opt = optim.SGD(model.parameters(), lr=args.lr * hvd.size())")
    assert _note(r, "lr_scaling").status == "ignored"
    assert r.extras["lr_scaling"]["by"] == "world_size"


def test_several_launch_commands_pick_one():
    text = "$ horovodrun -np 4 python a.py\n$ horovodrun -np 16 python b.py\n"
    assert translate_horovod(text).extras["world_size"] == 4
    r = translate_horovod(text, overrides={"launch": 1})
    assert r.extras["world_size"] == 16
    assert _note(r, "horovodrun[0].-np").status == "ignored"


def test_script_options_and_mpi_flags_are_ignored_with_reasons():
    r = translate_horovod(
        "mpirun -np 2 -bind-to none -mca pml ob1 -x NCCL_DEBUG=INFO python t.py --lr 0.1 --fast"
    )
    assert _note(r, "mpirun.script.--lr").value == "0.1"
    assert _note(r, "mpirun.script.--fast").value is True
    assert _note(r, "mpirun.-mca.pml").status == "ignored"
    assert "transport" in _note(r, "env.NCCL_DEBUG").detail


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("horovodrun -np four python t.py", "horovodrun.-np"),
        ("horovodrun -np 4 --fusion-threshold-mb -1 python t.py", "horovodrun.--fusion-threshold-mb"),
        ("horovodrun -np 4 --bogus-flag python t.py", "horovodrun.--bogus-flag"),
        ("horovodrun -np", "horovodrun.-np"),
        ("horovodrun -np 4 -H a:x python t.py", "horovodrun.-H"),
        ("HOROVOD_FUSION_THRESOLD=5 horovodrun -np 2 python t.py", "env.HOROVOD_FUSION_THRESOLD"),
        ("o = hvd.DistributedOptimizer(o, backward_passes_per_step=0)",
         "DistributedOptimizer.backward_passes_per_step"),
        ("o = hvd.DistributedOptimizer(o, bogus=1)", "DistributedOptimizer.bogus"),
        ("o = hvd.DistributedOptimizer(o, compression=MyCompressor())", "DistributedOptimizer.compression"),
        ("s = hvd.ProcessSet([0, 2])", "hvd.ProcessSet"),
        ("o = hvd.DistributedOptimizer(o, op=hvd.Average", "DistributedOptimizer"),
    ],
    ids=["np-word", "fusion-negative", "unknown-flag", "np-missing", "bad-slots", "env-typo", "passes-zero",
         "unknown-kwarg", "custom-compressor", "process-set", "unclosed-call"],
)  # fmt: skip
def test_bad_input_raises_typed_error_naming_key(text, key):
    with pytest.raises(TranslationError) as err:
        translate_horovod(text)
    assert err.value.key == key


def test_overrides_reach_flags_env_optimizer_and_plan():
    r = translate_horovod(
        "horovodrun -np 4 python t.py",
        overrides={
            "horovodrun.-np": 8,
            "env.HOROVOD_FUSION_THRESHOLD": 2000000,
            "DistributedOptimizer.op": "Sum",
            "batch.micro_batch_size": 16,
        },
    )
    assert r.extras["world_size"] == 8
    assert r.plan.communication.bucket_mb == pytest.approx(2.0)
    assert r.plan.communication.reduce_op == "sum"
    assert r.plan.batch.micro_batch_size == 16
    with pytest.raises(TranslationError):
        translate_horovod("horovodrun -np 4 python t.py", overrides={"nonsense": 1})
    with pytest.raises(PlanError):
        translate_horovod("horovodrun -np 4 python t.py", overrides={"batch.micro_batch_size": 0})


def test_every_note_value_is_json_data():
    import json

    r = translate_horovod(
        "HOROVOD_CYCLE_TIME=5 horovodrun -np 2 --blacklist-cooldown-range 10 100 python t.py\n"
        "o = hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(), groups=[[a, b]])"
    )
    json.dumps([n.to_dict() for n in r.notes])
    assert _note(r, "horovodrun.--blacklist-cooldown-range").value == ["10", "100"]


def test_errors_are_torsh_errors():
    with pytest.raises(TorshError):
        translate_horovod("horovodrun -np 'unbalanced")


_SCRIPT = """
parser.add_argument('--lr', type=float, default=0.01)
parser.add_argument('--momentum', type=float, default=0.5)
lr_scaler = hvd.size()
if args.use_adasum:
    lr_scaler = hvd.local_size()
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
"""


def test_wrapped_optimizer_with_world_size_scaling():
    """torch/optim/sgd.py: SGD(params, lr, momentum, ...); the script scales lr by hvd.size()."""
    r = translate_horovod(_SCRIPT, world_size=4)
    assert r.plan.optimizer.name == "sgd"
    assert r.plan.optimizer.learning_rate == pytest.approx(0.04)
    assert r.plan.optimizer.params == {"momentum": 0.5}
    note = _note(r, "DistributedOptimizer.optimizer.lr")
    assert note.status == "approximated" and "args.use_adasum" in note.detail
    resolved = translate_horovod(_SCRIPT, world_size=4, overrides={"args.use_adasum": False})
    assert _note(resolved, "DistributedOptimizer.optimizer.lr").status == "mapped"


def test_wrapped_optimizer_without_world_size_keeps_base_rate():
    r = translate_horovod(_SCRIPT, overrides={"args.use_adasum": False})
    assert r.plan.optimizer.learning_rate == pytest.approx(0.01)
    assert "--world-size" in _note(r, "DistributedOptimizer.optimizer.lr").detail


def test_wrapped_keras_adam_is_approximated_for_epsilon():
    """keras Adam: epsilon defaults to 1e-7 and is added after bias correction (epsilon-hat)."""
    r = translate_horovod(
        "opt = hvd.DistributedOptimizer(tf.optimizers.Adam(0.001), backward_passes_per_step=1)"
    )
    assert (r.plan.optimizer.name, r.plan.optimizer.params["eps"]) == ("adam", 1e-7)
    assert _note(r, "DistributedOptimizer.optimizer").status == "approximated"


def test_wrapped_optimizer_unknown_argument_is_unsupported():
    text = "opt = hvd.DistributedOptimizer(optim.SGD(model.parameters(), lr=0.1, maximize=True))"
    with pytest.raises(TranslationError) as err:
        translate_horovod(text)
    assert err.value.key == "DistributedOptimizer.optimizer.maximize"
